"""The model runner: a scheduled batch -> tensors -> one forward pass -> logits of the rows that
sample.

It owns the model and the KV cache tensors; the scheduler and block manager only deal in ids.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenpath.config import EngineConfig, env_num_threads
from tokenpath.engine.attention import AttentionMetadata, DecodeGroup, KVCache, PrefillChunk
from tokenpath.engine.kernels import NativeLibrary
from tokenpath.engine.kernels.model import DEFAULT_EXACT, DEFAULT_FINE, NativeLlama, select_native
from tokenpath.engine.kv_groups import KVLayout
from tokenpath.engine.loader import LoadedModel
from tokenpath.engine.lora import LoraManager
from tokenpath.engine.lora_batch import TorchLoraBatch, fused_offsets, native_step, row_groups
from tokenpath.engine.models.llama import LlamaModel
from tokenpath.engine.sequence import Sequence
from tokenpath.errors import ModelLoadError

log = logging.getLogger("tokenpath.engine")

# Decodes per attention call: with contexts sorted, small groups pad little; more calls cost little.
DECODE_GROUP = 8

# Prompt positions whose next-token logits a step also returns (SamplingParams.prompt_logprobs):
# (sequence, first position, count), their rows after the sampling rows, in this order.
PromptRows = list[tuple[Sequence, int, int]]


def _prompt_rows(seq: Sequence, start: int, n: int, row: int, rows: list[int], out: PromptRows) -> None:
    """The rows of a chunk whose logits score the next prompt token, for a choice 0 that asked."""
    if seq.params.prompt_logprobs is None or seq.index:
        return
    k = min(start + n, seq.num_prompt_tokens - 1) - start
    if k > 0:
        out.append((seq, start, k))
        rows.extend(range(row, row + k))


def _sampling_rows(seq: Sequence, start: int, n: int, end: int, rows: list[int], sampling: list[Sequence]) -> None:
    """A chunk that reaches the end of what `seq` knows samples: its last row, or, with draft
    tokens, every row from its last known token on (1 + drafts rows, ending at row `end`)."""
    drafts = len(seq.draft_ids)
    if start + n == seq.num_tokens + drafts:
        sampling.append(seq)
        if drafts:
            rows.extend(range(end - 1 - drafts, end))
        else:
            rows.append(end - 1)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware computes it natively, float32 elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def pick_kv_dtype(name: str, lib: NativeLibrary | None, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's storage dtype. On the native kernels float16 halves the cache (the issue's
    RSS target: it is most of a busy server's growth) and costs nothing measurable, because the
    kernels widen halves in registers; it needs F16C, and without it the cache stays float32.
    On torch, auto keeps the model's dtype (the exact transformers-equivalence path)."""
    if lib is not None:
        if name == "float32":
            return torch.float32
        if not lib.has_f16c:
            log.warning("this CPU lacks F16C: the native KV cache stays float32 (--kv-cache-dtype %s)", name)
            return torch.float32
        return torch.float16
    return model_dtype if name == "auto" else {"float32": torch.float32, "float16": torch.float16}[name]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> None:
        self.device = pick_device(config.device)
        # The native kernels compute in float32 on quantized weights (KV cache: pick_kv_dtype).
        lib = select_native(loaded, config.quantization, self.device, config.dtype)
        self.dtype = torch.float32 if lib is not None else pick_dtype(config.dtype, self.device)
        cfg = loaded.config
        self.model_config = cfg
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.native: NativeLlama | None = None
        self.loras: LoraManager | None = None  # set by the engine core: the resident adapters
        self._lora_offsets = fused_offsets(cfg)
        if lib is None:
            model = LlamaModel(cfg, max_positions=max_model_len, dtype=self.dtype)
            model.load_weights(loaded.weights)
            self.model = model.to(device=self.device).eval()
            self.model.rope.to(torch.float32)  # keep cos/sin tables exact
        self.kv_dtype = pick_kv_dtype(config.kv_cache_dtype, lib, self.dtype)
        # KV-cache groups: window layers keep only their window's blocks (kv_groups.py); a block is
        # a page of `group_size` layers.
        self.layout = KVLayout.for_model(cfg, hybrid=not config.disable_hybrid_kv_cache_manager)
        per_block = KVCache.bytes_per_block(self.layout.group_size, config.block_size, cfg.num_kv_heads,
                                            cfg.head_dim, self.kv_dtype)
        self.bytes_per_block = per_block
        # num_kv_blocks counts blocks of every layer (the memory it always meant); with KV-cache
        # groups the pool holds that memory in pages of group_size layers.
        budget = (config.num_kv_blocks * KVCache.bytes_per_block(cfg.num_layers, config.block_size, cfg.num_kv_heads,
                                                                  cfg.head_dim, self.kv_dtype)
                  if config.num_kv_blocks else config.kv_cache_bytes)
        self.num_blocks = max(1, budget // per_block)
        if self.num_blocks < 2:
            raise ModelLoadError(f"kv_cache_memory={config.kv_cache_memory} holds fewer than 2 blocks "
                                 f"({per_block} bytes each)")
        self.cache = KVCache(cfg.num_layers, self.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                             self.kv_dtype, self.device, zeroed=lib is None, layout=self.layout)
        if lib is not None:
            # The config's kernel knobs (their environment variables were its defaults); a mask
            # left None is the kernels' default.
            self.native = NativeLlama(lib, loaded, config.quantization, self.cache, config.block_size, max_model_len,
                                      isa=config.kernels_isa,
                                      fine=DEFAULT_FINE if config.kernels_fine is None else config.kernels_fine,
                                      exact=DEFAULT_EXACT if config.kernels_exact is None else config.kernels_exact)
        if self.device.type == "cpu" and (threads := env_num_threads()) is not None:
            torch.set_num_threads(threads)

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence], PromptRows]:
        """Run one step. Returns logits [S + P, vocab]: S rows for the sequences whose scheduled
        tokens reach the end of what they know (they sample; the rest were mid-prompt chunks), one
        each, 1 + len(draft_ids) for a sequence with draft tokens, then the P prompt positions of
        `PromptRows`."""
        if self.native is not None:
            return self._execute_native(self.native, scheduled)
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        logit_rows: list[int] = []
        sampling: list[Sequence] = []
        decode: list[Sequence] = []
        prefills: list[PrefillChunk] = []
        lora_spans: list = []  # (first row, rows, adapter) of the sequences that run one
        extra: list[int] = []
        prompt_rows: PromptRows = []
        row = 0
        # Decodes first, shortest context first: consecutive rows form the padded decode groups.
        scheduled = sorted(scheduled, key=lambda item: (item[1] != 1, item[0].num_computed_tokens))
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            ids.extend(seq.draft_ids)  # (speculative decoding: verified at every row)
            pos = np.arange(start, start + n)
            table = self._tables(seq, np.int64)  # [G, blocks]
            pos_chunks.append(pos)
            slot_chunks.append(table[:, pos // bs] * bs + pos % bs)
            if n == 1:
                decode.append(seq)
            else:
                prefills.append(self._prefill_chunk(seq, row, n, table))
            if seq.lora is not None and self.loras is not None:
                lora_spans.append((row, n, self.loras.get(seq.lora)))
            _prompt_rows(seq, start, n, row, extra, prompt_rows)
            row += n
            _sampling_rows(seq, start, n, row, logit_rows, sampling)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_chunks, axis=1)).to(dev),
            decode_groups=[self._decode_group(decode[i : i + DECODE_GROUP], i)
                           for i in range(0, len(decode), DECODE_GROUP)],
            prefills=prefills,
        )
        positions = torch.from_numpy(np.concatenate(pos_chunks)).to(dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        rows = torch.tensor(logit_rows + extra, dtype=torch.long, device=dev)
        lora = TorchLoraBatch(row_groups(lora_spans, dev), self._lora_offsets) if lora_spans else None
        logits = self.model(input_ids, positions, self.cache, meta, rows, lora)
        return logits.cpu(), sampling, prompt_rows

    def _execute_native(self, native: NativeLlama, scheduled: list[tuple[Sequence, int]]
                        ) -> tuple[torch.Tensor, list[Sequence], PromptRows]:
        """The same step on the native kernels: rows in any order, each row's context read in
        place through its sequence's block table (no padding, no gather, no masks)."""
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        table_chunks: list[np.ndarray] = []
        row_tables: list[np.ndarray] = []
        logit_rows: list[int] = []
        sampling: list[Sequence] = []
        adapters: list = []  # (rows, adapter or None) per sequence, in row order
        extra: list[int] = []
        prompt_rows: PromptRows = []
        row = offset = 0
        for seq, n in scheduled:
            adapters.append((n, self.loras.get(seq.lora) if seq.lora is not None and self.loras else None))
            start = seq.num_computed_tokens
            _prompt_rows(seq, start, n, row, extra, prompt_rows)
            ids.extend(seq.token_ids[start : start + n])
            ids.extend(seq.draft_ids)
            pos_chunks.append(np.arange(start, start + n, dtype=np.int32))
            table = self._tables(seq, np.int32)  # [G, blocks]
            table_chunks.append(table)
            row_tables.append(np.full(n, offset, dtype=np.int32))
            offset += table.shape[1]
            row += n
            _sampling_rows(seq, start, n, row, logit_rows, sampling)
        pos = np.concatenate(pos_chunks)
        tables = np.ascontiguousarray(np.concatenate(table_chunks, axis=1))  # [G, N]: group-major
        rt = np.concatenate(row_tables)
        slots = np.ascontiguousarray(tables[:, rt + pos // bs].astype(np.int64) * bs + pos % bs)  # [G, T]
        logits = native.forward(np.asarray(ids, dtype=np.int32), pos, slots, rt, tables,
                                     np.asarray(logit_rows + extra, dtype=np.int32), native_step(adapters))
        return logits, sampling, prompt_rows

    def _tables(self, seq: Sequence, dtype: type) -> np.ndarray:
        """The sequence's block tables, [groups, blocks] (every group's table has one length),
        a window group's freed entries read as block 0: they are never written, and whatever a
        read of them finds is masked out."""
        return np.maximum(np.asarray(seq.block_tables, dtype=dtype).reshape(len(seq.block_tables), -1), 0)

    def _prefill_chunk(self, seq: Sequence, row: int, n: int, table: np.ndarray) -> PrefillChunk:
        done = seq.num_computed_tokens
        if done == 0:
            return PrefillChunk(start=row, num_tokens=n, slots=None, mask=None)
        ctx = done + n
        pos = np.arange(ctx)
        slots = torch.from_numpy(table[:, pos // self.block_size] * self.block_size + pos % self.block_size)
        q_pos = torch.arange(done, ctx).unsqueeze(1)
        mask = torch.arange(ctx).unsqueeze(0) <= q_pos  # [n, ctx]
        return PrefillChunk(start=row, num_tokens=n, slots=slots.to(self.device),
                            mask=mask.to(self.device), computed=done)

    def _decode_group(self, seqs: list[Sequence], start: int) -> DecodeGroup:
        bs = self.block_size
        ctx = np.array([s.num_computed_tokens + 1 for s in seqs])
        max_blocks = int(-(-ctx.max() // bs))
        tables: np.ndarray = np.zeros((self.layout.num_groups, len(seqs), max_blocks), dtype=np.int64)
        for i, s in enumerate(seqs):
            t = self._tables(s, np.int64)[:, :max_blocks]
            tables[:, i, : t.shape[1]] = t
        slots = (tables[..., None] * bs + np.arange(bs)).reshape(*tables.shape[:2], -1)[..., : ctx.max()]
        mask = np.arange(ctx.max())[None, :] < ctx[:, None]
        return DecodeGroup(start=start, slots=torch.from_numpy(np.ascontiguousarray(slots)).to(self.device),
                           mask=torch.from_numpy(mask)[:, None, None, :].to(self.device),
                           ctx=torch.from_numpy(ctx).to(self.device))
