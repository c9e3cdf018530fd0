"""One JSON log line per finished request: the client's x-request-id, the same stage ms as the
response's Server-Timing header, and never a key."""

from __future__ import annotations

import time

import httpx

from tests.telemetry.conftest import Served, chat


def _line(served: Served, request_id: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [r for r in served.log_records() if r.get("event") == "request" and r["request_id"] == request_id]
        if lines:
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(f"no log line for {request_id}")


def _server_timing(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, dur = part.strip().split(";dur=")
        out[name] = float(dur)
    return out


def test_one_json_line_per_request_with_the_server_timing_numbers(served: Served, http: httpx.Client):
    resp = http.post("/v1/chat/completions", json=chat(6),
                     headers=served.headers(**{"x-request-id": "client-req-42"}))
    assert resp.status_code == 200
    assert resp.headers["x-client-request-id"] == "client-req-42"  # echoed; the server's id is its own
    line = _line(served, resp.headers["x-request-id"])
    assert line["client_request_id"] == "client-req-42" and line["request_id"].startswith("chatcmpl-")
    assert line["stages_ms"] == _server_timing(resp.headers["server-timing"])
    assert line["level"] == "info" and line["logger"] == "tokenpath.request"
    assert line["status"] == 200 and line["error_code"] is None
    assert line["tenant"] == "acme" and line["key_prefix"] and served.keys["acme"].startswith(line["key_prefix"])
    assert line["model"] == "smollm2-135m-instruct" and line["replica"]
    assert line["completion_tokens"] == 6 and line["prompt_tokens"] > 0 and "cached_tokens" in line
    assert len(line["trace_id"]) == 32 and line["time"].endswith("Z")

    refused = http.post("/v1/chat/completions", json=chat(6), headers={"authorization": "Bearer tp-nope"})
    assert refused.status_code == 401
    line = _line(served, refused.headers["x-request-id"])
    assert line["status"] == 401 and line["error_code"] == "invalid_api_key"
    assert line["stages_ms"] == _server_timing(refused.headers["server-timing"])


def test_events_are_logged_and_no_key_ever_is(served: Served, http: httpx.Client):
    assert http.get("/health").status_code == 200
    records = served.log_records()
    assert any(r.get("event") == "startup" for r in records)
    text = served.output()
    for key in served.keys.values():
        assert key not in text
    assert "tp-nope" not in text
