"""Engine steps driven by hand on one native runner, for the kernel tests: the test picks every
sequence's block table (out of order, shared for a prefix hit) and gets every row's logits."""

from __future__ import annotations

import numpy as np
import torch

from tokenpath.config import EngineConfig
from tokenpath.engine.loader import LoadedModel
from tokenpath.engine.runner import ModelRunner

BS = 16  # the engine's default block size, which slot numbers below assume


class NativeSteps:
    """One ModelRunner on the native kernels (GGUF: its own blocks; safetensors: q8_0), with every
    KV slot a step wrote remembered in `slots`."""

    def __init__(self, loaded: LoadedModel, kv: str, num_blocks: int = 16, max_len: int = 256,
                 quantization: str | None = None, **config) -> None:
        # One block table for every layer (the tests pick it), windows in the kernels' masks only.
        # `config`: more EngineConfig fields (the kernel knobs). quantization None: q8_0 for
        # safetensors, the file's own blocks for a GGUF.
        quantization = quantization or ("q8_0" if loaded.gguf is None else "auto")
        config = EngineConfig(kv_cache_dtype=kv, num_kv_blocks=num_blocks, disable_hybrid_kv_cache_manager=True,
                              quantization=quantization, **config)
        self.runner = ModelRunner(loaded, config, max_len)
        assert self.runner.native is not None
        self.slots: list[int] = []

    def step(self, chunks: list[tuple[list[int], list[int], int]], last_only: bool = False) -> torch.Tensor:
        """chunks: (block table, new token ids, position of the first) per sequence. Every row's
        logits, or with last_only each sequence's last row's (as the engine asks for them)."""
        ids, pos, rt, tables, last = [], [], [], [], []
        for table, toks, start in chunks:
            rt += [len(tables)] * len(toks)
            ids += toks
            pos += range(start, start + len(toks))
            tables += table
            last.append(len(ids) - 1)
        p, r, t = (np.asarray(a, dtype=np.int32) for a in (pos, rt, tables))
        slots = t[r + p // BS].astype(np.int64) * BS + p % BS
        self.slots += slots.tolist()
        return torch.from_numpy(self.runner.native.forward(np.asarray(ids, dtype=np.int32), p, slots, r, t,
                                                           np.asarray(last if last_only else range(len(ids)),
                                                                      dtype=np.int32)))
