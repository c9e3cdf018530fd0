"""Mixtures of experts (Qwen3-MoE, Mixtral) on the native kernels (csrc/moe.h, kernels/experts.py).

bf16, fp16 and fp32 checkpoints made by transformers (tests/engine/tiny_models.py: 8 experts, top-2;
Qwen3-MoE with a dense layer between sparse ones) run natively on their own expert values, so
the reference is the torch path in float32 on the same checkpoint: the two agree to float32
rounding (with float32 activations, `kernels_bf16=0`: on an AMX CPU a bf16 checkpoint's rows
default to bf16, test_native_safetensors.py holds that default to transformers' own bf16), with the same greedy tokens through the engine (batched prefill mixed with decode, so
a step's tokens scatter over experts and grouping by expert matters). The float32 GGUF form
(experts stacked as llama.cpp's converter writes them, quantized to Q8_0 at load) runs natively too.
The old kernels refused every MoE model (native_unsupported), so each test here failed on them.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from tests.engine.conftest import make_prompts
from tests.engine.test_native_safetensors import runner
from tests.engine.test_quantized_quality import all_logits
from tests.engine.tiny_models import cached_tiny, save_gguf
from tokenpath import LLM, SamplingParams
from tokenpath.engine import kernels as K
from tokenpath.engine.loader import load_model

pytestmark = [pytest.mark.requires("kernels"), pytest.mark.slow]  # transformers saves 16-bit copies: ~12 s


def _checkpoint(kind: str, dtype: torch.dtype, path) -> str:
    import transformers

    out = path / f"{kind}-{dtype}"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(cached_tiny(kind)), dtype=dtype)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in cached_tiny(kind).iterdir():  # the tokenizer and chat template
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    return str(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_float_moe_runs_natively_like_torch_float32(kind, dtype, tmp_path):
    loaded = load_model(_checkpoint(kind, dtype, tmp_path))
    native = runner(loaded, bf16=0)
    assert native.native is not None
    stored = K.TYPE_NAMES[{torch.bfloat16: K.BF16X16, torch.float16: K.F16X16, torch.float32: K.F32X16}[dtype]]
    assert native.native.weight_types == (stored,)  # the experts kept the file's values, repacked
    ids = torch.randint(3, loaded.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    got = all_logits(native, ids)
    ref = all_logits(runner(loaded, "none", "float32"), ids)
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    assert err <= 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_native_greedy_tokens_match_torch_float32(tmp_path):
    """Through the engine: batched, chunked prefill mixed with decode steps (decode at batch 1 and
    small batches takes the kernels' few-rows path)."""
    path = _checkpoint("qwen3moe", torch.bfloat16, tmp_path)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for quantization, dtype in (("auto", "auto"), ("none", "float32")):
        llm = LLM(path, dtype=dtype, quantization=quantization, max_num_batched_tokens=48, max_num_seqs=8,
                  kernels_bf16=0)
        assert (llm.engine.runner.native is not None) == (quantization == "auto")
        prompts = make_prompts(llm.tokenizer, [5, 17, 40, 8], seed=3)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, p)])
        outs.append(llm.generate([prompts[1]], p)[0].outputs[0].token_ids)
    assert outs[0] == outs[2] and outs[1] == outs[3]


@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_gguf_moe_runs_natively(kind):
    """float32 GGUF experts (ffn_{gate,up,down}_exps, [experts, rows, cols]) are quantized to Q8_0
    at load: the same numbers as the safetensors checkpoint's per-expert tensors under
    --quantization q8_0, so the two native runs agree to rounding (the stacked layout is read right);
    both stay near torch float32 for the first tokens (Q8_0 weights; later a near-tie of the router
    may send a token to another expert)."""
    hf_dir = cached_tiny(kind)
    loaded = load_model(str(save_gguf(kind, hf_dir, hf_dir.parent / "model.gguf")))
    native = runner(loaded)
    assert native.native is not None and "Q8X16" in native.native.weight_types
    ids = torch.randint(3, loaded.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    got = all_logits(native, ids)
    same = all_logits(runner(load_model(str(hf_dir)), "q8_0"), ids)
    assert (got - same).abs().max().item() <= 1e-4 * same.abs().max().item()
    ref = all_logits(runner(loaded, "none", "float32"), ids)
    err = (got[:4] - ref[:4]).abs().max().item() / ref.abs().max().item()
    print(f"{kind} GGUF Q8_0 experts, first 4 positions: max |native - torch| / max |torch| = {err:.2e}")
    assert err <= 5e-2


@pytest.mark.parametrize(("experts", "top_k"), [(8, 1), (128, 8), (128, 2)])
def test_routing_ties_broken_as_transformers(tmp_path, experts, top_k):
    """test_moe.tied_checkpoint natively (its float32 experts as F32X16, float32 rows): every
    token's top-k is chosen among tied experts, and csrc/moe.h's topk_select leaves them where
    torch.topk's CPU kernel does in transformers (nth_element for 8 of 8 and 8 of 128, partial_sort
    for 2 of 128): the logits are transformers' to float32 rounding. The old kernels gave a tie to
    the lower index (torch.topk gives [0, 0, 0, 1, 0, 1, 0, 0] to expert 5): logits off by ~3."""
    from tests.engine.test_moe import _hf, _hf_logits, tied_checkpoint

    path = tied_checkpoint(tmp_path / "tied", experts, top_k)
    loaded = load_model(str(path))
    native = runner(loaded, bf16=0)
    assert native.native is not None
    ids = np.random.default_rng(2).integers(3, loaded.config.vocab_size, 40).tolist()
    got = all_logits(native, ids)
    ref = _hf_logits(_hf(path), ids)
    assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_gguf_expert_type_the_kernels_do_not_run_is_refused(tmp_path):
    """Stacked experts in IQ4_NL (a type gguf-py reads, so the file loads and the torch path could
    dequantize it, but no expert kernel runs): refused when the native model is built, naming the
    tensor and the types the kernels run, rather than requantized at load."""
    from gguf import GGMLQuantizationType

    from tokenpath.errors import ModelLoadError

    path = save_gguf("qwen3moe", cached_tiny("qwen3moe"), tmp_path / "iq4nl.gguf",
                     expert_type=GGMLQuantizationType.IQ4_NL)
    loaded = load_model(str(path))
    with pytest.raises(ModelLoadError, match=r"expert tensor 'blk\.0\.ffn_gate_exps\.weight' has type IQ4_NL: "
                                             r"the native expert kernels run .*Q4_K.*\(and float32, as Q8_0\)"):
        runner(loaded)


def test_long_prefill_groups_many_rows_per_expert(tmp_path):
    """The grouped prefill GEMM (csrc/moe.h): one 160-token step over 8 experts top-2 routes ~40
    rows to each expert, gathered into one contiguous block per expert (many 4-row tiles of the
    multi-row GEMM, then a tail) and scattered back with the router weights. Every position's
    logits must match torch float32 and the same tokens run one per step (a single row per expert:
    nothing to group), with the same greedy token at every position; then a 150-token prompt
    through the engine gives torch's greedy tokens. The 40-token tests above put ~10 rows in a
    group: a gather or scatter that goes wrong past the first few tiles passes them, not this."""
    path = _checkpoint("qwen3moe", torch.bfloat16, tmp_path)
    loaded = load_model(path)
    native = runner(loaded, bf16=0)
    assert native.native is not None
    n = 160
    ids = torch.randint(3, loaded.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    got = all_logits(native, ids)
    ref = all_logits(runner(loaded, "none", "float32"), ids)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 1e-4 * scale
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    one = runner(loaded, bf16=0)  # a fresh cache: the same tokens, one row per step
    rows = []
    for t in range(n):
        p = np.array([t], dtype=np.int32)
        rows.append(torch.from_numpy(one.native.forward(np.array(ids[t:t + 1], dtype=np.int32), p, p.astype(np.int64),
                                                        np.zeros(1, dtype=np.int32),
                                                        np.arange(one.num_blocks, dtype=np.int32),
                                                        np.zeros(1, dtype=np.int32))))
    stepwise = torch.cat(rows)
    assert (got - stepwise).abs().max().item() <= 1e-4 * scale
    assert torch.equal(got.argmax(-1), stepwise.argmax(-1))
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for quantization, dtype in (("auto", "auto"), ("none", "float32")):
        llm = LLM(path, dtype=dtype, quantization=quantization, max_num_batched_tokens=256, kernels_bf16=0)
        prompt = make_prompts(llm.tokenizer, [150], seed=5)[0]
        assert len(prompt) == 150
        outs.append(llm.generate([prompt], p)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]


def test_bf16_experts_keep_each_rows_numbers(tmp_path):
    """The default on a CPU with AMX-BF16 or AVX512_BF16: the experts' rows in bf16 (tiles, or
    VDPBF16PS) too. 160 tokens route ~40 rows to each expert (packed weights, reused by every tile of
    rows) and one token a step puts one row on an expert (the streaming path): the two give the
    same numbers for every position, and they stay no further from float32 than transformers' bf16
    forward. Without either: float32 activations, as with kernels_bf16=0, exactly."""
    loaded = load_model(_checkpoint("qwen3moe", torch.bfloat16, tmp_path))
    native = runner(loaded)
    assert native.native is not None
    n = 160
    ids = torch.randint(3, loaded.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    got = all_logits(native, ids)
    if not (K.native_library().has_amx_bf16 or K.native_library().has_bf16_dot):
        assert native.native.bf16 == 0 and torch.equal(got, all_logits(runner(loaded, bf16=0), ids))
        return
    one = runner(loaded)
    rows = []
    for t in range(n):
        p = np.array([t], dtype=np.int32)
        rows.append(one.native.forward(np.array(ids[t:t + 1], dtype=np.int32), p, p.astype(np.int64),
                                       np.zeros(1, dtype=np.int32), np.arange(one.num_blocks, dtype=np.int32),
                                       np.zeros(1, dtype=np.int32)))
    assert np.array_equal(got.numpy(), np.concatenate(rows))
    ref = all_logits(runner(loaded, "none", "float32"), ids)
    anchor = all_logits(runner(loaded, "none", "bfloat16"), ids).float()
    assert 0 < (got - ref).abs().mean().item() <= (anchor - ref).abs().mean().item()
