"""gpt-oss on the torch path, against transformers' GptOssForCausalLM in float32.

A tiny random checkpoint made by transformers (tests/engine/tiny_models.py "gpt-oss": 3 layers,
sliding (window 8) / full / sliding, 8 experts top-4, biases on q/k/v/o, router and experts,
attention sinks, YaRN without truncation, the clamped SwiGLU with its limit lowered to 1.0 so that
random activations reach it). Logits equal transformers' to float32 rounding, and the engine's
greedy tokens (batched, chunked prefill past the window, mixed with decode) equal `generate`'s.
Each gpt-oss piece changes these logits here (so the equality is not blind to one of them).
The native kernels compute none of those pieces: the model runs on torch under `auto`.
Refused at load, naming what is not read: the released MXFP4 checkpoints (quantization_config,
or U8 `_blocks` tensors), a gpt-oss GGUF, and tensors missing or of the wrong shape.
The old loader refused every gpt-oss checkpoint as an unknown architecture, so each test failed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.conftest import assert_greedy_as_transformers, hf_float32, random_ids
from tests.engine.test_quantized_quality import all_logits, runner
from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM
from tokenpath.engine.kernels.model import native_unsupported
from tokenpath.engine.loader import load_model
from tokenpath.errors import ModelLoadError

pytestmark = pytest.mark.slow  # transformers builds and runs the reference: seconds under load




@pytest.fixture(scope="module")
def reference() -> tuple[Path, list[int], torch.Tensor]:
    path = cached_tiny("gpt-oss")
    ids = random_ids(load_model(str(path)).config.vocab_size)
    with torch.inference_mode():
        ref = hf_float32(path)(torch.tensor([ids])).logits[0].float()
    return path, ids, ref


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got - ref).abs().max().item() / max(1.0, ref.abs().max().item())


def test_logits_match_transformers(reference):
    path, ids, ref = reference
    loaded = load_model(str(path))
    cfg = loaded.config
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("gpt_oss", 8, 4)
    assert cfg.layer_windows == (8, None, 8) and cfg.moe_layers == (0, 1, 2)
    assert _err(all_logits(runner(loaded, "none"), ids), ref) <= 1e-5


@pytest.mark.parametrize("change", [
    {"attn_sinks": False}, {"attn_output_bias": False}, {"swiglu_limit": None},
    {"layer_windows": (None, None, None)}, {"rope_scaling": "truncate"},
])
def test_each_piece_changes_the_logits(reference, change):
    """The same weights computed without one piece (as a decoder that skipped it would) are far
    from transformers' logits: the equality above checks every one of them."""
    path, ids, ref = reference
    loaded = load_model(str(path))
    if change == {"rope_scaling": "truncate"}:
        assert loaded.config.rope_scaling is not None
        change = {"rope_scaling": dataclasses.replace(loaded.config.rope_scaling, truncate=True)}
    loaded = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, **change))
    assert _err(all_logits(runner(loaded, "none"), ids), ref) > 1e-3


def test_greedy_matches_transformers():
    """Under `auto` the native kernels decline it (naming the five pieces) and torch runs it:
    batched, chunked prefill (a 90-token prompt in 48-token steps, past the window) mixed with
    decode, then one prompt alone; the same greedy tokens as transformers' generate."""
    path = cached_tiny("gpt-oss")
    assert native_unsupported(load_model(str(path)).config) == [
        "attention sinks", "an attention output bias", "router and expert biases",
        "a softmax over the top-k router logits", "the clamped SwiGLU"]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=48, max_num_seqs=8)
    assert llm.engine.runner.native is None
    assert_greedy_as_transformers(llm, path, alone=3)


# ---------------------------------------------------------------- refused at load


def _copy(tmp_path: Path, config: dict | None = None, tensors: dict | None = None,
          drop: tuple[str, ...] = ()) -> Path:
    """The tiny checkpoint with config.json entries added, tensors replaced or added, or dropped."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(cached_tiny("gpt-oss"), d)
    if config:
        (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text()) | config))
    if tensors or drop:
        f = str(d / "model.safetensors")
        held = {k: v for k, v in load_file(f).items() if k not in drop} | (tensors or {})
        save_file(held, f, metadata={"format": "pt"})
    return d


def test_mxfp4_checkpoint_refused(tmp_path):
    """The released gpt-oss-20b/120b: quantization_config mxfp4, experts as U8 blocks and scales."""
    d = _copy(tmp_path, config={"quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ModelLoadError, match=r"quantization_config 'mxfp4': gpt-oss experts stored as MXFP4"):
        load_model(str(d))


def test_mxfp4_blocks_without_a_config_entry_refused(tmp_path):
    """Blocks in place of the float experts and no quantization_config: the U8 tensor is named."""
    name = "model.layers.0.mlp.experts.gate_up_proj"
    d = _copy(tmp_path, tensors={f"{name}_blocks": torch.zeros(8, 64, 2, 16, dtype=torch.uint8),
                                 f"{name}_scales": torch.zeros(8, 64, 2, dtype=torch.uint8)}, drop=(name,))
    with pytest.raises(ModelLoadError, match=rf"tensor {name}_blocks is U8"):
        load_model(str(d))


@pytest.mark.parametrize(("name", "shape", "want"), [
    ("model.layers.1.self_attn.sinks", (2,), "[4]"),
    ("model.layers.0.mlp.experts.gate_up_proj", (8, 64, 32), "[8, 64, 64]"),
    ("model.layers.2.mlp.router.bias", (6,), "[8]"),
])
def test_wrong_shape_names_the_tensor(tmp_path, name, shape, want):
    d = _copy(tmp_path, tensors={name: torch.zeros(shape)})
    with pytest.raises(ModelLoadError, match=rf"tensor {name} has shape \[{', '.join(map(str, shape))}\], "
                                             rf"expected \{want[:-1]}\]"):
        load_model(str(d))


def test_missing_sinks_named(tmp_path):
    d = _copy(tmp_path, drop=("model.layers.2.self_attn.sinks",))
    with pytest.raises(ModelLoadError, match=r"missing .*layers\.2\.sinks"):
        load_model(str(d))


def test_gguf_refused_naming_the_expert_type(tmp_path):
    """A gpt-oss GGUF (llama.cpp's architecture name), its experts MXFP4 as the released files'."""
    import gguf

    out = tmp_path / "gpt-oss.gguf"
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    blocks = np.zeros((8, 32, 2 * 17), dtype=np.uint8)  # 8 experts x 32 rows x 64 values: 2 blocks of 17 bytes
    w.add_tensor("blk.0.ffn_gate_exps.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"gpt-oss GGUF is not supported yet \(blk\.0\.ffn_gate_exps\.weight "
                                             r"is MXFP4\)"):
        load_model(str(out))


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_are_transformers(truncate):
    """gpt-oss-20b/120b's own rope (head_dim 64, base 150000, YaRN x32 from 4096, truncate false):
    the inverse frequencies and the cos/sin factor of transformers, from the tables both paths
    read (engine/rope_tables.py)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenpath.engine.model_config import RopeScaling
    from tokenpath.engine.rope_tables import inv_freq

    rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
            "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    ref, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(rope_parameters=rope))
    ours, scale = inv_freq(64, 150000.0, RopeScaling(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                                     truncate=truncate))
    assert np.allclose(ours, ref.numpy(), rtol=1e-6, atol=0) and scale == pytest.approx(ref_scale, rel=1e-12)
