"""A BERT encoder (embeddings + N post-LayerNorm transformer layers) for sentence embeddings.

Written here rather than taken from `transformers` so that the serving path owns its model code
(weights come straight from safetensors) and so batching/padding are under our control: padded
positions are masked out of attention with a large negative bias and out of the mean pooling.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from tokenpath.errors import ModelLoadError


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        raw = json.loads(Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ModelLoadError(f"{path}: only hidden_act=gelu is supported, got {raw['hidden_act']!r}")
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: raw[k] for k in names if k in raw})


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertLayer(nn.Module):
    """Self-attention + FFN, each followed by residual + LayerNorm (BERT's post-norm order)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // cfg.num_attention_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(h, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias
        ctx = torch.softmax(scores, dim=-1) @ v
        ctx = ctx.transpose(1, 2).reshape(x.shape)
        x = self.attn_norm(x + self.attn_out(ctx))
        # Exact (erf) GELU, as BERT's "gelu" activation.
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


# Checkpoint names (HF BertModel layout) -> our module names, per layer.
_LAYER_KEYS = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "out_norm",
}


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states, shape (batch, seq, hidden). `attention_mask` is 1 for real tokens."""
        x = self.embeddings(input_ids, torch.zeros_like(input_ids))
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, bias)
        return x

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> BertModel:
        model_dir = Path(model_dir)
        cfg_path, weights_path = model_dir / "config.json", model_dir / "model.safetensors"
        for p in (cfg_path, weights_path):
            if not p.is_file():
                raise ModelLoadError(f"{p}: missing (need config.json and model.safetensors)")
        model = cls(BertConfig.from_file(cfg_path))
        state = _rename(load_file(str(weights_path)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing:
            raise ModelLoadError(f"{weights_path}: missing tensors {missing[:5]}")
        if unexpected:
            raise ModelLoadError(f"{weights_path}: unexpected tensors {unexpected[:5]}")
        return model.to(dtype).eval()


def _rename(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        name = name.removeprefix("bert.")
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue  # the pooler is unused by mean pooling; position ids are recomputed
        if name.startswith("encoder.layer."):
            _, _, idx, rest = name.split(".", 3)
            for src, dst in _LAYER_KEYS.items():
                if rest.startswith(src + "."):
                    name = f"layers.{idx}.{dst}.{rest[len(src) + 1:]}"
                    break
        out[name] = tensor
    return out


def mean_pool_normalize(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens (padding masked out), then L2-normalise: sentence-transformers' recipe."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(dim=1)
    pooled = summed / mask.sum(dim=1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=1)
