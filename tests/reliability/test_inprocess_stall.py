"""A hung step in the default in-process deployment holds no request hostage (issue 23).

`tokenpath serve` with a tiny model in its own process, started through
`tests/reliability/frozen_step_server.py`, which can make the engine's step thread block in a step
(as a native call that never returns would). With a 2 s stall bound, checked against the real
server: the replica is ejected and logged (`replica_ejected`, reason `stalled`); the stream that was
generating ends with an SSE error event then `[DONE]`, the non-streaming request already generating
gets a 503 with Retry-After, the requests dispatched into the hung engine and the one queued in the
gateway get a 503 (no other replica to retry on), all within a moment of the bound; new requests
are refused at once; `/health` says unhealthy and why. Once the step returns, the replica recovers
and serves. Then shutdown with a hung step exits within `--shutdown-timeout` plus 2 s.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import pytest

from tests.api.conftest import start_server
from tests.engine.tiny_models import save_tiny
from tests.reliability import frozen_step_server
from tests.reliability.test_engine_stall import Call, body, gateway_events, wait_until

STALL_S = 2.0
SHUTDOWN_S = 3.0
SLACK_S = 3.0  # detection (a tick), the release, and a loaded 2-core test machine


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("inproc-stall")
    control = tmp / "control"
    control.mkdir()
    model = save_tiny("llama", tmp / "tiny", max_position_embeddings=4096)
    srv = start_server(tmp, "--model", str(model), "--stall-timeout", str(STALL_S), "--shutdown-timeout",
                       str(SHUTDOWN_S), "--max-model-len", "4096", "--max-num-seqs", "2", "--log-format", "json",
                       command=[sys.executable, frozen_step_server.__file__], env={**os.environ, "FROZEN_STEP_DIR": str(control)})
    name = httpx.get(srv.base_url + "/models", timeout=30).json()["data"][0]["id"]
    try:
        yield srv, control, name
    finally:
        (control / "thaw").touch()  # never leave the step thread blocked
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(30)


def freeze(srv, control, then: Call | None = None) -> float:  # noqa: ANN001
    """Block the engine's next step (that of `then`, started after the freeze is armed); returns
    when a step is blocked."""
    seen = srv.output().count(frozen_step_server.FROZEN)
    (control / "freeze").touch()
    if then is not None:
        then.start()
    wait_until(lambda: srv.output().count(frozen_step_server.FROZEN) > seen, 30, "the step never blocked")
    return time.monotonic()


def tokens_so_far(srv, client_request_id: str) -> int:  # noqa: ANN001
    """Tokens the gateway has received for an in-flight request (`/dashboard/data`; auth is off)."""
    inflight = httpx.get(srv.url + "/dashboard/data", timeout=10).json()["inflight"]
    return next((r["tokens"] for r in inflight if r["client_request_id"] == client_request_id), 0)


def error_of(call: Call) -> dict:
    return json.loads(call.text)["error"]


def test_a_hung_step_releases_its_requests_refuses_new_ones_and_recovers(stack):
    srv, control, name = stack
    warm = [Call(srv, body(name, 8), f"warm-{i}", "") for i in range(2)]
    for c in warm:
        c.start()
        c.join()
        assert c.status == 200, c.text
    normal = max(c.took for c in warm)
    assert httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok"

    # Two long requests generating (--max-num-seqs 2 runs both): one streaming, one not.
    streaming = Call(srv, body(name, 3500, stream=True), "long-stream", "")
    streaming.start()
    wait_until(lambda: len(streaming.lines) >= 3, 60, "the long stream never started")
    whole = Call(srv, body(name, 3500), "long-whole", "")
    whole.start()
    # The non-streaming request must be generating (its first tokens out of the engine) before the
    # hang: one still queued or prefilling is retried elsewhere, and with no other replica it gets
    # no_healthy_replica, not replica_stalled. Its client sees nothing until the end, so the
    # server's in-flight view says when: never a guess of how long a loaded machine takes.
    wait_until(lambda: tokens_so_far(srv, "long-whole") >= 5, 60, "the non-streaming request never started")
    assert streaming.is_alive() and whole.is_alive(), "the long requests finished before the freeze"

    frozen = freeze(srv, control)
    try:
        # Sent to the hung engine before the bound: two fill its slots, the next waits in the gateway's queue.
        dispatched = [Call(srv, body(name, 8), f"dispatched-{i}", "") for i in range(2)]
        for c in dispatched:
            c.start()
        time.sleep(0.3)
        queued = Call(srv, body(name, 8), "queued-0", "")
        queued.start()
        for c in (streaming, whole, *dispatched, queued):
            c.join(timeout=STALL_S + 20)
            assert not c.is_alive(), f"{c.rid} still waiting {time.monotonic() - frozen:.1f}s after the hang"
        # Past the bound: refused at once.
        late = Call(srv, body(name, 8), "late-0", "")
        late.start()
        late.join(30)
        health = httpx.get(srv.url + "/health", timeout=10)
    finally:
        (control / "thaw").touch()

    ejected = gateway_events(srv, "replica_ejected")
    assert len(ejected) == 1 and ejected[0]["reason"] == "stalled" and ejected[0]["inflight"] >= 4, ejected
    # The bound applied: --stall-timeout, or 3x this engine's normal step if longer (a loaded
    # machine's slow steps stretch it; `replica.local`).
    bound = ejected[0]["silent_s"]
    assert STALL_S <= bound < STALL_S + 10, ejected
    # The stream: an SSE error event naming the stall, then [DONE], soon after the bound.
    assert '"error"' in streaming.lines[-2][1] and "replica_stalled" in streaming.lines[-2][1], streaming.lines[-3:]
    assert streaming.lines[-1][1] == "data: [DONE]"
    assert streaming.lines[-1][0] - frozen < bound + SLACK_S
    # The non-streaming one already generating: 503, Retry-After, OpenAI-format error.
    assert whole.status == 503 and whole.retry_after, (whole.status, whole.text)
    assert error_of(whole)["code"] == "replica_stalled" and error_of(whole)["type"]
    assert whole.ended - frozen < bound + SLACK_S
    # In the hung engine's queue, and in the gateway's: 503 with Retry-After, no other replica to retry on.
    for c in (*dispatched, queued):
        assert c.status == 503 and c.retry_after, (c.rid, c.status, c.text)
        assert error_of(c)["code"] in ("replica_stalled", "no_healthy_replica"), (c.rid, c.text)
        assert c.ended - frozen < bound + SLACK_S, (c.rid, c.ended - frozen)
    assert late.status == 503 and late.retry_after and error_of(late)["code"] == "no_healthy_replica", late.text
    # Refused at admission, not after waiting: a request that waited on the hung replica would wait
    # a whole stall bound. (A fixed 1 s bound measured the loaded machine's HTTP round trip instead.)
    assert late.took < STALL_S, f"a new request took {late.took:.2f}s to be refused"
    # /health: unhealthy (the model's only replica), saying why.
    assert health.status_code == 503 and health.json()["status"] == "unhealthy", health.text
    replica = next(iter(health.json()["replicas"][name].values()))
    assert not replica["healthy"] and "stalled" in replica["detail"], replica

    # The step returns: recovered (logged), serving again within a normal time.
    wait_until(lambda: httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok", 15,
               "the replica never recovered")
    assert gateway_events(srv, "replica_recovered"), "no replica_recovered line"
    back = Call(srv, body(name, 8), "back-0", "")
    back.start()
    back.join(60)
    assert back.status == 200 and back.took < normal + 5, (back.status, back.took, back.text)
    print(f"normal {normal:.2f}s; stream cut {streaming.lines[-1][0] - frozen:.2f}s after the hang; "
          f"queued request refused {queued.ended - frozen:.2f}s after; new request refused in {late.took * 1000:.0f} ms")


def test_shutdown_with_a_hung_step_exits_within_the_timeout(stack):
    srv, control, name = stack
    hung = Call(srv, body(name, 200), "hung-0", "")
    freeze(srv, control, then=hung)
    start = time.monotonic()
    srv.stop(timeout=60)
    took = time.monotonic() - start
    assert srv.proc.returncode == 0, srv.output()[-3000:]
    assert took < SHUTDOWN_S + 2, f"shutdown took {took:.1f}s with --shutdown-timeout {SHUTDOWN_S}"
    hung.join(10)
    print(f"shutdown with a hung step: {took:.2f}s")
