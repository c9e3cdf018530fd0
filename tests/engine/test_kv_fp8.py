"""The one-byte KV cache (--kv-cache-dtype fp8_e4m3 / fp8 / fp8_e5m2, csrc/kv_fp8.h).

- The kernels' conversions against a reference written here from the formats' definitions (E5M2:
  IEEE-like, bias 15, inf and NaN; E4M3 "FN": bias 7, max 448, no inf, S.1111.111 NaN): every one
  of the 256 codes read, and floats written with round-to-nearest-even and saturation, at the
  edges where a slip shows (exact midpoints between neighbouring codes and the floats either side
  of them, the max, overflow, subnormals, signed zeros, NaN) and on random values.
- Attention over an fp8 pool is attention over the float32 values decoded from the same bytes:
  bit for bit, since the kernel widens a block into floats and then runs the float32 code.
- In the model: layer 0's cache holds exactly the reference rounding of what a float32 pool holds,
  the byte budget holds twice float16's tokens, and SmolLM2's greedy text stays near float16's.
- What refuses: the torch path (one line naming the flag), and a value the flag does not take.
- llama.cpp's q8_0 (blocks of 32 int8 with a half scale) alike: its blocks against a numpy
  reference of llama.cpp's quantize_row_q8_0, attention, the model's cache, and the refusal of a
  head_dim that is not whole blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.engine.native_steps import NativeSteps
from tests.engine.tiny_models import save_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.config import EngineConfig
from tokenpath.engine.kernels import native_library
from tokenpath.engine.kernels.model import KV_KINDS
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.errors import ModelLoadError

lib = native_library()
native_only = pytest.mark.requires("f16c")
TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
FORMATS = {"fp8_e5m2": (5, 2, 15), "fp8_e4m3": (4, 3, 7)}  # exponent bits, mantissa bits, bias


def reference_values(fmt: str) -> np.ndarray:
    """float64 value of each code 0..255, from the format's definition."""
    ebits, mbits, bias = FORMATS[fmt]
    out = np.empty(256)
    for c in range(256):
        sign = -1.0 if c & 0x80 else 1.0
        e, m = (c >> mbits) & ((1 << ebits) - 1), c & ((1 << mbits) - 1)
        if fmt == "fp8_e5m2" and e == 31:
            out[c] = sign * np.inf if m == 0 else np.nan
        elif fmt == "fp8_e4m3" and e == 15 and m == 7:
            out[c] = np.nan
        elif e == 0:  # subnormal
            out[c] = sign * m * 2.0 ** (1 - bias - mbits)
        else:
            out[c] = sign * (1 + m / 2**mbits) * 2.0 ** (e - bias)
    return out


def reference_encode(fmt: str, x: np.ndarray) -> np.ndarray:
    """The nearest code to each float (ties: the even code), magnitudes past the max finite value
    (infinities too) saturated to it, NaN to the format's NaN code of the same sign."""
    values = reference_values(fmt)[:128]
    codes = np.nonzero(np.isfinite(values))[0]  # positive finite codes, ascending in value
    finite = values[codes]
    nan_code = 0x7E if fmt == "fp8_e5m2" else 0x7F
    out = []
    for v in np.asarray(x, np.float32).astype(np.float64):
        sign = 0x80 if np.signbit(v) else 0
        a = abs(v)
        if np.isnan(v):
            out.append(sign | nan_code)
            continue
        i = int(np.searchsorted(finite, a))  # finite[i - 1] < a <= finite[i]
        if i == len(finite):
            c = codes[-1]
        elif finite[i] == a:
            c = codes[i]
        else:
            below, above = a - finite[i - 1], finite[i] - a
            c = codes[i - 1] if below < above or (below == above and codes[i - 1] % 2 == 0) else codes[i]
        out.append(sign | int(c))
    return np.array(out, np.uint8)


def kernel_encode(fmt: str, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(len(x), np.uint8)
    lib.lib.tp_kv_convert(KV_KINDS[fmt], 0, x.ctypes.data, out.ctypes.data, len(x))
    return out


def kernel_decode(fmt: str, codes: np.ndarray) -> np.ndarray:
    codes = np.ascontiguousarray(codes, np.uint8)
    out = np.empty(len(codes), np.float32)
    lib.lib.tp_kv_convert(KV_KINDS[fmt], 1, codes.ctypes.data, out.ctypes.data, len(codes))
    return out


def same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a == b) | (np.isnan(a) & np.isnan(b))


@native_only
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_code_reads_as_its_definition(fmt):
    want = reference_values(fmt)
    codes = np.arange(256, dtype=np.uint8)
    assert same(kernel_decode(fmt, codes), want).all()
    # lengths that are not multiples of 8 (the kernels' tails), from every offset
    for start in range(8):
        for n in (1, 3, 7, 9, 13):
            assert same(kernel_decode(fmt, codes[start : start + n]), want[start : start + n]).all()
    top = 57344.0 if fmt == "fp8_e5m2" else 448.0
    assert np.nanmax(want[np.isfinite(want)]) == top


def edge_values(fmt: str) -> np.ndarray:
    values = reference_values(fmt)
    finite = np.sort(values[:128][np.isfinite(values[:128])])
    mids = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact in float32: the ties
    top = finite[-1]
    ulp = top - finite[-2]
    rng = np.random.default_rng(0)
    return np.concatenate([
        mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
        finite.astype(np.float32),
        [top, top + ulp / 2, top + ulp / 2 - 1, top + ulp, top * 4, 65504, 65520, 1e6, 1e38],  # the max, past it
        [np.inf, np.nan, 0.0, 1e-30, 1e-45, finite[1] / 2, finite[1] / 4, finite[1] * 0.75],  # smallest: ties
        rng.standard_normal(20000) * 8, np.exp(rng.uniform(-25, 12, 20000)),
    ]).astype(np.float32)


@native_only
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_writes_round_to_nearest_even_and_saturate(fmt):
    x = edge_values(fmt)
    x = np.concatenate([x, -x])
    got, want = kernel_encode(fmt, x), reference_encode(fmt, x)
    bad = np.nonzero(got != want)[0]
    assert len(bad) == 0, [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]
    for n in range(1, 17):  # the tail path alike
        assert np.array_equal(kernel_encode(fmt, x[:n]), want[:n])
    # Every finite code survives the round trip.
    values = reference_values(fmt)
    finite = np.nonzero(np.isfinite(values))[0]
    assert np.array_equal(kernel_encode(fmt, values[finite]), finite.astype(np.uint8))


@native_only
def test_a_float_that_rounds_to_a_half_tie_is_not_rounded_twice():
    """1 + 2^-3 + 2^-14 in e5m2: nearest is 1.25 (just above the tie at 1.125), but the nearest
    half is 1.125 exactly, which a float->half->byte rounding would send to the even 1.0."""
    x = np.array([1 + 2**-3 + 2**-14, -(1 + 2**-3 + 2**-14)], np.float32)
    assert kernel_decode("fp8_e5m2", kernel_encode("fp8_e5m2", x)).tolist() == [1.25, -1.25]


ISAS = lib.available_isas() if lib else []


def attend(kind: str, k: np.ndarray, v: np.ndarray, q: np.ndarray, table: np.ndarray, p0: int, bs: int,
           rep: int, window: int = 0, isa: int = 2) -> np.ndarray:
    """tp_attend_tile_test: q [rows, n_kv * rep, D] at positions p0.. over the pool k, v [slots, n_kv, D],
    on the kernels of `isa` (2: attn_avx512.cpp where the object has it and D is a multiple of 16)."""
    rows, heads, d = q.shape
    out = np.zeros_like(q)
    lib.lib.tp_attend_tile_test(KV_KINDS[kind], k.ctypes.data, v.ctypes.data, q.ctypes.data, out.ctypes.data,
                                table.ctypes.data, rows, p0, bs, k.shape[1], d, rep, d**-0.5, window, isa)
    return out


def attend_numpy(k, v, q, table, p0, bs, rep, window=0) -> np.ndarray:
    rows, heads, d = q.shape
    out = np.zeros((rows, heads, d))
    for r in range(rows):
        pos = np.arange(p0 + r + 1)
        if window:
            pos = pos[pos > p0 + r - window]
        slots = table[pos // bs] * bs + pos % bs
        for h in range(heads):
            kk, vv = k[slots, h // rep].astype(np.float64), v[slots, h // rep].astype(np.float64)
            s = kk @ q[r, h] * d**-0.5
            w = np.exp(s - s.max())
            out[r, h] = w @ vv / w.sum()
    return out


@native_only
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(("rows", "p0", "d", "window"), [(8, 61, 64, 0), (5, 90, 20, 0), (1, 100, 64, 0),
                                                          (1, 37, 20, 0), (8, 70, 64, 24)])
def test_attention_over_fp8_is_attention_over_its_decoded_floats(fmt, rows, p0, d, window, isa):
    """A prefill tile (8 and 5 rows) and decodes (1 row), head_dim 64 and 20 (the scalar tails),
    several 32-key blocks, a shuffled block table, a sliding window: bit for bit the float32 kernel
    (of the same ISA) on the decoded pool, and that within float rounding of a float64 softmax."""
    rng = np.random.default_rng(rows * 1000 + p0)
    n_kv, rep, bs = 2, 3, 16
    table = rng.permutation(8).astype(np.int32)
    slots = len(table) * bs
    codes = [kernel_encode(fmt, rng.standard_normal(slots * n_kv * d) * 3).reshape(slots, n_kv, d) for _ in "kv"]
    floats = [kernel_decode(fmt, c.ravel()).reshape(c.shape) for c in codes]
    q = rng.standard_normal((rows, n_kv * rep, d)).astype(np.float32)
    got = attend(fmt, *codes, q, table, p0, bs, rep, window, isa)
    want = attend("float32", *floats, q, table, p0, bs, rep, window, isa)
    assert np.array_equal(got, want)
    np.testing.assert_allclose(got, attend_numpy(*floats, q, table, p0, bs, rep, window), atol=2e-5)


@pytest.fixture(scope="module")
def smol(smol_loaded):
    return smol_loaded, Tokenizer(smol_loaded.tokenizer_source).encode(TEXT.read_text())


@native_only
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_models_cache_holds_the_reference_rounding(smol, fmt):
    """Layer 0's K/V depend on the tokens and positions only, so the fp8 pool holds exactly the
    reference rounding of the float32 pool's values, for a prefill and the decode after it."""
    loaded, ids = smol
    runs = {}
    for kv in (fmt, "float32"):
        s = NativeSteps(loaded, kv)
        s.step([([3, 1, 4], ids[:40], 0)])
        s.step([([3, 1, 4], ids[40:41], 40)])
        runs[kv] = s
    cache = runs[fmt].runner.cache
    assert cache.dtype == fmt and cache.k[0].dtype == np.uint8 and runs[fmt].runner.kv_dtype == fmt
    slots = np.asarray(runs[fmt].slots)
    for pool in ("k", "v"):
        got = getattr(cache, pool)[0][slots]
        want = reference_encode(fmt, getattr(runs["float32"].runner.cache, pool)[0][slots].ravel())
        assert np.array_equal(got.ravel(), want)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


@native_only
def test_the_byte_budget_holds_twice_float16s_tokens(tiny):
    runners = {kv: LLM(str(tiny), quantization="q8_0", dtype="float32", kv_cache_memory="8MiB",
                       kv_cache_dtype=kv).engine.runner for kv in ("float16", "fp8", "fp8_e5m2")}
    assert runners["fp8"].kv_dtype == "fp8_e4m3"  # vLLM's alias
    for kv in ("fp8", "fp8_e5m2"):
        r = runners[kv]
        assert r.cache.k[0].dtype == np.uint8 and r.cache.k[0].itemsize == 1
        assert r.num_blocks in (2 * runners["float16"].num_blocks, 2 * runners["float16"].num_blocks + 1)
        assert r.bytes_per_block * 2 == runners["float16"].bytes_per_block


def test_the_torch_path_refuses_fp8_in_one_line(tiny):
    for kv in ("fp8", "fp8_e5m2"):
        with pytest.raises(ModelLoadError) as err:
            LLM(str(tiny), quantization="none", dtype="float32", num_kv_blocks=8, kv_cache_dtype=kv)
        msg = str(err.value)
        assert "--kv-cache-dtype" in msg and "fp8" in msg and "\n" not in msg


def test_a_bad_value_is_refused_naming_the_field():
    for bad in ("fp8_e4m3fn", "int8", "float8"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(model="x", kv_cache_dtype=bad)


def q8_reference(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q8_0 per 32 values in float32: d = max|x| / 127, q = rint(x * (1 / d)),
    d stored as an IEEE half; as the pool's bytes (34 per block)."""
    blocks = np.asarray(x, np.float32).reshape(-1, 32)
    d = (np.abs(blocks).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[:, None]).astype(np.int8)
    out = np.empty((len(blocks), 34), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.ravel()


def q8_reference_decode(raw: np.ndarray) -> np.ndarray:
    b = np.asarray(raw, np.uint8).reshape(-1, 34)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return (d * b[:, 2:].view(np.int8).astype(np.float32)).ravel()


def q8_kernel(x: np.ndarray, to_float: bool) -> np.ndarray:
    src = np.ascontiguousarray(x)
    n = len(src) // 34 * 32 if to_float else len(src)
    out = np.empty(n, np.float32) if to_float else np.empty(n // 32 * 34, np.uint8)
    lib.lib.tp_kv_convert(KV_KINDS["q8_0"], int(to_float), src.ctypes.data, out.ctypes.data, n)
    return out


@native_only
def test_q8_0_blocks_are_llama_cpps():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(32 * 200) * 4, np.zeros(32), np.full(32, -3.0),
                        np.exp(rng.uniform(-20, 8, 32 * 50)) * rng.choice([-1, 1], 32 * 50),
                        [127.0, 2.5, -2.5, 0.5, 1.5, -0.5] + [0.0] * 26]).astype(np.float32)  # ties: to even
    want = q8_reference(x)
    got = q8_kernel(x, False)
    assert np.array_equal(got, want)
    assert q8_reference_decode(want)[-32:-26].tolist() == [127.0, 2.0, -2.0, 0.0, 2.0, -0.0]
    # reading: random scales (finite halves) and int8 values, against the reference decoder
    raw = rng.integers(0, 256, size=(300, 34), dtype=np.uint8)
    raw[:, :2] = (rng.standard_normal(300) * 0.1).astype(np.float16).view(np.uint8).reshape(-1, 2)
    assert np.array_equal(q8_kernel(raw.ravel(), True), q8_reference_decode(raw.ravel()))


@native_only
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "p0"), [(8, 61), (5, 90), (1, 100)])
def test_attention_over_q8_0_is_attention_over_its_decoded_floats(rows, p0, isa):
    rng = np.random.default_rng(rows + p0)
    n_kv, rep, bs, d = 2, 3, 16, 64
    table = rng.permutation(8).astype(np.int32)
    slots = len(table) * bs
    blocks = [q8_kernel((rng.standard_normal(slots * n_kv * d) * 3).astype(np.float32), False) for _ in "kv"]
    floats = [q8_kernel(b, True).reshape(slots, n_kv, d) for b in blocks]
    q = rng.standard_normal((rows, n_kv * rep, d)).astype(np.float32)
    out = np.zeros_like(q)
    lib.lib.tp_attend_tile_test(KV_KINDS["q8_0"], blocks[0].ctypes.data, blocks[1].ctypes.data, q.ctypes.data,
                                out.ctypes.data, table.ctypes.data, rows, p0, bs, n_kv, d, rep, d**-0.5, 0, isa)
    assert np.array_equal(out, attend("float32", *floats, q, table, p0, bs, rep, isa=isa))


@native_only
def test_the_models_q8_0_cache_holds_llama_cpps_blocks(smol):
    loaded, ids = smol
    runs = {}
    for kv in ("q8_0", "float32"):
        s = NativeSteps(loaded, kv)
        s.step([([3, 1, 4], ids[:40], 0)])
        s.step([([3, 1, 4], ids[40:41], 40)])
        runs[kv] = s
    r = runs["q8_0"].runner
    cfg = loaded.config
    assert r.cache.k[0].shape[1:] == (cfg.num_kv_heads, cfg.head_dim // 32 * 34)
    assert r.bytes_per_block * 128 == runs["float32"].runner.bytes_per_block * 34  # 34 bytes per 32 values, not 128
    slots = np.asarray(runs["q8_0"].slots)
    for pool in ("k", "v"):
        got = getattr(r.cache, pool)[0][slots]
        want = q8_reference(getattr(runs["float32"].runner.cache, pool)[0][slots].ravel())
        assert np.array_equal(got.ravel(), want)


def test_q8_0_refuses_a_head_dim_that_is_not_whole_blocks(tiny):
    """The tiny Llama's head_dim is 16: refused at load in one line, on either path (torch: as fp8)."""
    for quantization, why in (("q8_0", "multiple of 32"), ("none", "native CPU kernels only")):
        with pytest.raises(ModelLoadError) as err:
            LLM(str(tiny), quantization=quantization, dtype="float32", num_kv_blocks=8, kv_cache_dtype="q8_0")
        msg = str(err.value)
        assert msg.startswith("--kv-cache-dtype q8_0: ") and why in msg and "\n" not in msg


# Measured on SmolLM2 (the GGUF, default precision), 48 greedy tokens of two chat prompts against
# float16 KV: the first differing token at 15 (e4m3), 39 (e5m2) and none (q8_0) on this test's
# prompt, at 7, 7 and 35 on another; float16's continuation scored by the fp8 engines lost
# -0.017 .. 0.057 nats per token, by q8_0 0.007 (float32 KV: 0.0001). The bounds leave room for a kernel or compiler change, not for a broken
# pool (garbage K/V lose whole nats per token).
GREEDY_TOKENS = 48
GREEDY_PREFIX = 12
LOSS_BOUND = 0.15  # nats per token


@pytest.mark.slow  # (loads SmolLM2 engines: not the fast tier)
@native_only
def test_greedy_text_stays_near_float16s():
    """fp8 KV rounds every cached K/V value to 3 (e4m3) or 2 (e5m2) mantissa bits (q8_0: to 8 bits
    of its block's range), so a greedy continuation drifts from float16's eventually (a near-tie
    flips); it must agree for the first GREEDY_PREFIX tokens, and float16's continuation must stay
    about as likely (teacher forced: its mean log-probability under each engine, prompt_logprobs)."""
    p = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    msgs = [{"role": "user", "content": "Write a short paragraph about rivers and the sea."}]
    # The activations stay fine on every row (--kernels-prompt-fine 31, no bf16 tiles on an AMX
    # CPU), so that what differs between the engines is the cache alone: with the default prompt
    # mask the prompt's int8 matmuls add their own near-ties (e5m2 then parts from float16 at the
    # second token).
    llms = {kv: LLM("smollm2-135m-instruct", kv_cache_memory="64MiB", kv_cache_dtype=kv, kernels_prompt_fine=31,
                    kernels_bf16=0)
            for kv in ("float16", "fp8_e4m3", "fp8_e5m2", "q8_0")}
    prompt = llms["float16"].tokenizer.apply_chat_template(msgs)
    ref = llms["float16"].generate(prompt, p)[0].outputs[0].token_ids
    base = score(llms["float16"], prompt, ref)
    for kv in ("fp8_e4m3", "fp8_e5m2", "q8_0"):
        assert llms[kv].engine.runner.kv_dtype == kv
        got = llms[kv].generate(prompt, p)[0].outputs[0].token_ids
        assert got[:GREEDY_PREFIX] == ref[:GREEDY_PREFIX], kv
        loss = (base - score(llms[kv], prompt, ref)) / len(ref)
        assert abs(loss) < LOSS_BOUND, (kv, loss)


def score(llm: LLM, prompt: list[int], continuation: list[int]) -> float:
    """Sum of the log-probabilities `llm` gives `continuation` after `prompt`."""
    out = llm.generate([prompt + continuation], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    lps = out.prompt_logprobs[len(prompt):]
    assert [lp.token_id for lp in lps] == continuation
    return sum(lp.logprob for lp in lps)
