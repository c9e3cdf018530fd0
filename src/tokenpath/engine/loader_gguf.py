"""GGUF checkpoints: hyperparameters from the metadata, tensors under our names.

Per architecture, what llama.cpp's converter changed is undone here, so every later stage sees the
Hugging Face form: llama's Q/K rows are un-permuted (rotate-half order), Gemma's norms (stored as
1 + w) get 1 subtracted, and the values llama.cpp hard-codes rather than stores (Gemma 3's sliding
pattern and local rope base) are filled in from the same constants. Anything this module does not
know how to read (an architecture, a rope type, a tensor type gguf-py cannot dequantize) is
refused here with one line naming it, never loaded and then computed wrong. The file is read by
`gguf_file` (metadata parsed lazily, tensors as views of the mapping), not gguf-py's reader.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokenpath.engine.ggml_types import GGMLType
from tokenpath.engine.gguf_file import GGUFFile
from tokenpath.engine.model_config import ModelConfig, RopeScaling
from tokenpath.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe")
GEMMA3_SWA_PATTERN = 6  # llama.cpp: layers i % 6 < 5 are windowed, every 6th is global
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp: rope_freq_base_train_swa for gemma3

_LAYER_NAMES = {
    "q_proj.weight": "attn_q.weight", "k_proj.weight": "attn_k.weight", "v_proj.weight": "attn_v.weight",
    "o_proj.weight": "attn_output.weight", "input_norm.weight": "attn_norm.weight",
    "post_norm.weight": "ffn_norm.weight", "gate_proj.weight": "ffn_gate.weight",
    "up_proj.weight": "ffn_up.weight", "down_proj.weight": "ffn_down.weight",
}
_QK_NORM_NAMES = {"q_norm.weight": "attn_q_norm.weight", "k_norm.weight": "attn_k_norm.weight"}
# A sparse layer's router and experts. llama.cpp's converter stacks each expert matrix into one 3D
# tensor [experts, rows, cols] (numpy order): our names for the stacked forms, which the torch
# MoEBlock copies in whole.
_MOE_NAMES = {"router.weight": "ffn_gate_inp.weight", "experts.gate_proj.weight": "ffn_gate_exps.weight",
              "experts.up_proj.weight": "ffn_up_exps.weight", "experts.down_proj.weight": "ffn_down_exps.weight"}
_DENSE_MLP = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
# The types read without gguf-py: the floats, and the blocks the native kernels read (gguf-py
# dequantizes each of these too, for the torch path, importing it then).
_READ_HERE = frozenset((GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
                        GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K))
_SANDWICH_NAMES = {"attn_out_norm.weight": "post_attention_norm.weight", "ffn_out_norm.weight": "post_ffw_norm.weight"}


def _field(reader, key: str, path: Path, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ModelLoadError(f"{path}: GGUF metadata has no '{key}'")
    return field.contents()


def _dequantize(data: np.ndarray, ggml_type: int) -> np.ndarray:
    """gguf-py's `dequantize`, its float types done here: a file's norms (F32) are read at every
    load, and importing gguf-py for them costs ~5 MiB of RSS (engine/ggml_types.py)."""
    if ggml_type == GGMLType.F32:
        return data.view(np.float32)
    if ggml_type == GGMLType.F16:
        return data.view(np.float16).astype(np.float32)
    if ggml_type == GGMLType.BF16:
        return (data.view(np.int16).astype(np.int32) << 16).view(np.float32)
    from gguf.quants import dequantize

    return dequantize(data, ggml_type)  # (an int: gguf-py's enum is an IntEnum, its tables take ours)


def _rope_scaling(reader, arch: str, tensors: dict, path: Path) -> RopeScaling | None:
    """GGUF `rope.scaling.*` keys, and llama.cpp's form of llama3 scaling: `rope_freqs.weight`."""
    kind = _field(reader, f"{arch}.rope.scaling.type", path, "none")
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", path, 1.0))
    # llama.cpp's default for yarn's original context: the context the model was trained with.
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length", path, 0) or \
        _field(reader, f"{arch}.context_length", path)
    freqs = None
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        freqs = tuple(float(x) for x in _dequantize(t.data, t.tensor_type).reshape(-1))
    if kind in ("none", "") or (kind == "linear" and factor == 1.0):
        return RopeScaling(freq_factors=freqs) if freqs else None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=factor, freq_factors=freqs)
    if kind == "yarn" and freqs is None:
        return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=int(orig))
    raise ModelLoadError(f"{path}: unsupported rope scaling '{kind}'" + (" with rope_freqs" if freqs else ""))


def _moe_fields(reader, arch: str, n_layers: int, tensors: dict, path: Path) -> dict:
    """Mixture-of-experts fields from `{arch}.expert_count` / `expert_used_count` /
    `expert_feed_forward_length` (Mixtral: llama with experts). A layer is sparse when it has a
    router (`ffn_gate_inp`). Top-k weights are renormalized, as llama.cpp's qwen3moe and llama
    graphs always do (its norm_w argument is hard-coded true for both)."""
    n = int(_field(reader, f"{arch}.expert_count", path, 0))
    if n == 0:
        if arch == "qwen3moe":
            raise ModelLoadError(f"{path}: qwen3moe GGUF without '{arch}.expert_count'")
        return {}
    k = int(_field(reader, f"{arch}.expert_used_count", path))
    if not 0 < k <= n:
        raise ModelLoadError(f"{path}: '{arch}.expert_used_count' is {k}, expected 1..{n} ('{arch}.expert_count')")
    ff = int(_field(reader, f"{arch}.expert_feed_forward_length", path, 0)) or \
        int(_field(reader, f"{arch}.feed_forward_length", path))
    layers = tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors)
    return dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=ff, norm_topk_prob=True,
                moe_layers=layers)


def read_gguf(path: Path) -> tuple[ModelConfig, GGUFTensors]:
    try:
        reader = GGUFFile(path)
    except (OSError, ValueError) as exc:  # truncated or not a GGUF file at all (GGUFFormatError)
        raise ModelLoadError(f"{path}: cannot read GGUF ({type(exc).__name__}: {exc})") from exc
    arch = _field(reader, "general.architecture", path)
    if arch == "gpt-oss":  # named apart: its experts' type is what the loader lacks, not the name
        experts = next((t for t in reader.tensors if "_exps." in t.name), None)
        held = f"{experts.name} is {experts.tensor_type.name}" if experts is not None else "no expert tensors found"
        raise ModelLoadError(f"{path}: gpt-oss GGUF is not supported yet ({held}): neither its experts (MXFP4 in "
                             "the released files) nor its sinks, biases and clamped SwiGLU are read from GGUF; a bf16 "
                             "or float32 gpt-oss safetensors checkpoint runs on the torch path")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{path}: unsupported architecture '{arch}' (supported: {', '.join(GGUF_ARCHS)})")
    n_heads = int(_field(reader, f"{arch}.attention.head_count", path))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", path, n_heads))
    hidden = int(_field(reader, f"{arch}.embedding_length", path))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", path, hidden // n_heads))
    if int(_field(reader, f"{arch}.attention.value_length", path, head_dim)) != head_dim:
        raise ModelLoadError(f"{path}: attention.value_length != key_length is not supported")
    n_layers = int(_field(reader, f"{arch}.block_count", path))
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # its length, without decoding 262k strings
    vocab = int(_field(reader, f"{arch}.vocab_size", path, tokens.count if tokens is not None else None))
    window = _field(reader, f"{arch}.attention.sliding_window", path, 0) or None
    extra: dict = {}
    if arch == "gemma3":
        if window is None:
            raise ModelLoadError(f"{path}: gemma3 GGUF without 'gemma3.attention.sliding_window'")
        # llama.cpp's gemma3: 1/sqrt(head_dim), except the 27B (62 layers): 1/sqrt(hidden/heads).
        scalar = hidden // n_heads if n_layers == 62 else head_dim
        extra = dict(
            layer_windows=tuple(int(window) if i % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1 else None
                                for i in range(n_layers)),
            rope_local_theta=GEMMA3_LOCAL_ROPE_BASE, qk_norm=True, sandwich_norms=True,
            hidden_act="gelu_tanh", embed_scale=float(hidden) ** 0.5, attn_scale=float(scalar) ** -0.5,
            norm_offset=1.0)
    elif window is not None:
        extra = dict(layer_windows=(int(window),) * n_layers)
    if arch in ("qwen3", "qwen3moe"):
        extra["qk_norm"] = True
    extra.update(_moe_fields(reader, arch, n_layers, tensors, path))
    config = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", path,
                                     extra.get("moe_intermediate_size"))),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", path, 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", path)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_rope_scaling(reader, arch, tensors, path),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", path, arch not in
                                  ("qwen2", "qwen3", "qwen3moe"))),
        **extra,
    )
    return config, GGUFTensors(path, tensors, config, reader)


@dataclass(frozen=True)
class RawTensor:
    """One GGUF tensor as stored: `data` is [rows, bytes per row] of blocks for quantized types,
    [rows, cols] of values for float types; `ggml_type` is gguf's GGMLQuantizationType number."""

    ggml_type: int
    data: np.ndarray
    rows: int
    cols: int


def _reverse_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved for its rope; undo it to the HF (rotate-half) layout."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensors:
    """The GGUF's tensors under our names, rows already in the Hugging Face (rotate-half) order.
    The native kernels read the quantized blocks as they are; the torch path dequantizes."""

    def __init__(self, path: Path, tensors: dict, config: ModelConfig, file: GGUFFile | None = None) -> None:
        self.path, self.config = path, config
        self._tensors = tensors
        self._file = file
        self.names: dict[str, str] = {"embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
        if not config.tie_word_embeddings:
            self.names["lm_head.weight"] = "output.weight"
        layer_names = dict(_LAYER_NAMES)
        if config.qk_norm:
            layer_names.update(_QK_NORM_NAMES)
        if config.sandwich_norms:
            layer_names.update(_SANDWICH_NAMES)
        for i in range(config.num_layers):
            moe = config.is_moe_layer(i)
            for ours, theirs in (layer_names | (_MOE_NAMES if moe else {})).items():
                if not (moe and ours in _DENSE_MLP):
                    self.names[f"layers.{i}.{ours}"] = f"blk.{i}.{theirs}"
            if config.attention_bias:
                for p in "qkv":
                    self.names[f"layers.{i}.{p}_proj.bias"] = f"blk.{i}.attn_{p}.bias"
        missing = [t for t in self.names.values() if t not in tensors]
        if missing:
            raise ModelLoadError(f"{path}: tensor '{missing[0]}' is missing")
        # The kernels' own types and the float ones are read without gguf-py; any other is
        # dequantized by it, which is imported (~5 MiB) only for a file that has one.
        odd = [theirs for theirs in self.names.values() if tensors[theirs].tensor_type not in _READ_HERE]
        if odd:
            from gguf.quants import _type_traits  # the types gguf-py can dequantize

            for theirs in odd:
                t = tensors[theirs]
                if t.tensor_type not in _type_traits:
                    raise ModelLoadError(f"{path}: tensor '{theirs}' has unsupported type {t.tensor_type.name}")
        self._check_experts()

    def _check_experts(self) -> None:
        """Each sparse layer's router and stacked experts have the metadata's expert count and
        feed-forward length (shapes in GGUF's order, fastest dimension first, as gguf-dump prints)."""
        c = self.config
        e, h, ff = c.num_experts, c.hidden_size, c.moe_intermediate_size
        want = {"router.weight": [h, e], "experts.gate_proj.weight": [h, ff, e],
                "experts.up_proj.weight": [h, ff, e], "experts.down_proj.weight": [ff, h, e]}
        for i in c.moe_layers:
            for ours, shape in want.items():
                theirs = self.names[f"layers.{i}.{ours}"]
                got = [int(d) for d in self._tensors[theirs].shape]
                if got != shape:
                    raise ModelLoadError(
                        f"{self.path}: tensor '{theirs}' has shape {got}, expected {shape} ({e} experts from "
                        f"'{c.architecture}.expert_count', expert feed-forward length {ff}, hidden {h})")

    def raw(self, name: str) -> RawTensor:
        t = self._tensors[self.names[name]]
        data = np.asarray(t.data)
        cols = int(t.shape[0])  # gguf lists dims fastest first
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        data = data.reshape(rows, -1)
        heads = self._rope_heads(name)
        if heads:  # whole rows move, so quantized blocks (laid out along a row) move intact
            data = _reverse_rope_permute(data, heads)
        return RawTensor(ggml_type=int(t.tensor_type), data=data, rows=rows, cols=cols)

    def release_view(self, view: np.ndarray) -> None:
        """Drop the pages under `view` from this process's RSS, if it is a view of the mapping."""
        if self._file is not None:
            self._file.release_view(view)

    def release_all(self) -> None:
        """Drop the whole mapping's pages from this process's RSS (see `GGUFFile.release_all`)."""
        if self._file is not None:
            self._file.release_all()

    def dequantized(self, name: str) -> np.ndarray:
        """float32 in the HF form: Gemma's norms back to w (the file holds 1 + w)."""
        t = self._tensors[self.names[name]]
        w: np.ndarray = _dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        heads = self._rope_heads(name)
        if heads:
            w = _reverse_rope_permute(w, heads)
        if self.config.norm_offset and name.endswith("norm.weight"):
            w = w - np.float32(self.config.norm_offset)
        return w

    def dequantized_rows(self, name: str, chunk_rows: int = 1024) -> Iterator[np.ndarray]:
        """`dequantized(name)` as float32 row blocks of at most `chunk_rows` rows, in order: a
        matrix requantized at load never exists whole in float32 (4 bytes a weight: 640 MiB for a
        262k x 640 embedding). Llama's Q/K (rows permuted across each head) come whole."""
        t = self._tensors[self.names[name]]
        data = np.asarray(t.data)
        if self._rope_heads(name) or data.ndim < 2 or (self.config.norm_offset and name.endswith("norm.weight")):
            yield self.dequantized(name)
            return
        rows = data.reshape(-1, data.shape[-1])
        for lo in range(0, rows.shape[0], chunk_rows):
            yield _dequantize(rows[lo:lo + chunk_rows], t.tensor_type).astype(np.float32, copy=False)

    def _rope_heads(self, name: str) -> int:
        """llama's converter permutes Q/K rows (the others do not): the head count to undo it with."""
        if self.config.architecture != "llama":
            return 0
        if name.endswith("q_proj.weight"):
            return self.config.num_heads
        if name.endswith("k_proj.weight"):
            return self.config.num_kv_heads
        return 0


class GGUFWeights(Mapping):
    """float32 weights dequantized on first access: the native path never asks for them, so a
    quantized model never holds a float32 copy (540 MB for SmolLM2-135M)."""

    def __init__(self, tensors: GGUFTensors) -> None:
        self._t = tensors

    def __getitem__(self, name: str) -> torch.Tensor:  # (the torch path's view: torch imported here)
        if name not in self._t.names:
            raise KeyError(name)
        import torch

        return torch.from_numpy(np.array(self._t.dequantized(name), dtype=np.float32))

    def __iter__(self) -> Iterator[str]:
        return iter(self._t.names)

    def __len__(self) -> int:
        return len(self._t.names)
