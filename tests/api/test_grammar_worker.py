"""The grammar workers' priority and bound, on real worker processes (issue 41, item 2): a check
runs below the gateway's (and engine's) priority, so it never takes a core from the streams being
decoded, and its bound counts the worker's own CPU seconds, so waiting for a core on a busy
machine is not mistaken for a slow grammar; a worker that cannot run at all is still ended, at
WALL_FACTOR times the bound. A stopped worker (SIGSTOP) stands for one that gets no CPU."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tokenpath.api import grammar_worker
from tokenpath.api.grammar_worker import GrammarWorkers, cpu_seconds
from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.structured.grammar import COMPILE_NICENESS
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.protocol.sampling_params import StructuredOutput

pytestmark = [pytest.mark.slow]  # worker processes, a real tokenizer


@pytest.fixture(scope="module")
def source():
    return Tokenizer(resolve_model_path("smollm2-135m-instruct")).grammar_source()


def _check(workers: GrammarWorkers, source, regex: str):
    return workers.check(source, [], StructuredOutput("regex", regex), "guided_regex")


def test_cpu_seconds_reads_a_process_own_time():
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None and after - before >= 0.2


def test_a_worker_runs_below_the_callers_priority(source):
    async def go() -> tuple[int, tuple]:
        workers = GrammarWorkers(size=1)
        try:
            reply = await _check(workers, source, "[0-9]{2}")
            pid = workers._workers[0].proc.pid  # the one worker's process
            return os.getpriority(os.PRIO_PROCESS, pid), reply
        finally:
            await workers.close()

    niceness, reply = asyncio.run(go())
    assert reply[0] == "ok"
    assert niceness >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICENESS)


def test_time_without_cpu_does_not_count_against_the_bound(source):
    """The worker is stopped for twice the bound while the job waits in its pipe: on a wall-clock
    bound that was a refusal (`timeout`); counted in CPU seconds, the job is answered."""
    async def go() -> tuple:
        workers = GrammarWorkers(size=1, timeout=1.0)
        try:
            assert (await _check(workers, source, "[0-9]{2}"))[0] == "ok"  # started, tokenizer loaded
            pid = workers._workers[0].proc.pid
            os.kill(pid, signal.SIGSTOP)
            job = asyncio.ensure_future(_check(workers, source, "[a-z]{3}"))
            await asyncio.sleep(2.0)
            os.kill(pid, signal.SIGCONT)
            return await job
        finally:
            await workers.close()

    assert asyncio.run(go())[0] == "ok"


def test_a_worker_that_gets_no_cpu_is_still_ended(source, monkeypatch):
    monkeypatch.setattr(grammar_worker, "WALL_FACTOR", 3.0)

    async def go() -> tuple[tuple, float]:
        workers = GrammarWorkers(size=1, timeout=0.5)
        try:
            assert (await _check(workers, source, "[0-9]{2}"))[0] == "ok"
            os.kill(workers._workers[0].proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            reply = await _check(workers, source, "[a-z]{4}")
            return reply, time.monotonic() - started
        finally:
            await workers.close()

    reply, seconds = asyncio.run(go())
    assert reply == ("timeout",)
    assert 1.4 <= seconds < 30, seconds  # 3 x 0.5 s of wall time, not 0.5 s, and not forever


_LEAN_WORKER = """
import asyncio, os, sys
from tokenpath.api.grammar_worker import GrammarWorkers
from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.protocol.sampling_params import StructuredOutput

def children():
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid == os.getpid():
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append(f.read().replace(b"\\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            pass
    return found

async def go():
    workers = GrammarWorkers(size=1)
    source = Tokenizer(resolve_model_path("smollm2-135m-instruct")).grammar_source()
    try:
        reply = await workers.check(source, [], StructuredOutput("regex", "[0-9]{2}"), "guided_regex")
        with open(f"/proc/{workers._workers[0].proc.pid}/maps") as f:
            maps = f.read()
        return reply[0], children(), maps
    finally:
        await workers.close()

status, kids, maps = asyncio.run(go())
print(status)
print(len(kids), "resource_tracker" in " ".join(kids))
print("_multiarray_umath" in maps, "_pydantic_core" in maps)
"""


def test_a_worker_is_one_lean_process(tmp_path):
    """The worker is the only process started, and maps neither numpy nor pydantic (issue 42's
    memory target). Before: multiprocessing's spawn started its resource tracker beside the worker
    (12 MiB, for named semaphores the workers never make), the worker imported numpy for one
    scratch buffer (21 MiB) and re-ran the parent's main module (pydantic, when it was
    `tokenpath.cli`): 98 MiB per worker, 60 now."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _LEAN_WORKER], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.split("\n")[:3] == ["ok", "1 False", "False False"], out.stderr[-2000:]
