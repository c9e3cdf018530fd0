"""Local engine processes: `tokenpath engine --port N` children, each a remote replica on loopback.

Separate processes (rather than several engines in one process) give each replica its own
interpreter and step loop, so one replica's Python overhead or crash does not stall the others,
and a killed process is exactly the failure a multi-machine deployment sees.

They run at a lower CPU priority (`ENGINE_NICE`) than the gateway that starts them: engines are
throughput work that fills every core, the gateway is light and latency-bound (a 429 should not
wait for an engine's time slice to end), so on shared cores the scheduler runs it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tokenpath.errors import ModelLoadError
from tokenpath.replica.remote import RemoteReplica, RemoteReplicaConfig

ENGINE_NICE = 5


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class EngineProcess:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the crash a router must survive (no drain, no goodbye)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                await asyncio.to_thread(self.proc.wait, 5)


async def _wait_healthy(ep: EngineProcess, deadline: float) -> None:
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if ep.proc.poll() is not None:
                raise ModelLoadError(f"engine process {ep.name} exited with {ep.proc.returncode}:\n{ep.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(ep.url + "/health")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise ModelLoadError(f"engine process {ep.name} not healthy in time:\n{ep.log_tail()}")


async def spawn_engines(n: int, model: str | None = None, engine_args: list[str] | None = None,
                        host: str = "127.0.0.1", startup_timeout: float = 600.0,
                        name_prefix: str = "engine", nice: int = ENGINE_NICE) -> list[EngineProcess]:
    """Start `n` engine processes and wait until each answers /health (they load in parallel)."""
    procs: list[EngineProcess] = []
    log_dir = Path(tempfile.mkdtemp(prefix="tokenpath-engines-"))
    try:
        for i in range(n):
            port = free_port(host)
            args = [sys.executable, "-m", "tokenpath.cli", "engine", "--host", host, "--port", str(port)]
            if model:
                args += ["--model", model]
            args += list(engine_args or [])
            log_path = log_dir / f"{name_prefix}-{i}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
            if nice:
                # Set before the child's interpreter has started any thread, so every thread it
                # creates inherits it. Best effort: a container may forbid it.
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
            procs.append(EngineProcess(f"{name_prefix}-{i}", f"http://{host}:{port}", proc, log_path, args))
        deadline = time.monotonic() + startup_timeout
        await asyncio.gather(*(_wait_healthy(p, deadline) for p in procs))
    except BaseException:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        raise
    return procs


async def engine_replicas(n: int, model: str | None = None, engine_args: list[str] | None = None,
                          served_name: str | None = None, max_num_seqs: int = 0,
                          poll_interval_s: float = 0.1) -> tuple[list[RemoteReplica], list[EngineProcess]]:
    """`n` local engine processes wrapped as remote replicas (polled, started)."""
    procs = await spawn_engines(n, model, engine_args)
    replicas = [RemoteReplica(p.name, RemoteReplicaConfig(url=p.url, max_num_seqs=max_num_seqs,
                                                          poll_interval_s=poll_interval_s), model=served_name)
                for p in procs]
    await asyncio.gather(*(r.start() for r in replicas))
    return replicas, procs
