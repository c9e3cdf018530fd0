"""Real `tokenpath serve` processes on free loopback ports, shared per session/module (the
default one, `server`, is tests/conftest.py's: the fault suite shares it).

The server is started exactly as a user would start it (the console script), its banner is read
for the port it bound (`--port 0`), and it is stopped with SIGTERM; a clean exit (0) is asserted
so every test run also checks graceful shutdown.
"""

from __future__ import annotations

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

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def start_server(tmp: Path, *args: str, wait: float = 240, exe: str = TOKENPATH, command: list[str] | None = None,
                 env: dict[str, str] | None = None, fresh_data_dir: bool = False) -> Server:
    """`exe serve --port 0 ARGS` (exe: another install's `tokenpath`; `command` replaces it with a
    test double that wraps the real entry point), in `env` (default: ours). Its data dir, TMP/data,
    holds the GGUF models' tokenizers already (tests/server_data.py), unless `fresh_data_dir`."""
    proc, log = spawn_server(tmp, *args, exe=exe, command=command, env=env, fresh_data_dir=fresh_data_dir)
    return await_banner(proc, log, time.monotonic() + wait)


def spawn_server(tmp: Path, *args: str, exe: str = TOKENPATH, command: list[str] | None = None,
                 env: dict[str, str] | None = None, fresh_data_dir: bool = False) -> tuple[subprocess.Popen, Path]:
    """`start_server`'s first half: the process, started, and its log; `await_banner` is the second."""
    log = tmp / "server.log"
    if not fresh_data_dir:
        seed_tokenizers(tmp / "data", served_models(args))
    env = {**(os.environ if env is None else env), "TOKENPATH_DATA_DIR": str(tmp / "data"), "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([*(command or [exe]), "serve", "--port", "0", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    return proc, log


def await_banner(proc: subprocess.Popen, log: Path, deadline: float) -> Server:
    """The server once its banner names the port it bound; killed, and an error, if it exits or
    is not listening by `deadline` (time.monotonic())."""
    while time.monotonic() < deadline:
        m = re.search(r"listening on https?://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            return Server(proc, int(m.group(1)), log)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start in time:\n{log.read_text()}")


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


class ServerFactory:
    """Servers with their own flags, each in a fresh temp dir; `stop_all` stops them (SIGTERM) and
    asserts each exited 0."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self.started: list[Server] = []

    def __call__(self, *args: str, fresh_data_dir: bool = False) -> Server:
        srv = start_server(self._tmp.mktemp("serve"), *args, fresh_data_dir=fresh_data_dir)
        self.started.append(srv)
        return srv

    def many(self, *flag_sets: tuple[str, ...], fresh_data_dir: tuple[bool, ...] = (), wait: float = 240) -> list[Server]:
        """Several servers started at once (fresh_data_dir[i] for the i-th): a start is mostly one
        busy core (imports, the model's load), so on 2 cores two starts side by side take about
        the time of one, where one after the other take twice that. `wait` is per server, as for
        the same starts one after the other: together they have that long in all."""
        fresh = list(fresh_data_dir) + [False] * (len(flag_sets) - len(fresh_data_dir))
        spawned = [spawn_server(self._tmp.mktemp("serve"), *flags, fresh_data_dir=f)
                   for flags, f in zip(flag_sets, fresh, strict=True)]
        deadline = time.monotonic() + wait * len(spawned)
        servers: list[Server] = []
        try:
            for proc, log in spawned:
                servers.append(await_banner(proc, log, deadline))
        finally:
            self.started += servers
            for proc, _ in spawned[len(servers):]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=60)
        return servers

    def stop_all(self) -> None:
        for srv in self.started:
            code = srv.stop()
            assert code == 0, srv.output()[-3000:]


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """Start extra servers with their own flags (`.many(...)`: several at once); all are stopped
    (SIGTERM, exit 0) at module end."""
    factory = ServerFactory(tmp_path_factory)
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def launch_server():
    """`start_server(tmp_dir, *flags)` for tests that must prepare the data dir first."""
    return start_server
