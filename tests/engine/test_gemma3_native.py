"""Gemma 3 270M Q4_K_M on the default native path, against the torch float32 path on the same GGUF.

The model's 27 Q4_K, 9 Q6_K, 81 Q5_0 and 10 Q8_0 tensors run as the file's own blocks (nothing
re-quantized), with Gemma 3's sliding and global layers, QK-norm, sandwich norms, GeGLU, head_dim
256. The issue's bars, here against tokenpath's torch float32 path (which the models tests hold to
transformers): at least 6 of 8 prompts keep the first 16 greedy tokens, perplexity within 1%.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from tests.engine.test_quantized_quality import all_logits
from tokenpath import LLM, SamplingParams
from tokenpath.engine.kernels import native_library

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(native_library() is None, reason="native kernels not built or CPU lacks AVX2")]

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "Photosynthesis is the process",
           "def fibonacci(n):", "The three primary colors are", "In 1969, the first humans",
           "A good way to learn to cook is", "The compiler reads the source code and"]


def run(quantization: str, ids: list[int]) -> tuple[list[list[int]], torch.Tensor]:
    # One block table for every layer: `all_logits` prefills by hand into blocks 0..n/16. The 400
    # tokens sit inside the 512-token window, so the windows change nothing here; the window-bounded
    # KV groups on this model are tests/engine/test_kv_window.py's.
    llm = LLM("gemma-3-270m", quantization=quantization, dtype="float32", kv_cache_memory="64MiB",
              disable_hybrid_kv_cache_manager=True)
    assert (llm.engine.runner.native is not None) == (quantization == "auto")
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)]
    return greedy, all_logits(llm.engine.runner, ids)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(-logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item())


def test_gemma3_270m_native_matches_float32(caplog):
    from tokenpath.engine.loader import load_model
    from tokenpath.engine.tokenizer import Tokenizer

    ids = Tokenizer(load_model("gemma-3-270m").tokenizer_source).encode(TEXT.read_text())[:400]
    with caplog.at_level(logging.INFO, logger="tokenpath.engine.kernels"):
        native, native_logits = run("auto", ids)
    assert "quantized to Q8_0" not in caplog.text
    assert "Q4KX16/Q5X16/Q6KX16/Q8X16" in caplog.text  # the file's four block types, repacked
    ref, ref_logits = run("none", ids)
    same = sum(a == b for a, b in zip(native, ref, strict=True))
    pn, pr = perplexity(native_logits, ids), perplexity(ref_logits, ids)
    print(f"gemma-3-270m: {same}/8 prompts share 16 greedy tokens; perplexity native {pn:.3f}, "
          f"float32 {pr:.3f} ({pn / pr - 1:+.2%})")
    assert same >= 6
    assert abs(pn / pr - 1) <= 0.01
