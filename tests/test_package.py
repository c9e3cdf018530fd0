import math

import pytest

from tokenpath import SamplingParams
from tokenpath.errors import SamplingParamsError
from tokenpath.telemetry.timeline import STAGES, Timeline


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": math.nan},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": math.inf},
        {"top_k": -5},
        {"min_p": 1.5},
        {"presence_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"max_tokens": 0},
        {"min_tokens": 5, "max_tokens": 2},
        {"logprobs": 21},
        {"n": 0},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"temperature": "hot"},
    ],
)
def test_invalid_sampling_params_raise_typed_error(kw):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kw)


def test_valid_sampling_params():
    p = SamplingParams(temperature=0, stop="###", top_k=0)
    assert p.greedy and p.stop == ["###"] and p.top_k == -1


def test_timeline_durations():
    t = Timeline("r1")
    t0 = t.stamps["received"]
    t.stamp("body_read", at=t0 + 0.05)
    t.stamp("admitted", at=t0 + 0.1)
    t.stamp("dispatched", at=t0 + 0.3)
    t.stamp("scheduled", at=t0 + 0.5)
    t.stamp("first_token", at=t0 + 0.75)
    t.stamp("finished", at=t0 + 1.0)
    t.stamp("finished", at=t0 + 9.0)  # first stamp wins
    d = t.durations()
    assert list(d) == [s for s in STAGES if s not in ("reasoning", "model_load")]  # (no thinking, no load)
    assert d == pytest.approx({"upload": 0.05, "gateway": 0.05, "queue": 0.2, "engine_queue": 0.2, "prefill": 0.25,
                               "decode": 0.25, "total": 1.0})
    assert sum(v for k, v in d.items() if k != "total") == pytest.approx(d["total"])
    assert t.server_timing().startswith("upload;dur=50.0, gateway;dur=50.0, queue;dur=200.0")
