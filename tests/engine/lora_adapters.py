"""LoRA adapters for the tests: real PEFT adapters made by `peft` on the tiny checkpoints (random,
non-zero A and B, so every target changes the output), and hand-written broken ones.

Nothing is downloaded. `peft_reference` is what transformers + peft generate greedily: the
reference the engine's adapters are compared with.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: Path, out: Path, r: int = 8, alpha: int = 16, seed: int = 0,
                      targets: list[str] | None = None, std: float = 0.15, rslora: bool = False) -> Path:
    """A PEFT LoRA adapter of the HF checkpoint at `base_dir`, saved at `out` (the PEFT format:
    adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (out / "adapter_model.safetensors").is_file():
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets or ALL_TARGETS), lora_dropout=0.0,
                         init_lora_weights=False, use_rslora=rslora, task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(str(out))
    return out


def peft_reference(base_dir: Path, adapter: Path | None, prompts: list[list[int]], max_new_tokens: int,
                   eos: int | None) -> list[list[int]]:
    """transformers (+ peft when `adapter` is given), float32, greedy, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    from tests.engine.conftest import hf_greedy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter)).eval()
    return hf_greedy(model, prompts, max_new_tokens, eos)


def write_adapter(out: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A hand-made adapter directory (for the broken cases `peft` would never write)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    cfg.update(config or {})
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    return out


def q_proj_tensors(r: int, hidden: int, out: int, layer: int = 0) -> dict[str, torch.Tensor]:
    """PEFT's names for one q_proj adapter of shape A [r, hidden], B [out, r]."""
    pre = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return {f"{pre}.lora_A.weight": torch.randn(r, hidden), f"{pre}.lora_B.weight": torch.randn(out, r)}


def random_adapter(out: Path, model, r: int = 16, alpha: int = 16, std: float = 0.02, seed: int = 0) -> Path:
    """A PEFT adapter on every target of every layer of `model` (a ModelConfig), A and B normal with
    `std`, written by hand: for a base that exists only as a GGUF (SmolLM2), which `peft` cannot
    load. A small `std` keeps the base model's behaviour (it still copies text) while changing
    some of its greedy tokens."""
    from tokenpath.engine.lora import target_shapes

    if (out / "adapter_model.safetensors").is_file():
        return out
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for target, (n_in, n_out) in target_shapes(model).items():
            part = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            pre = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(r, n_in, generator=g) * std
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n_out, r, generator=g) * std
    return write_adapter(out, tensors, {"r": r, "lora_alpha": alpha, "target_modules": ALL_TARGETS})
