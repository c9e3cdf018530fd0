"""A GGUF's yarn scaling without `rope.scaling.original_context_length` takes llama.cpp's default,
the context the model was trained with (it used to reach the rope as None and fail there)."""

from __future__ import annotations

import math

import gguf
import torch

from tokenpath.engine.loader_gguf import _rope_scaling
from tokenpath.engine.models.rope import inv_freq


def _read(path, **scaling):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(8192)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    if "orig" in scaling:
        w.add_rope_scaling_orig_ctx_len(scaling["orig"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _rope_scaling(gguf.GGUFReader(str(path)), "llama", {}, path)


def test_yarn_without_its_original_context_uses_the_trained_one(tmp_path):
    s = _read(tmp_path / "m.gguf")
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 8192)
    base, attn = inv_freq(64, 10000.0, s)
    assert bool(torch.isfinite(base).all()) and math.isclose(attn, 0.1 * math.log(4.0) + 1.0)
    assert _read(tmp_path / "n.gguf", orig=2048).original_max_position_embeddings == 2048
