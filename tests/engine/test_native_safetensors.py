"""bf16, fp16 and fp32 safetensors checkpoints run on the native kernels by default, on their own values.

What users bring are HF safetensors in bf16: they used to go to the torch path (0.38x vLLM's CPU
build on the same file). Under `--quantization auto` they now run natively: the kernels' BF16/F16
matrices keep the file's exact values and multiply float32 activations, which is `--dtype float32`'s
arithmetic on those weights. So the reference is the torch path in float32 on the same checkpoint,
and the two agree to float32 rounding (summation order only). A float32 checkpoint runs the same
way on the kernels' F32 matrices (F32X16), unless a 16-bit --dtype asks for a conversion.

On a CPU with AMX-BF16 (tiles) or AVX512_BF16 (VDPBF16PS) a bf16 checkpoint's matmuls take bf16
activations by default, as vLLM CPU and transformers compute it (`--kernels-bf16`, kernels/precision.py DEFAULT_BF16); the exact
comparison runs with `--kernels-bf16 0`, and the default is held to torch's own bf16 arithmetic.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.engine.test_native_families import VOCAB, save_family
from tests.engine.test_quantized_quality import WINDOW, all_logits
from tokenpath.config import KERNEL_MASK_ALL, EngineConfig
from tokenpath.engine import kernels as K
from tokenpath.engine.loader import load_model
from tokenpath.engine.loader_hf import HFWeights
from tokenpath.engine.runner import ModelRunner

lib = K.native_library()
pytestmark = pytest.mark.requires("kernels")
# Native F32X16 against torch float32 logits, relative to the largest: summation order only.
F32_BOUND = 1e-5


def runner(loaded, quantization: str = "auto", dtype: str = "auto", bf16: int | None = None) -> ModelRunner:
    cfg = EngineConfig(quantization=quantization, dtype=dtype, num_kv_blocks=WINDOW // 16, kv_cache_dtype="float32",
                       disable_hybrid_kv_cache_manager=True, kernels_bf16=bf16)
    return ModelRunner(loaded, cfg, WINDOW)


def checkpoint(kind: str, dtype: torch.dtype, path) -> str:
    import transformers

    d = save_family(kind, path / "f32")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    model.save_pretrained(str(path / str(dtype)), safe_serialization=True)
    return str(path / str(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["llama3-rope", "qwen3", "gemma3"])
def test_16_bit_checkpoints_run_natively_on_their_own_values(kind, dtype, tmp_path, caplog):
    loaded = load_model(checkpoint(kind, dtype, tmp_path))
    assert isinstance(loaded.weights, HFWeights)  # read lazily: no copy of the checkpoint held beside the model
    with caplog.at_level(logging.INFO, logger="tokenpath.engine.kernels"):
        native = runner(loaded, bf16=0)  # float32 activations on any CPU
    assert native.native is not None and native.native.bf16 == 0
    stored = K.BF16X16 if dtype == torch.bfloat16 else K.F16X16
    assert f"own {'BF16' if dtype == torch.bfloat16 else 'F16'} matrices" in caplog.text
    assert native.native.weight_types == (K.TYPE_NAMES[stored],)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    got = all_logits(native, ids)
    ref = all_logits(runner(loaded, "none", "float32"), ids)  # torch, the same bf16/fp16 values in float32
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    print(f"{kind} {dtype}: max |native - torch float32| / max |torch| = {err:.2e}")
    assert err <= 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen3", "gemma3"])
def test_bf16_checkpoints_take_bf16_activations(kind, tmp_path, caplog):
    """By default, where the CPU has AMX-BF16 (tiles) or AVX512_BF16 (VDPBF16PS): every matmul's rows
    in bf16, and the logits no further from the float32 arithmetic than transformers' own bf16
    forward of the checkpoint (the anchor's precision: vLLM CPU computes it in bf16 too). Without
    either the mask has nothing to run on: the model logs none and computes exactly what
    --kernels-bf16 0 computes."""
    loaded = load_model(checkpoint(kind, torch.bfloat16, tmp_path))
    with caplog.at_level(logging.INFO, logger="tokenpath.engine.kernels"):
        native = runner(loaded)
    assert native.native is not None
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    got = all_logits(native, ids)
    exact = all_logits(runner(loaded, bf16=0), ids)
    if not (lib.has_amx_bf16 or lib.has_bf16_dot):
        assert native.native.bf16 == 0 and "for []" in caplog.text
        assert torch.equal(got, exact)
        return
    assert native.native.bf16 == KERNEL_MASK_ALL
    engine = "AMX tiles" if lib.has_amx_bf16 else "VDPBF16PS"
    assert f"bf16 on {engine} for [qkv,o,gate_up,down,head]" in caplog.text
    ref = all_logits(runner(loaded, "none", "float32"), ids)
    anchor = all_logits(runner(loaded, "none", "bfloat16"), ids).float()  # torch, every op in bf16
    ours, theirs = (got - ref).abs().mean().item(), (anchor - ref).abs().mean().item()
    print(f"{kind}: mean |logit - float32|: native bf16 rows {ours:.2e}, torch bf16 {theirs:.2e}")
    assert 0 < ours <= theirs  # bf16 rows, not float32 ones, and no worse than the anchor's arithmetic
    assert not torch.equal(got, exact)


def test_a_bf16_row_gives_the_same_numbers_alone_and_in_any_step(tmp_path):
    """bf16 rows run on tiles whatever their number (one row is a tile of its own; up to 32 stream the
    weights, more reuse packed tiles), so a step of 40 rows equals a 24-row prompt step followed by
    16 one-row steps, on AMX and off it."""
    r = runner(load_model(checkpoint("qwen3", torch.bfloat16, tmp_path)))
    assert r.native is not None
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()

    def forward(part: list[int], start: int) -> np.ndarray:
        pos = np.arange(start, start + len(part), dtype=np.int32)
        return r.native.forward(np.asarray(part, dtype=np.int32), pos, pos.astype(np.int64),
                                np.zeros(len(part), dtype=np.int32), np.arange(r.num_blocks, dtype=np.int32),
                                np.arange(len(part), dtype=np.int32))

    whole = forward(ids, 0)
    parts = [forward(ids[:24], 0)] + [forward(ids[t : t + 1], t) for t in range(24, 40)]
    assert np.array_equal(whole, np.concatenate(parts))


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen3", "gemma3"])
def test_float32_checkpoints_run_natively_on_their_own_values(kind, tmp_path, caplog):
    """The F32X16 matrices hold the file's float32 values and multiply float32 activations: the
    torch float32 path's arithmetic but for the order of the sums (the kernels add each output's
    products in K order; torch's GEMM in blocks), so the logits agree to a few float32 roundings."""
    loaded = load_model(save_family(kind, tmp_path / "f32"))
    assert isinstance(loaded.weights, HFWeights)
    # the rows the repack reads: the file's bytes in place (a view of the map), 4 per weight
    view = loaded.weights.matrix_bytes("layers.0.q_proj.weight")
    dense = loaded.weights.dense("layers.0.q_proj.weight")
    assert view is not None and view.base is not None and view.shape == (dense.shape[0], 4 * dense.shape[1])
    assert np.array_equal(view.view(np.float32), dense)
    with caplog.at_level(logging.INFO, logger="tokenpath.engine.kernels"):
        native = runner(loaded)
    assert native.native is not None
    assert "own F32 matrices" in caplog.text
    assert native.native.weight_types == ("F32X16",)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    got = all_logits(native, ids)
    ref = all_logits(runner(loaded, "none", "float32"), ids)  # torch, float32 (the file's dtype)
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    print(f"{kind} float32: max |native - torch float32| / max |torch| = {err:.2e}")
    assert err <= F32_BOUND
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_dtype_choices(tmp_path):
    """auto and float32 (the kernels' arithmetic) and the file's own dtype run natively; another
    16-bit dtype (on a float32 file too: a conversion) and quantization none stay on torch; q8_0
    quantizes any."""
    bf16 = load_model(checkpoint("llama3-rope", torch.bfloat16, tmp_path))
    assert runner(bf16, dtype="float32").native is not None
    assert runner(bf16, dtype="bfloat16").native is not None
    assert runner(bf16, dtype="float16").native is None
    assert runner(bf16, quantization="none").native is None
    q8 = runner(bf16, quantization="q8_0").native
    assert q8 is not None and q8.weight_types == ("Q8X16",)
    f32 = load_model(str(tmp_path / "f32"))
    assert runner(f32).native is not None
    assert runner(f32, dtype="float32").native is not None
    assert runner(f32, dtype="bfloat16").native is None
    assert runner(f32, dtype="float16").native is None
    assert runner(f32, quantization="none").native is None
    q8 = runner(f32, quantization="q8_0").native
    assert q8 is not None and q8.weight_types == ("Q8X16",)


def test_a_16_bit_checkpoint_loads_and_generates_natively_without_importing_torch(tmp_path):
    """The native path reads a safetensors checkpoint with numpy (HFWeights.raw/dense/matrix_bytes):
    torch is ~100 MiB of a serving process's RSS, and a bf16 SmolLM2 served 561 MiB with it, 378
    without. The child generates the same greedy tokens as this (torch-importing) process."""
    import shutil
    import subprocess
    import sys

    import transformers

    from tests.engine.tiny_models import cached_tiny
    from tokenpath.engine.llm import LLM
    from tokenpath.protocol import SamplingParams

    src = cached_tiny("qwen3")
    transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(str(tmp_path))
    for f in src.glob("*"):
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, tmp_path / f.name)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = LLM(str(tmp_path)).generate("The capital of France is", params)[0].outputs[0].token_ids
    code = ("import sys\nfrom tokenpath.engine.llm import LLM\nfrom tokenpath.protocol import SamplingParams\n"
            f"llm = LLM({str(tmp_path)!r})\nassert llm.engine.runner.native is not None\n"
            "out = llm.generate('The capital of France is', SamplingParams(max_tokens=12, temperature=0.0, "
            "ignore_eos=True))\nprint(list(out[0].outputs[0].token_ids), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    tokens, imported = out.stdout.strip().rsplit(" ", 1)
    assert imported == "False", "the native load imported torch"
    assert tokens == str(list(want))
