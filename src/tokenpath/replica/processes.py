"""tokenpath's own engine processes: started, linked, supervised, restarted, and never orphaned.

Each `EngineProcess` is one `tokenpath engine` child serving its engine over the engine link
(`link_server.py`) to one `EngineLinkReplica` here. Separate processes give each replica its own
interpreter and step loop, so one replica's Python overhead or crash does not stall the others.

- **Trust.** The listening socket is created here, on loopback, and handed to the child as an
  inherited file descriptor (no port race, nothing else can bind it first); a fresh secret per
  launch travels in the child's environment (readable only by this user), never on its command
  line. A connection without it is refused by the engine.
- **Never orphaned.** The child asks the kernel for SIGKILL when its parent dies
  (`PR_SET_PDEATHSIG`, set before it loads anything) and exits when its link closes.
- **Supervised.** `asyncio`'s child watcher reaps a dead child at once; the link replica is
  marked down (in-flight streams fail with a clean 503, `/health` turns 503), and the engine is
  restarted with exponential backoff, logged, counted in `tokenpath:replica_restarts_total`, and
  re-admitted by the pool once its state says healthy.
- **Logs.** The child's stdout/stderr go to `<data dir>/logs/engines/<name>.log`, rotated by size.
- **Command.** By default `<this Python> -m tokenpath.cli engine`; a deployment may give its own
  (`engine_command` in a routing file), e.g. to run the engine under `numactl`, `taskset` or a
  profiler. The flags above are appended to it either way.
- **Priority.** Engines run at nice +`ENGINE_NICE` (set by the child before it starts a thread):
  the gateway is light and latency-bound, the engines fill every core, so the gateway goes first.
- **Cores.** `n` engines split the machine's cores (`TOKENPATH_NUM_THREADS` = cores // n, at least 1)
  unless the operator set `TOKENPATH_NUM_THREADS` or `OMP_NUM_THREADS`: two engines each running as
  many kernel threads as there are cores oversubscribe them, and a descheduled OpenMP thread holds
  up its whole parallel region.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import logging.handlers
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from tokenpath.config import NUM_THREADS_ENV, EngineLaunch, env_num_threads
from tokenpath.errors import ModelLoadError
from tokenpath.replica.link_client import EngineLinkReplica, LinkReplica
from tokenpath.telemetry import series

log = logging.getLogger("tokenpath.replica")

ENGINE_NICE = 5
RESTART_BASE_S = 1.0
RESTART_MAX_S = 30.0
# How long a stopping engine gets to exit by itself once its link is closed, before SIGKILL: the
# gateway's whole shutdown must fit in --shutdown-timeout plus 2 s (issue 23), and an engine holds
# nothing that outlives it (its KV cache dies with it either way).
STOP_TIMEOUT_S = 1.0
LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 3


class EngineProcess:
    def __init__(self, name: str, model: str | None, engine_args: list[str], log_dir: Path,
                 deployment: str = "", nice: int = ENGINE_NICE, max_num_seqs: int = 0,
                 link: type[LinkReplica[Any, Any]] = EngineLinkReplica, command: list[str] | None = None) -> None:
        self.name = name
        self.command = list(command) if command else default_engine_command()
        self.model = model
        self.engine_args = list(engine_args)
        self.deployment = deployment or (model or "")
        self.nice = nice
        self.num_threads = 0  # kernel threads for this engine; 0: its own default
        self.replica = link(name, secret="", max_num_seqs=max_num_seqs)  # (EmbeddingLinkReplica for encoders)
        self.proc: asyncio.subprocess.Process | None = None
        self.args: list[str] = []
        self.port = 0
        self.restarts = 0
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._log = _rotating_logger(name, log_dir)
        self.log_path = log_dir / f"{name}.log"
        self._pump: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._stopping = False

    def log_tail(self) -> str:
        return "\n".join(self._tail)

    # -- one launch -------------------------------------------------------------------------------
    async def _launch(self, timeout: float) -> None:
        """Start the child and link to it; raises ModelLoadError if it exits or stays silent."""
        secret = secrets.token_urlsafe(32)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.args = [*self.command, "--listen-fd", str(sock.fileno()), "--exit-with-link"]
        if self.model:
            self.args += ["--model", self.model]
        self.args += self.engine_args
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               **EngineLaunch(secret=secret, parent_pid=os.getpid(), nice=self.nice).env()}
        if self.num_threads and env_num_threads() is None and not os.environ.get("OMP_NUM_THREADS"):
            env[NUM_THREADS_ENV] = str(self.num_threads)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=env, pass_fds=(sock.fileno(),),
                start_new_session=True)  # no terminal Ctrl-C to the engines: the gateway drains first
        finally:
            sock.close()  # the child holds its own copy
        self._log.info("--- %s started (pid %d): %s", self.name, self.proc.pid, " ".join(self.args))
        self._pump = asyncio.create_task(self._pump_output(self.proc))
        self.replica.secret = secret
        linking = asyncio.create_task(self.replica.connect("127.0.0.1", self.port, timeout=timeout))
        exited = asyncio.create_task(self.proc.wait())
        try:
            await asyncio.wait({linking, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:  # (also when this launch is cancelled: no task is left behind unawaited)
            for t in (linking, exited):
                if not t.done():
                    t.cancel()
            await asyncio.gather(linking, exited, return_exceptions=True)
        if not linking.cancelled() and linking.exception() is None:
            return
        await self._kill_and_reap()
        why = f"exited with {self.proc.returncode}" if exited.done() and not exited.cancelled() else "did not link in time"
        if not linking.cancelled() and linking.exception() is not None:
            why = f"{why} ({linking.exception()!r})"
        raise ModelLoadError(f"engine process {self.name} {why}:\n{self.log_tail()}")

    async def _pump_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            self._tail.append(text)
            self._log.info("%s", text)

    async def _kill_and_reap(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()

    # -- lifetime ---------------------------------------------------------------------------------
    async def start(self, timeout: float = 600.0) -> None:
        await self._launch(timeout)
        self._watch = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        """Reap the child the moment it exits; restart it with backoff until stopped."""
        delay = RESTART_BASE_S
        while not self._stopping:
            assert self.proc is not None
            started = time.monotonic()
            code = await self.proc.wait()
            if self._stopping:
                return
            self.replica.mark_down(f"engine process exited with {code}")
            log.warning("replica %s: engine process (pid %d) died with exit code %s; restarting in %.0fs",
                        self.name, self.proc.pid, code, delay)
            if time.monotonic() - started > 60:
                delay = RESTART_BASE_S  # it had been up a while: not a crash loop
            while not self._stopping:
                await asyncio.sleep(delay)
                delay = min(RESTART_MAX_S, delay * 2)
                try:
                    await self._launch(timeout=600.0)
                except ModelLoadError as exc:
                    log.error("replica %s: restart failed, next try in %.0fs: %s", self.name, delay,
                              str(exc).splitlines()[0])
                    continue
                self.restarts += 1
                self.replica.restarts = self.restarts
                series.REPLICA_RESTARTS.labels(self.deployment, self.name).inc()
                log.info("replica %s: engine process restarted (pid %d, restart %d); linked and healthy",
                         self.name, self.proc.pid, self.restarts)
                break

    def kill(self) -> None:
        """SIGKILL: the crash a router must survive (no drain, no goodbye)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        frozen = self.replica.liveness.stalled  # (a stopped process can act on no signal but SIGKILL)
        await self.replica.close()  # the engine exits when its link closes...
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()  # ...or on SIGTERM
            try:
                await asyncio.wait_for(self.proc.wait(), 0 if frozen else timeout)
            except TimeoutError:
                log.warning("replica %s: engine process (pid %d) did not exit within %.1fs of its stop; killed",
                            self.name, self.proc.pid, timeout)
                await self._kill_and_reap()
        if self._pump is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._pump, 2)
        for h in list(self._log.handlers):
            h.close()
            self._log.removeHandler(h)


def default_engine_command() -> list[str]:
    """`tokenpath engine` on the Python running the gateway (same install, same environment)."""
    return [sys.executable, "-m", "tokenpath.cli", "engine"]


def _rotating_logger(name: str, log_dir: Path) -> logging.Logger:
    log_dir.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"tokenpath.engines.{name}.{id(log_dir)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.handlers.RotatingFileHandler(log_dir / f"{name}.log", maxBytes=LOG_MAX_BYTES,
                                                   backupCount=LOG_BACKUPS, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    return logger


async def spawn_engines(n: int, model: str | None = None, engine_args: list[str] | None = None,
                        log_dir: Path | None = None, startup_timeout: float = 600.0, name_prefix: str = "engine",
                        deployment: str = "", nice: int = ENGINE_NICE,
                        max_num_seqs: int = 0, link: type[LinkReplica[Any, Any]] = EngineLinkReplica,
                        command: list[str] | None = None) -> list[EngineProcess]:
    """Start `n` supervised engine processes (loading in parallel) and link to each. `command`
    replaces `default_engine_command()`; the engine's flags are appended to it."""
    if log_dir is None:
        from tokenpath.config import resolve_data_dir

        log_dir = resolve_data_dir() / "logs" / "engines"
    procs = [EngineProcess(f"{name_prefix}-{i}", model, list(engine_args or []), log_dir, deployment, nice,
                           max_num_seqs, link, command) for i in range(n)]
    for p in procs:  # the cores split between them (see "Cores" above)
        p.num_threads = max(1, (os.cpu_count() or 1) // n)
    try:
        await asyncio.gather(*(p.start(startup_timeout) for p in procs))
    except BaseException:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        raise
    return procs
