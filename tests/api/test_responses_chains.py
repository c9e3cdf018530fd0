"""100 concurrent `previous_response_id` chains lose no turn (issue 35's target), through the
real `openai` client. The model is a tiny random-weight llama with SmolLM2's tokenizer and chat
template (tests/engine/tiny_models.py), so 300 turns cost the edge and the store, not the model.
Auth is on: the chains belong to one tenant's key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from tests.api.conftest import Server
from tests.engine.tiny_models import cached_tiny

from tokenpath.gateway import GatewayStore
from tokenpath.gateway.admin import create_key

pytestmark = pytest.mark.slow

CHAT_MODEL = "tiny-chains"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[tuple[Server, str]]:
    tmp = tmp_path_factory.mktemp("chains")
    (tmp / "data").mkdir()
    store = GatewayStore(tmp / "data" / "gateway.sqlite3")
    try:
        key, _ = create_key(store, "alpha")
    finally:
        store.close()
    srv = launch_server(tmp, "--model", str(cached_tiny("llama")), "--served-model-name", CHAT_MODEL)
    try:
        yield srv, key
    finally:
        code = srv.stop()
    assert code == 0, srv.output()[-3000:]


CHAINS, TURNS = 100, 3


def test_concurrent_chains_lose_no_turn(keyed):
    """100 `previous_response_id` chains at once (one token a turn; every other chain streamed):
    each chain's stored history is exactly its own turns, in order, with the very output items
    each turn answered with; no turn lost, none crossed into another chain."""
    srv, alpha = keyed
    c = openai.AsyncOpenAI(base_url=srv.base_url, api_key=alpha, max_retries=0, timeout=600)

    async def turn(k: int, t: int, prev: str | None):  # noqa: ANN202
        kw = {"model": CHAT_MODEL, "input": f"chain {k} turn {t}", "previous_response_id": prev,
              "max_output_tokens": 1}
        if k % 2 == 0:
            return await c.responses.create(**kw)
        events = [e async for e in await c.responses.create(**kw, stream=True)]
        assert events[-1].type in ("response.incomplete", "response.completed")
        return events[-1].response

    async def chain(k: int) -> tuple[list[object], list[dict]]:
        replies, prev = [], None
        for t in range(TURNS):
            r = await turn(k, t, prev)
            assert r.previous_response_id == prev
            replies.append(r)
            prev = r.id
        page = await c.responses.input_items.list(prev, order="asc", limit=100)
        return replies, [i.model_dump() for i in page.data]

    async def all_chains() -> list[tuple[list[object], list[dict]]]:
        try:
            return await asyncio.gather(*(chain(k) for k in range(CHAINS)))
        finally:
            await c.close()

    results = asyncio.run(all_chains())
    ids = [r.id for replies, _ in results for r in replies]
    assert len(set(ids)) == CHAINS * TURNS
    for k, (replies, items) in enumerate(results):
        # turn 0's input, its output, turn 1's input, its output, ... the last turn's input
        expected: list[object] = []
        for t, r in enumerate(replies):
            expected.append(f"chain {k} turn {t}")
            if t < TURNS - 1:
                expected.extend(o.id for o in r.output)
        seen = [i["content"][0]["text"] if i.get("role") == "user" else i["id"] for i in items]
        assert seen == expected, (k, items)
        # (each stored output item is the one that turn answered with: same text)
        outputs = {o.id: o.model_dump() for r in replies for o in r.output}
        for i in items:
            if i.get("role") != "user":
                assert i["content"] == outputs[i["id"]]["content"], (k, i)
