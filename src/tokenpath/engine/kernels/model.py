"""The native decoder: a Llama/Mistral/Qwen2/Qwen3/Gemma 3 model whose weights stay in GGUF blocks,
run as one native call per engine step (`tp_model_forward` in csrc/forward.cpp), with the
families' switches of ModelConfig (QK-norm, sandwich norms, GeGLU, embedding and attention scales,
norm offset, per-layer sliding windows and rope tables).

What it holds: per layer the fused QKV and gate/up matrices (rows of the GGUF tensors stacked,
which keeps their blocks intact), the output and down projections, the norms; the embedding
(also the LM head when tied) and the RoPE tables. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
F16 and BF16 matrices keep the file's own blocks (repacked 16 rows at a time), and so do bf16/fp16/fp32
safetensors checkpoints (their values are BF16/F16/F32 rows); other types (a GGUF file's F32, Q2_K,
Q3_K, ...) and a matrix of those types whose rows are not a multiple of 16 are quantized to Q8_0 at
load (logged once per type); under `--quantization q8_0` every matrix of any checkpoint is Q8_0, and
under `--quantization q4_k` Q4_K (Q5_0 where a row is not whole 256-weight super-blocks; the
embedding and the LM head Q8_0, as llama.cpp's Q4_K_M keeps the output matrix at more bits).
The KV cache stays the engine's own block pool, float32, float16, one-byte fp8 (e4m3, e5m2) or
llama.cpp's q8_0 blocks (csrc/kv_fp8.h): the kernels read and write it in place, converting in
registers.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import numpy as np

from tokenpath.config import env_num_threads
from tokenpath.engine.kernels import (
    BF16,
    BF16X16,
    BLOCK_BYTES,
    F16,
    F32,
    FLOAT_PACKED,
    GGUF_BLOCKS,
    GROUP_ROWS,
    ISA_AVX512,
    ISA_NAMES,
    Q4_K,
    Q8_0,
    REPACK_BLOCKS,
    TYPE_NAMES,
    NativeLibrary,
    native_library,
    output_rows,
    quantize_as,
    repack,
    repack_parts,
)
from tokenpath.engine.kernels.abi import check_forward
from tokenpath.engine.kernels.experts import ExpertLayer, expert_layer
from tokenpath.engine.kernels.precision import (
    ATTN_TILE_KV,
    EXACT_DOWN,
    EXACT_GATE_UP,
    EXACT_HEAD,
    EXACT_O,
    EXACT_QKV,
    PROMPT_TILE_KINDS,
    PROMPT_TILES,
    TILE_PACKED,
    bf16_mask,
    exact_mask,
    fine_mask,
    prompt_fine_mask,
)
from tokenpath.engine.kv_cache import NUMPY_STORAGE, KVCache
from tokenpath.engine.loader import LoadedModel
from tokenpath.engine.loader_hf import hf_weights
from tokenpath.engine.model_config import ModelConfig
from tokenpath.engine.rope_tables import RopeTables, rope_keys

log = logging.getLogger("tokenpath.engine.kernels")

# KV-cache dtype name -> the kernels' KvKind (csrc/kv_fp8.h), tp_model_create's dims[12].
# --quantization's conversions at load (None: each matrix as stored where the kernels read it).
QUANTIZATIONS = {"q8_0": Q8_0, "q4_k": Q4_K}
KV_KINDS = {"float32": 0, "float16": 1, "fp8_e5m2": 2, "fp8_e4m3": 3, "q8_0": 4}


def native_unsupported(cfg: ModelConfig) -> list[str]:
    """The features of `cfg` the native forward does not compute: such a model runs on torch
    rather than natively and wrong. It computes QK-norm, sandwich norms, SwiGLU and GeGLU, embedding
    and attention scales, norm offsets, per-layer sliding windows and rope tables (any base and
    scaling: engine/rope_tables.py, which the torch path shares), any head_dim, and
    mixture-of-experts MLPs (Qwen3-MoE, Mixtral: csrc/moe.h, kernels/experts.py)."""
    checks = {
        f"activation {cfg.hidden_act}": cfg.hidden_act not in ("silu", "gelu_tanh"),
        "attention sinks": cfg.attn_sinks,  # gpt-oss (engine/gpt_oss.py): these five
        "an attention output bias": cfg.attn_output_bias,
        "router and expert biases": cfg.moe_bias,
        "a softmax over the top-k router logits": cfg.moe_topk_softmax,
        "the clamped SwiGLU": cfg.swiglu_limit is not None,
        "q/k norms over the whole projection": cfg.qk_norm_full,  # OLMoE (engine/moe_families.py)
        "a residual multiplier": cfg.residual_scale != 1.0,  # Granite MoE: these two and the top-k softmax
        "logits scaling": cfg.logits_scaling != 1.0,
    }
    return [name for name, hit in checks.items() if hit]




def checkpoint_float_type(loaded: LoadedModel) -> str | None:
    """The float type of a safetensors checkpoint's matrices ("BF16", "F16", "F32", or "mixed"), None for GGUF."""
    dtypes = getattr(loaded.weights, "dtypes", None)
    if loaded.gguf is not None or not dtypes:
        return None
    kinds = {d for n, d in dtypes.items() if n.endswith("proj.weight")}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def select_native(loaded: LoadedModel, quantization: str, device: str,
                  dtype: str = "auto") -> NativeLibrary | None:
    """The kernels to run this model with, or None for the torch path (saying why in one line).

    auto: GGUF checkpoints run natively on their own blocks; bf16, fp16 and fp32 safetensors run
    natively on their own values (the kernels' BF16/F16/F32 matrices times float32 activations: the
    arithmetic of `--dtype float32` on those weights, so `dtype` may be auto, float32 or the file's
    own). A 16-bit dtype other than the file's (bfloat16 or float16 on a float32 checkpoint, too)
    asks for a conversion and stays on torch, which computes exactly the dtype asked for. q8_0: any
    checkpoint, every matrix Q8_0. none: torch.
    `device`: the engine's device type ("cpu", "cuda", ...).
    """
    if quantization == "none":
        return None
    if device != "cpu":
        if quantization != "auto":
            log.warning("--quantization %s: the native kernels are CPU-only; using torch on %s",
                        quantization, device)
        return None
    missing = native_unsupported(loaded.config)
    if missing:
        log.log(logging.INFO if quantization == "auto" else logging.WARNING,
                "the native kernels do not compute %s yet: torch path", ", ".join(missing))
        return None
    if quantization == "auto" and loaded.gguf is None:
        kind = checkpoint_float_type(loaded)
        own = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(kind or "")
        if own is None or dtype not in ("auto", "float32", own):
            log.info("safetensors checkpoint (%s matrices, --dtype %s): torch path (the native kernels run bf16, "
                     "fp16 and fp32 checkpoints in their own dtype; --quantization q8_0 runs any natively)",
                     kind, dtype)
            return None
        lib = native_library()
        if lib is not None:
            log.info("safetensors checkpoint: native kernels on its own %s matrices (--quantization none: torch)", kind)
        return lib
    return native_library()


def _as_blocks(lib: NativeLibrary, loaded: LoadedModel, name: str, want: int | None,
               requantized: set[str]) -> tuple[int, np.ndarray]:
    """(ggml type, [rows, bytes]) of one matrix: the file's own blocks (GGUF) or bf16/fp16/fp32 values
    (safetensors) when the kernels read that type (and `want` allows it), else quantized here to
    Q8_0 (the type's name goes to `requantized`, for the load's log line)."""
    if loaded.gguf is not None:
        raw = loaded.gguf.raw(name)
        if raw.ggml_type in GGUF_BLOCKS and want in (None, raw.ggml_type):
            return raw.ggml_type, np.ascontiguousarray(raw.data).view(np.uint8)  # F16: values -> bytes
        if want is None:
            requantized.add(_type_name(raw.ggml_type))
        chunks = [quantize_as(lib, want, rows) for rows in loaded.gguf.dequantized_rows(name)]
        return chunks[0][0], np.concatenate([b for _, b in chunks])
    else:
        weights = hf_weights(loaded)
        view = weights.matrix_bytes(name)
        if view is not None:  # a 2-D BF16/F16/F32 tensor: the file's bytes, repacked from the map without a copy
            vtype = {"BF16": BF16, "F16": F16, "F32": F32}[weights.dtypes[name]]
            if want in (None, vtype):
                return vtype, view
        dense = weights.dense(name)
    return quantize_as(lib, want, dense)


def _type_name(ggml_type: int) -> str:
    try:
        from tokenpath.engine.ggml_types import GGMLType

        return GGMLType(ggml_type).name
    except ValueError:
        return str(ggml_type)


Part = tuple[int, int, np.ndarray]  # (kernel type, output rows, blocks): one row range of a matrix


def _matrix(lib: NativeLibrary, loaded: LoadedModel, names: list[str], want: int | None, pack: bool,
            requantized: set[str]) -> list[Part]:
    """The rows of several matrices with the same input size, stacked (fused QKV, gate/up), as the
    kernels run them: repacked (`pack`) parts of the file's own types, consecutive ones of one type
    merged; or, where a part cannot be repacked (rows not a multiple of 16) or the matmul keeps
    float activations (GGUF layouts of Q4_0/Q4_1/Q8_0 only), one matrix of one row-kernel type,
    Q8_0 when the types differ. The result is a copy: the GGUF file's mapped pages are dropped
    from RSS after it (without that, the whole file stays resident beside the repacked weights
    until the load ends: +240 MiB at Gemma 3 270M's peak). The whole file's, not only these
    tensors': reading them maps neighbouring pages back (the kernel maps page-cache folios around
    each fault; dropping each tensor's own pages left 39 MiB of Gemma's file resident after the
    load), and the experts of a sparse layer, read before the next matrix, go with them. A page
    still read in place (rows the kernels take as stored) faults back in from the page cache."""
    try:
        return _matrix_parts(lib, loaded, names, want, pack, requantized)
    finally:
        if loaded.gguf is not None:
            loaded.gguf.release_all()


def _matrix_parts(lib: NativeLibrary, loaded: LoadedModel, names: list[str], want: int | None, pack: bool,
                  requantized: set[str]) -> list[Part]:
    parts = [_as_blocks(lib, loaded, n, want, requantized) for n in names]
    # F16/BF16/F32 rows in whole 32-weight blocks only (the quantized types' rows always are).
    if pack and all(b.shape[0] % GROUP_ROWS == 0 and b.shape[1] % REPACK_BLOCKS[t][1] == 0 for t, b in parts):
        runs: list[tuple[int, list[np.ndarray]]] = []
        for t, b in parts:
            if runs and runs[-1][0] == t:
                runs[-1][1].append(b)
            else:
                runs.append((t, [b]))
        out = []
        release = getattr(loaded.gguf if loaded.gguf is not None else loaded.weights, "release_view", None)
        for t, run in runs:
            pt, packed = repack_parts(lib, t, run, release)
            out.append((pt, output_rows(pt, packed), packed))
        return out
    if len({t for t, _ in parts}) > 1 or any(t not in BLOCK_BYTES for t, _ in parts):
        for n, (t, _) in zip(names, parts, strict=True):
            if t not in BLOCK_BYTES:
                requantized.add(f"{TYPE_NAMES[t]} ({n}: rows not a multiple of 16, or float activations)")
        parts = [_as_blocks(lib, loaded, n, Q8_0, requantized) for n in names]
    t, blocks = parts[0][0], np.ascontiguousarray(np.concatenate([b for _, b in parts]))
    if pack:
        t, blocks = repack(lib, t, blocks)
    return [(t, output_rows(t, blocks), blocks)]


def _dense(loaded: LoadedModel, name: str) -> np.ndarray:
    """A small float32 vector (a norm's weights, a bias) as the kernels keep it: always a copy. A
    GGUF's F32 tensor would otherwise be a view of the file's mapping, read in place after the
    load's `release_all`, and each such read maps the 64 KiB of page-cache folios around it back
    into RSS: 14 MiB of SmolLM2's file for 0.14 MiB of norms."""
    if loaded.gguf is not None:
        return np.array(loaded.gguf.dequantized(name), dtype=np.float32, order="C", copy=True).reshape(-1)
    return hf_weights(loaded).dense(name).reshape(-1)


MAX_PARTS = 3  # row ranges of their own type per matrix (csrc/forward.cpp kMaxParts)

@dataclass
class NativeLoraStep:
    """One step's adapters for `tp_model_forward_lora` (csrc/forward.cpp LoraStep): the rows of
    each slot in blocks of at most 16 ((slot, first index into `rows`, count) each) and, per slot,
    its pointer table ([layers][LORA_TARGETS][A, B^T], float32), rank and scale. The arrays behind
    the pointers are owned by the resident adapters."""

    blocks: np.ndarray  # int32 [n_blocks * 3]
    rows: np.ndarray  # int32: the rows of slot 0, then slot 1, ...
    ptrs: np.ndarray  # uint64 [slots * layers * 7 * 2]
    ranks: np.ndarray  # int32 [slots]
    scales: np.ndarray  # float32 [slots]


class NativeLlama:
    def __init__(self, lib: NativeLibrary, loaded: LoadedModel, quantization: str, cache: KVCache,
                 block_size: int, max_positions: int, *, isa: str | None = None, fine: int | None = None,
                 exact: int | None = None, prompt_fine: int | None = None, bf16: int | None = None) -> None:
        """isa (auto | avx2 | avx512), fine, prompt_fine, bf16 and exact (bit masks): EngineConfig's
        kernels_* fields; None: their environment variables, else the defaults (for callers without
        a config)."""
        cfg = loaded.config
        self.lib, self.vocab = lib, cfg.vocab_size
        want = QUANTIZATIONS.get(quantization)
        # The embedding and the LM head take Q8_0 under q4_k (llama.cpp's Q4_K_M gives the output
        # matrix Q6_K): the head's error reaches every logit directly.
        outer_want = Q8_0 if want == Q4_K else want
        keep: list[np.ndarray] = []  # everything the C++ side points into

        def ptr(a: np.ndarray | None) -> int:
            if a is None:
                return 0
            keep.append(a)
            return a.ctypes.data

        exact = exact_mask() if exact is None else exact
        fine = fine_mask() if fine is None else fine
        prompt_fine = prompt_fine_mask() if prompt_fine is None else prompt_fine
        self.isa = lib.isa(isa)
        # bf16 activations need AMX tiles, or VDPBF16PS for BF16 weights (AVX512_BF16 without AMX:
        # only the matmuls whose every part is BF16, trimmed below): none with AVX2 kernels
        # (csrc/forward.cpp checks the same), and never for an exact matmul.
        tiles = lib.has_amx_bf16 and self.isa == ISA_AVX512
        dot = not tiles and lib.has_bf16_dot and self.isa == ISA_AVX512
        half = (bf16_mask() if bf16 is None else bf16) & ~exact if tiles or dot else 0
        kind_types: dict[int, set[int]] = {}  # matmul bit -> the kernel types of its parts
        requantized: set[str] = set()

        def matrix(kind: int, names: list[str]) -> list[Part]:
            """The int8-activation matmuls run on 16-row interleaved weights (csrc/packed_impl.h):
            the same bytes moved, 2-4x the GEMM speed. Float-activation ones keep GGUF's layout."""
            return _matrix(lib, loaded, names, want, not exact & kind, requantized)

        keys, layer_rope = rope_keys(cfg)
        ropes = [RopeTables(cfg.head_dim, base, max_positions, cfg.rope_scaling if scaled else None)
                 for base, scaled in keys]  # computed as far as the steps' positions reach (forward)

        def norm(name: str) -> np.ndarray:  # Gemma's (1 + w), added in float32 as the torch path does
            w = _dense(loaded, name)
            return w + np.float32(cfg.norm_offset) if cfg.norm_offset else w

        def optional_norm(name: str, present: bool) -> int:
            return ptr(norm(name)) if present else 0

        layer_ptrs, layer_types, used_types = [], [], set()
        sparse: dict[int, ExpertLayer] = {}  # layer -> its experts (tp_model_set_moe after create)
        for i in range(cfg.num_layers):
            def w(n: str, i: int = i) -> str:
                return f"layers.{i}.{n}"

            mats = [matrix(EXACT_QKV, [w(f"{p}_proj.weight") for p in "qkv"]),
                    matrix(EXACT_O, [w("o_proj.weight")])]
            if cfg.is_moe_layer(i):  # no dense gate_up and down: the layer's experts instead
                sparse[i] = expert_layer(lib, loaded, i, want, not exact & EXACT_GATE_UP, not exact & EXACT_DOWN)
                used_types |= {int(t) for t in sparse[i].types}
                kind_types.setdefault(EXACT_GATE_UP, set()).update(int(t) for t in sparse[i].types[:2])
                kind_types.setdefault(EXACT_DOWN, set()).add(int(sparse[i].types[2]))
                keep += [sparse[i].router, *sparse[i].blocks]
                mats += [[], []]
            else:
                mats += [matrix(EXACT_GATE_UP, [w("gate_proj.weight"), w("up_proj.weight")]),
                         matrix(EXACT_DOWN, [w("down_proj.weight")])]
            bias = (np.concatenate([_dense(loaded, w(f"{p}_proj.bias")) for p in "qkv"])
                    if cfg.attention_bias else None)
            rope = ropes[layer_rope[i]]
            layer_ptrs += [ptr(norm(w("input_norm.weight"))), ptr(norm(w("post_norm.weight"))),
                           ptr(bias), ptr(cache.k[i]), ptr(cache.v[i]),
                           optional_norm(w("q_norm.weight"), cfg.qk_norm), optional_norm(w("k_norm.weight"), cfg.qk_norm),
                           optional_norm(w("attn_out_norm.weight"), cfg.sandwich_norms),
                           optional_norm(w("ffn_out_norm.weight"), cfg.sandwich_norms),
                           ptr(rope.cos), ptr(rope.sin)]
            for kind, parts in zip((EXACT_QKV, EXACT_O, EXACT_GATE_UP, EXACT_DOWN), mats, strict=True):
                kind_types.setdefault(kind, set()).update(t for t, _, _ in parts)
                # MAX_PARTS (pointer) and (type, rows) slots per matrix, rows 0 = unused
                slots: list[tuple[int, int, np.ndarray | None]] = [*parts, *[(0, 0, None)] * (MAX_PARTS - len(parts))]
                layer_ptrs += [ptr(b) for _, _, b in slots]
                layer_types += [v for t, rows, _ in slots for v in (t, rows)]
                used_types |= {t for t, rows, _ in slots if rows}
            layer_types += [cfg.window(i) or 0, cache.layer_group[i]]  # window, KV-cache group
        if cfg.tie_word_embeddings:  # one copy: embedding lookups read the head's rows in either layout
            [(head_t, _, head)] = _matrix(lib, loaded, ["embed.weight"], outer_want, not exact & EXACT_HEAD,
                                          requantized)
            embed_t, embed = head_t, head
        else:
            [(head_t, _, head)] = _matrix(lib, loaded, ["lm_head.weight"], outer_want, not exact & EXACT_HEAD,
                                          requantized)
            # Embedding lookups read GGUF rows of the row-kernel types or repacked rows (16-row groups).
            [(embed_t, _, embed)] = _matrix(lib, loaded, ["embed.weight"], outer_want, True, requantized)
        glob = [ptr(embed), ptr(head), ptr(norm("norm.weight"))]
        if loaded.gguf is not None:  # the final norm's copy, read after the head's release, mapped 1 MiB back
            loaded.gguf.release_all()
        if requantized:
            log.warning("native kernels: %s quantized to Q8_0 at load (the kernels do not read them as stored)",
                        ", ".join(sorted(requantized)))
        kind_types[EXACT_HEAD] = {head_t}
        if dot:  # VDPBF16PS multiplies BF16 weights only: quantized ones keep their int8 activations
            half &= sum(kind for kind, types in kind_types.items() if types == {BF16X16})
        # 1: some matrix is float (F16/BF16/F32), 2: every one is, and no row needs int8 activations
        self.attn_tiles = tiles and bool(half) and cache.dtype in ATTN_TILE_KV and cfg.head_dim % 32 == 0
        floats = len((used_types | {head_t}) & set(FLOAT_PACKED))
        float_w = 0 if not floats else 2 if floats == len(used_types | {head_t}) else 1
        dims = np.array([cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                         cfg.head_dim, cfg.vocab_size, max_positions, block_size, embed_t, head_t,
                         exact, KV_KINDS.get(cache.dtype, -1), fine & ~exact,
                         int(cfg.hidden_act == "gelu_tanh"), float_w,
                         half, int(self.attn_tiles)],
                        dtype=np.int32)
        fparams = np.array([cfg.embed_scale, cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5],
                           dtype=np.float32)
        arrays = [np.array(glob, dtype=np.uint64), np.array(layer_ptrs, dtype=np.uint64),
                  np.array(layer_types, dtype=np.int32), fparams]
        if not isinstance(cache.k[0], np.ndarray) or cache.dtype not in KV_KINDS or (
                cache.dtype != "float32" and not lib.has_f16c) or cache.k[0].dtype != NUMPY_STORAGE[cache.dtype]:
            raise ValueError(f"the native kernels cannot use a {cache.dtype} KV cache of "
                             f"{type(cache.k[0]).__name__} on this CPU (numpy float32, or float16 / fp8 / q8_0 with F16C)")
        self.exact, self.fine = exact, fine & ~exact  # the masks this model runs (fine excludes exact)
        self.prompt_fine = prompt_fine & self.fine  # within fine: prompt rows take residual bytes for these
        self._kinds: np.ndarray | None = None
        self.kv_dtype = cache.dtype
        # Threads per step: None follows kernel_threads() at every step (see there).
        self.threads: int | None = None
        self._cores = physical_cores()
        self._handle = lib.lib.tp_model_create(dims.ctypes.data, cfg.rms_norm_eps, self.isa,
                                               *(a.ctypes.data for a in arrays))
        for i, ex in sparse.items():
            if lib.lib.tp_model_set_moe(self._handle, i, ex.dims.ctypes.data, ex.router.ctypes.data,
                                        ex.types.ctypes.data, ex.ptrs.ctypes.data):
                raise ValueError(f"layer {i}: the kernels refused its experts ({ex.dims.tolist()})")
        self._keep = keep
        self.sparse_layers = len(sparse)
        self.num_groups = max(cache.layer_group) + 1
        # The model's own bytes: not the KV pool or the rope tables, which `keep` holds too (numpy now, as the weights).
        not_weights = {id(a) for a in [*cache.k, *cache.v, *(t for r in ropes for t in (r.cos, r.sin))]}
        self.ropes = ropes  # (RopeTables: forward computes their rows as far as positions reach)
        self.weight_bytes = sum(a.nbytes for a in {id(a): a for a in keep if id(a) not in not_weights}.values())
        self.weight_types = tuple(sorted({TYPE_NAMES[t] for t in used_types | {head_t}}))  # e.g. ("BF16X16",)
        names = ("qkv", "o", "gate_up", "down", "head")
        # bf16 activations on tiles: BF16 weights in every row (bf16), quantized repacks in their
        # prompt rows, never the head's (prompt_tiles; csrc/forward.cpp kPromptTiles)
        self.bf16 = half if BF16X16 in used_types | {head_t} else 0
        tile_kinds = half & PROMPT_TILE_KINDS if tiles and used_types & set(TILE_PACKED) else 0
        self.prompt_tiles = bool(tile_kinds)
        log.info("native kernels: %s, %s weights (%.0f MiB), activations float for [%s], fine (int8 + residual) "
                 "for [%s] (prompt rows: [%s]), bf16 on %s for [%s] (prompt rows of quantized weights: [%s]), "
                 "int8 for the rest, %s KV cache, prompt rows' attention %s", ISA_NAMES[self.isa],
                 "/".join(self.weight_types),
                 self.weight_bytes / 2**20, ",".join(n for i, n in enumerate(names) if dims[11] >> i & 1),
                 ",".join(n for i, n in enumerate(names) if dims[13] >> i & 1),
                 ",".join(n for i, n in enumerate(names) if self.prompt_fine >> i & 1),
                 "AMX tiles" if tiles else "VDPBF16PS", ",".join(n for i, n in enumerate(names) if self.bf16 >> i & 1),
                 ",".join(n for i, n in enumerate(names) if tile_kinds >> i & 1), self.kv_dtype,
                 "in bf16 on AMX tiles" if self.attn_tiles else "in float32")

    def forward(self, ids: np.ndarray, pos: np.ndarray, slot_mapping: np.ndarray, row_table: np.ndarray,
                tables: np.ndarray, logit_rows: np.ndarray, lora: NativeLoraStep | None = None,
                generated: np.ndarray | None = None) -> np.ndarray:
        """One step over T rows -> float32 logits [len(logit_rows), vocab]. int32 inputs except
        slot_mapping (int64); row_table[t] is the offset of row t's block table in `tables`.
        `lora`: the step's adapters, whose float32 deltas run beside the quantized base GEMMs.
        With KV-cache groups, slot_mapping is [G, T] and tables [G, N] (group-major, each group's
        tables at the same offsets); one group may pass them flat. `generated`: bool [T], the rows
        of generated tokens (position past their sequence's prompt), which take `fine`'s residual
        bytes while prompt rows take `prompt_fine`'s; None: every row as a generated one."""
        groups = 1 if slot_mapping.ndim == 1 else slot_mapping.shape[0]
        if groups != self.num_groups or (tables.ndim == 1) != (slot_mapping.ndim == 1) or \
                (tables.ndim == 2 and tables.shape[0] != groups):
            raise ValueError(f"this model's KV cache has {self.num_groups} groups: slot_mapping "
                             f"{slot_mapping.shape} and tables {tables.shape} must have one row each")
        slot_mapping, tables = np.ascontiguousarray(slot_mapping), np.ascontiguousarray(tables)
        top = int(pos.max()) + 1 if len(pos) else 0
        for rope in self.ropes:  # (their rows up to this step's last position)
            rope.ensure(top)
        logits: np.ndarray = np.empty((len(logit_rows), self.vocab), dtype=np.float32)
        args = (self._handle, len(ids), _address(ids), _address(pos), _address(slot_mapping),
                _address(row_table), _address(tables), len(logit_rows), _address(logit_rows),
                _address(logits), self.threads or kernel_threads(self._cores), slot_mapping.shape[-1],
                tables.shape[-1], self._row_kinds(generated))
        if lora is None:
            status = self.lib.lib.tp_model_forward(*args)
        else:
            status = self.lib.lib.tp_model_forward_lora(*args, len(lora.blocks) // 3, lora.blocks.ctypes.data,
                                                        lora.rows.ctypes.data, lora.ptrs.ctypes.data,
                                                        lora.ranks.ctypes.data, lora.scales.ctypes.data)
        check_forward(status)
        return logits

    @property
    def rows_differ(self) -> bool:
        """Whether a prompt row computes differently from a generated one (forward's `generated`)."""
        return self.prompt_fine != self.fine or self.prompt_tiles or self.attn_tiles

    def _row_kinds(self, generated: np.ndarray | None) -> int:
        """tp_model_forward's row_kinds: 0 (null) when every row takes the fine mask and none is a
        prompt row on tiles."""
        if generated is None or not self.rows_differ or generated.all():
            return 0
        prompt = self.prompt_fine | (PROMPT_TILES if self.prompt_tiles or self.attn_tiles else 0)
        self._kinds = np.where(generated, self.fine, prompt).astype(np.uint8)  # alive through the call
        return int(self._kinds.ctypes.data)

    def moe_counters(self) -> list[int]:
        """The experts' cumulative counters (csrc/moe.h: pairs routed, experts read, the busiest
        expert's rows, sparse layer-steps); empty for a dense model."""
        if not self.sparse_layers:
            return []
        out: np.ndarray = np.zeros(4, dtype=np.uint64)
        self.lib.lib.tp_model_moe_counters(self._handle, out.ctypes.data)
        return [int(v) for v in out]

    def step_buffer_bytes(self, release: bool = False) -> int:
        """Bytes the kernels' step buffers hold: grown to the widest step seen (rows x the model's
        widths; ~30 MiB for SmolLM2 after a 1024-row prefill) and kept, so a steady step allocates
        nothing. `release`: hand them back to the OS first (unmapped); the next step grows what it
        needs again. Only between steps (the engine's step thread)."""
        out: np.ndarray = np.zeros(1, dtype=np.uint64)
        self.lib.lib.tp_model_step_buffers(self._handle, int(release), out.ctypes.data)
        return int(out[0])

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle:
            self.lib.lib.tp_model_free(handle)
            self._handle = None


def physical_cores() -> int:
    """This process's CPUs counted as physical cores (hyperthread siblings once), torch's default
    thread count: two threads on one core's siblings contend for its vector units."""
    allowed = os.sched_getaffinity(0)
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo") as f:
            cpu, phys = -1, "0"
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    phys = value
                elif key == "core id" and cpu in allowed:
                    cores.add((phys, value))
    except (OSError, ValueError):
        cores = set()
    return max(1, min(len(cores) or len(allowed), len(allowed)))


def _address(a: np.ndarray) -> int:
    """An array's data pointer (`.ctypes.data` builds a Python object per call: 7 a decode step)."""
    return a.__array_interface__["data"][0]


def kernel_threads(cores: int) -> int:
    """Threads for one native step: TOKENPATH_NUM_THREADS (the replica launcher splits the cores
    among local engines with it); else torch's intra-op setting where the process imported torch
    anyway (tests and benchmarks set it with torch.set_num_threads, and it is what the kernels
    followed when the engine imported torch); else OMP_NUM_THREADS; else `cores`, physical ones
    (torch's default). Read at each step: all are cheap to read."""
    threads = env_num_threads()
    if threads is not None:
        return max(1, threads)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return int(torch.get_num_threads())
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(omp) if omp.isdigit() and int(omp) > 0 else cores


__all__ = ["NativeLlama", "NativeLoraStep", "select_native", "native_library"]
