"""The default model on the native kernels against the float32 path on the same (dequantized)
weights: perplexity on a fixed human-written text within 2%, greedy continuations of 8 prompts
sharing their first 16 tokens in at least 6, and identical logits from the AVX2 and AVX-512 kernels."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenpath import LLM, SamplingParams
from tokenpath.config import EngineConfig
from tokenpath.engine.attention import AttentionMetadata, PrefillChunk
from tokenpath.engine.kernels import native_library
from tokenpath.engine.runner import ModelRunner
from tokenpath.engine.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow,
              pytest.mark.requires("kernels")]

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
WINDOW = 512


@pytest.fixture(scope="module")
def loaded(smol_loaded):
    return smol_loaded


@pytest.fixture(scope="module")
def text_ids(loaded) -> list[int]:
    return Tokenizer(loaded.tokenizer_source).encode(TEXT.read_text())


@pytest.fixture(scope="module")
def fp32_perplexity(loaded, text_ids) -> float:
    """The float32 torch path's perplexity: the reference of every KV dtype, computed once."""
    return perplexity(runner(loaded, "none"), text_ids)


def runner(loaded, quantization: str, kv: str = "auto") -> ModelRunner:
    # One block table for every layer: all_logits writes slot i for position i by hand.
    cfg = EngineConfig(quantization=quantization, dtype="float32", num_kv_blocks=WINDOW // 16, kv_cache_dtype=kv,
                       disable_hybrid_kv_cache_manager=True)
    return ModelRunner(loaded, cfg, WINDOW)


def all_logits(r: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one window, prefilled in one step into blocks 0..n/16."""
    n = len(ids)
    if r.native is not None:
        pos = np.arange(n, dtype=np.int32)
        return torch.from_numpy(r.native.forward(np.asarray(ids, dtype=np.int32), pos, pos.astype(np.int64),
                                                 np.zeros(n, dtype=np.int32), np.arange(r.num_blocks, dtype=np.int32),
                                                 pos))
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n, None, None)])
    return r.model(torch.tensor(ids), torch.arange(n), r.cache, meta, torch.arange(n))


def perplexity(r: ModelRunner, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, WINDOW):
        w = ids[s : s + WINDOW]
        if len(w) < 2:
            break
        logp = torch.log_softmax(all_logits(r, w)[:-1].double(), dim=-1)
        nll -= logp.gather(1, torch.tensor(w[1:]).unsqueeze(1)).sum().item()
        count += len(w) - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("kv", ["auto", "float32"], ids=["kv-default-float16", "kv-float32"])
def test_perplexity_within_2_percent(loaded, text_ids, fp32_perplexity, kv):
    assert len(text_ids) > 2000
    r = runner(loaded, "auto", kv)
    native, fp32 = perplexity(r, text_ids), fp32_perplexity
    print(f"perplexity: native ({r.kv_dtype} KV) {native:.3f}, float32 {fp32:.3f} ({native / fp32 - 1:+.2%})")
    assert native < 100  # a broken kernel gives thousands
    assert abs(native / fp32 - 1) <= 0.02


def test_isas_give_identical_logits(loaded, text_ids, monkeypatch):
    lib = native_library()
    if not lib.features & 2:
        pytest.skip("no AVX-512 VNNI on this CPU")
    ids = text_ids[:200]
    out = {}
    for isa in ("avx2", "avx512"):
        monkeypatch.setenv("TOKENPATH_KERNELS_ISA", isa)
        r = runner(loaded, "auto")
        assert r.native.isa == (1 if isa == "avx2" else 2)
        out[isa] = all_logits(r, ids)
    assert torch.equal(out["avx2"], out["avx512"])  # same integer dots, same float order


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "Explain photosynthesis in one sentence.", "List three uses of a paperclip.",
           "How many legs does a spider have?", "Give me a tip for learning to cook.",
           "What does a compiler do?", "Describe the color blue to someone who cannot see."]
CONVS = [[{"role": "user", "content": q}] for q in PROMPTS]


@pytest.fixture(scope="module")
def fp32_greedy() -> list[list[int]]:
    """The float32 torch path's greedy tokens: the reference of every kernel setting (their
    TOKENPATH_KERNELS_* knobs touch the native kernels only), computed once."""
    fp32 = LLM("smollm2-135m-instruct", quantization="none", dtype="float32", kv_cache_memory="64MiB")
    return [o.outputs[0].token_ids for o in fp32.chat(CONVS, GREEDY)]


@pytest.mark.parametrize(("fine", "exact", "prompt", "at_least"),
                         [(None, None, None, 5), (None, None, "31", 6), ("0", None, None, 2), (None, "1", None, 6)],
                         ids=["default", "fine", "int8", "float-activations"])
def test_greedy_agrees_with_float32(fine, exact, prompt, at_least, fp32_greedy, monkeypatch):
    """The bar of 6 of 8 prompts keeping the float32 path's first 16 greedy tokens holds for "fine"
    activations everywhere (int8 plus a second int8 pass over the rounding error, ~15 bits;
    --kernels-prompt-fine 31), measured 8/8, as for float activations. The default since issue 42
    (prompt rows fine for qkv only, generated rows fine everywhere) measures 5/8, as all-int8 prompt
    rows and qkv + down (6/8) within one near-tie: the default's bar is llama.cpp's perplexity on the
    same file (benchmarks/results/perplexity_prompt_masks.md, ~13k scored tokens), which it beats on both
    packaged GGUFs. llama.cpp's scheme, int8 everywhere (TOKENPATH_KERNELS_FINE=0), measures
    3/8 with the default float16 KV cache (5/8 with float32 KV on the kernels before the 16-row
    repack): every miss parts at a near-tie of the float32 path, where its top two log-probabilities
    differ by 0.01-0.09, and which near-ties flip changes with any change of summation order. Its
    floor here only catches a broken kernel. Float16 K/V alone costs nothing measurable: with float
    activations, perplexity 22.672 against 22.674 for float32 KV (float32 torch: 22.673)."""
    for name, value in (("TOKENPATH_KERNELS_FINE", fine), ("TOKENPATH_KERNELS_EXACT", exact),
                        ("TOKENPATH_KERNELS_PROMPT_FINE", prompt)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    native = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB")
    assert native.engine.runner.native is not None
    got = [o.outputs[0].token_ids for o in native.chat(CONVS, GREEDY)]
    del native
    ref = fp32_greedy
    same = sum(a == b for a, b in zip(got, ref, strict=True))
    print(f"greedy (fine={fine}, exact={exact}, prompt={prompt}): {same}/8 prompts share their first 16 tokens")
    assert same >= at_least
