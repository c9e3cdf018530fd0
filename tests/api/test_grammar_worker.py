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
