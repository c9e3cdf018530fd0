"""Greedy outputs are token-identical to Hugging Face transformers on the same weights (float32),
whatever the batching: one at a time, one batch, chunked prefill, prefix-cache hits, preemption."""

from __future__ import annotations

import pytest

from tests.engine.conftest import hf_greedy, make_prompts
from tokenpath import LLM, SamplingParams

LENGTHS = [10, 37, 64, 100, 200, 333, 480, 600]
NEW = 32


@pytest.fixture(scope="module")
def prompts(smol_llm_fp32):
    return make_prompts(smol_llm_fp32.tokenizer, LENGTHS)


@pytest.fixture(scope="module")
def reference(hf_smol, prompts, smol_llm_fp32):
    return hf_greedy(hf_smol, prompts, NEW, smol_llm_fp32.tokenizer.eos_token_id)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_one_at_a_time(smol_llm_fp32, prompts, reference):
    got = [tokens(smol_llm_fp32.generate([p], greedy()))[0] for p in prompts]
    assert got == reference


def test_one_batch(smol_llm_fp32, prompts, reference):
    assert tokens(smol_llm_fp32.generate(prompts, greedy())) == reference


def test_chunked_prefill(smol_llm_fp32, prompts, reference):
    sched = smol_llm_fp32.engine.scheduler
    old = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = 64  # every prompt over 64 tokens is prefilled in chunks
    try:
        assert tokens(smol_llm_fp32.generate(prompts, greedy())) == reference
    finally:
        sched.max_num_batched_tokens = old


def test_prefix_cache_second_pass(smol_llm_fp32, prompts, reference):
    smol_llm_fp32.generate(prompts, greedy())
    hits_before = smol_llm_fp32.engine.blocks.prefix_hits
    outs = smol_llm_fp32.generate(prompts, greedy())
    assert smol_llm_fp32.engine.blocks.prefix_hits > hits_before
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert tokens(outs) == reference


def test_preemption(prompts, reference):
    # 45 blocks of 16 tokens (the 600-token prompt alone needs 40) and 128-token chunks: prompts are
    # admitted chunk by chunk, then grow until the pool runs dry and the latest arrivals are preempted.
    llm = LLM("smollm2-135m-instruct", dtype="float32", quantization="none", num_kv_blocks=45, max_num_seqs=8,
              max_num_batched_tokens=128)
    outs = llm.generate(prompts, greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == reference
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    assert llm.engine.blocks.check_consistency() == []
