"""The request's `timeout` over HTTP: a deadline for its first token, wherever it waits.

A replica that runs one sequence at a time and makes a token every 50 ms keeps requests waiting
for seconds, so each place a request can wait is reachable on cue: refused up front when the
predicted wait is already too long (429), expired in the gateway's queue (504), and expired in
the engine's own queue after dispatch (504, and the replica is told to drop it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from sim_server import SimServer
from tests.simulated_replica import SimulatedConfig, SimulatedReplica

from tokenpath.admission.controller import AdmissionConfig

LONG = {"model": "sim", "prompt": "hello", "max_tokens": 100}  # 2 s each on this replica


@pytest.fixture
def server() -> Iterator[SimServer]:
    # A service-time prior of 0.5 s makes the predicted wait behind k requests k * 0.5 / 3 slots.
    running = SimServer(SimulatedReplica("sim-0", SimulatedConfig(max_num_seqs=1, token_interval_s=0.02)),
                        AdmissionConfig(initial_service_s=0.5))
    running.start()
    yield running
    running.stop()


def _occupy(url: str, n: int) -> list[threading.Thread]:
    """n long requests in flight; returns once the replica and gateway hold all of them."""
    def one() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            assert c.post("/v1/completions", json=LONG).status_code == 200

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    return threads


def test_unreachable_timeout_is_refused_up_front_with_retry_after(server):
    url = server.url
    threads = _occupy(url, 5)  # 1 running, 2 in the engine's queue, 2 in the gateway's
    # Predicted wait: 3 ahead (counting itself) * 0.5 s / 3 slots = 0.5 s, past a 0.2 s timeout.
    resp = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 2, "timeout": 0.2}, timeout=30)
    assert resp.status_code == 429
    assert resp.json()["error"]["code"] == "deadline_unreachable"
    assert int(resp.headers["retry-after"]) >= 1
    assert "total;dur=" in resp.headers["server-timing"]  # how long the refusal took, server side
    for t in threads:
        t.join()


def test_timeout_expires_in_the_gateway_queue(server):
    url = server.url
    threads = _occupy(url, 5)
    # Predicted 0.5 s fits in 1.5 s, so it queues; the real wait (about 4 s) does not.
    resp = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 2, "timeout": 1.5}, timeout=30)
    assert resp.status_code == 504
    body = resp.json()["error"]
    assert body["code"] == "deadline_exceeded" and "queue" in body["message"]
    for t in threads:
        t.join()


def test_timeout_expires_in_the_engine_queue_and_the_replica_drops_it(server):
    url = server.url
    threads = _occupy(url, 2)  # 1 running, 1 waiting in the engine: a new request is dispatched at once
    resp = httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 2, "timeout": 1, "stream": True},
                      timeout=30)
    assert resp.status_code == 504  # nothing was streamed yet, so a plain error response
    assert resp.json()["error"]["code"] == "deadline_exceeded"
    assert "before its first token" in resp.json()["error"]["message"]
    for t in threads:
        t.join()
    # The expired request never ran: only the two long ones did.
    assert len(server.replica.served) == 2


def test_timeout_that_is_met_changes_nothing(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="sim", prompt="hi", max_tokens=3, extra_body={"timeout": 30})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3


@pytest.mark.parametrize("bad", [0, -1, "soon", 10**9])
def test_invalid_timeout_is_a_400(server, bad):
    resp = httpx.post(server.url + "/v1/completions", json={**LONG, "timeout": bad}, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
