"""A client that goes away stops costing anything: its request is aborted and its KV freed."""

from __future__ import annotations

import time

import httpx

CHAT = "smollm2-135m-instruct"
LONG = {"model": CHAT, "prompt": "Write a very long story about a lighthouse keeper.", "max_tokens": 1500,
        "ignore_eos": True}


def wait_idle(http: httpx.Client, metric, kv_before: float, within: float) -> tuple[float, float]:
    """Poll /metrics until nothing runs and KV usage is back; return the last values seen."""
    deadline = time.monotonic() + within
    while True:
        text = http.get("/metrics").text
        running, kv = metric(text, "num_requests_running"), metric(text, "kv_cache_usage_perc")
        if (running == 0 and kv <= kv_before) or time.monotonic() > deadline:
            return running, kv
        time.sleep(0.05)


def test_stream_disconnect_aborts_within_a_second(server, http, metric):
    kv_before = metric(http.get("/metrics").text, "kv_cache_usage_perc")
    with httpx.Client(base_url=server.url, timeout=60) as client, \
            client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
        assert resp.status_code == 200
        chunks = 0
        # Held, not dropped: an abandoned line iterator is closed when it is collected, and httpx
        # then closes the connection, so the client would leave before the scrape below.
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                chunks += 1
            if chunks == 3:
                break
        text = http.get("/metrics").text
        assert metric(text, "num_requests_running") == 1 and metric(text, "kv_cache_usage_perc") > kv_before
    closed = time.monotonic()
    running, kv = wait_idle(http, metric, kv_before, within=1.0)
    assert time.monotonic() - closed <= 1.0 + 0.5  # the last scrape may start just before the deadline
    assert running == 0 and kv <= kv_before
    assert 'finished_reason="abort"' in http.get("/metrics").text


def test_non_streaming_disconnect_aborts(server, http, metric):
    kv_before = metric(http.get("/metrics").text, "kv_cache_usage_perc")
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.5)) as client:
        try:
            client.post("/v1/completions", json=LONG)
            raise AssertionError("a 1500-token generation finished within 1.5 s")
        except httpx.ReadTimeout:
            pass  # the client gives up and closes the connection
    running, kv = wait_idle(http, metric, kv_before, within=1.0)
    assert running == 0 and kv <= kv_before
    # The server is fine afterwards.
    ok = http.post("/v1/completions", json={"model": CHAT, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200
