"""The sampler never fails a batch, whatever passed validation and whatever the logits hold.

Issue 10's adversarial run found four values that passed validation and then crashed the step
loop (temperature 1e-320, top_p 1e-46, repetition_penalty 1e-300, top_k 2**63). The fix is for
the class, not the cases: the property test below throws every extreme that validation accepts,
plus non-finite logits, at one batched call and requires a valid token for every row.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenpath.engine.rng import Generator
from tokenpath.engine.sampler import Sampler
from tokenpath.engine.sequence import Sequence
from tokenpath.errors import SamplingParamsError
from tokenpath.protocol.limits import TOP_K
from tokenpath.protocol.sampling_params import SamplingParams

VOCAB = 64


def seq(params: SamplingParams, outputs: list[int] | None = None) -> Sequence:
    prompt = [1, 2, 3, 4]
    return Sequence(request_id="r", index=0, token_ids=prompt + list(outputs or []), num_prompt_tokens=len(prompt),
                    params=params)


def tiny_floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Values spread over many orders of magnitude, subnormals included, within [lo, hi]."""
    edge = st.sampled_from([v for v in (lo, hi, 5e-324, 1e-320, 1e-300, 1e-46, 1e-38, 1e-8, 1e-5, 0.01, 0.5)
                            if lo <= v <= hi])
    return st.one_of(edge, st.floats(lo, hi, allow_nan=False, allow_infinity=False))


params_strategy = st.builds(
    SamplingParams,
    temperature=tiny_floats(0.0, 2.0),
    top_p=tiny_floats(5e-324, 1.0),
    top_k=st.one_of(st.just(-1), st.integers(1, TOP_K.value)),
    min_p=tiny_floats(0.0, 1.0),
    presence_penalty=tiny_floats(-2.0, 2.0),
    frequency_penalty=tiny_floats(-2.0, 2.0),
    repetition_penalty=tiny_floats(0.01, 2.0),
    min_tokens=st.integers(0, 3),
    max_tokens=st.just(16),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
)

logit_values = st.one_of(st.floats(-1e4, 1e4), st.sampled_from([float("inf"), -float("inf"), float("nan"), 3e38]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(params_strategy, st.lists(logit_values, min_size=VOCAB, max_size=VOCAB)),
                     min_size=1, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_valid_params_and_any_logits_give_a_token_per_row(rows, dtype):
    seqs = [seq(p, outputs=[5, 5, 6]) for p, _ in rows]
    for s in seqs:
        if s.params.seed is not None:
            s.generator = Generator(s.params.seed % 2**64)
    # (bfloat16: the torch path's logits, widened to float32 as ModelRunner hands them over)
    logits = torch.tensor([v for _, v in rows], dtype=torch.float32).to(dtype).float().numpy()
    result = Sampler(eos_token_id=0)(logits, seqs)
    assert len(result.token_ids) == len(rows)
    assert all(0 <= t < VOCAB for t in result.token_ids)


@pytest.mark.parametrize("value", [1e-320, 1e-38, 5e-324])
def test_temperature_below_eps_is_greedy(value):
    p = SamplingParams(temperature=value)
    assert p.greedy
    logits = np.random.default_rng(1).standard_normal((2, VOCAB)).astype(np.float32)
    assert Sampler(0)(logits, [seq(p), seq(p)]).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_the_most_likely_token():
    p = SamplingParams(temperature=1.0, top_p=1e-46, seed=1)
    logits = np.random.default_rng(2).standard_normal((3, VOCAB)).astype(np.float32)
    assert Sampler(0)(logits, [seq(p)] * 3).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 1e-300), ("repetition_penalty", 0.0), ("top_k", 2**63), ("top_k", 2**31),
    ("temperature", math.nan), ("top_p", 0.0), ("temperature", 2.5),
])
def test_values_the_sampler_cannot_compute_are_refused_naming_the_param(field, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and field in err.value.message
