"""The float16 KV cache (--kv-cache-dtype): the native kernels against their own float32-KV path on
the default model, the byte budget, the F16C fallback, and float16 storage on the torch path.

Why the logit comparison runs with float activations (TOKENPATH_KERNELS_EXACT=1): quantized
activations (int8, or the default int8 plus residual bytes) round every matmul input per 32-block,
a step function, so a 5e-4 change in one
attention output can move an int8 rounding and the two paths drift apart by far more than the KV
storage itself costs (measured: up to 0.3 of the logit scale on one row, argmax still agreeing on
90-100% of rows). With float activations everything downstream is smooth and the difference is the
float16 rounding alone: measured at most 1.1e-3 of the largest logit, against the 2e-3 bound here.
What the default quantized path loses end to end is the quality test's business (perplexity, greedy).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.native_steps import NativeSteps
from tests.engine.tiny_models import save_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.engine.kernels import FEATURE_F16C, NativeLibrary, native_library
from tokenpath.engine.runner import pick_kv_dtype
from tokenpath.engine.tokenizer import Tokenizer

lib = native_library()
native_only = pytest.mark.requires("f16c")
TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
REL_BOUND = 2e-3  # max |logit difference| / max |logit|, float activations (see the module docstring)


@pytest.fixture(scope="module")
def smol(smol_loaded):
    return smol_loaded, Tokenizer(smol_loaded.tokenizer_source).encode(TEXT.read_text())


def scenario(loaded, ids: list[int], kv: str, m: int) -> tuple[list[torch.Tensor], NativeSteps]:
    """A prefill of m tokens; a mixed step (a decode beside a 40-token prefill); a second sequence
    that shares the first 32 tokens (2 blocks) of that prefill and prefills the rest in two chunks,
    the second chunk beside two decodes."""
    s = NativeSteps(loaded, kv)
    a, b = ids[: m + 2], ids[100:141]
    c = b[:32] + ids[300:340]
    t0, t1 = [7, 2], [4, 0, 9]
    t2 = t1[:2] + [12, 3, 5]  # the prefix hit: blocks 4 and 0 hold c[:32] already; 70 tokens: 5 blocks
    out = [s.step([(t0, a[:m], 0)]),
           s.step([(t0, a[m : m + 1], m), (t1, b[:40], 0)]),
           s.step([(t2, c[32:52], 32)]),
           s.step([(t2, c[52:70], 52), (t0, a[m + 1 : m + 2], m + 1), (t1, b[40:41], 40)])]
    return out, s


@native_only
@pytest.mark.parametrize("m", [1, 3, 17])
def test_float16_kv_logits_match_float32_kv(smol, m, monkeypatch):
    monkeypatch.setenv("TOKENPATH_KERNELS_EXACT", "1")
    loaded, ids = smol
    half, h = scenario(loaded, ids, "float16", m)
    full, f = scenario(loaded, ids, "float32", m)
    assert h.runner.cache.k[0].dtype == np.float16 and f.runner.cache.k[0].dtype == np.float32
    for i, (x, y) in enumerate(zip(half, full, strict=True)):
        rel = ((x - y).abs().max() / y.abs().max()).item()
        assert 0 < rel <= REL_BOUND, f"step {i}: {rel:.2e}"  # 0 would mean float16 was not used
        assert torch.equal(x.argmax(-1), y.argmax(-1))
    # Layer 0's K/V depend on the token and position only, so the half cache holds exactly the
    # float32 cache's values rounded to nearest even (what torch's .half() does).
    slots = np.asarray(h.slots)
    for pool in ("k", "v"):
        got = getattr(h.runner.cache, pool)[0][slots]
        want = getattr(f.runner.cache, pool)[0][slots].astype(np.float16)
        assert np.array_equal(got, want)


@native_only
def test_default_path_uses_float16_and_stays_close(smol):
    """The default configuration (quantized activations, kv auto): float16 KV, and the scenario's
    greedy choices agree with float32 KV on nearly every row (measured 90-100% per step)."""
    loaded, ids = smol
    half, h = scenario(loaded, ids, "auto", 17)
    full, _ = scenario(loaded, ids, "float32", 17)
    assert h.runner.kv_dtype == "float16"
    agree = torch.cat([x.argmax(-1) == y.argmax(-1) for x, y in zip(half, full, strict=True)]).float().mean()
    assert agree >= 0.85


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("quantization", [pytest.param("q8_0", marks=pytest.mark.requires("f16c")), "none"])
def test_byte_budget_holds_twice_the_blocks_in_float16(tiny, quantization):
    n = {kv: LLM(str(tiny), quantization=quantization, dtype="float32", kv_cache_memory="8MiB",
                 kv_cache_dtype=kv).engine.runner for kv in ("float16", "float32", "auto")}
    assert str(n["float16"].cache.k[0].dtype).removeprefix("torch.") == "float16"
    assert n["float16"].num_blocks in (2 * n["float32"].num_blocks, 2 * n["float32"].num_blocks + 1)
    # auto: float16 on the native kernels, the model's dtype (float32 here) on torch.
    assert n["auto"].kv_dtype == ("float16" if quantization == "q8_0" else "float32")


@pytest.mark.requires("kernels")
def test_without_f16c_the_native_cache_stays_float32(caplog):
    no_f16c = NativeLibrary(lib=lib.lib, features=lib.features & ~FEATURE_F16C)
    with caplog.at_level(logging.WARNING, logger="tokenpath.engine"):
        assert pick_kv_dtype("auto", no_f16c, "float32") == "float32"
        assert pick_kv_dtype("float16", no_f16c, "float32") == "float32"
    assert "F16C" in caplog.text
    assert pick_kv_dtype("float32", lib, "float32") == "float32"
    assert pick_kv_dtype("auto", None, "bfloat16") == "bfloat16"  # torch path: the model's dtype


def test_torch_path_stores_float16_and_computes_in_float32(tiny):
    """--quantization none --kv-cache-dtype float16: K/V are rounded on write and widened after the
    gather, so decode and prefix-hit prefill read them back; the greedy text matches float32 KV."""
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = {}
    for kv in ("float16", "float32"):
        llm = LLM(str(tiny), quantization="none", dtype="float32", num_kv_blocks=32, kv_cache_dtype=kv)
        assert llm.engine.runner.cache.k[0].dtype == getattr(torch, kv)
        prompt = list(range(300, 340))
        first = llm.generate([prompt], p)[0]
        again = llm.generate([prompt + [7, 8, 9]], p)[0]  # a prefix hit: gathers the cached K/V
        assert again.num_cached_tokens > 0
        got[kv] = [first.outputs[0].token_ids, again.outputs[0].token_ids]
    assert got["float16"] == got["float32"]
