"""One real `tokenpath serve` for the telemetry tests, exporting traces to a loopback OTLP
receiver and logging JSON to a file, with real keys in its store:

- `admin`: an admin key (`tokenpath keys create --admin`: the dashboard's and /metrics');
- `acme`: an ordinary key; `limited`, `limited_mix`: one request per minute each (429s);
- `other`: a key allowed only another model (the 403).

The server is started as a user would (the console script, `--port 0`) and stopped with
SIGTERM; a clean exit (0) is asserted. Tests run one after another against it, so counters
are compared as differences.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.server_data import seed_tokenizers, served_models
from tests.telemetry.otlp_receiver import OtlpReceiver
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.base import Limits
from tokenpath.gateway.store import GatewayStore, resolve_store_location
from tokenpath.telemetry.otel import PresetIdGenerator

CHAT_MODEL = "smollm2-135m-instruct"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log: Path
    data_dir: Path
    receiver: OtlpReceiver
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def log_records(self) -> list[dict]:
        import json

        out = []
        for line in self.output().split("\n")[:-1]:  # whole lines (the last may be midway written)
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def headers(self, who: str = "acme", **extra: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[who]}", **extra}


def make_keys(data_dir: Path) -> dict[str, str]:
    store = GatewayStore(resolve_store_location(data_dir))
    try:
        return {
            "admin": create_key(store, "admin", admin=True)[0],
            "acme": create_key(store, "acme")[0],
            "limited": create_key(store, "limited", limits=Limits(rpm=1))[0],
            "limited_mix": create_key(store, "limited", limits=Limits(rpm=1))[0],
            "other": create_key(store, "other", models=frozenset({"some-other-model"}))[0],
        }
    finally:
        store.close()


def launch(tmp: Path, receiver: OtlpReceiver, *args: str, env: dict[str, str] | None = None,
           wait: float = 300) -> Served:
    data_dir = tmp / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    keys = make_keys(data_dir)
    seed_tokenizers(data_dir, served_models(["--model", CHAT_MODEL, *args]))
    log = tmp / "server.log"
    full_env = {**os.environ, "TOKENPATH_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1",
                "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_METRIC_EXPORT_INTERVAL": "300", **(env or {})}
    with log.open("wb") as out:
        proc = subprocess.Popen([TOKENPATH, "serve", "--port", "0", "--otlp-endpoint", receiver.url,
                                 "--model", CHAT_MODEL, *args], stdout=out, stderr=subprocess.STDOUT, env=full_env)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            return Served(proc, int(m.group(1)), log, data_dir, receiver, keys)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start in {wait}s:\n{log.read_text()}")


def stop(srv: Served) -> int:
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
    return srv.proc.wait(timeout=60)


@pytest.fixture
def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A tracer provider whose spans stay in memory (the span unit tests)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=PresetIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture(scope="session")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[Served]:
    srv = launch(tmp_path_factory.mktemp("telemetry"), receiver)
    try:
        yield srv
    finally:
        code = stop(srv)
    assert code == 0, srv.output()[-3000:]


@pytest.fixture
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=120) as client:
        yield client


def chat(max_tokens: int = 8, **extra: object) -> dict:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
