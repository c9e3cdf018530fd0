"""The native kernels' precision policy: which activations each matmul's rows take (int8, int8 with
residual bytes, float32, bf16), by default and from the environment. NativeLlama (kernels/model.py)
applies it; the measurements behind each default are below."""

from __future__ import annotations

from tokenpath.config import (
    KERNEL_MASK_ALL,
    env_kernels_bf16,
    env_kernels_exact,
    env_kernels_fine,
    env_kernels_prompt_fine,
)
from tokenpath.engine.kernels import Q4KX16, Q4X16, Q5KX16, Q5X16, Q6KX16, Q8X16

# Bits of the kernels_exact and kernels_fine masks (EngineConfig; TOKENPATH_KERNELS_EXACT and
# TOKENPATH_KERNELS_FINE by default), in the order forward.cpp numbers the matmuls.
EXACT_QKV, EXACT_O, EXACT_GATE_UP, EXACT_DOWN, EXACT_HEAD = 1, 2, 4, 8, 16
# Activations per matmul: int8 per 32-block (llama.cpp's q8 scheme), "fine" (int8 plus a second
# int8 pass over the rounding error, ~15 bits; csrc/tp_kernels.h QAct::q2), or float ("exact",
# GGUF layout, slowest). Measured on the quality test (perplexity of the committed text against
# float32 torch on the same weights; greedy: of 8 prompts, how many keep float32's first 16
# tokens), float16 KV, repacked kernels:
#   all int8 +0.75%, 3/8    all fine +0.01%, 8/8    fine but for one matmul +0.11 to +0.19%, 5-8/8
# Every int8 matmul left in costs about 0.1% perplexity, and with it the greedy agreement becomes
# a coin toss at the float32 path's near-ties (top two log-probabilities 0.01-0.09 apart), which
# any change of summation order flips. So fine everywhere is the default: it meets the quality bar
# with margin, for about 1.8x the integer work of int8 (GEMM time at M >= 32; 1.25x at M = 1, where
# reading the weights dominates). --kernels-fine 0 (TOKENPATH_KERNELS_FINE=0) selects llama.cpp's
# all-int8 scheme.
# Prompt rows are another matter (issue 42): prefill is bound by that integer work, not by reading
# the weights, and the quality bar is llama.cpp's own perplexity on the same file. Measured
# (benchmarks/results/perplexity_prompt_masks.md: prompt_logprobs, ~13k scored tokens, the committed
# text and five license texts, ratio to llama-perplexity's; SmolLM2 Q4_1 / Gemma 3 270M Q4_K_M):
#   prompt rows all int8 0.9992x / 0.9979x    qkv fine 0.9994x / 0.9971x    down fine 1.0004x / 0.9956x
#   qkv + down fine 0.9991x / 0.9957x   (a 1k-token text had all int8 1.002x on Gemma: noise of the text)
# So by default a prompt's rows take the residual bytes for qkv only (17% of a ~1B layer's
# multiply-adds; o, gate_up, down and the head run llama.cpp's int8): below llama.cpp on both files,
# prefill 1.13x qkv + down's speed, and the rows of generated tokens keep them for every matmul.
# A row's precision follows its position against its own prompt, never what else shares the step,
# so batching, chunked prefill and speculation give the same tokens (tests/engine/test_prompt_precision.py).
# --kernels-prompt-fine 31 runs prompts fine everywhere; 0 all-int8, llama.cpp's own scheme.
DEFAULT_EXACT = 0
DEFAULT_FINE = KERNEL_MASK_ALL
DEFAULT_PROMPT_FINE = EXACT_QKV
# BF16 weights (a bf16 safetensors checkpoint) on a CPU with AMX-BF16 (Sapphire Rapids and later):
# every matmul's rows take bf16 activations and run on tiles (csrc/amx_bf16.cpp), as vLLM CPU and
# transformers compute a bf16 checkpoint, prompt and generated rows alike, so a row's precision never
# depends on what shares its step. On a CPU with AVX512_BF16 but no AMX (AMD Zen 4 and later) the
# same rows run on VDPBF16PS (csrc/bf16_dot.cpp: 32 multiply-adds an instruction against the FMA
# kernels' 16, and no widening; bf16 prefill 1.8x). Elsewhere BF16 weights multiply float32
# activations on FMAs. --kernels-bf16 0 (TOKENPATH_KERNELS_BF16=0) keeps float32 activations there too.
DEFAULT_BF16 = KERNEL_MASK_ALL
# Quantized (GGUF) weights on the same CPUs: a prompt row's qkv, o, gate_up and down take bf16
# activations on tiles, the 16-row groups dequantized to bf16 once per GEMM (csrc/tile_pack.h);
# generated rows keep their int8 activations (decode reads the weights, it does not multiply them).
PROMPT_TILE_KINDS = EXACT_QKV | EXACT_O | EXACT_GATE_UP | EXACT_DOWN
PROMPT_TILES = 0x80  # a row_kinds bit: a prompt row (csrc/forward.cpp kPromptTiles)
# Where any matmul takes the tiles, a prompt row's attention does too (csrc/attn_amx.cpp: bf16
# queries, keys, values and weights, float32 sums, as vLLM computes a bf16 checkpoint's prefill),
# with a float16 or float32 KV cache and a head_dim that is a multiple of 32. Generated rows keep the
# float32 attention, so speculation and batching still give the same tokens; the prompt's own
# rows give the same bits in any chunking. --kernels-bf16 0 turns it off with the matmuls' tiles.
ATTN_TILE_KV = ("float16", "float32")
TILE_PACKED = (Q4X16, Q8X16, Q5X16, Q4KX16, Q5KX16, Q6KX16)  # the repacks tile_pack.h dequantizes


def fine_mask() -> int:
    """Which matmuls take int8 activations with residual bytes (~15 bits; TOKENPATH_KERNELS_FINE)."""
    mask = env_kernels_fine()
    return DEFAULT_FINE if mask is None else mask


def prompt_fine_mask() -> int:
    """Which matmuls' prompt rows take residual bytes too (TOKENPATH_KERNELS_PROMPT_FINE)."""
    mask = env_kernels_prompt_fine()
    return DEFAULT_PROMPT_FINE if mask is None else mask


def bf16_mask() -> int:
    """Which matmuls' BF16 weights take bf16 activations (AMX tiles or VDPBF16PS; TOKENPATH_KERNELS_BF16)."""
    mask = env_kernels_bf16()
    return DEFAULT_BF16 if mask is None else mask


def exact_mask() -> int:
    """Which matmuls keep float activations (TOKENPATH_KERNELS_EXACT)."""
    mask = env_kernels_exact()
    return DEFAULT_EXACT if mask is None else mask
