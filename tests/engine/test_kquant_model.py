"""A llama GGUF made of Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16 and BF16 tensors runs natively on the file's own
blocks (none re-quantized to Q8_0), and its logits match the torch float32 path fed with
gguf-py's dequantization of the same blocks.

The GGUF is written here with gguf-py: 2 layers, hidden 256 (a K-quant row is whole 256-weight
super-blocks), random blocks scaled so that the weights are of a trained model's size. The fused
QKV of layer 0 mixes types (Q5_0, Q5_0, Q6_K: Gemma 3 270M Q4_K_M's attn_v is Q8_0 or Q5_0 beside
Q5_0 Q and K), so the kernels run one matrix in parts of different layouts.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from tests.engine.test_kquant_kernels import random_blocks
from tests.engine.test_quantized_quality import all_logits, runner
from tokenpath.engine import kernels as K
from tokenpath.engine.loader import load_model

lib = K.native_library()
pytestmark = pytest.mark.requires("kernels")

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 512
# fp16 scale sizes that make weights of about 0.05-0.1 in each type (K-quants multiply by 6-bit
# or int8 sub-block scales too).
SIZE = {K.Q5_0: 0.01, K.Q5_1: 0.005, K.Q4_K: 3e-4, K.Q5_K: 2e-4, K.Q6_K: 1e-4, K.Q8_0: 1e-3, K.F16: 0.01,
        K.BF16: 0.01}


def write_gguf(path, types: dict[str, int], tied: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])

    def matrix(name: str, rows: int, cols: int, wtype: int) -> None:
        blocks = random_blocks(wtype, rows, cols, rng, SIZE[wtype])
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType(wtype))

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN, types["embed"])
    if not tied:
        matrix("output.weight", VOCAB, HIDDEN, types["output"])
    norm("output_norm.weight")
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
              "ffn_down": (HIDDEN, INTER)}
    for i in range(2):
        for name, (rows, cols) in shapes.items():
            matrix(f"blk.{i}.{name}.weight", rows, cols, types.get(f"{i}.{name}", types[name]))
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MODELS = {
    # Gemma 3 270M Q4_K_M's mix, tied Q6_K embedding (the LM head and embedding lookups repacked)
    "q4_k_m": ({"embed": K.Q6_K, "attn_q": K.Q5_0, "attn_k": K.Q5_0, "attn_v": K.Q5_0, "0.attn_v": K.Q6_K,
                "attn_output": K.Q4_K, "ffn_gate": K.Q5_0, "ffn_up": K.Q5_0, "ffn_down": K.Q6_K,
                "1.ffn_down": K.Q4_K}, True),
    # the other types, an untied head, a QKV of three types, float matrices (F16 beside Q5_1)
    "q5_k_q5_1_f16": ({"embed": K.BF16, "output": K.Q5_K, "attn_q": K.Q5_K, "attn_k": K.Q5_1, "attn_v": K.Q8_0,
                       "attn_output": K.Q5_1, "1.attn_output": K.F16, "ffn_gate": K.Q4_K, "ffn_up": K.Q5_K,
                       "ffn_down": K.Q5_0, "1.ffn_down": K.BF16}, False),
}


@pytest.fixture(scope="module", params=list(MODELS))
def kquant_model(request, tmp_path_factory):
    types, tied = MODELS[request.param]
    return load_model(str(write_gguf(tmp_path_factory.mktemp("kq") / "m.gguf", types, tied)))


def test_runs_on_the_files_blocks_and_matches_the_float32_path(kquant_model, caplog, monkeypatch):
    ids = np.random.default_rng(1).integers(0, VOCAB, 96).tolist()
    out = {}
    # float32 activations for the BF16 matrix: on an AMX CPU it would take bf16 ones on tiles, which
    # the AVX2 kernels do not have (test_native_safetensors.py holds that path to its own bound)
    monkeypatch.setenv("TOKENPATH_KERNELS_BF16", "0")
    for isa in lib.available_isas():
        monkeypatch.setenv("TOKENPATH_KERNELS_ISA", "avx2" if isa == K.ISA_AVX2 else "avx512")
        with caplog.at_level(logging.INFO, logger="tokenpath.engine.kernels"):
            r = runner(kquant_model, "auto")
        assert r.native is not None
        assert "quantized to Q8_0" not in caplog.text
        out[isa] = all_logits(r, ids)
    native = out[K.ISA_AVX2]
    assert all(torch.equal(native, o) for o in out.values())  # AVX2 and AVX-512 VNNI: the same bits
    ref = all_logits(runner(kquant_model, "none"), ids)
    err = (native - ref).abs().max().item() / ref.abs().max().item()
    agree = (native.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"max |native - float32| / max |float32| = {err:.2e}, argmax agreement {agree:.3f}")
    assert ref.abs().max().item() > 1  # logits that say something
    assert err <= 1e-2
    assert agree >= 0.95


def test_a_matrix_the_kernels_cannot_read_as_stored_falls_back_to_q8_0_and_says_so(tmp_path):
    """A K-quant matrix under float activations (TOKENPATH_KERNELS_EXACT: the GGUF-layout row
    kernels, Q4_0/Q4_1/Q8_0 only) is re-quantized, and named for the load's log line."""
    from tokenpath.engine.kernels.model import _matrix

    loaded = load_model(str(write_gguf(tmp_path / "m.gguf", MODELS["q4_k_m"][0], True)))

    requantized: set[str] = set()
    q = loaded.gguf.raw("layers.0.q_proj.weight")
    assert q.ggml_type == K.Q5_0
    parts = _matrix(lib, loaded, ["layers.0.o_proj.weight"], None, True, requantized)
    assert [(t, rows) for t, rows, _ in parts] == [(K.Q4KX16, HIDDEN)] and not requantized
    parts = _matrix(lib, loaded, ["layers.0.o_proj.weight"], None, False, requantized)  # float activations
    assert [t for t, _, _ in parts] == [K.Q8_0]
    assert any("Q4_K" in r for r in requantized)
