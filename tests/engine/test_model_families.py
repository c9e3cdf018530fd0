"""Every supported family, from tiny random checkpoints made by transformers (nothing downloaded):
greedy tokens equal transformers float32 on >= 95% of positions, from the HF directory and from
the GGUF form, across chunked prefill, batching and prefix-cache hits; and what is not supported
is refused at load, naming it.

The windowed families (Mistral, Gemma 3) have windows of 8 positions and prompts up to 90
tokens, so a window that is ignored or off by one changes the tokens (6 of 64 right when it is).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import warnings

import pytest
import torch

from tests.engine.conftest import hf_greedy, make_prompts
from tests.engine.tiny_models import cached_json, cached_tiny, save_gguf
from tokenpath import LLM, SamplingParams
from tokenpath.engine.loader import load_model
from tokenpath.errors import ModelLoadError

LENGTHS = [5, 17, 40, 90]
NEW = 16


@pytest.fixture(scope="module")
def tiny():
    """kind -> HF directory (cached in the data dir: tiny_models.cached_tiny)."""
    return cached_tiny


def agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    total = sum(len(r) for r in ref)
    return sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=False)) / total


def check_engine(llm: LLM, load_hf, ref_file) -> None:
    prompts = make_prompts(llm.tokenizer, LENGTHS, seed=3)
    key = hashlib.sha256(json.dumps([prompts, NEW]).encode()).hexdigest()[:12]
    ref = cached_json(ref_file.with_name(f"{ref_file.name}-{key}.json"),
                      lambda: hf_greedy(load_hf().eval(), prompts, NEW, llm.tokenizer.eos_token_id))
    p = SamplingParams(temperature=0, max_tokens=NEW)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]  # 32-token chunks
    assert agreement(ref, batched) >= 0.95, (ref, batched)
    hits = llm.engine.blocks.prefix_hits
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]  # from cached prefixes
    assert llm.engine.blocks.prefix_hits > hits
    assert again == batched


def engine(path) -> LLM:
    return LLM(str(path), dtype="float32", quantization="none", num_kv_blocks=64, max_num_batched_tokens=32,
               max_num_seqs=8)


@pytest.mark.parametrize("kind", ["llama3", "llama-yarn", "mistral", "qwen3", "gemma3", "gemma3-scalar"])
def test_hf_dir_matches_transformers(tiny, kind):
    from transformers import AutoModelForCausalLM

    hf_dir = tiny(kind)
    check_engine(engine(hf_dir), lambda: AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32),
                 hf_dir.parent / "ref-hf")


# The reference: transformers' GGUF loader where it reads what the file says; the HF directory
# where it does not (it ignores rope_freqs, and Qwen3's attention.key_length).
@pytest.mark.parametrize("kind,reference", [("llama", "gguf"), ("llama3", "hf"), ("qwen3", "hf"),
                                            ("gemma3", "gguf")])
def test_gguf_matches_transformers(tiny, kind, reference):
    from transformers import AutoModelForCausalLM

    hf_dir = tiny(kind)
    gguf = save_gguf(kind, hf_dir, hf_dir.parent / "model.gguf")

    def load_hf():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if reference == "gguf":
                return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                            dtype=torch.float32)
            return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)

    check_engine(engine(gguf), load_hf, hf_dir.parent / f"ref-{reference}")


def test_native_runs_gemma3_and_refuses_what_it_does_not_compute(tiny, caplog):
    """A GGUF Gemma 3 goes to the native kernels by default (they compute its windows, QK-norm,
    sandwich norms and GeGLU: tests/engine/test_native_families.py holds them to the torch path);
    a feature they lack would be refused in one line, the model then on torch (never natively
    and wrong)."""
    import dataclasses

    from tokenpath.engine.kernels.model import native_unsupported

    hf_dir = tiny("gemma3")
    gguf = save_gguf("gemma3", hf_dir, hf_dir.parent / "model.gguf")
    with caplog.at_level(logging.INFO, logger="tokenpath.engine"):
        llm = LLM(str(gguf), dtype="float32", num_kv_blocks=16)
    assert llm.engine.runner.native is not None
    assert not any("native kernels do not compute" in r.message for r in caplog.records)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    cfg = llm.engine.runner.model_config
    assert native_unsupported(cfg) == []
    assert native_unsupported(dataclasses.replace(cfg, hidden_act="relu")) == ["activation relu"]


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change,named", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, "longrope"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "mscale": 0.7, "rope_theta": 1e4}}, "mscale"),
    ({"hidden_act": "relu"}, "relu"),
])
def test_unsupported_config_refused(tiny, tmp_path, change, named):
    with pytest.raises(ModelLoadError, match=named):
        load_model(str(_edit_config(tiny("llama"), tmp_path / "m", **change)))


def test_qwen_sliding_window_refused(tiny, tmp_path):
    d = _edit_config(tiny("qwen3"), tmp_path / "m", use_sliding_window=True, sliding_window=8)
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        load_model(str(d))


def test_unsupported_gguf_architecture(tiny, tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'phi3'"):
        load_model(str(tmp_path / "x.gguf"))
