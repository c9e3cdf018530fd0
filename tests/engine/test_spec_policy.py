"""The default draft policy ("adaptive", engine/spec/state.py and decoder.py): a sequence drafts
only the tokens expected to pay for their verification rows at the engine's measured step
prices, and a stream whose drafting steps lose against plain decoding stops drafting, for pauses
that double, however many drafts each step accepted. Driven by hand: `_replay` runs a sequence's
steps through the decoder with a chosen acceptance, and prices each step as the engine would."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tokenpath import SamplingParams
from tokenpath.config import SpeculativeConfig
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.decoder import SpecDecoder
from tokenpath.engine.spec.ngram import NgramIndex
from tokenpath.engine.spec.state import DraftState

# A T-row step against a 1-row step, SmolLM2-135M Q4_1 on 2 threads at context 400 (quiet, stop 58:
# benchmarks/results/step_rows_quiet.md): the shape the engine measures on this host.
MEASURED = {1: 1.0, 2: 1.24, 3: 1.50, 4: 1.72, 5: 1.79, 8: 2.65, 9: 2.99, 17: 5.35}


def _seq(**params) -> Sequence:
    return Sequence("r", 0, [1, 2, 3, 1, 2], 5, SamplingParams(**{"temperature": 0, "max_tokens": 1000, **params}))


def _decoder(policy: str = "adaptive", prices: dict[int, float] | None = None) -> SpecDecoder:
    """A decoder whose engine timed steps of these row counts at these prices (10 ms a plain step)."""
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=16, draft_policy=policy), max_model_len=4096)
    for rows, price in (prices or MEASURED).items():
        for _ in range(3):
            spec.observe_step(rows, 0.010 * price)
    return spec


def _replay(spec: SpecDecoder, accepted_of: Callable[[int], int], steps: int = 200) -> tuple[float, int]:
    """`steps` decode steps of one sequence, `accepted_of(k)` of each step's k drafts accepted:
    (tokens per unit of time against plain decoding at the decoder's prices, drafting steps)."""
    seq = _seq()
    tokens = cost = 0.0
    drafting = 0
    for _ in range(steps):
        k = spec.draft_len(seq, budget=64)
        accepted = accepted_of(k) if k else 0
        cost += spec.prices.price(1 + k) / spec.prices.price(1)
        tokens += accepted + 1
        if k:
            spec.settle(seq, proposed=k, accepted=accepted)
            drafting += 1
    return tokens / cost, drafting


def _iid(p: float, seed: int = 0) -> Callable[[int], int]:
    """Drafts accepted one after another with probability `p` each (the first rejection ends them)."""
    rng = random.Random(seed)

    def accepted_of(k: int) -> int:
        a = 0
        while a < k and rng.random() < p:
            a += 1
        return a

    return accepted_of


@pytest.mark.parametrize("p", [0.2, 0.35, 0.5])
def test_a_low_acceptance_stream_loses_at_most_3_percent_against_plain_decoding(p: float):
    """On the old rule (one more than accepted, doubling after a full acceptance, a pause only
    after a step that accepted nothing) these streams lost 5-20% at the measured prices."""
    for seed in range(3):
        speedup, _ = _replay(_decoder(), _iid(p, seed))
        assert speedup >= 0.97, (p, seed, speedup)


def test_a_stream_whose_drafts_hold_for_one_token_drafts_one():
    """Every draft's first token accepted, the rest rejected, at rows dearer than the old rule
    assumed free: it drafted one more than accepted, 2 every step (2 tokens for 2.2 steps' time,
    0.91x); priced, one draft a step pays (2 tokens for 1.6)."""
    dear = {r: 1.0 + 0.6 * (r - 1) for r in (1, 2, 3, 5, 9, 17)}
    speedup, drafting = _replay(_decoder(prices=dear), lambda k: min(k, 1))
    assert speedup >= 1.1 and drafting >= 150


def test_a_stream_that_loses_even_on_one_draft_stops_drafting():
    """A draft accepted one time in four at 0.6 of a step a row: drafting loses at any length, so
    after its probes it drafts in few of the steps."""
    dear = {r: 1.0 + 0.6 * (r - 1) for r in (1, 2, 3, 5, 9, 17)}
    speedup, drafting = _replay(_decoder(prices=dear), _iid(0.25))
    assert speedup >= 0.97
    assert drafting <= 30  # of 200 steps


def test_a_copy_still_drafts_long():
    """Every draft accepted: the copy ramps up within a few steps and gains well over 2x."""
    speedup, drafting = _replay(_decoder(), lambda k: k, steps=60)
    assert speedup > 2.5 and drafting == 60
    seq = _seq()
    spec = _decoder()
    lengths = []
    for _ in range(6):
        k = spec.draft_len(seq, budget=64)
        lengths.append(k)
        spec.settle(seq, proposed=k, accepted=k)
    assert lengths == sorted(lengths) and lengths[-1] >= 8


def test_a_losing_step_pauses_even_when_it_accepted_some():
    state = DraftState(NgramIndex(1, 2), k=4)
    state.settle(accepted=1, max_k=4, proposed=4, gain=-0.5)
    assert state.pause == 1
    state.pause = 0
    state.settle(accepted=1, max_k=4, proposed=2, gain=-0.2)
    assert state.pause == 2  # the pause doubles, as after misses
    state.pause = 0
    state.settle(accepted=2, max_k=4, proposed=3, gain=1.5)
    assert (state.pause, state.backoff) == (0, 1)  # a step that paid halves the backing off
    state.settle(accepted=1, max_k=4, proposed=2, gain=-0.4)
    assert state.pause == 0  # the ledger's earlier gain covers a small loss
    state.settle(accepted=2, max_k=4, proposed=2)  # without a gain (the rule): as before
    assert (state.k, state.pause) == (4, 0)


def test_the_rule_policy_ignores_prices():
    spec = _decoder("rule", prices={1: 1.0, 17: 100.0})
    assert not spec.keeps_prices
    assert spec.draft_len(_seq(), budget=64) == 16


def test_a_seeded_sampled_sequence_drafts_by_the_prior_not_the_timings():
    """Its acceptance tests draw from its own random stream once per draft, so its draft lengths
    must not follow the host's timings: two engines timed differently draft it alike."""
    cheap, dear = _decoder(prices={1: 1.0, 17: 1.5}), _decoder(prices={1: 1.0, 17: 20.0})
    runs = []
    for spec in (cheap, dear):
        seq = _seq(temperature=0.8, seed=7)
        lengths = []
        for accepted in (1, 0, 2, 3, 0, 1):
            k = spec.draft_len(seq, budget=64)
            lengths.append(k)
            if k:
                spec.settle(seq, proposed=k, accepted=min(accepted, k))
        runs.append(lengths)
    assert runs[0] == runs[1] and any(runs[0])
