"""Real `tokenpath serve` processes on free loopback ports, shared per session/module (the
default one, `server`, is tests/conftest.py's: the fault suite shares it).

The server is started exactly as a user would start it (the console script), its banner is read
for the port it bound (`--port 0`), and it is stopped with SIGTERM; a clean exit (0) is asserted
so every test run also checks graceful shutdown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tests.server_data import seed_tokenizers, served_models

CHAT_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self) -> list[str]:
        """The log's whole lines: the server may be midway through writing the last one (a line
        read before its end failed to parse once, under CI's load)."""
        return self.output().split("\n")[:-1]  # (the last piece: "" or a line not ended yet)

    def request_log(self, request_id: str, timeout: float = 10) -> dict:
        """The server's JSON log line for one request. It is written as the request ends, after
        its reply (a client may read the last byte a moment before): waited for, up to `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            for line in reversed(self.lines()):
                if line.startswith("{") and f'"request_id":"{request_id}"' in line.replace(" ", ""):
                    return json.loads(line)
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line for {request_id}:\n{self.output()[-2000:]}")
            time.sleep(0.05)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def start_server(tmp: Path, *args: str, wait: float = 240, exe: str = TOKENPATH, command: list[str] | None = None,
                 env: dict[str, str] | None = None, fresh_data_dir: bool = False) -> Server:
    """`exe serve --port 0 ARGS` (exe: another install's `tokenpath`; `command` replaces it with a
    test double that wraps the real entry point), in `env` (default: ours). Its data dir, TMP/data,
    holds the GGUF models' tokenizers already (tests/server_data.py), unless `fresh_data_dir`."""
    log = tmp / "server.log"
    if not fresh_data_dir:
        seed_tokenizers(tmp / "data", served_models(args))
    env = {**(os.environ if env is None else env), "TOKENPATH_DATA_DIR": str(tmp / "data"), "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([*(command or [exe]), "serve", "--port", "0", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        m = re.search(r"listening on https?://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            return Server(proc, int(m.group(1)), log)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start in {wait}s:\n{log.read_text()}")


@contextmanager
def running_server(tmp: Path, *args: str, wait: float = 240) -> Iterator[Server]:
    """A server for the length of a with-block; its clean exit (SIGTERM -> 0) is asserted after."""
    srv = start_server(tmp, *args, wait=wait)
    try:
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.output()[-3000:]


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def read_metric(text: str, name: str, model: str = CHAT_MODEL) -> float:
    """One sample of a `tokenpath:` metric for a model from a /metrics page."""
    m = re.search(rf'^tokenpath:{name}\{{model_name="{re.escape(model)}"\}} (\S+)$', text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture
def metric():
    return read_metric


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start extra servers with their own flags; all are stopped (SIGTERM, exit 0) at module end."""
    started: list[Server] = []

    def make(*args: str, fresh_data_dir: bool = False) -> Server:
        srv = start_server(tmp_path_factory.mktemp("serve"), *args, fresh_data_dir=fresh_data_dir)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        code = srv.stop()
        assert code == 0, srv.output()[-3000:]


@pytest.fixture(scope="session")
def launch_server():
    """`start_server(tmp_dir, *flags)` for tests that must prepare the data dir first."""
    return start_server
