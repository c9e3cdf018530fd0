"""Faults inside a real engine process, as a client of `tokenpath serve` sees them (issue 10).

A step that raises fails only its request; an engine that dies under a non-streaming request
answers it 503 with a Retry-After (on main before this test: no Retry-After).

`tests/engine/test_step_faults.py` checks the engine itself; this checks what a client of
`tokenpath serve` sees when the fault happens in an engine process behind the gateway. Two engine
processes are started by a routing file whose `engine_command` runs the real engine through
`tests/reliability/poisoned_engine.py`, which makes any step holding a request with its poison
`seed` raise. The poisoned request must get a clean 500 `engine_failed` OpenAI error (streamed
or not), must not be retried on the other replica (the fault is injected exactly once per
request: counted in the engine logs under the data dir), no replica is ejected or restarted,
/health stays 200, and the next request is 200 and token-identical to one made before the fault.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from tests.api.conftest import Server, running_server
from tests.reliability import poisoned_engine
from tests.reliability.nasty_bodies import CHAT_MODEL

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("step-fault")
    routing = tmp / "routing.yaml"
    routing.write_text(yaml.safe_dump({"deployments": [{
        "name": CHAT_MODEL,
        "replicas": [{"local": 2, "engine_args": ["--num-kv-blocks", "128"],
                      "engine_command": [sys.executable, poisoned_engine.__file__, "engine"]}],
    }]}))
    with running_server(tmp, "--routing", str(routing), wait=600) as srv:
        yield srv


def faults_injected(srv: Server) -> int:
    """Injected faults so far, from every engine log under the server's data dir."""
    logs = list((srv.log.parent / "data" / "logs" / "engines").glob("*.log"))
    assert logs, "no engine log under the data dir"
    return sum(p.read_text(errors="replace").count(poisoned_engine.INJECTED) for p in logs)


def counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^tokenpath:{name}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M))


def greedy(client: openai.OpenAI, request_id: str, stream: bool = False, poison: bool = False) -> str:
    kwargs = dict(model=CHAT_MODEL, messages=PROMPT, max_tokens=16, temperature=0,
                  extra_headers={"x-request-id": request_id}, **({"seed": poisoned_engine.POISON_SEED} if poison else {}))
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                   if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_poisoned_step_fails_its_request_only_with_engine_failed(poisoned: Server, stream: bool):
    client = openai.OpenAI(base_url=poisoned.base_url, api_key="unused", max_retries=0, timeout=120)
    before = greedy(client, f"before-{stream}")
    assert before
    metrics = httpx.get(poisoned.url + "/metrics").text
    faults = faults_injected(poisoned)

    started = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        greedy(client, f"poison-{stream}", stream=stream, poison=True)
    assert time.monotonic() - started < 30  # failed at once: no hang, no retry loop
    assert isinstance(err.value, openai.APIStatusError), err.value  # failed before the stream began
    assert err.value.status_code == 500
    body = err.value.body if isinstance(err.value.body, dict) else {}
    error = body.get("error", body)
    assert error.get("code") == "engine_failed", err.value
    assert poisoned_engine.FAULT_LINE in str(error.get("message")), err.value

    # Injected once: the gateway did not retry it on the other replica.
    deadline = time.monotonic() + 5
    while faults_injected(poisoned) == faults and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert faults_injected(poisoned) == faults + 1

    # Nobody ejected, retried or restarted; every replica healthy; nothing held.
    after = httpx.get(poisoned.url + "/metrics").text
    for name in ("replica_ejections", "replica_restarts", "replica_retries"):
        assert counter(after, name) == counter(metrics, name), name
    health = httpx.get(poisoned.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert all(r["healthy"] for r in health.json()["replicas"][CHAT_MODEL].values()), health.text

    # The next requests (the same prompt: prefix routing sends it back to the replica that failed)
    # are 200 and token-identical.
    for i in range(4):
        assert greedy(client, f"after-{stream}-{i}") == before
    assert faults_injected(poisoned) == faults + 1


def test_a_non_streaming_request_cut_by_an_engine_death_is_503_with_retry_after(poisoned: Server):
    """Last in the module: it kills an engine, then waits until it is back (the server must still
    stop cleanly after)."""
    log_dir = poisoned.log.parent / "data" / "logs" / "engines"
    body = {"model": CHAT_MODEL, "messages": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    answer: dict[str, httpx.Response] = {}

    def call() -> None:
        answer["r"] = httpx.post(poisoned.base_url + "/chat/completions", json=body,
                                 headers={"x-request-id": "cut-short"}, timeout=120)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 60
    sid = None  # the server's id, which its engine logs it under (the dashboard pairs it with ours)
    while sid is None:
        assert time.monotonic() < deadline and caller.is_alive(), "the request never reached the gateway"
        inflight = httpx.get(poisoned.url + "/dashboard/data", timeout=10).json()["inflight"]
        sid = next((r["request_id"] for r in inflight if r["client_request_id"] == "cut-short"), None)
        time.sleep(0.05)
    while not (on := [p for p in log_dir.glob("*.log") if f"request {sid}" in p.read_text(errors="replace")]):
        assert time.monotonic() < deadline and caller.is_alive(), "the request never reached an engine"
        time.sleep(0.05)
    pid = int(re.findall(r"started \(pid (\d+)\)", on[0].read_text())[-1])
    time.sleep(1.0)  # decoding: past its first token, so not retried elsewhere
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    caller.join(30)
    assert not caller.is_alive(), "the request hung after its engine died"
    r = answer["r"]
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1, r.headers
    assert r.json()["error"]["message"], r.text
    while httpx.get(poisoned.url + "/health").json()["status"] != "ok":  # both engines up again
        assert time.monotonic() - killed < 180, poisoned.output()[-2000:]
        time.sleep(0.5)
