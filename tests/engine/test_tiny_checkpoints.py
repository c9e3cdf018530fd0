"""The safetensors loader on tiny random Llama and Qwen2 checkpoints: greedy outputs equal HF's
across batching modes, and broken directories fail with the file and the problem named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.engine.conftest import hf_greedy, make_prompts
from tests.engine.tiny_models import save_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.engine.loader import load_model
from tokenpath.errors import ModelLoadError


@pytest.fixture(scope="module", params=["qwen2", "llama-untied"])
def tiny_dir(request, tmp_path_factory):
    kind, tie = (request.param, True) if request.param == "qwen2" else ("llama", False)
    return save_tiny(kind, tmp_path_factory.mktemp(request.param), tie=tie)


def test_tiny_greedy_matches_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    # 10 sequences: two decode groups (8 + 2); 40 blocks and 48-token chunks force preemption.
    # The torch path: transformers' own arithmetic, so the tokens are equal at every near-tie of
    # these random weights (under auto a float32 checkpoint runs on the native F32X16 kernels, whose
    # sums in another order flip such a tie: tests/engine/test_native_safetensors.py holds them to
    # torch float32's logits).
    llm = LLM(str(tiny_dir), dtype="float32", quantization="none", num_kv_blocks=40, max_num_batched_tokens=48,
              max_num_seqs=10)
    prompts = make_prompts(llm.tokenizer, [5, 17, 40, 90, 150, 210, 8, 33, 61, 120], seed=3)
    eos = llm.tokenizer.eos_token_id
    ref = hf_greedy(hf, prompts, 24, eos)
    p = SamplingParams(temperature=0, max_tokens=24)
    one_by_one = [llm.generate([x], p)[0].outputs[0].token_ids for x in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]  # chunked, preempting
    assert one_by_one == ref
    assert batched == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_unknown_architecture(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(str(d))


def test_truncated_safetensors(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(d))


def test_truncated_gguf(tmp_path):
    from tokenpath.engine.loader import resolve_model_path

    src = resolve_model_path("smollm2-135m-instruct")
    bad = tmp_path / "broken.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model(str(bad))


def test_unknown_name():
    with pytest.raises(ModelLoadError, match="known model"):
        load_model("no-such-model-anywhere")


def test_a_header_that_lies_about_a_tensor_is_refused_at_load(tiny_dir, tmp_path):
    """Offsets that disagree with the tensor's shape: refused when the file is opened (the
    tensors are read lazily later, so the check must not wait for the read)."""
    import struct

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [2 * header[name]["shape"][0], *header[name]["shape"][1:]]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(d))


def test_a_dtype_neither_path_computes_is_refused_naming_the_tensor(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"{name} is F8_E4M3"):
        load_model(str(d))


def test_a_quantized_checkpoint_is_refused_not_run_without_its_scales(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantization_config 'fp8'"):
        load_model(str(d))
