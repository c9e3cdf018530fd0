"""`--quantization q4_k`: a float checkpoint's matrices quantized to Q4_K at load (issue 42's opt-in
conversions), Q5_0 where a row is not whole 256-weight super-blocks, the embedding and head Q8_0.

The quantizers (csrc/quantize_more.cpp) write GGUF's block layouts, so they are checked against
gguf-py's own decoders, an implementation independent of ours; the model is checked against torch
in float32 on those decoded weights, which is what the kernels run (up to the activations' int8).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tests.engine.test_native_families import VOCAB, save_family
from tests.engine.test_native_safetensors import runner
from tests.engine.test_quantized_quality import all_logits
from tokenpath.engine import kernels as K
from tokenpath.engine.loader import LoadedModel, load_model

lib = K.native_library()
pytestmark = pytest.mark.requires("kernels")


def decoded(wtype: int, blocks: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """gguf-py's dequantization of GGUF blocks (not ours)."""
    qtype = {K.Q4_K: GGMLQuantizationType.Q4_K, K.Q5_0: GGMLQuantizationType.Q5_0,
             K.Q8_0: GGMLQuantizationType.Q8_0}[wtype]
    return quants.dequantize(blocks, qtype).reshape(shape)


def rel_rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def test_q4_k_blocks_decode_to_the_weights_with_a_searched_fit():
    """Decoded by gguf-py, Q4_K rows are within 4-bit error of the weights, and the fitted scales
    beat a plain min/max affine fit at the same bits (Q4_1: an exact fp16 scale and minimum per 32
    weights), which is what the search over step sizes is for."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 512)) * rng.uniform(0.01, 1.0, (64, 1))).astype(np.float32)
    w[3, 17] = 9.0  # an outlier in one sub-block
    w[5, :256] = 0.0  # an all-zero super-block
    w[6, :32] = np.abs(w[6, :32])  # a sub-block with no negative weight (its offset is zero)
    blocks = K.quantize(lib, K.Q4_K, w)
    assert blocks.shape == (64, 2 * 144)
    q4k = decoded(K.Q4_K, blocks, w.shape)
    assert np.all(q4k[5, :256] == 0.0)
    assert np.all(np.isfinite(q4k))
    err = rel_rmse(q4k, w)
    plain = rel_rmse(K.dequantize(lib, K.Q4_1, K.quantize(lib, K.Q4_1, w), 512), w)
    print(f"relative RMSE: Q4_K {err:.4f}, Q4_1 (min/max) {plain:.4f}")
    assert err < 0.11
    assert err < plain
    # The largest weights keep their sign and rough size (the dot products' main terms).
    assert abs(q4k[3, 17] - 9.0) < 0.6


def test_q5_0_blocks_decode_to_the_weights():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 96)).astype(np.float32)
    blocks = K.quantize(lib, K.Q5_0, w)
    assert blocks.shape == (16, 3 * 22)
    q5 = decoded(K.Q5_0, blocks, w.shape)
    assert rel_rmse(q5, w) < 0.06
    # The weight of largest magnitude in each block is exact (d = -max / 16, as Q4_0's -max / 8).
    for r in range(16):
        for b in range(3):
            block = w[r, 32 * b : 32 * b + 32]
            i = int(np.argmax(np.abs(block)))
            assert q5[r, 32 * b + i] == pytest.approx(block[i], rel=1e-3)


def test_rows_that_are_not_whole_blocks_are_refused_by_the_quantizer():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        K.quantize(lib, K.Q4_K, np.zeros((2, 576), np.float32))
    assert K.quantize_as(lib, K.Q4_K, np.zeros((2, 576), np.float32))[0] == K.Q5_0  # llama.cpp's fallback
    assert K.quantize_as(lib, K.Q4_K, np.zeros((2, 40), np.float32))[0] == K.Q8_0
    assert K.quantize_as(lib, K.Q4_K, np.zeros((2, 512), np.float32))[0] == K.Q4_K
    assert K.quantize_as(lib, K.Q8_0, np.zeros((2, 512), np.float32))[0] == K.Q8_0


def through(loaded: LoadedModel) -> LoadedModel:
    """The checkpoint with each matrix through the type q4_k gives it and back (gguf-py's decoders):
    the numbers the native path runs."""
    weights = {}
    for name, w in loaded.weights.items():
        if w.dim() == 2:
            a = w.float().numpy()
            head = "embed" in name or "lm_head" in name
            t, blocks = K.quantize_as(lib, K.Q8_0 if head else K.Q4_K, a)
            w = torch.from_numpy(decoded(t, blocks, a.shape).astype(np.float32))
        weights[name] = w
    return dataclasses.replace(loaded, weights=weights)


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen3"])
def test_a_float_checkpoint_runs_q4_k_matrices(kind, tmp_path):
    """hidden 256 and FFN 512 are whole super-blocks: every layer matrix is Q4_K, repacked (Q4KX16),
    and the embedding / tied head Q8_0; a hidden size of 96 is not, and its layer matrices take
    Q5_0 (Q5X16). The logits follow torch on the decoded weights, and the weights take less
    memory than under q8_0."""
    loaded = load_model(save_family(kind, tmp_path / kind, hidden_size=256, intermediate_size=512,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64))
    q4 = runner(loaded, "q4_k", bf16=0)  # int8 + residual activations: the bf16 tiles would round the weights
    assert q4.native is not None
    assert set(q4.native.weight_types) == {"Q4KX16", "Q8X16"}, q4.native.weight_types
    ids = np.random.default_rng(0).integers(3, VOCAB, 40).tolist()
    native = all_logits(q4, ids)
    ref = all_logits(runner(through(loaded), "none", dtype="float32"), ids)
    err = (native - ref).abs().max().item() / ref.abs().max().item()
    agree = (native.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{kind}: max |native - torch| / max |torch| = {err:.2e}, argmax agreement {agree:.3f}")
    assert err <= 5e-3
    assert agree >= 0.95
    assert q4.native.weight_bytes < runner(loaded, "q8_0").native.weight_bytes * 0.75

    small = load_model(save_family(kind, tmp_path / f"{kind}-96", hidden_size=96, intermediate_size=192,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=24))
    assert set(runner(small, "q4_k").native.weight_types) == {"Q5X16", "Q8X16"}
