"""Metric arithmetic against hand-computed records (the definitions of `vllm bench serve`)."""

import pytest

from tokenpath.bench.metrics import (
    Stats,
    meets_slo,
    parse_duration,
    parse_slo,
    percentile,
    summarize,
)
from tokenpath.bench.records import RequestRecord


def rec(i, ttft, itl, out, prompt=10, timing=None, **kw):
    """A successful record whose E2EL is TTFT plus the sum of its ITL gaps (as the client measures)."""
    return RequestRecord(index=i, success=True, status=200, ttft=ttft, itl=list(itl), e2el=ttft + sum(itl),
                         output_tokens=out, output_tokens_source="usage", prompt_tokens=prompt,
                         intended_input_len=prompt, intended_output_len=kw.pop("asked", out),
                         server_timing=timing, **kw)


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = rec(0, 0.2, [0.1, 0.1, 0.3], out=4)
    assert r.e2el == pytest.approx(0.7)
    assert r.tpot == pytest.approx((0.7 - 0.2) / 3)


def test_tpot_undefined_for_one_token_or_failure():
    assert rec(0, 0.2, [], out=1).tpot is None
    assert RequestRecord(index=1, success=False, status=500).tpot is None


def test_percentile_linear_interpolation():
    vals = [1.0, 2.0, 3.0, 4.0]
    assert percentile(vals, 50) == pytest.approx(2.5)
    assert percentile(vals, 90) == pytest.approx(3.7)  # rank 0.9*3 = 2.7 -> 3 + 0.7*(4-3)
    assert percentile(vals, 99) == pytest.approx(3.97)
    assert percentile([], 50) is None


def test_stats_in_milliseconds():
    s = Stats.of([0.1, 0.2, 0.3, 0.4])
    assert (s.count, s.mean, s.median) == (4, pytest.approx(250.0), pytest.approx(250.0))
    assert s.p90 == pytest.approx(370.0) and s.p99 == pytest.approx(397.0)
    assert Stats.of([]).mean is None


def test_summary_by_hand():
    records = [
        rec(0, 0.1, [0.05, 0.05, 0.05], out=4, prompt=100),  # e2el .25, tpot .05
        rec(1, 0.3, [0.1, 0.2], out=3, prompt=120),  # e2el .6,  tpot .15
        RequestRecord(index=2, success=False, status=429, error="http:busy"),
        RequestRecord(index=3, success=False, status=None, error="connect:refused"),
        RequestRecord(index=4, success=False, status=500, error="http:boom"),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s.completed, s.failed) == (2, 3)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(7 / 2.0)
    assert s.total_token_throughput == pytest.approx((7 + 220) / 2.0)
    assert s.mean_prompt_tokens == pytest.approx(110.0)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    assert s.ttft_ms.median == pytest.approx(200.0)
    assert s.tpot_ms.mean == pytest.approx(100.0)
    # ITL pools every gap of every request: [50, 50, 50, 100, 200]
    assert s.itl_ms.count == 5
    assert s.itl_ms.mean == pytest.approx(90.0)
    assert s.itl_ms.median == pytest.approx(50.0)
    assert s.itl_ms.p90 == pytest.approx(160.0)  # rank 3.6 -> 100 + 0.6*100
    assert s.e2el_ms.mean == pytest.approx(425.0)
    assert s.errors == {"total": 3, "http_429": 1, "by_status": {"429": 1, "500": 1, "connect": 1}}
    assert s.goodput is None and s.good_requests is None
    assert s.exact_output_fraction == 1.0


def test_goodput_counts_requests_meeting_every_bound():
    slo = parse_slo("ttft=500ms,tpot=100ms")
    assert slo == {"ttft": 0.5, "tpot": 0.1}
    records = [
        rec(0, 0.4, [0.05, 0.05], out=3),  # ttft ok, tpot .05 ok -> good
        rec(1, 0.6, [0.05, 0.05], out=3),  # ttft too slow
        rec(2, 0.1, [0.2, 0.2], out=3),  # tpot .2 too slow
        rec(3, 0.5, [], out=1),  # exactly at the TTFT bound; one token has no TPOT -> good
        RequestRecord(index=4, success=False, status=429),
    ]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration_s=4.0, slo=slo)
    assert s.good_requests == 2
    assert s.goodput == pytest.approx(0.5)
    assert s.request_throughput == pytest.approx(1.0)


def test_itl_and_e2el_slo_terms():
    slo = parse_slo("itl=150ms,e2el=1s")
    assert meets_slo(rec(0, 0.1, [0.1, 0.14], out=3), slo)
    assert not meets_slo(rec(1, 0.1, [0.1, 0.16], out=3), slo)  # worst gap over
    assert not meets_slo(rec(2, 0.9, [0.1, 0.1], out=3), slo)  # e2el 1.1 s


def test_server_stage_stats_and_exactness():
    t = {"queue": 0.01, "prefill": 0.02, "decode": 0.5, "total": 0.53}
    records = [rec(0, 0.1, [0.1], out=2, timing=t), rec(1, 0.1, [0.1], out=1, asked=2,
                                                        timing={**t, "queue": 0.03})]
    s = summarize(records, duration_s=1.0)
    assert s.server_ms["queue"]["mean"] == pytest.approx(20.0)
    assert s.server_ms["queue"]["p99"] == pytest.approx(29.8)
    assert s.server_ms["decode"]["mean"] == pytest.approx(500.0)
    assert s.exact_output_fraction == 0.5


def test_zero_duration_or_no_success_gives_zero_throughput():
    s = summarize([RequestRecord(index=0, success=False, status=503)], duration_s=0.0)
    assert s.request_throughput == 0.0 and s.output_throughput == 0.0 and s.ttft_ms.mean is None


@pytest.mark.parametrize("bad", ["ttft", "ttft=", "foo=1ms", "ttft=fast"])
def test_bad_slo_rejected(bad):
    with pytest.raises(ValueError):
        parse_slo(bad)


def test_parse_duration_units():
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2s") == 2.0
    assert parse_duration("250") == 0.25
