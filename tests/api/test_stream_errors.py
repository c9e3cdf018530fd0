"""An engine that dies mid-stream: the client gets an OpenAI error event, then [DONE], and /health
turns 503. Uses the project's simulated replica (a real Replica with failure injection) behind the
real app on a real loopback server, since a real model cannot be made to die on cue."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from sim_server import SimServer
from tests.simulated_replica import SimulatedConfig, SimulatedReplica


@pytest.fixture
def sim() -> Iterator[tuple[SimServer, str]]:
    running = SimServer(SimulatedReplica("sim-0", SimulatedConfig(token_interval_s=0.05)))
    url = running.start()
    yield running, url
    running.stop()


def test_engine_death_mid_stream_is_an_error_event_then_done(sim):
    running, url = sim
    body = {"model": "sim", "prompt": "hello world", "max_tokens": 200, "stream": True}
    events = []
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    running.kill_replica()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert set(error) == {"error"} and error["error"]["type"] == "service_unavailable"
        assert all("choices" in json.loads(e) for e in events[:-2])
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["models"] == {"sim": False}
        # New requests get a clean 503, and the server is still up.
        after = client.post("/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": 2})
        assert after.status_code == 503 and set(after.json()) == {"error"}
