"""Hugging Face model directories: config.json -> ModelConfig, *.safetensors -> our weight names.

Both config spellings are read: transformers 5's `rope_parameters` (per layer type for Gemma 3)
and the older `rope_theta` + `rope_scaling`. Features this engine does not compute (a rope type,
Qwen's `use_sliding_window`, Gemma 2's logit soft-capping) are refused with the field named.
Weights keep the checkpoint's dtype: the model converts each one as it copies it in, so a bf16
checkpoint never exists as a second float32 copy beside the model's own parameters.
"""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenpath.engine.gpt_oss import check_gpt_oss_weights, gpt_oss_fields, gpt_oss_windows
from tokenpath.engine.model_config import ROPE_TYPES, ModelConfig, RopeScaling
from tokenpath.engine.moe_families import (
    GRANITE_RENAMES,
    granitemoe_fields,
    olmoe_fields,
    stacked_expert_shapes,
)
from tokenpath.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

    from tokenpath.engine.loader import LoadedModel

HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3moe",
            "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe", "GraniteMoeForCausalLM": "granitemoe",
            "GptOssForCausalLM": "gpt_oss"}
_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _rope(params: dict, cfg_file: Path, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope base, scaling) from one rope dict (transformers 5 `rope_parameters` or old `rope_scaling`)."""
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = float(params.get("rope_theta", 10000.0))
    if kind not in ROPE_TYPES or kind == "dynamic":
        raise ModelLoadError(f"{cfg_file}: unsupported rope type '{kind}' (supported: default, linear, llama3, yarn)")
    for key in ("partial_rotary_factor", "mscale", "mscale_all_dim"):
        if params.get(key) not in (None, 1.0):
            raise ModelLoadError(f"{cfg_file}: rope parameter '{key}' is not supported")
    if kind == "default":
        return theta, None
    orig = params.get("original_max_position_embeddings") or max_pos
    return theta, RopeScaling(
        rope_type=kind, factor=float(params.get("factor") or (max_pos / orig)),
        original_max_position_embeddings=int(orig),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))


def _moe_fields(cfg: dict, arch: str, n_layers: int, cfg_file: Path) -> dict:
    """The mixture-of-experts fields of ModelConfig: Qwen3-MoE's sparse layers are those not in
    `mlp_only_layers` whose (index + 1) is a multiple of `decoder_sparse_step`; Mixtral's are all,
    each with `intermediate_size` experts and renormalized top-k weights (OLMoE, Granite MoE:
    engine/moe_families.py; gpt-oss: engine/gpt_oss.py)."""
    if arch not in ("qwen3moe", "mixtral", "olmoe", "granitemoe", "gpt_oss"):
        return {}
    n = cfg.get("num_experts", cfg.get("num_local_experts"))
    k = cfg.get("num_experts_per_tok")
    if not isinstance(n, int) or not isinstance(k, int) or not 0 < k <= n:
        raise ModelLoadError(f"{cfg_file}: num_experts {n!r} / num_experts_per_tok {k!r}: expected 1 <= top-k <= experts")
    if arch == "mixtral":
        return dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=cfg["intermediate_size"],
                    norm_topk_prob=True, moe_layers=tuple(range(n_layers)))
    if arch == "gpt_oss":
        return gpt_oss_fields(cfg, n, k, n_layers)
    if arch == "olmoe":
        return olmoe_fields(cfg, n, k, n_layers, cfg_file)
    if arch == "granitemoe":
        return granitemoe_fields(cfg, n, k, n_layers)
    step, dense = int(cfg.get("decoder_sparse_step", 1) or 1), set(cfg.get("mlp_only_layers") or [])
    return dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0))


def read_hf_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{cfg_file}: missing (a model directory needs config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{cfg_file}: not valid JSON ({exc})") from exc
    archs = cfg.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None:
        raise ModelLoadError(f"{cfg_file}: unsupported architecture {archs or cfg.get('model_type')!r} "
                             f"(supported: {', '.join(HF_ARCHS)})")
    quant = cfg.get("quantization_config")
    if quant and arch == "gpt_oss":  # the released gpt-oss checkpoints: experts as MXFP4 blocks and scales
        raise ModelLoadError(f"{cfg_file}: quantization_config {quant.get('quant_method', quant)!r}: gpt-oss experts "
                             "stored as MXFP4 (*_blocks / *_scales tensors) are not read yet; a bf16 or float32 "
                             "gpt-oss checkpoint runs on the torch path")
    if quant:  # FP8/GPTQ/AWQ/bitsandbytes weights come with scales this loader would ignore: refuse
        raise ModelLoadError(f"{cfg_file}: quantization_config {quant.get('quant_method', quant)!r} is not supported "
                             "(bf16, fp16 and fp32 safetensors are; GGUF files for quantized weights)")
    for key in ("use_sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            raise ModelLoadError(f"{cfg_file}: '{key}' = {cfg[key]!r} is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in _ACTS:
        raise ModelLoadError(f"{cfg_file}: unsupported activation '{act}'")
    try:
        n_heads, hidden, n_layers = cfg["num_attention_heads"], cfg["hidden_size"], cfg["num_hidden_layers"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        rope = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}),
                                              "rope_theta": cfg.get("rope_theta", 10000.0)}
        extra: dict = {}
        window = cfg.get("sliding_window")
        if arch == "gemma3":
            local = rope.get("sliding_attention", {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)})
            glob = rope.get("full_attention", rope)
            theta, scaling = _rope(glob, cfg_file, max_pos)
            local_theta, local_scaling = _rope(local, cfg_file, max_pos)
            if local_scaling is not None:
                raise ModelLoadError(f"{cfg_file}: rope scaling on sliding layers is not supported")
            types = cfg.get("layer_types") or [
                "full_attention" if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
                for i in range(n_layers)]
            extra = dict(layer_windows=tuple(int(window) if t == "sliding_attention" else None for t in types),
                         rope_local_theta=local_theta, qk_norm=True, sandwich_norms=True,
                         embed_scale=float(hidden) ** 0.5, attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                         norm_offset=1.0)
        else:
            theta, scaling = _rope(rope, cfg_file, max_pos)
            if arch in ("mistral", "mixtral") and window:
                extra = dict(layer_windows=(int(window),) * n_layers)
            if arch == "gpt_oss":
                extra = dict(layer_windows=gpt_oss_windows(cfg, n_layers, cfg_file))
            extra["qk_norm"] = arch in ("qwen3", "qwen3moe")
            extra.update(_moe_fields(cfg, arch, n_layers, cfg_file))
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or hidden // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            hidden_act=_ACTS[act],
            **extra,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{cfg_file}: missing field {exc}") from exc


# HF module names -> ours. Gemma's post_attention_layernorm is a sandwich norm (the attention
# output's), while in Llama/Qwen it is the norm before the MLP (ours: post_norm).
_RENAMES = [("embed_tokens.", "embed."), ("self_attn.", ""), ("mlp.gate.", "router."),
            ("block_sparse_moe.gate.", "router."), ("block_sparse_moe.", ""), ("mlp.", ""), ("input_layernorm.", "input_norm."),
            ("pre_feedforward_layernorm.", "post_norm."), ("post_feedforward_layernorm.", "ffn_out_norm."),
            *GRANITE_RENAMES]


class HFWeights(Mapping):
    """The checkpoint's tensors under our names, read from the memory-mapped files on access.

    Two readers: `__getitem__` gives a torch tensor (the torch path copies each into its
    parameters), and `raw`/`dense`/`matrix_bytes` give numpy views of the map (the native path
    repacks or converts each, and never imports torch: torch alone is ~100 MiB of a serving
    process's RSS). Nothing is held but the maps, whose pages each reader drops once its tensor
    is copied (`release_view`), so at most one tensor beside the model is resident at a time (peak
    RSS near the file's size, never twice it). The torch reader opens its file anew per tensor: a
    held handle would keep the whole mapping's touched pages resident after load."""

    def __init__(self, index: dict[str, tuple[Path, str]], dtypes: dict[str, str],
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        self._index, self.dtypes = index, dtypes  # dtypes: our name -> safetensors dtype ("BF16", ...)
        self.shapes = shapes or {}  # our name -> shape, from the headers: checked without reading
        # the numpy readers' maps, per file: (the map, its bytes, where the data starts, the header)
        self._maps: dict[Path, tuple[mmap.mmap, np.ndarray, int, dict]] = {}

    def source(self, name: str) -> str:
        """The checkpoint's own name of one tensor, for messages."""
        return self._index[name][1]

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        f, key = self._index[name]
        try:
            with safe_open(str(f), framework="pt") as st:
                return st.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{f}: cannot read tensor {key} ({exc})") from exc

    def _bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes, a view of its file's memory map (opened once per file per load)."""
        f, key = self._index[name]
        if f not in self._maps:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[f] = (mm, np.frombuffer(mm, dtype=np.uint8), 8 + size, header)
        _, buf, start, header = self._maps[f]
        begin, end = header[key]["data_offsets"]  # checked against the file by safe_open at load
        return buf[start + begin:start + end]

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored type and shape, a view of the map: BF16 as its uint16 bit
        patterns (numpy has no bfloat16), F16 as float16, F32 as float32."""
        view: np.ndarray = self._bytes(name).view({"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[self.dtypes[name]])
        return view.reshape(self.shapes[name])

    def dense(self, name: str) -> np.ndarray:
        """The tensor as a float32 copy (bf16 widened exactly: its bits are float32's top half),
        the map's pages under it dropped afterwards."""
        view = self.raw(name)
        if self.dtypes[name] == "BF16":
            out = (view.astype(np.uint32) << 16).view(np.float32)
        else:
            out = view.astype(np.float32)
        self.release_view(view)
        return out

    def matrix_bytes(self, name: str) -> np.ndarray | None:
        """A 2-D float tensor's bytes (BF16, F16 or F32), [rows, itemsize * cols], as a view of its
        file's memory map (no copy: the native path repacks from it chunk by chunk,
        `release_view`-ing each chunk), or None for other tensors. The maps live as long as this
        mapping (the load)."""
        shape = self.shapes.get(name)
        itemsize = {"BF16": 2, "F16": 2, "F32": 4}.get(self.dtypes.get(name, ""))
        if itemsize is None or shape is None or len(shape) != 2:
            return None
        data = self._bytes(name)
        rows, cols = shape
        if data.nbytes != rows * cols * itemsize:
            return None
        return data.reshape(rows, cols * itemsize)

    def release_view(self, view: np.ndarray) -> None:
        """Drop the pages under `view` (a chunk of `matrix_bytes`) from RSS once it was copied."""
        for mm, buf, _, _ in self._maps.values():
            offset = view.ctypes.data - buf.ctypes.data
            if view.flags.c_contiguous and offset >= 0 and offset + view.nbytes <= buf.nbytes:
                page = mmap.PAGESIZE
                lo, hi = offset // page * page, min(buf.nbytes, -(-(offset + view.nbytes) // page) * page)
                if hi > lo:
                    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                return

    def __contains__(self, name: object) -> bool:  # (Mapping's would read the tensor)
        return name in self._index

    def __delitem__(self, name: str) -> None:
        del self._index[name]
        self.dtypes.pop(name, None)
        self.shapes.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def hf_weights(loaded: LoadedModel) -> HFWeights:
    """A loaded safetensors checkpoint's weights (a LoadedModel's), whose numpy readers the native
    path uses instead of torch tensors."""
    if not isinstance(loaded.weights, HFWeights):
        raise TypeError(f"{loaded.path}: expected safetensors weights, got {type(loaded.weights).__name__}")
    return loaded.weights


_MIXTRAL_EXPERTS = {".w1.": ".gate_proj.", ".w2.": ".down_proj.", ".w3.": ".up_proj."}


def _our_name(name: str, post_attn: str) -> str:
    n = name.removeprefix("model.")
    for a, b in _RENAMES:
        n = n.replace(a, b)
    if ".experts." in n:  # Mixtral's w1/w2/w3 are gate/down/up
        for a, b in _MIXTRAL_EXPERTS.items():
            n = n.replace(a, b)
    return n.replace("post_attention_layernorm.", post_attn)


def load_hf_weights(path: Path, config: ModelConfig) -> HFWeights:
    """Every tensor under our names, in the checkpoint's own dtype, read lazily (HFWeights).

    Each file is opened here, at load, and safetensors checks its header against the file then: a
    truncated shard or a header whose offsets or sizes lie fails now, naming the file."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    post_attn = "attn_out_norm." if config.sandwich_norms else "post_norm."
    index: dict[str, tuple[Path, str]] = {}
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:  # headers only: no torch
                for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if "rotary_emb" in name:
                        continue
                    sl = st.get_slice(name)
                    n = _our_name(name, post_attn)
                    index[n], dtypes[n], shapes[n] = (f, name), sl.get_dtype(), tuple(sl.get_shape())
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{f}: cannot read safetensors ({exc})") from exc
    odd = {n: d for n, d in dtypes.items() if d not in FLOAT_DTYPES}
    if odd:
        name, dtype = next(iter(odd.items()))
        raise ModelLoadError(f"{index[name][0]}: tensor {index[name][1]} is {dtype} (supported: "
                             f"{', '.join(FLOAT_DTYPES)})" + (f", and {len(odd) - 1} more" if len(odd) > 1 else ""))
    return HFWeights(index, dtypes, shapes)


FLOAT_DTYPES = ("BF16", "F16", "F32")  # the safetensors dtypes both paths compute


def check_weights(config: ModelConfig, weights: Mapping[str, Any], path: Path) -> None:
    if config.architecture == "gpt_oss":  # its experts are fused per layer, and it has biases and sinks
        check_gpt_oss_weights(config, weights, path)
        return
    need = ["embed.weight", "norm.weight"]
    per_layer = ["q_proj", "k_proj", "v_proj", "o_proj", "input_norm", "post_norm"]
    per_layer += ["q_norm", "k_norm"] if config.qk_norm else []
    per_layer += ["attn_out_norm", "ffn_out_norm"] if config.sandwich_norms else []
    for i in range(config.num_layers):
        need += [f"layers.{i}.{n}.weight" for n in per_layer]
        mlp = expert_shapes(config, i) if config.is_moe_layer(i) else \
            {f"{n}.weight": () for n in ("gate_proj", "up_proj", "down_proj")}
        need += [f"layers.{i}.{n}" for n in mlp]
    fused = next((n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))), None)
    if fused is not None:  # transformers 5's in-memory form; save_pretrained writes one tensor per expert
        raise ModelLoadError(f"{path}: tensor {fused} holds all experts fused in one 3D tensor; expected "
                             "one tensor per expert (mlp.experts.N.gate_proj/up_proj/down_proj.weight)")
    if config.num_experts:  # before the missing names: a wrong expert count shows first in the router's shape
        _check_experts(config, weights, path)
    missing = [n for n in need if n not in weights]
    if missing:
        raise ModelLoadError(f"{path}: weights missing from the safetensors files: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))


def expert_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """One sparse layer's router and expert matrices (our names, relative to the layer) -> shape."""
    if config.architecture == "granitemoe":  # its experts stacked per layer
        return stacked_expert_shapes(config)
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"router.weight": (e, h)}
    for x in range(e):
        shapes |= {f"experts.{x}.gate_proj.weight": (i, h), f"experts.{x}.up_proj.weight": (i, h),
                   f"experts.{x}.down_proj.weight": (h, i)}
    return shapes


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _check_experts(config: ModelConfig, weights: Mapping[str, Any], path: Path) -> None:
    """Every sparse layer's router and experts present have the config's count and shapes, and no layer
    holds an expert past the config's count (a config that undercounts the checkpoint's experts)."""
    shapes = getattr(weights, "shapes", {})
    source = getattr(weights, "source", lambda n: n)
    for i in range(config.num_layers):
        if not config.is_moe_layer(i):
            continue
        for rel, want in expert_shapes(config, i).items():
            name = f"layers.{i}.{rel}"
            if name not in weights:
                continue  # reported with the other missing tensors
            got = tuple(shapes[name]) if name in shapes else tuple(weights[name].shape)
            if got != want:
                raise ModelLoadError(f"{path}: tensor {source(name)} has shape {list(got)}, expected {list(want)} "
                                     f"({config.num_experts} experts, hidden {config.hidden_size}, expert "
                                     f"intermediate {config.moe_intermediate_size} in config.json)")
    extra = next((n for n in weights if (m := _EXPERT.search(n)) and int(m[1]) >= config.num_experts), None)
    if extra is not None:
        raise ModelLoadError(f"{path}: tensor {source(extra)} is an expert past config.json's num_experts "
                             f"{config.num_experts}")
