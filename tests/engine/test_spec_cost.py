"""The cost-aware draft length (engine/spec/cost.py, state.py): a sequence drafts only the tokens
that pay for their verification rows at the engine's own measured step prices."""

from __future__ import annotations

import json

import pytest

from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.config import SpeculativeConfig
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.cost import StepPrices, best_drafts, expected_tokens
from tokenpath.engine.spec.decoder import SpecDecoder


def _seq() -> Sequence:
    return Sequence("r", 0, [1, 2, 3, 1, 2], 5, SamplingParams(temperature=0, max_tokens=100))


def _priced(per_row: float, k: int = 16) -> SpecDecoder:
    """A decoder whose engine timed 1..17-row steps at 10 ms + `per_row` of that a row."""
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=k, draft_policy="cost"), max_model_len=4096)
    for rows in (1, 2, 5, 9, 17):
        for _ in range(3):
            spec.observe_step(rows, 0.010 * (1 + per_row * (rows - 1)))
    return spec


def test_prices_are_learned_from_step_timings():
    prices = StepPrices()
    assert prices.price(5) == pytest.approx(1 + 4 * prices.prior_row_cost)  # nothing timed: the prior
    for t in (0.010, 0.011, 0.500):  # a step the host delayed: the median ignores it
        prices.observe(1, t)
    for t in (0.030, 0.030, 0.031):
        prices.observe(9, t)
    assert prices.price(1) == pytest.approx(0.011)
    assert prices.price(5) == pytest.approx((0.011 + 0.030) / 2)  # interpolated between sizes timed
    assert prices.price(17) == pytest.approx(0.030 + 8 * (0.030 - 0.011) / 8)  # extrapolated
    assert prices.observed(9) == 3 and prices.observed(2) == 0


@pytest.mark.parametrize("policy", ["cost", "adaptive", "rule"])
def test_the_engine_feeds_its_decode_step_times_to_the_prices(policy: str):
    """Under the priced policies only (cost, and the default adaptive): the rule alone does not
    use them, so it keeps none."""
    model = str(cached_tiny("llama"))
    llm = LLM(model, num_kv_blocks=64, block_size=4, dtype="float32", quantization="none",
              speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 4, "draft_policy": policy}))
    prompt = llm.tokenizer.encode("a b c d e f a b c d e f")
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    prices = llm.engine.spec.prices
    decode_prices = sum(prices.observed(n) for n in range(1, 6))  # decode steps (1 + up to 4 drafts)
    assert decode_prices >= 5 if policy != "rule" else decode_prices == 0
    assert len(prompt) > 5 and prices.observed(len(prompt)) == 0  # a prefill is no decode price


def test_low_acceptance_at_high_row_prices_drafts_nothing_then_probes():
    spec = _priced(per_row=0.3)
    seq = _seq()
    spec.draft_len(seq, budget=64)
    for _ in range(3):
        seq.spec.settle(accepted=0, max_k=16, proposed=1)  # misses: its estimate drops
        seq.spec.pause = 0
    seq.spec.k = 16
    assert spec.draft_len(seq, budget=64) == 0  # 1 + a tokens do not pay for 1.3x a step
    waits = 0
    while (k := spec.draft_len(seq, budget=64)) == 0:
        waits += 1
    assert waits >= 1 and k == 1  # it paused, then probes with one draft


def test_high_acceptance_at_cheap_rows_drafts_long():
    spec = _priced(per_row=0.05)
    seq = _seq()
    lengths = []
    for _ in range(5):
        k = spec.draft_len(seq, budget=64)
        lengths.append(k)
        spec.settle(seq, proposed=k, accepted=k)  # a copy: every draft accepted
    assert lengths[-1] == 16
    assert lengths == sorted(lengths)  # ramping up as the copy keeps matching


def test_the_length_is_where_tokens_per_step_time_peak():
    spec = _priced(per_row=0.25)
    assert best_drafts(spec.prices, accept=0.9, limit=16) == max(
        range(17), key=lambda k: expected_tokens(0.9, k) / (1 + 0.25 * k))
    assert 0 < best_drafts(spec.prices, accept=0.9, limit=16) < 16
    assert best_drafts(spec.prices, accept=0.99, limit=16) > best_drafts(spec.prices, accept=0.9, limit=16)
    assert best_drafts(spec.prices, accept=0.1, limit=16) == 0


def test_in_a_batch_extra_rows_are_cheaper_so_it_drafts_at_lower_acceptance():
    prices = StepPrices()
    for rows, t in ((1, 0.010), (2, 0.013), (4, 0.014), (5, 0.0142), (6, 0.0144), (8, 0.016)):
        prices.observe(rows, t)
    assert best_drafts(prices, accept=0.3, limit=4, rows=1) == 0
    assert best_drafts(prices, accept=0.3, limit=4, rows=4) > 0
