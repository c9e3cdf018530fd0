"""Tiny random-weight checkpoints saved as safetensors by the tests, to exercise the HF loader."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenpath.engine.loader import resolve_model_path


def save_tiny(kind: str, path: Path, tie: bool = True, seed: int = 0, **config: int) -> Path:
    """A 2-layer Llama or Qwen2 with SmolLM2's tokenizer (so prompts and chat templates work);
    `config` overrides entries of the model config (e.g. head_dim, num_attention_heads)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    src = resolve_model_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rope_theta=10000.0, tie_word_embeddings=tie, initializer_range=0.2,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    common.update(config)
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random q/k/v biases so the bias path matters
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return path
