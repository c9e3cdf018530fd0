"""The draft-model proposer: a second, smaller model of the same vocabulary, in the same engine,
drafts K tokens by greedy decoding; the target verifies them in one forward pass (issue 39;
vLLM's `{"method": "draft_model", "model": ...}`, llama.cpp's `--model-draft`).

Why its KV cache shares the target's block tables: the draft needs its own KV for every position
it reads, and the target's block manager already owns where each position of a sequence lives.
The draft's pool has the target's number of blocks and block size, so a sequence's block table
and slot mapping index both pools: no second block manager, no second allocation, and the blocks
the target gives back (rejected drafts, finished requests) free the draft's slots too.

Which of the draft's KV positions are valid is the sequence's own bookkeeping (`DraftState`): the
draft wrote positions up to where it proposed, and after verification those holding accepted
drafts are still right; the next proposal first feeds the draft every token after the last valid
position (a catch-up: the prompt on the first proposal, the target's bonus token after each
verification). Exactness never rests on this: the target verifies every draft, so a stale draft
KV (a prefix-cache hit on blocks the draft never saw, another choice's write) can only lower the
acceptance, never change the output. Drafting is greedy, a point mass the existing rejection
sampling already treats exactly (verify.py), so sampled requests keep the target's distribution.
"""

from __future__ import annotations

import logging

import numpy as np

from tokenpath.config import EngineConfig
from tokenpath.engine.heap import trim_heap
from tokenpath.engine.kernels.model import NativeLlama, select_native
from tokenpath.engine.kv_cache import KVCache
from tokenpath.engine.kv_groups import KVLayout
from tokenpath.engine.loader import load_model
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.state import DraftState
from tokenpath.errors import ModelLoadError

log = logging.getLogger("tokenpath.engine")


class DraftModel:
    """A draft model on the native kernels, its KV pool indexed by the target's block tables."""

    def __init__(self, path: str, config: EngineConfig, *, num_blocks: int, target_vocab: int,
                 target_groups: int, max_model_len: int) -> None:
        loaded = load_model(path)
        cfg = loaded.config
        if cfg.vocab_size != target_vocab:
            raise ModelLoadError(f"speculative_config.model {path}: its vocabulary has {cfg.vocab_size} tokens, "
                                 f"the target's {target_vocab}; a draft model must share the target's vocabulary")
        if cfg.num_experts:
            raise ModelLoadError(f"speculative_config.model {path}: a mixture-of-experts draft model is not supported")
        layout = KVLayout.for_model(cfg, hybrid=not config.disable_hybrid_kv_cache_manager)
        if layout.num_groups != 1 or target_groups != 1:
            raise ModelLoadError(f"speculative_config.model {path}: a draft model needs one KV-cache group in both "
                                 "models (no sliding-window layers)")
        lib = select_native(loaded, config.quantization, "cpu", config.dtype)
        if lib is None:
            raise ModelLoadError(f"speculative_config.model {path}: a draft model runs on the native CPU kernels "
                                 "only, and this one would run on torch")
        kv_dtype = "float16" if lib.has_f16c else "float32"
        self.block_size = config.block_size
        self.max_chunk = config.max_num_batched_tokens
        self.cache = KVCache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype,
                             None, zeroed=False, layout=layout)
        self.native = NativeLlama(lib, loaded, config.quantization, self.cache, config.block_size, max_model_len,
                                  isa=config.kernels_isa)
        del loaded  # its tensors and mapping: the kernels hold the one copy
        trim_heap()
        self.path = path
        per_block = KVCache.bytes_per_block(layout.group_size, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                                            kv_dtype)
        log.info("speculative decoding: draft model %s (%d layers; its KV pool %d MiB, the target's blocks)", path,
                 cfg.num_layers, num_blocks * per_block >> 20)

    def propose(self, seq: Sequence, state: DraftState, k: int) -> list[int]:
        """`k` greedy draft tokens for what follows `seq`. The slots of positions up to
        num_tokens + k - 2 must be allocated (the scheduler allocates 1 + k rows first)."""
        n = seq.num_tokens
        tokens = seq.token_ids
        done = state.valid_draft_kv(tokens)
        table = np.maximum(np.asarray(seq.block_table, dtype=np.int32), 0)
        drafts: list[int] = []
        start = done
        ids = tokens[done:n]
        while len(drafts) < k:
            for lo in range(0, len(ids), self.max_chunk):  # a long catch-up in the step budget's chunks
                chunk = ids[lo : lo + self.max_chunk]
                logits = self._forward(chunk, start + lo, table)
            token = int(np.argmax(logits[-1]))
            drafts.append(token)
            start, ids = n + len(drafts) - 1, [token]
        state.proposed_at, state.proposed = n, drafts
        return drafts

    def _forward(self, ids: list[int], start: int, table: np.ndarray) -> np.ndarray:
        """The draft over `ids` at positions start.., one sequence; the last row's logits."""
        bs = self.block_size
        pos: np.ndarray = np.arange(start, start + len(ids), dtype=np.int32)
        slots = (table[pos // bs].astype(np.int64) * bs + pos % bs)
        rows: np.ndarray = np.zeros(len(ids), dtype=np.int32)
        return self.native.forward(np.asarray(ids, dtype=np.int32), pos, slots, rows, table,
                                   np.asarray([len(ids) - 1], dtype=np.int32))
