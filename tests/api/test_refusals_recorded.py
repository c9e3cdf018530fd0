"""A body refused by the schema (an unknown field, malformed JSON, a missing field) is recorded like
every other ending: a request log line, an audit row and a `requests_total` count, on the real
shared `tokenpath serve`. (guidellm's vLLM extras were refused unseen before: issue 26.) So is a body
refused by the body limit before any route runs."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from tests.api.test_replicas import audit_row

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
MSG = [{"role": "user", "content": "Hi"}]

# (request id, path, raw body, model the audit row names, param named in the 400)
CASES = [
    ("schema-refused-unknown-field", "/v1/chat/completions",
     {"model": CHAT, "messages": MSG, "not_a_vllm_field": True}, CHAT, "not_a_vllm_field"),
    ("schema-refused-bad-json", "/v1/embeddings", b'{"model": "all-minilm-l6-v2", "input": ', None, None),
    ("schema-refused-tokenize", "/tokenize", {"model": CHAT, "prompt": "x", "return_token_strs": "maybe"}, CHAT,
     "return_token_strs"),
    ("schema-refused-bad-type", "/v1/completions", {"model": CHAT, "prompt": "x", "max_tokens": "many"}, CHAT,
     "max_tokens"),
]


def requests_total(http: httpx.Client, endpoint: str, model: str, status: str = "400") -> float:
    """The sum of `tokenpath:requests_total` over codes for one endpoint, model and status."""
    total = 0.0
    for labels, value in re.findall(r"^tokenpath:requests_total\{([^}]*)\} (\S+)$", http.get("/metrics").text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if got.get("endpoint") == endpoint and got.get("status") == status and got.get("model_name") == model:
            total += float(value)
    return total


@pytest.mark.parametrize(("rid", "path", "body", "model", "param"), CASES, ids=[c[0] for c in CASES])
def test_schema_refusal_is_logged_audited_and_counted(server, http, rid, path, body, model, param):
    label = model or "unknown"  # (metrics name an unnamed or unserved model `unknown`)
    before = requests_total(http, path, label)
    headers = {"x-request-id": rid}
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={**headers, "content-type": "application/json"})
    else:
        r = http.post(path, json=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
    assert r.headers["x-client-request-id"] == rid and "server-timing" in r.headers
    sid = r.headers["x-request-id"]  # the server's own id; the client's is kept beside it

    row = audit_row(server, sid)
    assert (row.status, row.endpoint, row.model, row.error_type) == (400, path, model, "invalid_request_error")
    assert row.client_request_id == rid
    line = _log_line(server, sid)
    assert path in line and "400" in line, line
    assert requests_total(http, path, label) == before + 1


def _log_line(server, rid: str) -> str:
    """The server's request log line for this request id (it is written as the request ends)."""
    deadline = time.monotonic() + 10
    while not any(rid in ln for ln in server.lines()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return next(ln for ln in server.lines() if rid in ln)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_over_the_limit_is_logged_audited_and_counted(server, http, chunked):
    """The body limit refuses before any route runs (api/limits.py): recorded all the same."""
    rid = f"limit-refused-{'chunked' if chunked else 'declared'}"
    big = json.dumps({"model": CHAT, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}).encode()
    content = (big[i:i + 65536] for i in range(0, len(big), 65536)) if chunked else big
    before = requests_total(http, "/v1/chat/completions", "unknown", status="413")
    r = http.post("/v1/chat/completions", content=content,
                  headers={"content-type": "application/json", "x-request-id": rid})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    assert r.headers["x-client-request-id"] == rid and r.headers["connection"] == "close"
    sid = r.headers["x-request-id"]
    row = audit_row(server, sid)
    assert (row.status, row.endpoint, row.model, row.client_request_id) == (413, "/v1/chat/completions", None, rid)
    assert _log_line(server, sid)
    assert requests_total(http, "/v1/chat/completions", "unknown", status="413") == before + 1
