"""A URL replica's KV events: vLLM's ZMQ feed, turned into the prefix index the router reads.

vLLM publishes its prefix cache's changes when started with `--kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558"}'`: multipart messages (topic, 8-byte sequence number, payload),
the payload a msgpack `KVEventBatch` [ts, events, dp rank], each event a map tagged with its
`type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`; vllm/distributed/kv_events.py).

vLLM's block hashes are its own (SHA-256 bytes by default, or 64-bit ints), not the ones this
router computes from a prompt (`engine.block_hash`). A `BlockStored` carries the blocks' token ids
and its parent's hash, so each of vLLM's hashes is translated once into ours by chaining our hash
over the same tokens from the parent's translation, as llm-d's precise prefix scorer does; a
`BlockRemoved` then names blocks by vLLM's hash and the translation finds ours. A chain whose
parent was never seen (events missed before this subscriber joined) cannot be translated: with a
replay endpoint the feed asks for vLLM's buffered batches from sequence 0 when it starts, so a
gateway that restarts rebuilds the index instead of routing blind.

Only the first KV-cache group's device blocks are indexed (`group_idx` 0 or absent, `medium`
GPU/CPU device or absent): what a prompt's prefix hit depends on. Blocks of LoRA adapters are
skipped (an adapter's chain root here is its name and path, which vLLM's events do not carry).
A frame that does not decode drops the feed for that replica with one log line: routing to it
falls back to prediction, and says so (`prefix_predicted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgpack

from tokenpath.engine.block_hash import hash_block_tokens

log = logging.getLogger("tokenpath.replica")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay: no more buffered batches
REPLAY_TIMEOUT_S = 5.0
_DEVICE = (None, "GPU", "CPU")  # (vLLM's CPU build stores its blocks in "CPU" memory: its device)


class KVEventIndex:
    """Our block hashes of what one vLLM replica caches, kept from its events."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.held: set[int] = set()
        self.reported = False  # True once a batch was applied; False again after a garbled frame
        self.untranslated = 0  # blocks whose parent chain was never seen
        self._ours: dict[Any, int] = {}  # vLLM's hash -> ours

    def apply_payload(self, payload: bytes) -> None:
        """One published batch. A payload that is not a KVEventBatch raises ValueError."""
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:
            raise ValueError(f"not msgpack: {exc}") from None
        if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
            raise ValueError("not a KVEventBatch [ts, events, ...]")
        for event in batch[1]:
            self._apply(event)
        self.reported = True

    def _apply(self, event: Any) -> None:
        if not isinstance(event, dict):
            raise ValueError(f"an event that is not a map: {type(event).__name__}")
        kind = event.get("type")
        if kind == "AllBlocksCleared":
            self.held.clear()
            self._ours.clear()
            return
        if event.get("group_idx") not in (None, 0) or event.get("medium") not in _DEVICE:
            return
        hashes = event.get("block_hashes")
        if not isinstance(hashes, list):
            raise ValueError(f"{kind} without block_hashes")
        if kind == "BlockRemoved":
            for vh in hashes:
                ours = self._ours.pop(_key(vh), None)
                if ours is not None:
                    self.held.discard(ours)
        elif kind == "BlockStored":
            self._stored(event, hashes)
        else:
            raise ValueError(f"unknown event type {kind!r}")

    def _stored(self, event: dict, hashes: list) -> None:
        if event.get("lora_name") is not None or event.get("lora_id") is not None:
            return
        tokens, size = event.get("token_ids"), event.get("block_size")
        if not isinstance(tokens, list) or not isinstance(size, int) or size <= 0 or len(tokens) < size * len(hashes):
            raise ValueError("BlockStored whose token_ids do not fill its blocks")
        parent_vh = event.get("parent_block_hash")
        parent: int | None = None
        if parent_vh is not None:
            parent = self._ours.get(_key(parent_vh))
            if parent is None:  # the chain began before we listened
                self.untranslated += len(hashes)
                return
        for i, vh in enumerate(hashes):
            parent = hash_block_tokens(parent, tokens[i * size : (i + 1) * size])
            self._ours[_key(vh)] = parent
            self.held.add(parent)


def _key(vh: Any) -> Any:
    """vLLM's hash as a dict key (bytes or int; msgpack may give bytes back as bytes or list)."""
    return bytes(vh) if isinstance(vh, bytearray | list) else vh


class KVEventFeed:
    """Subscribes to one replica's ZMQ publisher (and asks its replay endpoint for the buffered
    past first, when given), applying each batch to `index` on the gateway's event loop."""

    def __init__(self, index: KVEventIndex, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "") -> None:
        self.index = index
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self._task: asyncio.Task | None = None
        self.failed: str | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.index.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)  # (subscribed before the replay: nothing between them is lost)
        try:
            last = -1
            if self.replay_endpoint:
                last = await self._replay(ctx)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    raise ValueError(f"a message of {len(frames)} frames, not (topic, seq, payload)")
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq <= last:
                    continue  # (already applied from the replay)
                last = seq
                self.index.apply_payload(frames[2])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a garbled feed: this replica is routed by prediction from now on
            self.failed = f"{type(exc).__name__}: {exc}"
            self.index.reported = False
            self.index.held.clear()
            log.warning("replica %s: KV events from %s dropped (%s); routing to it falls back to prediction",
                        self.index.name, self.endpoint, self.failed,
                        extra={"event": "kv_events_dropped", "replica": self.index.name})
        finally:
            sub.close(linger=0)

    async def _replay(self, ctx: Any) -> int:
        """vLLM's buffered batches from sequence 0 (its ROUTER replay socket); the last applied."""
        import zmq

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        last = -1
        try:
            await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4:
                    raise ValueError(f"a replay message of {len(frames)} frames")
                _, _, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    return last
                last = int.from_bytes(seq_bytes, "big", signed=True)
                self.index.apply_payload(payload)
        except TimeoutError:
            log.warning("replica %s: no replay from %s within %.0fs; indexing new events only",
                        self.index.name, self.replay_endpoint, REPLAY_TIMEOUT_S)
            return last
        finally:
            dealer.close(linger=0)
