"""Schema validation and grammar compiles off the event loop, in worker processes, with a bound
that is really enforced.

Why processes: jsonschema's meta-validation is pure Python (its draft-4 enum uniqueness check is
quadratic: a 2,000-entry enum of objects took 7 s), and llguidance's `compute_ff_tokens` holds the
GIL, so in a thread either one froze the event loop and every stream with it, and no timer could
fire to end it. A worker process can be killed: a job over its bound (`COMPILE_TIMEOUT_S` of its
own CPU time, see WALL_FACTOR) kills the worker, the request gets a 400 `grammar_too_complex`, and a fresh worker is started for the
next job. The gateway meanwhile only waits on a pipe.

The pool is small (two workers by default) and owned by the app's state. One worker is started at
server start with each tokenizer loaded (`start`: a process start, about a second, plus a fraction of one to
load each tokenizer's vocabulary into llguidance; on the first structured request this took ~2 s
of CPU beside the streams), the other on the first overlap; neither start counts against the bound. Verdicts are cached by spec,
refusals too, so a repeated spec, or a repeated bomb, costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from tokenpath.engine.structured.grammar import lower_priority
from tokenpath.protocol.sampling_params import StructuredOutput

log = logging.getLogger("tokenpath.api")

COMPILE_TIMEOUT_S = 5.0  # generous: the bound is for pathological grammars, not 2 busy cores
START_TIMEOUT_S = 120.0  # a fresh worker: spawn, imports, one tokenizer (seconds on a loaded machine)
# The bound counts the worker's own CPU seconds (Linux /proc), since it runs below the engine's
# priority and may wait for a core while streams decode: a spec is refused for what it costs, not
# for how busy the machine is. A job that cannot get this many times its bound in wall time is
# ended all the same, so a request never waits without end; without /proc the bound is wall time.
WALL_FACTOR = 6.0
POLL_S = 0.25
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far, or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None
VERDICTS = 512

# (tokenizer key, the tokenizer as llguidance reads it: (tokenizer.json text, vocabulary size, EOS id))
TokenizerSource = tuple[str, tuple[str, int, int]]
Reply = tuple[Any, ...]


class WorkerTimeout(Exception):
    """A job ran past its bound; its worker was killed."""


class WorkerDied(Exception):
    """The worker exited in the middle of a job (out of memory, a crash in the library)."""


class _Worker:
    """One process and its pipe; every method blocks, so each runs on a thread, never on the loop."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.tokenizers: set[str] = set()

    def _start(self) -> None:
        """A plain child running `grammar_child.main` over one end of a socket pair, with this
        process's sys.path (as spawn passed it).
        Not multiprocessing's spawn: that ran the server's own main module again in the worker
        (`tokenpath.cli`, which imports pydantic: 12 MiB of the worker's 98) and started
        multiprocessing's resource tracker beside it (another process, 12 MiB), which only cleans
        up named semaphores and shared memory, and the workers have neither."""
        code = f"import sys; sys.path[:] = {sys.path!r}; from tokenpath.api.grammar_child import main; main(sys.argv)"
        parent, child = socket.socketpair()
        try:
            proc = subprocess.Popen([sys.executable, "-c", code, str(child.fileno())], pass_fds=(child.fileno(),),
                                    stdin=subprocess.DEVNULL)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.proc, self.conn, self.tokenizers = proc, Connection(parent.detach()), set()

    def _call(self, msg: tuple, timeout: float) -> Reply:
        if self.conn is None or self.proc is None:
            raise WorkerDied
        try:
            self.conn.send(msg)
            if not self._wait(self.conn, self.proc.pid, timeout):
                self.kill()
                raise WorkerTimeout
            reply: Reply = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.kill()
            raise WorkerDied from exc
        return reply

    @staticmethod
    def _wait(conn: Connection, pid: int, timeout: float) -> bool:
        """Whether the reply came before the job spent `timeout` CPU seconds (see WALL_FACTOR)."""
        started, cpu0 = time.monotonic(), cpu_seconds(pid)
        wall = timeout if cpu0 is None else timeout * WALL_FACTOR
        while True:
            left = started + wall - time.monotonic()
            if conn.poll(max(0.0, min(POLL_S, left))):
                return True
            if left <= 0:
                return False
            cpu = cpu_seconds(pid) if cpu0 is not None else None
            if cpu is not None and cpu0 is not None and cpu - cpu0 >= timeout:
                return False

    def load(self, tokenizer: TokenizerSource) -> None:
        """Start the worker and load the tokenizer, if not done yet (neither counts against a job's bound)."""
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self._start()
        key, source = tokenizer
        if key not in self.tokenizers:
            text, n_vocab, eos = source
            self._call(("tokenizer", key, text, n_vocab, eos), START_TIMEOUT_S)
            self.tokenizers.add(key)

    def run(self, tokenizer: TokenizerSource, job: tuple, timeout: float) -> Reply:
        """Start the worker and load the tokenizer if needed (not counted), then the job, bounded."""
        self.load(tokenizer)
        return self._call(("check", tokenizer[0], *job), timeout)

    def kill(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        self.proc, self.conn, self.tokenizers = None, None, set()


class GrammarWorkers:
    """The pool: `check` waits for a free worker, runs one job on it off the loop, and returns its
    reply; a worker whose job ran late is killed and replaced on its next use."""

    def __init__(self, size: int = 2, timeout: float = COMPILE_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._workers = [_Worker() for _ in range(size)]
        # The gateway's own compile of a passed spec (for its grammar cache, which an in-process
        # engine shares) runs on these threads, below the engine's priority as the workers are:
        # llguidance's matcher constructor releases the GIL but takes 0.1-0.8 s of CPU for a large
        # schema, which at the step's priority is a core taken from the step's threads.
        self.local = ThreadPoolExecutor(size, thread_name_prefix="tokenpath-grammar-local",
                                        initializer=lower_priority, initargs=(True,))
        # Last returned, first taken: the warm worker (started by `start`, or by the last job) is
        # reused, and the second is spawned only when two jobs overlap.
        self._idle: asyncio.Queue[_Worker] = asyncio.LifoQueue()
        for w in self._workers:
            self._idle.put_nowait(w)
        self._verdicts: OrderedDict[tuple, Reply] = OrderedDict()

    async def check(self, tokenizer: TokenizerSource, schemas: list[tuple[str, str]], spec: StructuredOutput | None,
                    param: str) -> Reply:
        """("ok", seconds) or ("bad", param, message, code); ("timeout",) or ("died",) when the job
        killed its worker. A client that leaves does not return the worker early: the job's thread
        does, when it is done."""
        key = (tokenizer[0], tuple(schemas), None if spec is None else (spec.kind, spec.spec, spec.tools), param)
        found = self._verdicts.get(key)
        if found is not None:
            self._verdicts.move_to_end(key)
            return found
        worker = await self._idle.get()
        loop = asyncio.get_running_loop()
        job = (schemas, spec, param)
        fut = loop.run_in_executor(None, self._run, worker, tokenizer, job)
        fut.add_done_callback(lambda _: self._idle.put_nowait(worker))
        reply = await asyncio.shield(fut)
        if reply[0] == "died":  # perhaps not the spec's doing: the next try gets a fresh worker
            return reply
        self._verdicts[key] = reply
        while len(self._verdicts) > VERDICTS:
            self._verdicts.popitem(last=False)
        return reply

    def _run(self, worker: _Worker, tokenizer: TokenizerSource, job: tuple) -> Reply:
        try:
            return worker.run(tokenizer, job, self.timeout)
        except WorkerTimeout:
            log.warning("a grammar job ran past %.1f s; its worker was killed", self.timeout)
            return ("timeout",)
        except WorkerDied:
            log.warning("the grammar worker died during a job; a fresh one will be started")
            return ("died",)

    async def start(self, tokenizer: TokenizerSource) -> None:
        """Start one worker and load `tokenizer` into it now (at server start), so the first
        structured request does not pay the spawn, the imports and the vocabulary (~2 s of CPU at
        full priority, beside whatever streams are running then). One worker: the second starts
        on the first burst that needs it."""
        worker = await self._idle.get()
        try:
            await asyncio.get_running_loop().run_in_executor(None, worker.load, tokenizer)
        except Exception as exc:  # (a background start: nothing waits for it to raise)
            log.warning("the grammar worker did not start (%s); it is started again on first use", exc)
            worker.kill()
        finally:
            self._idle.put_nowait(worker)

    async def close(self) -> None:
        self.local.shutdown(wait=False, cancel_futures=True)
        for w in self._workers:
            await asyncio.to_thread(w.kill)
