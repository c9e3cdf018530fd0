"""The native library's exported functions as ctypes sees them, declared once.

csrc/tp_api.h declares the same functions for the compiler (every .cpp defining one includes it);
tests/engine/test_kernel_abi.py parses that header and checks it against `SIGNATURES` here: the
same names, argument counts and kinds (int, float, pointer) and return types. ctypes itself
checks nothing against the C side, so without the test a changed signature would pass the wrong
arguments silently. `apply` sets every restype and argtypes at load; callers then pass ints for
pointers (`array.ctypes.data`, `tensor.data_ptr()`).
"""

from __future__ import annotations

import ctypes

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float

# tp_model_forward's arguments; tp_model_forward_lora takes these, then the step's adapters.
FORWARD_ARGS: list[type] = [_P, _I, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _P]

# name -> (restype, argtypes); restype None: void.
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "tp_cpu_features": (_I, []),
    "tp_kernel_isas": (_I, []),
    "tp_quantize": (None, [_I, _P, _I, _I, _P]),
    "tp_dequantize_row": (None, [_I, _P, _I, _P]),
    "tp_repack": (_I, [_I, _P, _I, _I, _P]),
    "tp_dequantize_packed_row": (None, [_I, _P, _I, _I, _I, _P]),
    "tp_model_create": (_P, [_P, _F, _I, _P, _P, _P, _P]),
    "tp_model_free": (None, [_P]),
    "tp_model_set_moe": (_I, [_P, _I, _P, _P, _P, _P]),
    "tp_model_moe_counters": (None, [_P, _P]),
    "tp_model_step_buffers": (None, [_P, _I, _P]),
    "tp_model_abi": (_I, []),
    "tp_model_forward": (_I, FORWARD_ARGS),
    "tp_model_forward_lora": (_I, [*FORWARD_ARGS, _I, _P, _P, _P, _P, _P]),
    "tp_model_debug_phase_cap": (None, [_P, _I]),
    "tp_kv_convert": (None, [_I, _I, _P, _P, _I]),
    "tp_decode_chunks": (_I, [_P, _P, _I, _I, _I, _I, _P]),
    "tp_attend_tile_test": (None, [_I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _I, _I]),
    "tp_stream_read": (None, [_I, _P, _I, _I, _I, _P, _P]),
    "tp_gemm": (None, [_I, _I, _P, _I, _I, _P, _I, _P, _I, _I]),
    "tp_gemm_tiles": (_I, [_I, _I, _I, _I, _P]),
    "tp_bpe_merge": (_I, [_P, _I, _P, _P, _P, _P, _P, _I, _P]),
}

# csrc/forward.cpp tp_model_abi: the argument layout this module passes (2: KV-cache groups;
# 3: tp_model_forward_lora, the LoRA deltas beside the base GEMMs; 4: their A and B^T in IEEE
# halves; 5: the forwards return a status; 6: tp_model_set_moe, sparse MLPs; 7: dims[12] is the
# KV kind, kernels/model.py KV_KINDS; tp_kv_convert, tp_attend_tile_test; 8: the F32X16 weight
# type, which an older library would run as Q8_0 rows; 9: tp_model_moe_counters; 10: the forwards'
# row_kinds, each row's residual-byte mask; 11: dims[16], the matmuls whose BF16 weights take bf16
# activations on AMX tiles, and tp_gemm's mode 3; 12: tp_attend_tile_test's isa, which picks the
# AVX-512 attention, csrc/attn_avx512.cpp; 13: dims[17], prompt rows' attention on AMX tiles,
# csrc/attn_amx.cpp, and tp_attend_tile_test's isa 3; 14: tp_model_step_buffers; 15: tp_gemm_tiles;
# 16: tp_decode_chunks). A library reporting another is refused at load.
MODEL_ABI = 16

# tp_model_forward's statuses (csrc/tp_api.h TP_STATUS_*) other than 0
FORWARD_STATUS = {
    1: "the step walked more work phases than the kernels allocated for it (csrc/forward.cpp "
       "phases_for_step miscounts them): a kernel bug; this step's logits were not used",
}


def apply(lib: ctypes.CDLL) -> None:
    """Sets restype and argtypes of every function in `SIGNATURES` (AttributeError if one is missing)."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


def check_forward(status: int) -> None:
    """Raises for a nonzero status of tp_model_forward(_lora)."""
    if status:
        raise RuntimeError("native forward failed: " + FORWARD_STATUS.get(status, f"unknown status {status}"))
