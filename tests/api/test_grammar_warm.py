"""Structured output's one-time and per-spec costs stay off the streams being decoded (issue 41,
item 2: a concurrent stream's p99 gap within 1.5x of normal while a grammar compiles).

What froze the gateway's process (engine and event loop included) before, each measured with a
1 ms ticker thread: reading the vocabulary into llguidance (~0.8 s, GIL held) and serializing the
tokenizer for the workers (~0.3 s, GIL held) on the first structured request; a grammar worker's
spawn and imports on that request too; and per fresh schema, making its grammar from the schema
(~40 ms, GIL held for a 2,000-value enum) plus its matcher's build at the step's priority. Now:
the first two happen at start-up (before serving), a worker is started then too, the worker ships
the grammar text it made, and the gateway's own matcher build runs below the engine's priority.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest

from tokenpath.api.app import create_app
from tokenpath.api.grammar_worker import GrammarWorkers
from tokenpath.api.settings import ApiSettings
from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.structured.grammar import COMPILE_NICENESS, GrammarCache, grammar_text
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.protocol.sampling_params import StructuredOutput
from tokenpath.routing.models import Deployment, ModelRouter

pytestmark = [pytest.mark.slow]  # worker processes, a real tokenizer

SCHEMA = StructuredOutput("json", json.dumps({"type": "object", "properties": {"k": {"enum": [1, 2, 3]}},
                                              "required": ["k"]}))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model_path("smollm2-135m-instruct"))


def test_the_gateways_own_compile_runs_below_its_priority():
    async def go() -> int:
        workers = GrammarWorkers(size=1)
        try:
            tid = await asyncio.get_running_loop().run_in_executor(workers.local, threading.get_native_id)
            return os.getpriority(os.PRIO_PROCESS, tid)
        finally:
            await workers.close()

    assert asyncio.run(go()) >= min(19, os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICENESS)


def test_a_worker_ships_the_grammar_it_made_and_the_gateway_builds_from_it(tokenizer):
    async def go() -> tuple:
        workers = GrammarWorkers(size=1)
        try:
            return await workers.check(tokenizer.grammar_source(), [], SCHEMA, "response_format")
        finally:
            await workers.close()

    reply = asyncio.run(go())
    assert reply[0] == "ok" and reply[2] == grammar_text(SCHEMA)
    # The cache builds the matcher from the text it is given (not from the spec again): here a
    # regex's text under the schema's key, and the matcher follows the text.
    cache = GrammarCache(tokenizer.llg_tokenizer())
    found = cache.get(SCHEMA, grammar_text(StructuredOutput("regex", "[a-z]{3}")))
    ids = tokenizer.encode("abc")
    assert found.matcher.validate_tokens(ids) == len(ids)


def test_start_up_reads_the_vocabulary_and_starts_a_worker_before_any_request(tokenizer):
    """Before: both waited for the first structured request (the tokenizer's grammar cache was
    None, and no worker process existed)."""
    fresh = Tokenizer(resolve_model_path("smollm2-135m-instruct"))
    # (on by default; the suite's own servers run with TOKENPATH_GRAMMAR_WARMUP=0, tests/conftest.py)
    app = create_app(ModelRouter([Deployment(name="m", task="completion", tokenizer=fresh)]),
                     config=ApiSettings(grammar_warmup=True))
    workers: GrammarWorkers = app.state.tokenpath.grammar_workers

    async def go() -> tuple[bool, bool]:
        async with app.router.lifespan_context(app):
            built = fresh._grammars is not None  # built before serving
            key = fresh.grammar_source()[0]
            for _ in range(1200):  # the worker starts in the background, once serving
                if any(w.proc is not None and w.proc.poll() is None and key in w.tokenizers for w in workers._workers):
                    return built, True
                await asyncio.sleep(0.1)
            return built, False

    assert asyncio.run(go()) == (True, True)


def test_without_the_warmup_nothing_is_read_before_the_first_structured_request():
    fresh = Tokenizer(resolve_model_path("smollm2-135m-instruct"))
    app = create_app(ModelRouter([Deployment(name="m", task="completion", tokenizer=fresh)]),
                     config=ApiSettings(grammar_warmup=False))

    async def go() -> bool:
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0.5)
            return fresh._grammars is None and all(w.proc is None for w in app.state.tokenpath.grammar_workers._workers)

    assert asyncio.run(go())
