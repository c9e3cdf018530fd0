"""The real app on a real loopback uvicorn server, in a thread, in front of simulated replicas.

For behaviour a real model cannot produce on cue (an engine that dies mid-stream, a queue that
stays full for seconds): the simulated replica is a real `Replica` with failure injection.
"""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from tests.simulated_replica import SimulatedReplica

from tokenpath.admission.controller import AdmissionConfig
from tokenpath.api.app import create_app
from tokenpath.api.settings import ApiSettings
from tokenpath.engine.embedding import EmbeddingTokenizer, default_embedding_model_dir
from tokenpath.gateway.base import RequestGuard
from tokenpath.routing.models import Deployment, ModelRouter


class SimServer:
    def __init__(self, replica: SimulatedReplica, admission: AdmissionConfig | None = None,
                 guard: RequestGuard | None = None, config: ApiSettings | None = None) -> None:
        self.replica = replica
        tok = EmbeddingTokenizer(default_embedding_model_dir() / "tokenizer.json")  # any real tokenizer will do
        dep = Deployment(name="sim", task="completion", replicas=[replica], tokenizer=tok, max_model_len=512,
                         admission=admission or AdmissionConfig())
        closers = [guard.aclose] if hasattr(guard, "aclose") else []
        app = create_app(ModelRouter([dep]), guard, config, on_shutdown=closers)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on"))
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
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def kill_replica(self) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.replica.kill)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
