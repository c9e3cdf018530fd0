"""A hung step inside an engine process holds no request hostage (issue 23), though its process lives on.

A SIGSTOPped engine goes silent on its link (tests/reliability/test_engine_stall.py). A step thread
stuck in a kernel or a deadlock does not: the process's event loop runs on and pushes its state
every second, so before each state said how long its current step had run (`EngineState.step_age_s`)
the gateway saw a live engine and its requests waited for as long as the step hung.

`tokenpath serve` with a routing file: two engine processes of a tiny model, each started through
`tests/reliability/frozen_step_server.py` (the real `tokenpath engine`, whose step thread a test can
block in one step: `freeze.<pid>`), routed by session so each request's engine is known in advance.
With a 2 s stall bound, one engine's step is blocked under traffic. Checked against the real
processes: the engine is ejected and logged (`replica_ejected`, reason `stalled`, cause `step`, not
silence: its link kept talking); `/health` says the step hung; the stream it was generating ends
with an SSE error event then `[DONE]`; the requests sent into the hung engine, with no token yet,
are retried on the other engine (same request id, on the audit row) and succeed; a request sent
after the bound goes to the other at once; when the step returns the engine is recovered (logged)
and serves again. Then shutdown with a step hung: within `--shutdown-timeout` plus 2 s.
"""

from __future__ import annotations

import os
import re
import sys
import time

import httpx
import pytest
import yaml

from tests.api.conftest import start_server
from tests.engine.tiny_models import save_tiny
from tests.reliability import frozen_step_server
from tests.reliability.test_engine_stall import (
    OTHER,
    VICTIM,
    Call,
    audit_timing,
    body,
    gateway_events,
    queued_in,
    session_for,
    wait_until,
)

STALL_S = 2.0
SHUTDOWN_S = 3.0
SLACK_S = 3.0  # detection (a tick, a state push), the release, and a loaded 2-core test machine
MODEL = "tiny-hang"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("hung-step")
    control = tmp / "control"
    control.mkdir()
    model = save_tiny("llama", tmp / "tiny", max_position_embeddings=4096)
    routing = tmp / "routing.yaml"
    routing.write_text(yaml.safe_dump({"deployments": [{
        "name": MODEL, "model": str(model), "policy": "session_affinity",
        "replicas": [{"local": 2, "engine": {"max_model_len": 4096},
                      "engine_command": [sys.executable, frozen_step_server.__file__, "engine"]}],
    }]}))
    srv = start_server(tmp, "--model", str(model), "--routing", str(routing), "--stall-timeout", str(STALL_S),
                       "--shutdown-timeout", str(SHUTDOWN_S), "--log-format", "json",
                       env={**os.environ, "FROZEN_STEP_DIR": str(control)})
    log_dir = tmp / "data" / "logs" / "engines"
    pids = {p.stem: int(re.findall(r"started \(pid (\d+)\)", p.read_text())[-1]) for p in log_dir.glob("*.log")}
    try:
        yield srv, pids, log_dir, control
    finally:
        (control / "thaw").touch()  # never leave a step thread blocked
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(30)


def hang(log_dir, control, pid: int, then: Call | None = None) -> float:  # noqa: ANN001
    """Block the next step of the engine process `pid` (that of `then`, started after the hang is
    armed, if given); returns once it is blocked."""
    log = log_dir / f"{VICTIM}.log"
    seen = log.read_text().count(frozen_step_server.FROZEN)
    (control / f"freeze.{pid}").touch()
    if then is not None:
        then.start()
    wait_until(lambda: log.read_text().count(frozen_step_server.FROZEN) > seen, 30, "the step never blocked")
    return time.monotonic()


def test_a_hung_step_in_an_engine_process_is_ejected_its_requests_released_and_it_recovers(stack):
    srv, pids, log_dir, control = stack
    on_victim, on_other = session_for(VICTIM), session_for(OTHER)
    warm = [Call(srv, body(MODEL, 8), f"warm-{i}", s) for i, s in enumerate((on_victim, on_other) * 2)]
    for c in warm:  # (each engine's first steps: what a normal step of it takes)
        c.start()
        c.join()
        assert c.status == 200, c.text
    normal = max(c.took for c in warm[2:])
    assert queued_in(log_dir, VICTIM, "warm-0") and queued_in(log_dir, OTHER, "warm-1")

    streaming = Call(srv, body(MODEL, 3500, stream=True), "long-stream", on_victim)
    streaming.start()
    wait_until(lambda: len(streaming.lines) >= 3, 60, "the long stream never started")
    hung = hang(log_dir, control, pids[VICTIM])
    try:
        # Sent into the hung engine before the bound: no token yet, so retried on the other engine.
        waiting = [Call(srv, body(MODEL, 8), f"waiting-{i}", on_victim) for i in range(2)]
        for c in waiting:
            c.start()
        for c in (streaming, *waiting):
            c.join(timeout=STALL_S + 20)
            assert not c.is_alive(), f"{c.rid} still waiting {time.monotonic() - hung:.1f}s after the hang"
        health = httpx.get(srv.url + "/health", timeout=10).json()
        late = Call(srv, body(MODEL, 8), "late-0", on_victim)  # past the bound: to the other, at once
        late.start()
        late.join(30)
        still_hung = frozen_step_server.THAWED not in (log_dir / f"{VICTIM}.log").read_text()
    finally:
        (control / "thaw").touch()
    assert still_hung, "the step returned before the checks ran: they proved nothing"

    # Ejected once, for its step: the link kept talking (state pushes), so not for silence.
    ejected = [e for e in gateway_events(srv, "replica_ejected") if e.get("replica") == VICTIM]
    assert len(ejected) == 1 and ejected[0]["reason"] == "stalled" and ejected[0]["cause"] == "step", ejected
    assert STALL_S <= ejected[0]["silent_s"] < STALL_S + SLACK_S and ejected[0]["inflight"] >= 2, ejected
    assert not any(e.get("replica") == OTHER for e in gateway_events(srv, "replica_ejected"))
    victim = health["replicas"][MODEL][VICTIM]
    assert health["status"] == "degraded" and not victim["healthy"], health
    assert "one step of the engine has run" in victim["detail"], victim
    assert health["replicas"][MODEL][OTHER]["healthy"], health
    # The stream it was generating: an SSE error event naming the stall, then [DONE], soon after the bound.
    assert '"error"' in streaming.lines[-2][1] and "replica_stalled" in streaming.lines[-2][1], streaming.lines[-3:]
    assert streaming.lines[-1][1] == "data: [DONE]"
    assert streaming.lines[-1][0] - hung < STALL_S + SLACK_S
    # Sent into the hung engine: retried on the other (same id, on the audit row), within 5 s of normal.
    for c in waiting:
        assert c.status == 200, (c.rid, c.status, c.text)
        assert c.took < normal + STALL_S + 5, (c.rid, c.took, normal)
        assert queued_in(log_dir, OTHER, c.rid)
        timing = audit_timing(srv, c.rid)
        assert timing["retried_after"] == VICTIM and timing["replica"] == OTHER, timing
    # After the bound: served by the other at once.
    assert late.status == 200 and late.took < normal + 5, (late.status, late.took, late.text)
    assert queued_in(log_dir, OTHER, "late-0") and not queued_in(log_dir, VICTIM, "late-0")

    # The step returns: recovered (logged), its released requests aborted, serving again.
    thawed = time.monotonic()
    wait_until(lambda: httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok", 10,
               "the engine never recovered")
    recovered = time.monotonic() - thawed
    assert any(e.get("replica") == VICTIM for e in gateway_events(srv, "replica_recovered"))
    assert "request long-stream aborted by the gateway" in (log_dir / f"{VICTIM}.log").read_text()
    back = Call(srv, body(MODEL, 8), "back-0", on_victim)
    back.start()
    back.join(60)
    assert back.status == 200 and queued_in(log_dir, VICTIM, "back-0"), (back.status, back.text)
    print(f"normal {normal:.2f}s; stream cut {streaming.lines[-1][0] - hung:.2f}s after the hang; retried "
          f"requests {max(c.took for c in waiting):.2f}s; recovered {recovered:.2f}s after the step returned")


def test_shutdown_with_a_step_hung_in_an_engine_process_exits_within_the_timeout(stack):
    srv, pids, log_dir, control = stack
    hung = Call(srv, body(MODEL, 200), "hung-0", session_for(VICTIM))
    hang(log_dir, control, pids[VICTIM], then=hung)
    start = time.monotonic()
    code = srv.stop(timeout=60)
    took = time.monotonic() - start
    assert code == 0, srv.output()[-3000:]
    assert took < SHUTDOWN_S + 2, f"shutdown took {took:.1f}s with --shutdown-timeout {SHUTDOWN_S}"
    hung.join(10)
    print(f"shutdown with a step hung in an engine process: {took:.2f}s")

