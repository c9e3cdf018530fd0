"""OLMoE and Granite MoE (engine/moe_families.py) on the torch path, against transformers in float32.

Tiny random checkpoints made by transformers (tests/engine/tiny_models.py: 8 experts, top-2). OLMoE's
q/k norms span the whole projection and its top-k weights are not renormalized; the tiny Granite
MoE's four multipliers are all away from 1 and its experts are stacked per layer. Greedy tokens
equal `model.generate`'s, logits equal transformers' to 1e-5, and `--quantization auto` runs them
on torch, the native kernels naming what they lack. Before this module's code both were refused
at load as unknown architectures.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import assert_greedy_as_transformers, hf_float32, random_ids
from tests.engine.test_quantized_quality import all_logits, runner
from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM
from tokenpath.engine.kernels.model import native_unsupported
from tokenpath.engine.loader import load_model
from tokenpath.errors import ModelLoadError

KINDS = ["olmoe", "granitemoe"]
LACKS = {"olmoe": ["q/k norms over the whole projection"],
         "granitemoe": ["a softmax over the top-k router logits", "a residual multiplier", "logits scaling"]}




@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind):
    path = cached_tiny(kind)
    loaded = load_model(str(path))
    cfg = loaded.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == (kind, 8, 2)
    assert cfg.moe_layers == tuple(range(cfg.num_layers)) and cfg.norm_topk_prob == (kind == "granitemoe")
    assert native_unsupported(cfg) == LACKS[kind]
    ids = random_ids(cfg.vocab_size)
    ours = all_logits(runner(loaded, "none"), ids)
    with torch.inference_mode():
        ref = hf_float32(path)(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(kind):
    """Batched, chunked prefill mixed with decode, and one prompt alone; under `auto` (torch: the
    native kernels decline both)."""
    path = cached_tiny(kind)
    llm = LLM(str(path), dtype="float32", quantization="auto", max_num_batched_tokens=48, max_num_seqs=8)
    assert llm.engine.runner.native is None
    assert_greedy_as_transformers(llm, path, alone=2)


@pytest.mark.parametrize(("kind", "change"), [
    ("olmoe", {"qk_norm_full": False}),  # per-head norms of the first head_dim weights instead
    ("granitemoe", {"residual_scale": 1.0}), ("granitemoe", {"logits_scaling": 1.0}),
    ("granitemoe", {"attn_scale": None}), ("granitemoe", {"embed_scale": 1.0}),
])
def test_each_switch_changes_the_logits(kind, change):
    """Each field the family sets moves the logits (so the equality above holds each to transformers).
    Granite's top-k-then-softmax is not among them: it is the renormalized softmax's numbers in
    another order (transformers' order, kept for 16-bit runs)."""
    loaded = load_model(str(cached_tiny(kind)))
    ids = random_ids(loaded.config.vocab_size)
    base = all_logits(runner(loaded, "none"), ids)
    if "qk_norm_full" in change:  # the per-head form reads head_dim-sized norms: give it the first ones
        w = dict(loaded.weights)
        d = loaded.config.head_dim
        for name in [n for n in w if n.endswith(("q_norm.weight", "k_norm.weight"))]:
            w[name] = w[name][:d]
        loaded = replace(loaded, weights=w)
    other = all_logits(runner(replace(loaded, config=replace(loaded.config, **change)), "none"), ids)
    assert (other - base).abs().max().item() > 1e-3


def _copy(tmp_path: Path, kind: str, config: dict | None = None, shapes: dict | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(cached_tiny(kind), d)
    if config:
        (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text()) | config))
    if shapes:
        tensors = load_file(str(d / "model.safetensors"))
        tensors |= {name: torch.zeros(shape) for name, shape in shapes.items()}
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize(("kind", "config", "match"), [
    ("olmoe", {"clip_qkv": 8.0}, r"'clip_qkv' = 8\.0 is not supported"),
    ("olmoe", {"head_dim": 32}, r"head_dim 32: OLMoE's q/k norms need hidden_size / num_attention_heads = 16"),
    ("granitemoe", {"num_local_experts": 6},
     r"model\.layers\.0\.block_sparse_moe\.router\.layer\.weight has shape \[8, 64\], expected \[6, 64\]"),
    ("granitemoe", {"architectures": ["GraniteMoeSharedForCausalLM"]},
     r"unsupported architecture \['GraniteMoeSharedForCausalLM'\]"),
])
def test_bad_configs_refused(kind, config, match, tmp_path):
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(_copy(tmp_path, kind, config=config)))


@pytest.mark.parametrize(("name", "shape", "want"), [
    ("model.layers.1.block_sparse_moe.input_linear.weight", (8, 48, 64), r"\[8, 64, 64\]"),
    ("model.layers.0.block_sparse_moe.output_linear.weight", (8, 64, 48), r"\[8, 64, 32\]"),
])
def test_granite_expert_shape_names_the_tensor(name, shape, want, tmp_path):
    d = _copy(tmp_path, "granitemoe", shapes={name: shape})
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \[{', '.join(map(str, shape))}\], expected {want}"):
        load_model(str(d))
