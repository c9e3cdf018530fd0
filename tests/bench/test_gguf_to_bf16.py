"""benchmarks/gguf_to_bf16.py: a Qwen3 GGUF back as the bf16 HF checkpoint vLLM is given (issue 42).

A tiny Qwen3 (tied embedding, QK-norm) is written as a float32 GGUF by the suite's writer, then
converted: transformers must load the result as the same model, weights equal to the original's
rounded to bf16 and logits equal to the original's run in bf16, which checks the names, the
matrices' orientation, the tie and config.json together. A tensor outside the dense layout (an
expert) is refused by name rather than dropped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.gguf_to_bf16 import convert, hf_name  # noqa: E402
from tests.engine.tiny_models import cached_tiny, save_gguf  # noqa: E402


def test_converted_checkpoint_is_the_model_in_bf16(tmp_path: Path) -> None:
    import transformers

    hf = cached_tiny("qwen3")
    gguf = save_gguf("qwen3", hf, tmp_path / "tiny.f32.gguf")
    out = convert(gguf, tmp_path / "bf16", shard_bytes=64 * 1024)  # several shards, and their index
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16).eval()
    got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    assert got.config.tie_word_embeddings and got.config.num_hidden_layers == ref.config.num_hidden_layers
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert ref_sd.keys() == got_sd.keys()
    for name, w in ref_sd.items():
        assert torch.equal(w, got_sd[name]), name
    ids = torch.tensor([[1, 400, 5000, 77, 12000, 9]])
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, got(ids).logits)
    assert (out / "tokenizer.json").is_file()


def test_expert_tensors_are_refused() -> None:
    assert hf_name("blk.2.attn_q_norm.weight") == "model.layers.2.self_attn.q_norm.weight"
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        hf_name("blk.0.ffn_gate_exps.weight")
