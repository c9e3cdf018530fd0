"""Gemma 3 270M Q4_K_M on the default native path, against the torch float32 path on the same GGUF.

The model's 27 Q4_K, 9 Q6_K, 81 Q5_0 and 10 Q8_0 tensors run as the file's own blocks (nothing
re-quantized), with Gemma 3's sliding and global layers, QK-norm, sandwich norms, GeGLU, head_dim
256. The issue's bars, here against tokenpath's torch float32 path (which the models tests hold to
transformers): at least 6 of 8 prompts keep the first 16 greedy tokens, perplexity within 1%.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import GEMMA3_270M, LoadedLLM
from tests.engine.test_quantized_quality import all_logits
from tokenpath import LLM, SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.requires("kernels")]

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "Photosynthesis is the process",
           "def fibonacci(n):", "The three primary colors are", "In 1969, the first humans",
           "A good way to learn to cook is", "The compiler reads the source code and"]


def run(llm: LLM, ids: list[int]) -> tuple[list[list[int]], torch.Tensor]:
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)]
    try:
        return greedy, all_logits(llm.engine.runner, ids)
    finally:  # blocks 0..n/16 written by hand: whatever prefix they held is gone
        llm.engine.blocks.reset_prefix_cache()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(-logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item())


def test_gemma3_270m_native_matches_float32(gemma3_270m_flat: LoadedLLM):
    # One block table for every layer (the flat engine): `all_logits` prefills by hand into blocks
    # 0..n/16. The 400 tokens sit inside the 512-token window, so the windows change nothing here;
    # the window-bounded KV groups on this model are tests/engine/test_kv_window.py's.
    native = gemma3_270m_flat.llm
    assert native.engine.runner.native is not None
    assert "quantized to Q8_0" not in gemma3_270m_flat.load_log
    assert "Q4KX16/Q5X16/Q6KX16/Q8X16" in gemma3_270m_flat.load_log  # the file's four block types, repacked
    ids = native.tokenizer.encode(TEXT.read_text())[:400]
    native_tokens, native_logits = run(native, ids)
    fp32 = LLM(**{**GEMMA3_270M, "quantization": "none"}, disable_hybrid_kv_cache_manager=True)
    assert fp32.engine.runner.native is None
    ref, ref_logits = run(fp32, ids)
    same = sum(a == b for a, b in zip(native_tokens, ref, strict=True))
    pn, pr = perplexity(native_logits, ids), perplexity(ref_logits, ids)
    print(f"gemma-3-270m: {same}/8 prompts share 16 greedy tokens; perplexity native {pn:.3f}, "
          f"float32 {pr:.3f} ({pn / pr - 1:+.2%})")
    assert same >= 6
    assert abs(pn / pr - 1) <= 0.01
