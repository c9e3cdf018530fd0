"""The model runner: a scheduled batch -> arrays -> one forward pass -> logits of the rows that
sample (float32 numpy, whichever path computed them).

It owns the model and the KV cache; the scheduler and block manager only deal in ids. The native
kernels (the default for GGUF files on a CPU with AVX2) run here on numpy arrays; the torch path
(runner_torch.py) is imported only when chosen, so a GGUF engine never imports torch (issue 42).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from tokenpath.config import EngineConfig
from tokenpath.engine.kernels import NativeLibrary
from tokenpath.engine.kernels.model import NativeLlama, select_native
from tokenpath.engine.kernels.precision import DEFAULT_BF16, DEFAULT_EXACT, DEFAULT_FINE, DEFAULT_PROMPT_FINE
from tokenpath.engine.kv_cache import NATIVE_ONLY, KVCache, head_bytes
from tokenpath.engine.kv_groups import KVLayout
from tokenpath.engine.loader import LoadedModel
from tokenpath.engine.lora import LoraManager
from tokenpath.engine.lora_batch import fused_offsets, native_step
from tokenpath.engine.sequence import Sequence
from tokenpath.errors import ModelLoadError

if TYPE_CHECKING:
    from tokenpath.engine.runner_torch import TorchForward

log = logging.getLogger("tokenpath.engine")

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


def gpu_present() -> bool:
    """Whether this machine may have a GPU torch could use: its driver's device nodes exist
    (NVIDIA, or AMD's ROCm). Without them "auto" is the CPU, decided without importing torch."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version", "/dev/kfd"))


def pick_device(name: str) -> str:
    """The engine's device ("cpu", "cuda", "cuda:1", ...). auto: CUDA when torch finds it, else the
    CPU; torch is asked only where a GPU driver is present."""
    if name != "auto":
        return name
    if not gpu_present():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_type(device: str) -> str:
    return device.split(":", 1)[0]


def pick_kv_dtype(name: str, lib: NativeLibrary | None, model_dtype: str) -> str:
    """The KV cache's storage dtype (a name). On the native kernels float16 halves the cache (the
    issue's RSS target: it is most of a busy server's growth) and costs nothing measurable, because
    the kernels widen halves in registers; it needs F16C, and without it the cache stays float32.
    fp8_e4m3 (vLLM's "fp8"), fp8_e5m2 and llama.cpp's q8_0 (1.06 bytes a value) halve it
    again, on the native kernels only: the torch path has no conversion of them, and storing
    float16 instead would quietly double the memory asked for, so it refuses them at load
    (ModelLoadError, one line naming the flag), as does a CPU without F16C (their conversions
    use halves). q8_0 also needs head_dim a multiple of 32 (ModelRunner checks it).
    On torch, auto keeps the model's dtype (the exact transformers-equivalence path)."""
    name = "fp8_e4m3" if name == "fp8" else name
    if name in NATIVE_ONLY:
        if lib is None:
            raise ModelLoadError(f"--kv-cache-dtype {name}: runs on the native CPU kernels only, and this model "
                                 "runs on torch (use float16 or float32, or a GGUF / --quantization q8_0)")
        if not lib.has_f16c:
            raise ModelLoadError(f"--kv-cache-dtype {name}: this CPU lacks F16C, which its conversions need")
        return name
    if lib is not None:
        if name == "float32":
            return "float32"
        if not lib.has_f16c:
            log.warning("this CPU lacks F16C: the native KV cache stays float32 (--kv-cache-dtype %s)", name)
            return "float32"
        return "float16"
    return model_dtype if name == "auto" else name


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> None:
        self.device = pick_device(config.device)
        # The native kernels compute in float32 on quantized weights (KV cache: pick_kv_dtype).
        lib = select_native(loaded, config.quantization, device_type(self.device), config.dtype)
        cfg = loaded.config
        self.model_config = cfg
        self.block_size = config.block_size
        self.native: NativeLlama | None = None
        self.torch: TorchForward | None = None
        self.loras: LoraManager | None = None  # set by the engine core: the resident adapters
        self._lora_offsets = fused_offsets(cfg)
        self.dtype = "float32"  # the activations' dtype, a name
        if lib is None:
            from tokenpath.engine.runner_torch import TorchForward, dtype_name

            self.torch = TorchForward(loaded, config, max_model_len, self.device)
            self.dtype = dtype_name(self.torch.dtype)
        self.kv_dtype = pick_kv_dtype(config.kv_cache_dtype, lib, self.dtype)
        try:
            head_bytes(self.kv_dtype, cfg.head_dim)
        except ValueError as exc:
            raise ModelLoadError(f"--kv-cache-dtype {self.kv_dtype}: {exc}") from None
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
        # The native kernels' pool is numpy in this process (device None); the torch path's, tensors.
        self.cache = KVCache(cfg.num_layers, self.num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                             self.kv_dtype, None if self.torch is None else self.torch.device,
                             zeroed=lib is None, layout=self.layout)
        self.kv_unwritten = lib is not None  # (KVCache zeroed=False)
        if lib is not None:
            # The config's kernel knobs (their environment variables were its defaults); a mask
            # left None is the kernels' default.
            self.native = NativeLlama(lib, loaded, config.quantization, self.cache, config.block_size, max_model_len,
                                      isa=config.kernels_isa,
                                      fine=DEFAULT_FINE if config.kernels_fine is None else config.kernels_fine,
                                      exact=DEFAULT_EXACT if config.kernels_exact is None else config.kernels_exact,
                                      prompt_fine=DEFAULT_PROMPT_FINE if config.kernels_prompt_fine is None
                                      else config.kernels_prompt_fine,
                                      bf16=DEFAULT_BF16 if config.kernels_bf16 is None else config.kernels_bf16)

    @property
    def model(self):  # noqa: ANN201 - the torch path's LlamaModel (tests and benchmarks read it)
        if self.torch is None:
            raise AttributeError("this runner runs the native kernels: it has no torch model")
        return self.torch.model

    def moe_counters(self) -> list[int]:
        """Mixture-of-experts counters since load (pairs routed, experts read, the busiest expert's
        rows, sparse layer-steps: `telemetry.engine_steps.MOE_COUNTERS`); empty for a dense model."""
        if self.native is not None:
            return self.native.moe_counters()
        return self.torch.moe_counters() if self.torch is not None else []

    def kv_resident_bytes(self, touched_blocks: int) -> int:
        """The KV pool's bytes in memory: `touched_blocks` (BlockManager.touched) of an unwritten
        pool, whose other pages were never mapped in; all of a zeroed one."""
        return self.bytes_per_block * (touched_blocks if self.kv_unwritten else self.num_blocks)

    def step_buffer_bytes(self, release: bool = False) -> int:
        """The native kernels' step buffers (NativeLlama.step_buffer_bytes); 0 on the torch path."""
        return self.native.step_buffer_bytes(release) if self.native is not None else 0

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[np.ndarray, list[Sequence], PromptRows]:
        """Run one step. Returns float32 logits [S + P, vocab]: S rows for the sequences whose
        scheduled tokens reach the end of what they know (they sample; the rest were mid-prompt
        chunks), one each, 1 + len(draft_ids) for a sequence with draft tokens, then the P prompt
        positions of `PromptRows`."""
        if self.native is not None:
            return self._execute_native(self.native, scheduled)
        if self.torch is None:
            raise RuntimeError("the runner has neither the native kernels nor a torch model")
        return self.torch.execute(scheduled, self.cache, self.block_size, self.layout.num_groups, self._tables,
                                  lambda seq: self.loras.get(seq.lora) if seq.lora is not None and self.loras
                                  else None, self._lora_offsets)

    def _execute_native(self, native: NativeLlama, scheduled: list[tuple[Sequence, int]]
                        ) -> tuple[np.ndarray, list[Sequence], PromptRows]:
        """The same step on the native kernels: rows in any order, each row's context read in
        place through its sequence's block table (no padding, no gather, no masks).

        The inputs are built in Python lists and made arrays once each: a decode step has one row
        a sequence, where per-sequence numpy pieces (an arange, a full, a table array, their
        concatenations, the slots' fancy indexing) cost more than the row itself (issue 42)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        rt: list[int] = []  # per row: the offset of its sequence's block table in `tables`
        generated: list[bool] | None = [] if native.rows_differ else None
        groups: list[list[int]] = [[] for _ in range(self.layout.num_groups)]  # [G][N]: group-major tables
        slots: list[list[int]] = [[] for _ in groups]  # [G][T]
        logit_rows: list[int] = []
        sampling: list[Sequence] = []
        adapters: list = []  # (rows, adapter or None) per sequence, in row order; rows count its drafts
        uses_lora = False  # no row has an adapter: no LoRA arguments built (LoRA off costs nothing)
        extra: list[int] = []
        prompt_rows: PromptRows = []
        row = offset = 0
        for seq, n in scheduled:
            adapter = self.loras.get(seq.lora) if seq.lora is not None and self.loras else None
            adapters.append((n, adapter))
            uses_lora = uses_lora or adapter is not None
            start = seq.num_computed_tokens
            _prompt_rows(seq, start, n, row, extra, prompt_rows)
            ids.extend(seq.token_ids[start : start + n])
            ids.extend(seq.draft_ids)
            span = range(start, start + n)
            pos.extend(span)
            rt.extend([offset] * n)
            if generated is not None:
                prompt = seq.num_prompt_tokens
                generated.extend(p >= prompt for p in span)
            tables = seq.block_tables
            if len(tables) != len(groups) or any(len(t) != len(tables[0]) for t in tables):
                raise ValueError(f"sequence {seq.request_id}: {len(tables)} block tables of lengths "
                                 f"{[len(t) for t in tables]}, the KV cache has {len(groups)} groups of one length")
            for g, table in enumerate(tables):
                # A window group's freed entries (NULL_BLOCK) read as block 0 (see _tables).
                groups[g].extend(b if b > 0 else 0 for b in table)
                slots[g].extend((table[p // bs] if table[p // bs] > 0 else 0) * bs + p % bs for p in span)
            offset += len(tables[0])
            row += n
            _sampling_rows(seq, start, n, row, logit_rows, sampling)
        logits = native.forward(np.array(ids, dtype=np.int32), np.array(pos, dtype=np.int32),
                                np.array(slots, dtype=np.int64), np.array(rt, dtype=np.int32),
                                np.array(groups, dtype=np.int32), np.array(logit_rows + extra, dtype=np.int32),
                                native_step(adapters) if uses_lora else None,
                                # (every row generated: None, which the kernels read alike)
                                None if generated is None or all(generated) else np.array(generated, dtype=bool))
        return logits, sampling, prompt_rows

    def _tables(self, seq: Sequence, dtype: type) -> np.ndarray:
        """The sequence's block tables, [groups, blocks] (every group's table has one length),
        a window group's freed entries read as block 0: they are never written, and whatever a
        read of them finds is masked out."""
        return np.maximum(np.asarray(seq.block_tables, dtype=dtype).reshape(len(seq.block_tables), -1), 0)
