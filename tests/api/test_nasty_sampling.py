"""Issue 10, defect 1 over HTTP: sampling values that once killed the chat model for good.

Each value is either refused with a 400 naming the parameter or served with a 200; either way
the next normal request is served (before the fix the model answered 503 forever after)."""

from __future__ import annotations

import pytest

CHAT_MODEL = "smollm2-135m-instruct"

NASTY = [
    ({"temperature": 1e-320}, 200, None),
    ({"temperature": 1e-38}, 200, None),
    ({"top_p": 1e-46, "temperature": 1.0}, 200, None),
    ({"top_p": 5e-324, "temperature": 1.0}, 200, None),
    ({"repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ({"top_k": 2**63}, 400, "top_k"),
    ({"top_k": 2**63 - 1}, 400, "top_k"),
    ({"min_p": 1e-320, "temperature": 1.0}, 200, None),
    ({"frequency_penalty": 2.0, "presence_penalty": -2.0, "temperature": 1e-300}, 200, None),
]


@pytest.mark.parametrize(("extra", "status", "param"), NASTY, ids=[str(x[0]) for x in NASTY])
def test_nasty_sampling_values_never_take_the_model_down(http, extra, status, param):
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
    ok = http.post("/v1/chat/completions", json={"model": CHAT_MODEL, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    assert ok.status_code == 200, ok.text
    assert http.get("/health").status_code == 200
