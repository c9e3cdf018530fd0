"""Causes derived from a Timeline's facts (no server): kinds, ms, culprits, order; and the engine
facts survive the engine link's codec (what `--replicas N` relies on)."""

from __future__ import annotations

import pytest

from tokenpath.protocol import GenerateRequest, SamplingParams
from tokenpath.protocol.outputs import CompletionOutput, EngineEvents, RequestOutput
from tokenpath.protocol.wire import decode_output, encode_output
from tokenpath.telemetry.causes import derive
from tokenpath.telemetry.timeline import Timeline


def _timeline(**stamps: float) -> Timeline:
    t = Timeline("me")
    t0 = t.stamps["received"]
    for name, at in stamps.items():
        t.stamp(name, at=t0 + at)
    return t


def test_each_fact_becomes_its_cause_sorted_by_ms():
    t = _timeline(body_read=0.02, admitted=0.03, dispatched=0.53, scheduled=0.92, first_token=1.0, finished=3.0)
    t0 = t.stamps["received"]
    t.attrs.update(
        admission="queued", admission_ahead=1, admission_behind=[["a", "acme", 100, "r0"]], admission_freed_by="a",
        replica="r1", engine_behind=[["b", "acme", 40, "running"]], engine_freed_by="b",
        prefix_elsewhere={"replica": "r0", "blocks": 8, "chosen_blocks": 0, "why": "load_threshold",
                          "block_size": 16, "holders": ["a"]},
        engine_stalls=[[t0 + 1.5, 0.3, [["long", 900]]], [t0 + 1.6, 0.011, [["long", 5]]]],
        engine_preempted=[[t0 + 2.0, "big", 300, t0 + 2.6]], client_blocked_s=0.05,
        body_bytes=100,
        retried_after="r2", retry_reason="ConnectionError: gone", retry_lost_s=0.2)
    causes = derive(t, prompt_tokens=200, cached_tokens=0, token_times=[t0 + 1.0 + 0.01 * i for i in range(10)])
    by = {c.kind: c for c in causes}
    assert [c.ms for c in causes] == sorted((c.ms for c in causes), reverse=True)
    assert by["preempted"].ms == pytest.approx(600) and by["preempted"].request_ids == ["big"]
    assert by["preempted"].detail["stage"] == "decode" and by["preempted"].detail["recomputed_tokens"] == 300
    queued = [c for c in causes if c.kind == "queued_behind"]
    assert {c.detail["where"]: c.request_ids[0] for c in queued} == {"admission": "a", "engine": "b"}
    assert {c.detail["where"]: c.ms for c in queued} == {"admission": pytest.approx(500), "engine": pytest.approx(390)}
    stall = by["decode_stalled_by_prefill"]  # only the 300 ms step is over 2x the 10 ms ITL
    assert stall.request_ids == ["long"] and stall.ms == pytest.approx(290) and stall.detail["slow_steps"] == 1
    assert by["prefill_uncached"].ms == pytest.approx(80) and by["prefill_uncached"].detail["uncached_tokens"] == 200
    assert by["prefix_elsewhere"].ms == pytest.approx(80 * 128 / 200) and by["prefix_elsewhere"].request_ids == ["a"]
    assert by["replica_ejected"].ms == pytest.approx(200) and by["replica_ejected"].detail["replica"] == "r2"
    assert by["slow_client"].ms == pytest.approx(50) and by["upload"].ms == pytest.approx(20)


def test_a_calm_request_has_only_its_prefill():
    t = _timeline(body_read=0.003, admitted=0.004, dispatched=0.004, scheduled=0.005, first_token=0.05,
                  finished=0.2)
    t.attrs["client_blocked_s"] = 0.002  # a few ms of normal writes: not a slow client
    causes = derive(t, prompt_tokens=10, cached_tokens=4, token_times=[])
    assert [c.kind for c in causes] == ["prefill_uncached"]
    assert causes[0].detail["cached_tokens"] == 4 and causes[0].detail["uncached_tokens"] == 6


def test_engine_facts_cross_the_link_and_shift_clocks():
    ev = EngineEvents(1.0, 2.0, 3.0, 4.0, [(2.5, 16)], behind=[["x", "t", 5, "running"]], freed_by="x",
                      stalls=[[3.5, 0.2, [["y", 512]]]], preempted=[[3.6, "z", 40, None]])
    out = RequestOutput("me", [CompletionOutput(0, "a", [1])], [1, 2], 0, False, events=ev)
    req = GenerateRequest(request_id="me", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=4))
    back = decode_output(encode_output(out), req).events.shifted(10.0)
    assert back.behind == [["x", "t", 5, "running"]] and back.freed_by == "x"
    assert back.stalls == [[13.5, 0.2, [["y", 512]]]] and back.preempted == [[13.6, "z", 40, None]]
    old = encode_output(out)
    old["ev"] = old["ev"][:5]  # an engine of the previous version
    assert decode_output(old, req).events.stalls == []


def test_speculation_that_kept_failing_is_a_cause_and_a_finding_with_its_lever():
    from tokenpath.telemetry.diagnose import diagnose

    t = _timeline(admitted=0.001, dispatched=0.001, scheduled=0.002, first_token=0.1, finished=2.1)
    t.attrs["spec_decode"] = {"steps": 40, "proposed": 120, "accepted": 12, "acceptance": 0.1}
    (spec,) = [c for c in derive(t, prompt_tokens=10, completion_tokens=100) if c.kind == "speculation_wasted"]
    # 108 rejected rows beside 100 output tokens: 108 / 208 of the 2 s decode
    assert spec.ms == pytest.approx(2000 * 108 / 208, rel=1e-3) and spec.detail["acceptance"] == 0.1
    row = {"request_id": "me", "status": 200, "total_ms": 2100.0, "causes": [spec.as_dict()],
           "stages": [{"stage": "decode", "ms": 2000.0}]}
    finding = next(f for f in diagnose([row]) if f.kind == "speculation_wasted")
    assert "num_speculative_tokens" in finding.lever and "suffix_decoding_min_token_prob" in finding.lever
    t.attrs["spec_decode"] = {"steps": 40, "proposed": 120, "accepted": 90, "acceptance": 0.75}  # it paid
    assert not [c for c in derive(t, completion_tokens=100) if c.kind == "speculation_wasted"]
    t.attrs["spec_decode"] = {"steps": 4, "proposed": 8, "accepted": 0, "acceptance": 0.0}  # too few to judge
    assert not [c for c in derive(t, completion_tokens=100) if c.kind == "speculation_wasted"]
