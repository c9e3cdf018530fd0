"""tokenpath's gateway in front of a real vLLM (vLLM's CPU build, 0.32): the peers tier.

`make test-peers` installs vLLM into its own venv (scripts/vllm_venv.sh) and runs this module
alone (`pytest --peers`). One vLLM serves the bf16 SmolLM2 safetensors with its per-request
metrics and ZMQ KV events (benchmarks/vllm_peer.py); one `tokenpath serve --routing` gateway has it
as its only `url:` replica. What the issue asked of a URL replica, checked against the real thing:
constraints reach vLLM and hold, logprobs and usage are vLLM's own (never re-counted from text),
the stages come from vLLM's metrics, prefix routing is confirmed by vLLM's KV events, and a paused
vLLM is ejected within the stall bound and re-admitted when it answers again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.vllm_peer import NAME, Vllm, request_lines, start_gateway, start_vllm, stop_group  # noqa: E402

# vLLM compiles its model at start: a minute on a quiet machine, many on a loaded one (the fixture's
# time counts against the first test's timeout).
pytestmark = [pytest.mark.requires("vllm"), pytest.mark.timeout(2400)]
STALL_S = 5.0  # the gateway's --stall-timeout: how long a silent backend keeps its requests
PREFIX = "You are a careful assistant who answers briefly. " * 40  # several of vLLM's 16-token blocks


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    server = start_vllm(tmp_path_factory.mktemp("vllm"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def front(vllm: Vllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Path]]:
    out = tmp_path_factory.mktemp("gateway")
    proc, port = start_gateway(vllm, out, "1", "--stall-timeout", str(STALL_S))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            yield http, out / "gateway-1.log"
    finally:
        stop_group(proc)


def chat(http: httpx.Client, content: str, **extra: object) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 24,
                                                   "messages": [{"role": "user", "content": content}], **extra})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constraints_reach_vllm_and_hold(front: tuple[httpx.Client, Path], seed: int) -> None:
    """Sampled at temperature 0.8, so an unconstrained model would wander: every reply is valid."""
    http, _ = front
    r = chat(http, f"Is day {seed} good?", temperature=0.8, seed=seed,
             structured_outputs={"choice": ["yes", "no"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
    r = chat(http, f"Give a code for day {seed}.", temperature=0.8, seed=seed,
             structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["message"]["content"]), r.text
    schema = {"type": "object", "properties": {"mood": {"type": "string", "enum": ["good", "bad"]}},
              "required": ["mood"], "additionalProperties": False}
    r = chat(http, f"How was day {seed}?", temperature=0.8, seed=seed, max_tokens=32,
             response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": schema}})
    assert json.loads(r.json()["choices"][0]["message"]["content"])["mood"] in ("good", "bad"), r.text


def test_a_required_tool_call_comes_back_as_one(front: tuple[httpx.Client, Path]) -> None:
    http, _ = front
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    r = chat(http, "What is the weather in Paris?", tools=tools, tool_choice="required", max_tokens=48,
             temperature=0)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert "city" in json.loads(calls[0]["function"]["arguments"])


def test_logprobs_and_usage_are_vllms_own(front: tuple[httpx.Client, Path], vllm: Vllm) -> None:
    http, _ = front
    r = chat(http, "Hello", max_tokens=8, temperature=0, logprobs=True, top_logprobs=3).json()
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"] > 0
    assert all(len(e["top_logprobs"]) == 3 for e in entries)
    # The same seeded, sampled request straight to vLLM and through the gateway: the same text and
    # the same counts (the gateway takes vLLM's usage; it does not re-tokenize the text).
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.9, "seed": 3,
            "ignore_eos": True}
    via = http.post("/v1/completions", json=body).json()
    direct = httpx.post(f"{vllm.url}/v1/completions", json=body, timeout=300).json()
    assert via["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 40
    assert via["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]


def test_the_stages_come_from_vllms_metrics(front: tuple[httpx.Client, Path]) -> None:
    http, log = front
    r = http.post("/v1/completions", json={"model": NAME, "prompt": "Hi there", "max_tokens": 8}).json()
    timing = r["tokenpath"]["timing"]
    assert {"engine_queue", "prefill", "decode", "total"} <= set(timing), timing
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # (the request's log line is written after its reply)
        rows = [row for row in request_lines(log) if row.get("request_id") == r["id"]]
        if rows:
            break
        time.sleep(0.2)
    rows = rows or request_lines(log)[-1:]
    assert rows and (rows[-1].get("backend_timing") or {}).get("source") == "vllm", rows[-1:]


def test_a_shared_prefix_is_routed_by_vllms_kv_events(front: tuple[httpx.Client, Path]) -> None:
    http, log = front
    for i in range(2):
        r = http.post("/v1/completions", json={"model": NAME, "prompt": PREFIX + f"Question {i}?", "max_tokens": 2})
        assert r.status_code == 200, r.text
        time.sleep(1.0)  # (vLLM publishes the first one's blocks)
    assert request_lines(log)[-1].get("routing_reason") == "prefix_hit"


def test_a_paused_vllm_is_ejected_then_readmitted(front: tuple[httpx.Client, Path], vllm: Vllm) -> None:
    """SIGSTOP: the stream in flight ends with an error within the stall bound (never a hang), a new
    request is refused with Retry-After; SIGCONT: the gateway serves again."""
    http, _ = front
    os.killpg(vllm.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        body = {"model": NAME, "prompt": "Count slowly:", "max_tokens": 64, "stream": True}
        with http.stream("POST", "/v1/completions", json=body, timeout=STALL_S * 12) as r:
            text = "".join(r.iter_text())
        waited = time.monotonic() - t0
        assert r.status_code != 200 or '"error"' in text, text[-500:]
        assert waited < STALL_S * 10, waited
        refused = http.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2},
                            timeout=STALL_S * 12)
        assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
    finally:
        os.killpg(vllm.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 120
    status = 0
    while time.monotonic() < deadline:
        status = http.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}).status_code
        if status == 200:
            break
        time.sleep(1.0)
    assert status == 200
