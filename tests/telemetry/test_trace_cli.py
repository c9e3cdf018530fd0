"""`tokenpath trace` on a real request: its stages sum to the total (within 5 ms), the text
names the dominant stage, and `--slowest` finds it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.telemetry.conftest import Served, chat

TOKENPATH = str(Path(sys.executable).parent / "tokenpath")


def _trace(served: Served, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TOKENPATH, "trace", *args, "--data-dir", str(served.data_dir)],
                          capture_output=True, text=True, timeout=60)


def test_trace_shows_one_requests_waterfall(served: Served, http: httpx.Client):
    resp = http.post("/v1/chat/completions", json=chat(16), headers=served.headers())
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while (out := _trace(served, rid, "--json")).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.2)  # the audit row is written as the request finishes
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    names = [st["stage"] for st in s["stages"]]
    assert names == ["upload", "gateway", "queue", "engine_queue", "prefill", "decode"]
    assert abs(sum(st["ms"] for st in s["stages"]) - s["total_ms"]) <= 5.0
    assert abs(sum(st["percent"] for st in s["stages"]) - 100) <= 1.0
    assert s["replica"] and s["routing_policy"] and s["routing_reason"] and s["cached_tokens"] is not None
    dominant = max(s["stages"], key=lambda st: st["ms"])["stage"]
    assert s["dominant_stage"] == dominant

    text = _trace(served, rid)
    assert text.returncode == 0, text.stderr
    assert f"dominant stage: {dominant}" in text.stdout
    assert s["replica"] in text.stdout and "cached" in text.stdout and s["routing_reason"] in text.stdout
    assert "█" in text.stdout

    slow = _trace(served, "--slowest", "50", "--since", "10m", "--json")
    assert slow.returncode == 0, slow.stderr
    rows = json.loads(slow.stdout)
    assert rid in [r["request_id"] for r in rows]
    assert [r["total_ms"] for r in rows] == sorted((r["total_ms"] for r in rows), reverse=True)
    assert _trace(served, "no-such-request").returncode == 1
