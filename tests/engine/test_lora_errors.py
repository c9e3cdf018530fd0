"""Every way an adapter can be wrong is a LoraError (a 400) that names the problem: a missing
path, a directory that is not PEFT, a rank over the limit, a module the model lacks, an adapter
made for another base model (shapes). Hand-written adapters: the broken cases `peft` never writes."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engine.lora_adapters import q_proj_tensors, write_adapter
from tests.engine.tiny_models import cached_tiny
from tokenpath.engine.lora import LoraError, base_model_config, check_adapter, read_adapter


@pytest.fixture(scope="module")
def cfg():
    config = base_model_config(str(cached_tiny("llama")))
    assert config is not None and config.hidden_size == 64
    return config


def _refused(path, cfg, code: str, match: str, max_rank: int = 64) -> None:
    with pytest.raises(LoraError, match=match) as info:
        check_adapter(path, cfg, max_rank)
    assert info.value.code == code and info.value.status_code == 400 and info.value.param == "lora_path"


def test_good_adapter_reads(tmp_path, cfg):
    w = read_adapter("x", write_adapter(tmp_path / "ok", q_proj_tensors(4, 64, 64, layer=1)), cfg, 64)
    assert w.rank == 4 and w.scaling == 2.0 and set(w.layers[1]) == {"q_proj"} and not w.layers[0]


def test_missing_path(tmp_path, cfg):
    _refused(tmp_path / "nowhere", cfg, "lora_path_not_found", "does not exist")


def test_not_peft(tmp_path, cfg):
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(empty, cfg, "lora_not_peft", "adapter_config.json is missing")
    _refused(cached_tiny("llama"), cfg, "lora_not_peft", "adapter_config.json is missing")  # a model, not an adapter
    prefix = write_adapter(tmp_path / "prefix", q_proj_tensors(4, 64, 64), {"peft_type": "PREFIX_TUNING"})
    _refused(prefix, cfg, "lora_not_peft", "not 'LORA'")
    garbled = write_adapter(tmp_path / "garbled", q_proj_tensors(4, 64, 64))
    (garbled / "adapter_config.json").write_text("{not json")
    _refused(garbled, cfg, "lora_not_peft", "not valid JSON")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _refused(a_file, cfg, "lora_not_peft", "not a directory")


def test_rank_over_the_limit(tmp_path, cfg):
    big = write_adapter(tmp_path / "big", q_proj_tensors(16, 64, 64), {"r": 16})
    _refused(big, cfg, "lora_rank_too_large", "rank 16, over this server's --max-lora-rank 8", max_rank=8)


def test_modules_the_model_lacks(tmp_path, cfg):
    gpt2 = write_adapter(tmp_path / "gpt2", {"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight":
                                             torch.randn(4, 64)}, {"target_modules": ["c_attn"]})
    _refused(gpt2, cfg, "lora_unsupported_modules", "c_attn")
    head = write_adapter(tmp_path / "head", {**q_proj_tensors(4, 64, 64),
                                             "base_model.model.lm_head.lora_A.weight": torch.randn(4, 64)},
                         {"target_modules": ["q_proj"]})
    _refused(head, cfg, "lora_unsupported_modules", "lm_head")
    saved = write_adapter(tmp_path / "saved", q_proj_tensors(4, 64, 64), {"modules_to_save": ["lm_head"]})
    with pytest.raises(LoraError, match="modules_to_save"):
        check_adapter(saved, cfg, 64)


def test_adapter_of_another_base(tmp_path, cfg):
    wide = write_adapter(tmp_path / "wide", q_proj_tensors(4, 128, 128))  # a hidden size of 128
    _refused(wide, cfg, "lora_base_mismatch", "another base model")
    deep = write_adapter(tmp_path / "deep", q_proj_tensors(4, 64, 64, layer=30))
    _refused(deep, cfg, "lora_base_mismatch", "layer 30")
    half = write_adapter(tmp_path / "half", {k: v for k, v in q_proj_tensors(4, 64, 64).items() if "lora_A" in k})
    _refused(half, cfg, "lora_not_peft", "lora_A only")


def test_structural_checks_without_a_model_config(tmp_path):
    """A gateway that cannot read the base model (a URL replica) still refuses what it can."""
    _refused(tmp_path / "nowhere", None, "lora_path_not_found", "does not exist")
    big = write_adapter(tmp_path / "big", q_proj_tensors(16, 64, 64), {"r": 16})
    _refused(big, None, "lora_rank_too_large", "max-lora-rank", max_rank=8)
    ok = write_adapter(tmp_path / "ok", q_proj_tensors(4, 128, 128))
    check_adapter(ok, None, 64)  # (shapes are the engine's to check)
    assert json.loads((ok / "adapter_config.json").read_text())["r"] == 4
