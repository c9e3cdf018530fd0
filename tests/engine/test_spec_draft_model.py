"""The draft-model proposer (engine/spec/draft_model.py): a second model of the target's vocabulary
drafts greedily, its KV cache indexed by the target's block tables. Greedy output is token for
token the plain engine's whatever the draft proposes (a model drafting for itself has every draft
accepted; another model few), through preemptions that take the sequence's blocks, and the
configuration is checked at start-up (vLLM's spelling: `model` alone means draft_model)."""

from __future__ import annotations

import json

import pytest

from tests.engine.tiny_models import cached_tiny, save_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.config import EngineConfig, SpeculativeConfig
from tokenpath.engine.spec.state import DraftState
from tokenpath.errors import ModelLoadError

PROMPTS = ["The quick brown fox", "def fib(n):\n    return", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def draft(path: object, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def tokens(llm: LLM, params: SamplingParams = GREEDY, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# ---------------------------------------------------------------- configuration
def test_a_model_alone_means_draft_model_as_in_vllm():
    cfg = SpeculativeConfig(model="/m", num_speculative_tokens=3)
    assert cfg.method == "draft_model"
    assert SpeculativeConfig(method="draft", model="/m", num_speculative_tokens=3).method == "draft_model"
    assert SpeculativeConfig(num_speculative_tokens=3).method == "ngram"


@pytest.mark.parametrize("bad, field", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "ngram", "model": "/m", "num_speculative_tokens": 3}, "model"),
])
def test_a_draft_model_config_missing_or_misplacing_model_is_refused(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=json.dumps(bad))


def test_a_draft_model_of_another_vocabulary_is_refused_at_load(tmp_path):
    other = save_tiny("llama", tmp_path / "draft", vocab_size=1000)
    with pytest.raises(ModelLoadError, match=r"speculative_config\.model .*vocabulary has 1000 tokens"):
        LLM(str(cached_tiny("qwen3")), speculative_config=draft(other))


# ---------------------------------------------------------------- exactness
def test_a_model_drafting_for_itself_has_every_draft_accepted():
    target = cached_tiny("qwen3")
    plain = tokens(LLM(str(target)))
    llm = LLM(str(target), speculative_config=draft(target))
    assert tokens(llm) == plain
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # the draft is the target: it never misses


def test_another_model_drafting_keeps_greedy_exact():
    target = cached_tiny("qwen3")
    plain = tokens(LLM(str(target)))
    llm = LLM(str(target), speculative_config=draft(cached_tiny("llama"), k=3))
    assert tokens(llm) == plain
    assert llm.engine.spec.stats.num_draft_tokens > 0


def test_preempted_sequences_recompute_the_drafts_kv_and_stay_exact():
    """A pool too small for every sequence preempts some mid-generation; their blocks (and the
    draft's KV in them) go back to the pool, so the draft must start over from position 0."""
    target = cached_tiny("qwen3")
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompts = [*PROMPTS, "Once upon a time", "Hello there", "A B C D"]
    plain = tokens(LLM(str(target), num_kv_blocks=12, block_size=16), params, prompts)
    llm = LLM(str(target), num_kv_blocks=12, block_size=16, speculative_config=draft(target))
    assert tokens(llm, params, prompts) == plain
    assert llm.engine.scheduler.num_preemptions > 0
    stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_sampled_requests_are_reproducible_with_a_draft_model():
    target = cached_tiny("qwen3")
    llm = LLM(str(target), speculative_config=draft(cached_tiny("llama")))
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)
    first, again = tokens(llm, params), tokens(llm, params)
    assert first == again and all(len(t) == 20 for t in first)


# ---------------------------------------------------------------- the draft's KV bookkeeping
def test_the_drafts_valid_kv_ends_at_the_first_rejected_draft():
    state = DraftState(None, 4)
    assert state.valid_draft_kv([1, 2, 3]) == 0  # never proposed: everything is fed
    state.proposed_at, state.proposed = 3, [7, 8, 9, 5]  # KV written for 7, 8, 9 (not for 5)
    assert state.valid_draft_kv([1, 2, 3, 7, 8, 4]) == 5  # 7, 8 accepted, then the target's 4
    assert state.valid_draft_kv([1, 2, 3, 7, 8, 9, 5, 6]) == 6  # all accepted: 5's KV was never written
    assert state.valid_draft_kv([1, 2, 3, 6]) == 3
    state.forget_draft_kv()
    assert state.valid_draft_kv([1, 2, 3, 7]) == 0
