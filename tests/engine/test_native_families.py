"""The native forward on every decoder family's features, against the torch path on the same weights.

Tiny random checkpoints made by transformers (nothing downloaded): Llama 3.1-style rope scaling,
Mistral's sliding window with head_dim != hidden / heads, Qwen3's QK-norm, Gemma 3 (sliding and
global layers with their own rope bases, QK-norm, sandwich norms, GeGLU, embedding scale, its
attention scale, (1 + w) norms, head_dim 256). The native path runs them under
`--quantization q8_0`; the torch reference gets the same Q8_0 weights (quantized and dequantized
by the kernels' own quantizer), so what is compared is the forward pass, not the quantization.
Prompts are longer than the windows (8), so a window that is ignored or off by one changes the
logits of every later position.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.engine.test_quantized_quality import all_logits, runner
from tests.engine.tiny_models import FAMILIES as TINY_FAMILIES
from tokenpath.engine import kernels as K
from tokenpath.engine.loader import LoadedModel, load_model

lib = K.native_library()
pytestmark = pytest.mark.requires("kernels")

VOCAB = 512
# The tiny families of tests/engine/tiny_models.py, on a smaller vocabulary; Mistral with head_dim 32.
FAMILIES = {
    "llama3-rope": TINY_FAMILIES["llama3"],
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8, "head_dim": 32}),
    "qwen3": TINY_FAMILIES["qwen3"],
    "gemma3": TINY_FAMILIES["gemma3"],
    "gemma3-scalar": TINY_FAMILIES["gemma3-scalar"],
}


def save_family(kind: str, path, **overrides) -> str:
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[kind]
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
               initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(extra)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**cfg))
    with torch.no_grad():  # random norm weights: a dropped or mis-offset norm shows up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "gemma" in kind else 1.0))
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def q8_weights(loaded: LoadedModel) -> LoadedModel:
    """The checkpoint with every matrix through Q8_0 and back: the numbers the native path runs."""
    weights = {}
    for name, w in loaded.weights.items():
        if w.dim() == 2:
            a = w.float().numpy()
            w = torch.from_numpy(K.dequantize(lib, K.Q8_0, K.quantize(lib, K.Q8_0, a), a.shape[1]))
        weights[name] = w
    return dataclasses.replace(loaded, weights=weights)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_native_forward_matches_torch(kind, tmp_path, monkeypatch):
    loaded = load_model(save_family(kind, tmp_path / kind))
    ids = np.random.default_rng(0).integers(3, VOCAB, 40).tolist()
    out = {}
    for isa in lib.available_isas():
        monkeypatch.setenv("TOKENPATH_KERNELS_ISA", "avx2" if isa == K.ISA_AVX2 else "avx512")
        r = runner(loaded, "q8_0")
        assert r.native is not None, kind
        out[isa] = all_logits(r, ids)
    native = out[K.ISA_AVX2]
    assert all(torch.equal(native, o) for o in out.values())  # AVX2 and AVX-512 VNNI: the same bits
    ref = all_logits(runner(q8_weights(loaded), "none"), ids)
    err = (native - ref).abs().max().item() / ref.abs().max().item()
    agree = (native.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{kind}: max |native - torch| / max |torch| = {err:.2e}, argmax agreement {agree:.3f}")
    assert err <= 5e-3
    assert agree >= 0.95


@pytest.mark.parametrize("kind", ["mistral-window", "gemma3-scalar"])
@pytest.mark.parametrize("kv", ["float32", pytest.param("float16", marks=pytest.mark.requires("f16c"))])
def test_windowed_prefill_matches_token_by_token(kind, kv, tmp_path):
    """With sliding windows a row still sums its keys in the same blocks whatever its tile: a
    100-token chunk (tiles of 8 rows whose 40-key windows start mid key-block and span two or
    three blocks of 32) equals the same tokens one per step, bit for bit, and so does the decode
    after it."""
    from tests.engine.native_steps import NativeSteps

    loaded = load_model(save_family(kind, tmp_path / kind, sliding_window=40))
    assert loaded.config.has_windows
    ids = np.random.default_rng(1).integers(3, VOCAB, 101).tolist()
    table = [9, 3, 14, 0, 6, 12, 1]
    chunked, alone = NativeSteps(loaded, kv), NativeSteps(loaded, kv)
    whole = chunked.step([(table, ids[:100], 0)])
    one_by_one = torch.cat([alone.step([(table, ids[i : i + 1], i)]) for i in range(100)])
    assert torch.equal(whole, one_by_one), f"max |diff| {(whole - one_by_one).abs().max():.3e}"
    assert torch.equal(chunked.step([(table, ids[100:101], 100)]), alone.step([(table, ids[100:101], 100)]))
