"""`tokenpath bench` against a real `tokenpath serve` on loopback (loads SmolLM2: marked slow).

Both run as the user would run them, as separate processes: the server on a free port, the bench
for a few seconds with --json. Checks every record and summary field, non-zero throughput, exact
output lengths (the server honours ignore_eos/min_tokens) and tokenpath's server-side stage timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from stub_server import free_port
from tests.server_data import seed_tokenizers

pytestmark = pytest.mark.slow

RECORD_FIELDS = {"index", "start", "success", "status", "error", "ttft", "itl", "e2el", "tpot", "output_tokens",
                 "output_tokens_source", "prompt_tokens", "intended_input_len", "intended_output_len",
                 "server_timing", "group", "session", "turn"}
SUMMARY_FIELDS = {"completed", "failed", "duration_s", "request_throughput", "output_throughput",
                  "total_token_throughput", "total_output_tokens", "total_prompt_tokens", "mean_prompt_tokens",
                  "mean_output_tokens", "exact_output_fraction", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "slo",
                  "good_requests", "goodput", "errors", "server_ms"}
STATS_FIELDS = {"count", "mean", "median", "p90", "p99", "std"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    data = tmp_path_factory.mktemp("serve-data")
    seed_tokenizers(data, ["smollm2-135m-instruct"])  # as a second start finds it (tests/server_data.py)
    log = (data / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenpath.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--model", "smollm2-135m-instruct", "--data-dir", str(data)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENPATH_DATA_DIR": str(data)})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"tokenpath serve exited {proc.returncode}: {(data / 'serve.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"tokenpath serve not healthy in 240 s: {(data / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_bench_against_real_tokenpath_serve(served, tmp_path):
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [sys.executable, "-m", "tokenpath.cli", "bench", "--base-url", served, "--duration", "4",
         "--concurrency", "2", "--input-len", "48", "--output-len", "8", "--warmup", "1", "--slo",
         "ttft=30s,tpot=10s", "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    s = run["summary"]
    assert s.keys() >= SUMMARY_FIELDS
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert s[key].keys() >= STATS_FIELDS and s[key]["count"] > 0
    assert s["completed"] >= 1 and s["failed"] == 0, s["errors"]
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0 and s["total_token_throughput"] > 0
    assert s["goodput"] is not None and s["goodput"] > 0
    assert s["exact_output_fraction"] == 1.0  # ignore_eos + min_tokens honoured
    for stage in ("queue", "prefill", "decode", "total"):
        assert s["server_ms"][stage]["count"] == s["completed"]
    for r in run["records"]:
        assert r.keys() >= RECORD_FIELDS
        assert r["success"] and r["status"] == 200
        assert r["output_tokens"] == 8 and r["output_tokens_source"] == "usage"
        # prompts were calibrated with SmolLM2's tokenizer and chat template: the server should agree
        assert abs(r["prompt_tokens"] - 48) <= 2, r["prompt_tokens"]
        assert 0 < r["ttft"] <= r["e2el"] and len(r["itl"]) >= 1
        assert set(r["server_timing"]) >= {"queue", "prefill", "decode", "total"}
    assert "TTFT" in res.stdout and "server-side stages" in res.stdout


def _bench_json(served, tmp_path, name, *extra) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    res = subprocess.run(
        [sys.executable, "-m", "tokenpath.cli", "bench", "--base-url", served, "--num-requests", "4",
         "--concurrency", "2", "--input-len", "96", "--output-len", "2", "--warmup", "0", "--json", str(out),
         "--no-progress", *extra],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text()), res.stderr


def test_repeated_default_runs_are_cold_and_say_their_hit_rate(served, tmp_path):
    """Issue 14: run i was built from (seed 0, i), so a second default run hit the prefix cache (10% ->
    91%) and measured it instead of prefill. Now each run draws its own prompts, reports its hit rate,
    warns when a reused seed makes a 'random' workload mostly cache hits, and --reset-cache undoes it."""
    first, _ = _bench_json(served, tmp_path, "a")
    second, _ = _bench_json(served, tmp_path, "b")
    assert first["meta"]["seed"] != second["meta"]["seed"]
    for doc in (first, second):
        s = doc["runs"][0]["summary"]
        assert s["prefix_cache_hit_rate"] is not None and s["prefix_cache_hit_rate"] < 0.5, s
        assert doc["runs"][0]["warnings"] == []
    again, err = _bench_json(served, tmp_path, "c", "--seed", str(first["meta"]["seed"]))
    assert again["runs"][0]["summary"]["prefix_cache_hit_rate"] > 0.5
    assert again["runs"][0]["warnings"] and "warning" in err
    cold, _ = _bench_json(served, tmp_path, "d", "--seed", str(first["meta"]["seed"]), "--reset-cache")
    assert cold["runs"][0]["summary"]["prefix_cache_hit_rate"] < 0.5
