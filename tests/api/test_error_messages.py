"""Every client mistake named in issue 14 gets a message that names the parameter and the fix, with
`param` set: one row per message, against the real server (the shared `tokenpath serve`)."""

from __future__ import annotations

import json

import pytest

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
MSG = [{"role": "user", "content": "Hi"}]

# (path, raw body, content-type, status, param, words the message must contain)
CASES = [
    ("/v1/chat/completions", {"model": CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     None, 400, "messages.0.content.1", ["image inputs are not supported by this model"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": MSG, "logprobs": True, "top_logprobs": 50},
     None, 400, "top_logprobs", ["top_logprobs must be between 0 and 20", "50"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": MSG, "stream_options": {"include_usage": True}},
     None, 400, "stream_options", ["stream_options is only allowed when stream is true", "set"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": MSG}, "text/plain", 400, "Content-Type",
     ["Content-Type: application/json", "text/plain"]),
    ("/v1/chat/completions", b"", "application/json", 400, "model", ["body is empty", "'model'", "'messages'"]),
    ("/v1/completions", b"", "application/json", 400, "model", ["body is empty", "'prompt'"]),
    ("/v1/chat/completions", {"model": EMBED, "messages": MSG}, None, 400, "model",
     ["is an embedding model", "/v1/embeddings"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": [{"role": "user", "content": None}]}, None, 400,
     "messages.0.content", ["null is only allowed for an assistant message with tool_calls"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": [{"role": "assistant", "content": None}, *MSG]}, None,
     400, "messages.0.content", ["null is only allowed"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}, *MSG]},
     None, 400, "messages.0.tool_calls.0", ["messages.0.tool_calls.0 must be", "function"]),
    ("/v1/chat/completions", {"model": CHAT}, None, 400, "messages", ["Missing required parameter", "messages"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": MSG, "logit_bias": {"99999999": 5}}, None, 400,
     "logit_bias", ["outside this model's vocabulary"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": MSG, "logit_bias": {"42": 101}}, None, 400,
     "logit_bias", ["between -100 and 100"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": MSG, "logit_bias": {"x": 1}}, None, 400,
     "logit_bias", ["token ids"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": MSG, "tools": [{"type": "function"}]}, None, 400,
     "tools.0", ["tools.0 must be", "function"]),
    ("/v1/chat/completions", {"model": CHAT, "messages": [{"role": "user", "content": 5}]}, None, 400,
     "messages.0.content", ["messages.0.content"]),
]


@pytest.mark.parametrize(("path", "body", "ctype", "status", "param", "words"), CASES,
                         ids=[f"{i}-{c[4]}" for i, c in enumerate(CASES)])
def test_error_message_names_the_param_and_the_fix(http, path, body, ctype, status, param, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = http.post(path, content=content, headers={"content-type": ctype or "application/json"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    assert "Value error" not in err["message"] and "more problems" not in err["message"], err
