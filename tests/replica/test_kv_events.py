"""vLLM's KV events become the prefix index of a URL replica (issue 37: routing guessed).

The payloads in data/vllm_kv_events.json were encoded by vLLM 0.32's own `KVEventBatch` structs
and msgspec encoder, as its `ZmqEventPublisher` sends them (block hashes are SHA-256 bytes, its
default). The feed test serves them over real ZMQ sockets in vLLM's protocol: a PUB socket of
(topic, sequence, payload) messages and a ROUTER replay socket answering a DEALER's start sequence
with the buffered batches and an end marker.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from tokenpath.engine.block_hash import block_hashes
from tokenpath.protocol import GenerateRequest, ReplicaState, SamplingParams, Submission
from tokenpath.replica.kv_events import END_SEQ, KVEventFeed, KVEventIndex
from tokenpath.routing.replicas import PrefixAwarePicker
from tokenpath.telemetry.timeline import Timeline

DATA = json.loads((Path(__file__).parent / "data" / "vllm_kv_events.json").read_text())
PAYLOADS = [bytes.fromhex(p) for p in DATA["payloads"]]
TOKENS: list[int] = DATA["token_ids"]
OURS = block_hashes(TOKENS, 16)  # what the router computes for a prompt of these tokens


def test_vllm_hashes_translate_into_the_routers_own():
    index = KVEventIndex("vllm-0")
    index.apply_payload(PAYLOADS[0])  # two blocks, no parent
    assert index.held == set(OURS[:2]) and index.reported
    index.apply_payload(PAYLOADS[1])  # two more, chained on vLLM's hash of block 1
    assert index.held == set(OURS)
    index.apply_payload(PAYLOADS[2])  # a parent never seen: cannot be translated, not guessed
    assert index.untranslated == 1 and index.held == set(OURS)
    index.apply_payload(PAYLOADS[3])  # a LoRA adapter's block: skipped
    assert index.held == set(OURS)
    index.apply_payload(PAYLOADS[4])  # vLLM evicted block 3
    assert index.held == set(OURS[:3])
    index.apply_payload(PAYLOADS[5])  # AllBlocksCleared
    assert index.held == set()


@pytest.mark.parametrize("payload", [b"\xc1garbage", b"\x92\x01\x02", b"\x91\xcb" + bytes(8),
                                     bytes.fromhex("92cb41d9c3b7a8000000" "91" "81a474797065a342616d")])
def test_a_garbled_payload_is_refused(payload):
    with pytest.raises(ValueError):
        KVEventIndex("vllm-0").apply_payload(payload)


def test_the_picker_reads_the_index_as_the_replicas_own_report():
    index = KVEventIndex("vllm-1")
    for p in PAYLOADS[:2]:
        index.apply_payload(p)
    states = [ReplicaState("vllm-0", prefix_reported=True),
              ReplicaState("vllm-1", prefix_hashes=index.held, prefix_reported=index.reported)]
    request = Submission(GenerateRequest("r", TOKENS + [1, 2, 3], SamplingParams()), Timeline("r"))
    pick = PrefixAwarePicker().pick(request, states)
    assert (pick.name, pick.reason, pick.matched_blocks) == ("vllm-1", "prefix_hit", 4)


async def _serve_vllm_protocol(pub: zmq.asyncio.Socket, router: zmq.asyncio.Socket, past: list[bytes]) -> None:
    """vLLM's replay: a DEALER sends (b"", start seq); the ROUTER answers each buffered batch from
    it as (id, b"", topic, seq, payload), then (id, b"", b"", END_SEQ, b"")."""
    client, _, start = await router.recv_multipart()
    for seq, payload in enumerate(past):
        if seq >= int.from_bytes(start, "big"):
            await router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
    await router.send_multipart((client, b"", b"", END_SEQ, b""))


async def _until(check) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.02)


async def test_the_feed_replays_the_past_then_follows_and_drops_garbage(unused_tcp_port_factory):
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    live, replay = f"tcp://127.0.0.1:{unused_tcp_port_factory()}", f"tcp://127.0.0.1:{unused_tcp_port_factory()}"
    pub.bind(live)
    router.bind(replay)
    index = KVEventIndex("vllm-0")
    feed = KVEventFeed(index, live, replay)
    try:
        replayed = asyncio.create_task(_serve_vllm_protocol(pub, router, PAYLOADS[:1]))
        feed.start()  # a gateway starting after vLLM cached block 0-1: it learns them from the replay
        await replayed
        await _until(lambda: index.held == set(OURS[:2]))
        # Then the live feed (resent until the subscription is up: PUB drops what no one hears).
        async with asyncio.timeout(10):
            while index.held != set(OURS):
                await pub.send_multipart((b"", (1).to_bytes(8, "big"), PAYLOADS[1]))
                await asyncio.sleep(0.05)
        await pub.send_multipart((b"", (2).to_bytes(8, "big"), b"\xc1 not msgpack"))
        await _until(lambda: feed.failed is not None)
        assert not index.reported and index.held == set()  # routed by prediction from now on
    finally:
        await feed.close()
        pub.close(0)
        router.close(0)
        ctx.term()
