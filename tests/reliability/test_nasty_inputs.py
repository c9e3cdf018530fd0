"""Issue 10's nasty-input table against a real server: every answer is a 4xx OpenAI error or a
200, never a 5xx or a hang, and a normal request right after each one is served."""

from __future__ import annotations

import httpx
import pytest

from tests.reliability.nasty_bodies import CASES, CHAT_MODEL, Nasty

NORMAL = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def check_case(url: str, case: Nasty) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post(case.path, content=case.body, headers=case.headers)
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500])
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["message"] and err["type"], err
        ok = client.post("/v1/chat/completions", json=NORMAL)
        assert ok.status_code == 200, ok.text[:500]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nasty_input_in_process(gateway, case):
    check_case(gateway.url, case)
