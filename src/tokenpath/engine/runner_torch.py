"""The torch path of the model runner: the fallback where the native kernels do not run (a
safetensors checkpoint they do not take, CUDA, a CPU without AVX2, TOKENPATH_NO_KERNELS=1).

A module of its own so that torch is imported only when this path is chosen: serving a GGUF on the
native kernels never imports it (issue 42: the import alone is ~218 MiB of RSS). The runner
(runner.py) builds a `TorchForward` for such a model and hands it each scheduled batch; the
logits come back as float32 numpy, which the sampler (one implementation for both paths) reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tokenpath.config import EngineConfig, env_num_threads
from tokenpath.engine.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from tokenpath.engine.kv_cache import KVCache
from tokenpath.engine.loader import LoadedModel
from tokenpath.engine.lora_batch import TorchLoraBatch, row_groups
from tokenpath.engine.models.llama import LlamaModel
from tokenpath.engine.models.moe import MoEBlock
from tokenpath.engine.runner import PromptRows, _prompt_rows, _sampling_rows
from tokenpath.engine.sequence import Sequence

# Decodes per attention call: with contexts sorted, small groups pad little; more calls cost little.
DECODE_GROUP = 8


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


def dtype_name(dtype: torch.dtype) -> str:
    """"float32", "bfloat16", ...: the KV cache's and the logs' name of a torch dtype."""
    return str(dtype).removeprefix("torch.")


class TorchForward:
    """The torch model on `device`, and its step: a scheduled batch -> padded attention metadata
    -> one forward -> float32 logits as numpy."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int, device: str) -> None:
        self.device = torch.device(device)
        self.dtype = pick_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        model = LlamaModel(loaded.config, max_positions=max_model_len, dtype=self.dtype)
        model.load_weights(loaded.weights)
        self.model = model.to(device=self.device).eval()
        self.model.rope.to(torch.float32)  # keep cos/sin tables exact
        self._moe_blocks = [m for m in self.model.modules() if isinstance(m, MoEBlock)]
        if self.device.type == "cpu" and (threads := env_num_threads()) is not None:
            torch.set_num_threads(threads)

    def moe_counters(self) -> list[int]:
        """The sparse layers' counters summed (models/moe.py), or empty for a dense model."""
        blocks = self._moe_blocks
        return [sum(b.counters[i] for b in blocks) for i in range(4)] if blocks else []

    def execute(self, scheduled: list[tuple[Sequence, int]], cache: KVCache, block_size: int, num_groups: int,
                tables: Callable[[Sequence, type], np.ndarray], adapter: Callable[[Sequence], Any],
                lora_offsets: dict[str, list[tuple[str, int]]]) -> tuple[np.ndarray, list[Sequence], PromptRows]:
        """The runner's `execute` on torch (see there): decodes first, shortest context first, so
        consecutive rows form the padded decode groups."""
        bs = block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        logit_rows: list[int] = []
        sampling: list[Sequence] = []
        decode: list[Sequence] = []
        prefills: list[PrefillChunk] = []
        lora_spans: list = []  # (first row, rows, adapter) of the sequences that run one; rows count drafts
        extra: list[int] = []
        prompt_rows: PromptRows = []
        row = 0
        scheduled = sorted(scheduled, key=lambda item: (item[1] != 1, item[0].num_computed_tokens))
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            ids.extend(seq.draft_ids)  # (speculative decoding: verified at every row)
            pos = np.arange(start, start + n)
            table = tables(seq, np.int64)  # [G, blocks]
            pos_chunks.append(pos)
            slot_chunks.append(table[:, pos // bs] * bs + pos % bs)
            if n == 1:
                decode.append(seq)
            else:
                prefills.append(self._prefill_chunk(seq, row, n, table, bs))
            if (w := adapter(seq)) is not None:
                lora_spans.append((row, n, w))
            _prompt_rows(seq, start, n, row, extra, prompt_rows)
            row += n
            _sampling_rows(seq, start, n, row, logit_rows, sampling)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_chunks, axis=1)).to(dev),
            decode_groups=[self._decode_group(decode[i : i + DECODE_GROUP], i, bs, num_groups, tables)
                           for i in range(0, len(decode), DECODE_GROUP)],
            prefills=prefills,
        )
        positions = torch.from_numpy(np.concatenate(pos_chunks)).to(dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        rows = torch.tensor(logit_rows + extra, dtype=torch.long, device=dev)
        lora = TorchLoraBatch(row_groups(lora_spans, dev), lora_offsets) if lora_spans else None
        logits = self.model(input_ids, positions, cache, meta, rows, lora)
        return logits.float().cpu().numpy(), sampling, prompt_rows

    def _prefill_chunk(self, seq: Sequence, row: int, n: int, table: np.ndarray, bs: int) -> PrefillChunk:
        done = seq.num_computed_tokens
        if done == 0:
            return PrefillChunk(start=row, num_tokens=n, slots=None, mask=None)
        ctx = done + n
        pos = np.arange(ctx)
        slots = torch.from_numpy(table[:, pos // bs] * bs + pos % bs)
        q_pos = torch.arange(done, ctx).unsqueeze(1)
        mask = torch.arange(ctx).unsqueeze(0) <= q_pos  # [n, ctx]
        return PrefillChunk(start=row, num_tokens=n, slots=slots.to(self.device),
                            mask=mask.to(self.device), computed=done)

    def _decode_group(self, seqs: list[Sequence], start: int, bs: int, num_groups: int,
                      tables_of: Callable[[Sequence, type], np.ndarray]) -> DecodeGroup:
        ctx = np.array([s.num_computed_tokens + 1 for s in seqs])
        max_blocks = int(-(-ctx.max() // bs))
        tables: np.ndarray = np.zeros((num_groups, len(seqs), max_blocks), dtype=np.int64)
        for i, s in enumerate(seqs):
            t = tables_of(s, np.int64)[:, :max_blocks]
            tables[:, i, : t.shape[1]] = t
        slots = (tables[..., None] * bs + np.arange(bs)).reshape(*tables.shape[:2], -1)[..., : ctx.max()]
        mask = np.arange(ctx.max())[None, :] < ctx[:, None]
        return DecodeGroup(start=start, slots=torch.from_numpy(np.ascontiguousarray(slots)).to(self.device),
                           mask=torch.from_numpy(mask)[:, None, None, :].to(self.device),
                           ctx=torch.from_numpy(ctx).to(self.device))
