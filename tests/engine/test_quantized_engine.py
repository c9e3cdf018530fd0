"""The engine's behaviour on the native kernels (tiny safetensors checkpoints quantized to Q8_0 at
load): greedy outputs are the same whatever the batching, chunking, prefix hits and preemption
(every row is computed independently, so the native path is batch-invariant), and the churn test
(aborts, stop strings, preemption, block accounting) passes unchanged on it."""

from __future__ import annotations

import pytest

from tests.engine import test_churn
from tests.engine.conftest import make_prompts
from tests.engine.tiny_models import save_tiny
from tokenpath import LLM, SamplingParams

pytestmark = pytest.mark.requires("kernels")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_dir(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param), tie=request.param == "qwen2")


@pytest.mark.parametrize(("isa", "kv"), [("avx2", "auto"), ("auto", "auto"), ("auto", "float32")])
def test_greedy_is_batch_invariant(tiny_dir, isa, kv, monkeypatch):
    """kv auto is the float16 KV cache (F16C permitting); float32 keeps the other pool layout tested."""
    monkeypatch.setenv("TOKENPATH_KERNELS_ISA", isa)
    llm = LLM(str(tiny_dir), quantization="q8_0", num_kv_blocks=40, max_num_batched_tokens=48, max_num_seqs=10,
              kv_cache_dtype=kv)
    assert llm.engine.runner.native is not None
    assert llm.engine.runner.kv_dtype == ("float16" if kv == "auto" and llm.engine.runner.native.lib.has_f16c
                                          else "float32")
    prompts = make_prompts(llm.tokenizer, [5, 17, 40, 90, 150, 210, 8, 33, 61, 120], seed=3)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one_by_one = [llm.generate([x], p)[0].outputs[0].token_ids for x in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]  # chunked, preempting
    assert llm.engine.scheduler.num_preemptions > 0
    llm.generate([prompts[5]], p)
    again = llm.generate([prompts[5]], p)[0]  # its 210-token prompt now mostly from the prefix cache
    assert again.num_cached_tokens > 0
    assert batched == one_by_one
    assert again.outputs[0].token_ids == one_by_one[5]
    assert all(len(t) == 24 for t in one_by_one)
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_churn_on_native(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENPATH_QUANTIZATION", "q8_0")
    test_churn.test_random_mix_frees_everything(tmp_path)


def test_none_keeps_the_torch_path(tmp_path):
    llm = LLM(str(save_tiny("llama", tmp_path / "t")), quantization="none", num_kv_blocks=8)
    assert llm.engine.runner.native is None
