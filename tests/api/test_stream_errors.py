"""An engine that dies mid-stream: the client gets an OpenAI error event, then [DONE], and /health
turns 503. Uses the project's simulated replica (a real Replica with failure injection) behind the
real app on a real loopback server, since a real model cannot be made to die on cue."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from tokenpath.api.app import create_app
from tokenpath.engine.embedding import EmbeddingTokenizer, default_embedding_model_dir
from tokenpath.replica.simulated import SimulatedConfig, SimulatedReplica
from tokenpath.routing.models import Deployment, ModelRouter


class _Running:
    def __init__(self, replica: SimulatedReplica) -> None:
        self.replica = replica
        tok = EmbeddingTokenizer(default_embedding_model_dir() / "tokenizer.json")  # any real tokenizer will do
        dep = Deployment(name="sim", task="completion", replicas=[replica], tokenizer=tok, max_model_len=512)
        self.server = uvicorn.Server(uvicorn.Config(create_app(ModelRouter([dep])), host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def kill_replica(self) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.replica.kill)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def sim() -> Iterator[tuple[_Running, str]]:
    running = _Running(SimulatedReplica("sim-0", SimulatedConfig(token_interval_s=0.05)))
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
