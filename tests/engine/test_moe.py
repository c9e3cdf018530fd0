"""Mixtures of experts (Qwen3-MoE, Mixtral) on the torch path, against transformers in float32.

Tiny random checkpoints made by transformers (tests/engine/tiny_models.py: 8 experts, top-2; a
Qwen3-MoE with a dense layer between sparse ones, one without renormalized top-k weights, and a
Mixtral). Greedy tokens equal `model.generate`'s, logits equal transformers' to 1e-5, routing ties
go where torch.topk sends them (transformers' choice), and a checkpoint whose experts disagree with
its config is refused at load naming the tensor. The same checkpoints as GGUF files (experts
stacked as llama.cpp's converter writes them) give the same tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.conftest import hf_greedy, make_prompts
from tests.engine.test_quantized_quality import all_logits, runner
from tests.engine.tiny_models import cached_tiny, save_gguf, save_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.engine.kernels.model import native_unsupported
from tokenpath.engine.loader import load_model
from tokenpath.engine.lora import LoraError, check_adapter
from tokenpath.errors import ModelLoadError

KINDS = ["qwen3moe", "qwen3moe-unnorm", "mixtral"]


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(kind):
    """Batched, chunked prefill mixed with decode (tokens of many sequences routed in one step) and
    one prompt at a time: the same greedy tokens as transformers' generate."""
    path = cached_tiny(kind)
    llm = LLM(str(path), dtype="float32", quantization="none", max_num_batched_tokens=48, max_num_seqs=8)
    assert llm.engine.runner.native is None  # torch's own (under auto a float32 checkpoint runs natively)
    prompts = make_prompts(llm.tokenizer, [5, 17, 40, 90, 8, 61], seed=3)
    ref = hf_greedy(_hf(path), prompts, 16, None)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == ref
    assert llm.generate([prompts[2]], p)[0].outputs[0].token_ids == ref[2]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind):
    path = cached_tiny(kind)
    loaded = load_model(str(path))
    cfg = loaded.config
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.moe_layers == ((0, 2) if kind == "qwen3moe" else tuple(range(cfg.num_layers)))
    assert native_unsupported(cfg) == []  # the native kernels run experts too (test_moe_native.py)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 40).tolist()
    ours = all_logits(runner(loaded, "none"), ids)
    ref = _hf_logits(_hf(path), ids)
    assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def tied_checkpoint(path: Path, experts: int = 8, top_k: int = 1) -> Path:
    """A float32 Qwen3-MoE whose router logits all tie with others. 8 experts top-1: experts 3 and
    5 have the same router row and the others a zero one, so each token's best logit is shared by
    3 and 5 (or by the six zero experts). More experts: expert e's router row is one of three
    random rows, or zero, by e % 4, so each value is shared by a quarter of the experts and top-k
    picks among many equals. The experts' own weights differ, so a tie broken differently from
    torch.topk (transformers' choice) changes the logits."""
    from safetensors.torch import load_file, save_file

    path = save_tiny("qwen3moe-unnorm", path, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32)
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    for i in range(2):
        router = tensors[f"model.layers.{i}.mlp.gate.weight"]
        router.zero_()
        rows = torch.randn(3, router.shape[1], generator=torch.Generator().manual_seed(i))
        if experts == 8:
            router[3], router[5] = rows[0], rows[0]
        else:
            for e in range(experts):
                if e % 4:
                    router[e] = rows[e % 4 - 1]
    save_file(tensors, str(f), metadata={"format": "pt"})
    return path


def test_routing_ties_broken_as_transformers(tmp_path):
    """tied_checkpoint on the torch path (the native kernels: test_moe_native.py)."""
    path = tied_checkpoint(tmp_path / "tied")
    loaded = load_model(str(path))
    layer = runner(loaded, "none").model.layers[0]
    x = torch.randn(64, loaded.config.hidden_size, generator=torch.Generator().manual_seed(7))
    logits = x @ layer.moe.router.T
    assert torch.equal(logits[:, 3], logits[:, 5])  # the tie is exact
    _, chosen = layer.moe.route(x)
    assert torch.equal(chosen, torch.topk(torch.softmax(logits, -1), 1).indices)
    ids = np.random.default_rng(2).integers(3, loaded.config.vocab_size, 40).tolist()
    ours = all_logits(runner(loaded, "none"), ids)
    ref = _hf_logits(_hf(path), ids)
    assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


def _copy_with(tmp_path: Path, kind: str, config: dict | None = None, shapes: dict | None = None,
               drop: list[str] | tuple[str, ...] = ()) -> Path:
    """A copy of the tiny checkpoint with config.json entries replaced (or dropped), or tensors
    replaced by zeros of other shapes."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(cached_tiny(kind), d)
    if config or drop:
        cfg = json.loads((d / "config.json").read_text())
        cfg = {k: v for k, v in cfg.items() if k not in drop} | (config or {})
        (d / "config.json").write_text(json.dumps(cfg))
    if shapes:
        tensors = load_file(str(d / "model.safetensors"))
        for name, shape in shapes.items():
            tensors[name] = torch.zeros(shape)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize(("kind", "field"), [("qwen3moe", "num_experts"), ("qwen3moe", "num_local_experts"),
                                           ("mixtral", "num_local_experts")])
@pytest.mark.parametrize("count", [6, 16])
def test_expert_count_disagreeing_with_config(kind, field, count, tmp_path):
    """Both spellings: transformers 5 writes num_local_experts, older Qwen3-MoE configs num_experts."""
    d = _copy_with(tmp_path, kind, config={field: count}, drop=["num_local_experts"] if field == "num_experts" else [])
    gate = "mlp.gate" if kind == "qwen3moe" else "block_sparse_moe.gate"
    with pytest.raises(ModelLoadError, match=rf"model\.layers\.0\.{gate}\.weight has shape \[8, 64\], "
                                             rf"expected \[{count}, 64\]"):
        load_model(str(d))


def test_extra_expert_tensor_refused(tmp_path):
    """Right router, one expert too many in the file: named, not ignored."""
    name = "model.layers.2.mlp.experts.8.up_proj.weight"
    d = _copy_with(tmp_path, "qwen3moe", shapes={name: (32, 64)})
    with pytest.raises(ModelLoadError, match=rf"{name} is an expert past config.json's num_experts 8"):
        load_model(str(d))


@pytest.mark.parametrize(("kind", "name", "shape", "want"), [
    ("qwen3moe", "model.layers.2.mlp.experts.3.up_proj.weight", (31, 64), "[32, 64]"),
    ("qwen3moe", "model.layers.0.mlp.experts.7.down_proj.weight", (64, 64), "[64, 32]"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.5.w2.weight", (64, 64), "[64, 128]"),
])
def test_wrong_expert_shape_names_the_tensor(kind, name, shape, want, tmp_path):
    d = _copy_with(tmp_path, kind, shapes={name: shape})
    with pytest.raises(ModelLoadError, match=rf"{name} has shape \[{shape[0]}, {shape[1]}\], expected \{want[:-1]}\]"):
        load_model(str(d))


def test_missing_expert_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy_with(tmp_path, "mixtral")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing .*layers\.1\.experts\.2\.up_proj\.weight"):
        load_model(str(d))


def test_lora_refused_on_moe_models(tmp_path):
    """The torch path adds no LoRA deltas inside experts: an adapter is refused, never half-applied."""
    cfg = load_model(str(cached_tiny("mixtral"))).config
    with pytest.raises(LoraError, match="mixture of experts"):
        check_adapter(tmp_path, cfg, 16)


# ---------------------------------------------------------------- GGUF, as llama.cpp's converter stacks experts


@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_gguf_greedy_matches_transformers(kind):
    """The same checkpoint as a float32 GGUF (experts stacked into ffn_{gate,up,down}_exps, the
    router as ffn_gate_inp; Mixtral as llama with experts): transformers' greedy tokens, and the
    safetensors load's logits exactly."""
    hf_dir = cached_tiny(kind)
    gguf = save_gguf(kind, hf_dir, hf_dir.parent / "model.gguf")
    loaded = load_model(str(gguf))
    assert loaded.config.num_experts == 8 and loaded.config.moe_layers == load_model(str(hf_dir)).config.moe_layers
    ids = np.random.default_rng(0).integers(3, loaded.config.vocab_size, 40).tolist()
    assert torch.equal(all_logits(runner(loaded, "none"), ids), all_logits(runner(load_model(str(hf_dir)), "none"), ids))
    llm = LLM(str(gguf), dtype="float32", max_num_batched_tokens=48, quantization="none")  # torch's own path
    assert llm.engine.runner.native is None
    prompts = make_prompts(llm.tokenizer, [9, 40, 75], seed=5)
    ref = hf_greedy(_hf(hf_dir), prompts, 12, None)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == ref


@pytest.mark.parametrize(("config", "match"), [
    ({"num_local_experts": 6}, r"'blk\.0\.ffn_gate_inp\.weight' has shape \[64, 8\], expected \[64, 6\]"),
    ({"moe_intermediate_size": 48}, r"'blk\.0\.ffn_gate_exps\.weight' has shape \[64, 32, 8\], expected \[64, 48, 8\]"),
    ({"num_experts_per_tok": 9}, r"'qwen3moe\.expert_used_count' is 9, expected 1\.\.8"),
])
def test_gguf_experts_disagreeing_with_metadata(config, match, tmp_path):
    """A GGUF whose expert count, expert feed-forward length or top-k disagree with its tensors."""
    d = _copy_with(tmp_path, "qwen3moe", config=config)
    gguf = save_gguf("qwen3moe", d, tmp_path / "bad.gguf")
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(gguf))
