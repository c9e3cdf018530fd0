"""Prompt rows mostly at llama.cpp's int8, generated rows with residual bytes (issue 42).

Prefill is bound by the integer work of its GEMMs and decode by reading the weights, so by default
the native kernels run most of a prompt's matmuls at llama.cpp's own precision (int8 activations;
the quality bar is its perplexity on the same file; qkv keeps the residual byte) and the rows of
generated tokens carry the second, residual byte everywhere. Which a row takes is decided by its
position against its own prompt, never by what else shares the step: a request gives the same
numbers alone, batched, or chunked.

On a CPU with AMX-BF16 a prompt row's qkv, o, gate_up and down take bf16 activations on tiles
instead (the weights dequantized into bf16 tiles, csrc/tile_pack.h); the mask tests below run
with --kernels-bf16 0, the invariance tests with the default.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.conftest import make_prompts
from tests.engine.tiny_models import cached_tiny, save_gguf
from tokenpath import LLM, SamplingParams
from tokenpath.config import EngineConfig
from tokenpath.engine.kernels.precision import DEFAULT_PROMPT_FINE
from tokenpath.engine.loader import LoadedModel, load_model
from tokenpath.engine.runner import ModelRunner

pytestmark = [pytest.mark.requires("kernels")]

BLOCKS = 8  # 128 positions: slot i holds position i


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "qwen3moe"])
def model(request, smol_loaded) -> LoadedModel:
    if request.param == "smollm2":  # Q4_1 and Q8_0 rows (packed_impl.h)
        return smol_loaded
    if request.param == "gemma3":  # Q4_K, Q5_0, Q6_K rows (kquant_impl.h) and a GeGLU
        return load_model("gemma-3-270m")
    hf_dir = cached_tiny("qwen3moe")  # its sparse MLP groups rows by expert: runs of rows inside a group
    return load_model(str(save_gguf("qwen3moe", hf_dir, hf_dir.parent / "model.gguf")))


def _runner(loaded: LoadedModel, **knobs) -> ModelRunner:
    cfg = EngineConfig(dtype="float32", num_kv_blocks=BLOCKS, disable_hybrid_kv_cache_manager=True, **knobs)
    r = ModelRunner(loaded, cfg, BLOCKS * 16)
    assert r.native is not None
    return r


def _forward(r: ModelRunner, ids: list[int], start: int, generated: np.ndarray | None) -> np.ndarray:
    """Rows at positions start.. of one sequence whose block table is 0..BLOCKS-1."""
    assert r.native is not None
    pos = np.arange(start, start + len(ids), dtype=np.int32)
    return r.native.forward(np.asarray(ids, dtype=np.int32), pos, pos.astype(np.int64),
                            np.zeros(len(ids), dtype=np.int32), np.arange(BLOCKS, dtype=np.int32),
                            np.arange(len(ids), dtype=np.int32), generated=generated)


def _ids(loaded: LoadedModel, n: int) -> list[int]:
    return torch.randint(3, loaded.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def test_prompt_rows_take_the_prompt_mask_and_generated_rows_the_fine_one(model):
    ids = _ids(model, 40)
    default, fine = _runner(model, kernels_bf16=0), _runner(model, kernels_prompt_fine=31, kernels_bf16=0)
    prompt = np.zeros(40, dtype=bool)
    # Every row a prompt row: the numbers of kernels whose every row takes the prompt mask
    # (qkv with residual bytes), not the all-fine ones.
    got = _forward(default, ids, 0, prompt)
    assert np.array_equal(got, _forward(_runner(model, kernels_fine=DEFAULT_PROMPT_FINE, kernels_bf16=0), ids, 0, None))
    assert not np.array_equal(got, _forward(fine, ids, 0, prompt))
    # --kernels-prompt-fine 0: llama.cpp's int8 exactly.
    int8_prompt = _runner(model, kernels_prompt_fine=0, kernels_bf16=0)
    assert np.array_equal(_forward(int8_prompt, ids, 0, prompt),
                          _forward(_runner(model, kernels_fine=0, kernels_bf16=0), ids, 0, None))
    # Every row a generated one: the residual bytes everywhere, as every row took them before.
    assert np.array_equal(_forward(default, ids, 0, ~prompt), _forward(fine, ids, 0, None))
    assert np.array_equal(_forward(int8_prompt, ids, 0, ~prompt), _forward(fine, ids, 0, None))


def test_prompt_rows_take_tiles_where_the_cpu_has_amx(model):
    """The default: with AMX-BF16, prompt rows on tiles (not the int8 mask's numbers), generated rows
    exactly as without tiles; without AMX, nothing changes at all."""
    ids, prompt = _ids(model, 40), np.zeros(40, dtype=bool)
    tiles, plain = _runner(model), _runner(model, kernels_bf16=0)
    assert not plain.native.prompt_tiles
    assert np.array_equal(_forward(tiles, ids, 0, ~prompt), _forward(plain, ids, 0, ~prompt))
    got, before = _forward(tiles, ids, 0, prompt), _forward(plain, ids, 0, prompt)
    if not tiles.native.lib.has_amx_bf16:
        assert not tiles.native.prompt_tiles and np.array_equal(got, before)
        return
    assert tiles.native.prompt_tiles and not np.array_equal(got, before)
    # bf16 rows on 4-6 bit weights: closer to the fine rows' numbers than the int8 prompt rows are
    fine = _forward(_runner(model, kernels_prompt_fine=31, kernels_bf16=0), ids, 0, prompt)
    assert np.abs(got - fine).mean() <= np.abs(before - fine).mean()  # measured 0.42x (Gemma 3)


@pytest.mark.parametrize("prompt_mask", [DEFAULT_PROMPT_FINE, 0])
def test_a_mixed_step_equals_its_rows_in_steps_of_their_own(model, prompt_mask):
    """24 prompt rows and 16 generated ones in one step (the GEMMs split into runs of rows with and
    without residual bytes) give what the prompt's step and then 16 one-row decode steps give."""
    ids, r = _ids(model, 40), _runner(model, kernels_prompt_fine=prompt_mask)
    generated = np.arange(40) >= 24
    whole = _forward(r, ids, 0, generated)
    parts = [_forward(r, ids[:24], 0, generated[:24])]
    parts += [_forward(r, ids[t:t + 1], t, generated[t:t + 1]) for t in range(24, 40)]
    assert np.array_equal(whole, np.concatenate(parts))
    interleaved = np.arange(40) % 3 == 0  # runs of one and two rows, alternating
    assert np.array_equal(_forward(r, ids, 0, interleaved),
                          np.concatenate([_forward(r, ids[t:t + 1], t, interleaved[t:t + 1]) for t in range(40)]))


@pytest.mark.slow  # loads the packaged SmolLM2 (tests/tiers.py)
def test_a_request_gives_the_same_tokens_and_logprobs_alone_and_batched():
    """Through the engine, SmolLM2: one request alone, then with three others whose chunked prompts
    share its decode steps (max_num_batched_tokens 48)."""
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_num_batched_tokens=48, max_num_seqs=8,
              kv_cache_memory="64MiB")
    prompts = make_prompts(llm.tokenizer, [30, 90, 17, 60], seed=5)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    alone = llm.generate([prompts[0]], p)[0].outputs[0]
    batched = llm.generate(prompts, p)[0].outputs[0]
    assert alone.token_ids == batched.token_ids
    assert alone.logprobs == batched.logprobs
