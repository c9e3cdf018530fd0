"""vLLM's sampling extras, as vLLM users send them, each honoured by the real server (the shared
`tokenpath serve`, real SmolLM2) or refused with a 400 naming it: none is silently dropped.

Each check compares against a greedy reference, so a field that was accepted but ignored fails."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "smollm2-135m-instruct"
PROMPT = "The capital of France is"


def complete(http: httpx.Client, **kw) -> dict:
    body = {"model": CHAT, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **kw}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def greedy(server) -> dict:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        ref = complete(http, logprobs=0)
    assert ref["finish_reason"] == "length" and len(ref["logprobs"]["tokens"]) == 12, ref
    return ref


def token_id(http: httpx.Client, text: str) -> int:
    """The id of a token from its text (as logprobs and /tokenize's token_strs show it)."""
    r = http.post("/tokenize", json={"model": CHAT, "prompt": text, "return_token_strs": True}).json()
    return next(t for t, s in zip(r["tokens"], r["token_strs"], strict=True) if s == text)


def test_top_k_and_min_p_narrow_sampling_to_the_greedy_token(http, greedy):
    hot = {"temperature": 1.8, "seed": 3}
    assert complete(http, top_k=1, **hot)["text"] == greedy["text"]
    assert complete(http, min_p=1.0, **hot)["text"] == greedy["text"]
    assert complete(http, **hot)["text"] != greedy["text"]  # (so the two above did something)


def test_seed_reproduces_a_sampled_reply(http):
    a, b = (complete(http, temperature=1.0, seed=1234, max_tokens=16)["text"] for _ in range(2))
    others = {complete(http, temperature=1.0, seed=s, max_tokens=16)["text"] for s in (1, 2, 3)}
    assert a == b and len(others | {a}) > 1


def test_repetition_penalty_changes_a_repetitive_greedy_reply(http):
    kw = {"prompt": "one one one one one one one one", "max_tokens": 10}
    assert complete(http, **kw)["text"] != complete(http, repetition_penalty=2.0, **kw)["text"]


def test_min_tokens_holds_off_the_end_of_a_short_reply(http):
    body = {"model": CHAT, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 60,
            "temperature": 0}
    short = http.post("/v1/chat/completions", json=body).json()
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 40, short
    held = http.post("/v1/chat/completions", json={**body, "min_tokens": 40}).json()
    assert held["usage"]["completion_tokens"] >= 40, held


def test_stop_token_ids_end_the_reply_before_that_token(http, greedy):
    tokens = greedy["logprobs"]["tokens"]
    k = tokens.index(tokens[3])
    out = complete(http, stop_token_ids=[token_id(http, tokens[3])])
    assert out["finish_reason"] == "stop" and out["text"] == "".join(tokens[:k])


def test_include_stop_str_in_output_keeps_the_matched_stop_string(http, greedy):
    text = greedy["text"]
    stop = text.strip().split()[1]  # a word in the middle of the greedy reply
    i = text.index(stop)
    without = complete(http, stop=[stop])
    assert (without["text"], without["finish_reason"]) == (text[:i], "stop")
    kept = complete(http, stop=[stop], include_stop_str_in_output=True)
    assert (kept["text"], kept["finish_reason"]) == (text[:i + len(stop)], "stop")
    streamed = http.post("/v1/completions", json={"model": CHAT, "prompt": PROMPT, "max_tokens": 12,
                                                  "temperature": 0, "stop": [stop], "stream": True,
                                                  "include_stop_str_in_output": True})
    assert "".join(_stream_texts(streamed.text)) == text[:i + len(stop)]


def _stream_texts(sse: str) -> list[str]:
    return [c["text"] for line in sse.splitlines() if line.startswith("data: {")
            for c in json.loads(line[6:])["choices"]]


def test_logit_bias_and_skip_special_tokens(http):
    """A +100 bias forces a special token (<|im_start|>); it is in the text only when
    skip_special_tokens is false, as vLLM does."""
    tok = http.post("/tokenize", json={"model": CHAT, "messages": [{"role": "user", "content": "x"}],
                                       "return_token_strs": True}).json()
    special, text = tok["tokens"][0], tok["token_strs"][0]
    assert text == "<|im_start|>"
    forced = complete(http, logit_bias={str(special): 100}, max_tokens=3)
    assert forced["text"] == ""
    shown = complete(http, logit_bias={str(special): 100}, max_tokens=3, skip_special_tokens=False)
    assert shown["text"] == text * 3


# (prompt_logprobs is served on /v1/completions: tests/api/test_prompt_logprobs.py)
@pytest.mark.parametrize("field", [{"use_beam_search": True}, {"truncate_prompt_tokens": 4},
                                   {"allowed_token_ids": [1, 2]}, {"bad_words": ["Paris"]}])
def test_vllm_extras_not_served_are_refused_by_name(http, field):
    r = http.post("/v1/completions", json={"model": CHAT, "prompt": PROMPT, "max_tokens": 2, **field})
    (name,) = field
    assert r.status_code == 400 and r.json()["error"]["param"] == name and name in r.json()["error"]["message"]
