"""Stages from stamps, rejection reasons, log formatting and the waterfall text: no server."""

from __future__ import annotations

import json
import logging

import pytest

from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.request_log import JsonFormatter, TextFormatter, request_fields
from tokenpath.telemetry.stages import current_stage, dominant_stage, stage_durations
from tokenpath.telemetry.timeline import Timeline
from tokenpath.telemetry.waterfall import render, summary


def _timeline(*stamps: tuple[str, float]) -> Timeline:
    t = Timeline("r")
    t0 = t.stamps["received"]
    for name, at in stamps:
        t.stamp(name, at=t0 + at)
    return t


def test_stages_always_sum_to_total_and_the_end_closes_the_current_stage():
    full = _timeline(("admitted", 0.01), ("dispatched", 0.03), ("scheduled", 0.04), ("first_token", 0.2),
                     ("finished", 1.0))
    d = stage_durations(full)
    assert list(d) == ["gateway", "queue", "engine_queue", "prefill", "decode", "total"]
    assert sum(v for k, v in d.items() if k != "total") == pytest.approx(d["total"]) == pytest.approx(1.0)
    assert dominant_stage(d) == "decode" and current_stage(full) == "done"
    refused = _timeline(("finished", 0.005))  # a 400 in the gateway
    assert stage_durations(refused) == {"gateway": pytest.approx(0.005), "total": pytest.approx(0.005)}
    remote = _timeline(("admitted", 0.01), ("dispatched", 0.02))  # no engine stamps (yet)
    assert current_stage(remote) == "engine_queue"
    remote.stamp("finished", at=remote.stamps["received"] + 0.5)
    assert stage_durations(remote)["engine_queue"] == pytest.approx(0.48)


@pytest.mark.parametrize(("status", "code", "reason"), [
    (401, "invalid_api_key", "auth"), (403, "model_not_allowed", "acl"), (429, "rate_limit_exceeded", "rate_limit"),
    (429, "queue_full", "admission"), (503, "no_healthy_replica", "admission"), (429, "deadline_unreachable", "deadline"),
    (504, "deadline_exceeded", "deadline"), (400, None, None), (499, "client_disconnected", None), (200, None, None)])
def test_rejection_reasons(status, code, reason):
    assert FinishedRequest(Timeline("r"), "/v1/completions", status, error_code=code).rejection_reason == reason


def test_json_and_text_log_lines_carry_the_extra_fields():
    rec = logging.LogRecord("tokenpath.request", logging.INFO, __file__, 1, "done %s", ("x",), None)
    rec.request_id, rec.stages_ms = "r1", {"total": 1.5}
    line = json.loads(JsonFormatter().format(rec))
    assert line["msg"] == "done x" and line["request_id"] == "r1" and line["stages_ms"] == {"total": 1.5}
    assert "request_id=r1" in TextFormatter().format(rec)


def test_log_fields_carry_no_text_unless_given():
    t = _timeline(("finished", 0.01))
    assert "prompt_text" not in request_fields(FinishedRequest(t, "/v1/completions", 200))
    assert request_fields(FinishedRequest(t, "/v1/completions", 200, prompt_text="p"))["prompt_text"] == "p"


def test_waterfall_text_names_the_dominant_stage_and_scales_bars():
    timing = {"stages_ms": {"gateway": 10.0, "queue": 0.0, "engine_queue": 5.0, "prefill": 35.0, "decode": 50.0,
                            "total": 100.0}, "replica": "r0", "policy": "prefix_aware", "reason": "prefix_hit"}
    row = {"request_id": "r1", "time": 0.0, "model": "m", "status": 200, "timing": json.dumps(timing),
           "prompt_tokens": 40, "cached_tokens": 32, "completion_tokens": 9}
    s = summary(row)
    assert s["dominant_stage"] == "decode" and [x["percent"] for x in s["stages"]] == [10.0, 0.0, 5.0, 35.0, 50.0]
    text = render(s)
    assert "dominant stage: decode (50.0% of the total)" in text
    assert "32 cached" in text and "prefix_aware: prefix_hit" in text and "replica r0" in text
    decode_line = next(line for line in text.splitlines() if line.strip().startswith("decode"))
    assert decode_line.count("█") == 24  # half of the 48-wide scale
    old = summary({"request_id": "r0", "time": 0.0, "status": 200, "queue_s": 0.1, "total_s": 0.2})
    assert old["total_ms"] == 200.0  # rows from before the timing column still render
