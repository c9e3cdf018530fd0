"""A URL replica's backend reports its own stage times; they become the Timeline's engine stages.

The chunks below are what the servers send: llama.cpp's is a real final chunk of `llama-server`
(the b1-0c1e570 build of the llama-cpp-python 0.3.36 sdist, streaming /v1/completions), vLLM's is
the `metrics` object its completions stream puts on the final usage chunk under
`--enable-per-request-metrics` (vllm/entrypoints/generate/base/serving.py, 0.32), and tokenpath's
is its own `tokenpath.timing` extension. Before, none was read: `engine_queue` never existed for a
URL replica, and its backend's queue was folded into `prefill`.
"""

from __future__ import annotations

import time

from tokenpath.protocol.outputs import CompletionOutput, EngineEvents, RequestOutput
from tokenpath.replica.backend_timing import apply_timing, backend_timing
from tokenpath.replica.events import stamp_events
from tokenpath.telemetry.causes import derive
from tokenpath.telemetry.timeline import Timeline

LLAMA_CPP_FINAL = {
    "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}],
    "object": "text_completion",
    "usage": {"completion_tokens": 4, "prompt_tokens": 5, "total_tokens": 9,
              "prompt_tokens_details": {"cached_tokens": 0}},
    "timings": {"cache_n": 3, "prompt_n": 5, "prompt_ms": 73.256, "prompt_per_token_ms": 14.6512,
                "prompt_per_second": 68.25, "predicted_n": 4, "predicted_ms": 57.924,
                "predicted_per_token_ms": 19.308, "predicted_per_second": 51.79},
}
VLLM_USAGE = {
    "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
    "metrics": {"time_to_first_token_ms": 40.0, "generation_time_ms": 60.0, "queue_time_ms": 250.0,
                "mean_itl_ms": 20.0, "tokens_per_second": 40.0},
}
TOKENPATH_USAGE = {
    "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
    "tokenpath": {"timing": {"upload": 0.001, "gateway": 0.002, "queue": 0.1, "engine_queue": 0.003,
                             "prefill": 0.05, "decode": 0.2, "total": 0.356}},
}


def test_each_dialect_is_read():
    v = backend_timing(VLLM_USAGE)
    assert v is not None and (v.source, v.queue_ms, v.prefill_ms, v.decode_ms) == ("vllm", 250.0, 40.0, 60.0)
    lc = backend_timing(LLAMA_CPP_FINAL)
    assert lc is not None and (lc.source, lc.queue_ms, lc.prefill_ms, lc.cached_tokens) == ("llama.cpp", None,
                                                                                             73.256, 3)
    tp = backend_timing(TOKENPATH_USAGE)
    assert tp is not None and tp.source == "tokenpath"
    assert abs(tp.queue_ms - 106.0) < 1e-6 and abs(tp.prefill_ms - 50.0) < 1e-6 and abs(tp.decode_ms - 200.0) < 1e-6


def test_nothing_or_garbage_is_none():
    assert backend_timing({"choices": [{"text": "x"}]}) is None
    for bad in ({"metrics": {"time_to_first_token_ms": "12"}}, {"metrics": {"time_to_first_token_ms": -1.0}},
                {"timings": {"prompt_ms": float("nan")}}, {"timings": []}, {"tokenpath": {"timing": None}},
                {"metrics": {"time_to_first_token_ms": True}}):
        assert backend_timing(bad) is None, bad
    # A bad queue time alone is dropped, the prefill kept.
    v = backend_timing({"metrics": {"time_to_first_token_ms": 5.0, "queue_time_ms": "soon"}})
    assert v is not None and v.queue_ms is None and v.prefill_ms == 5.0


def _final(first_token: float) -> RequestOutput:
    return RequestOutput(request_id="r", outputs=[CompletionOutput(index=0, text="", token_ids=[1],
                                                                   finish_reason="length")],
                         prompt_token_ids=[1, 2], num_cached_tokens=0, finished=True,
                         events=EngineEvents(queued=first_token - 1.0, first_token=first_token))


def test_the_backend_prefill_splits_dispatch_to_first_token():
    """Dispatched 1 s before the first token arrived; the backend says its prefill took 40 ms and it
    queued 250 ms: engine_queue is the rest (the HTTP hop and its queue), prefill its 40 ms."""
    tl = Timeline("r")
    now = time.monotonic()
    tl.stamps.update(received=now - 1.2, body_read=now - 1.2, admitted=now - 1.1, dispatched=now - 1.1)
    first = now - 0.1
    tl.stamps["first_token"] = first  # stamped on receipt of the first chunk, as stamp_events does
    last = _final(first)
    apply_timing(last, backend_timing(VLLM_USAGE), tl)
    stamp_events(tl, last, now=now)
    d = tl.durations()
    assert abs(d["prefill"] - 0.040) < 1e-6
    assert abs(d["engine_queue"] - 0.960) < 1e-6
    assert abs(sum(v for k, v in d.items() if k != "total") - d["total"]) < 1e-9
    assert tl.attrs["backend_timing"] == {"source": "vllm", "queue_ms": 250.0, "prefill_ms": 40.0, "decode_ms": 60.0}
    causes = [c for c in derive(tl) if c.kind == "queued_behind"]
    assert len(causes) == 1 and causes[0].detail["where"] == "backend" and causes[0].ms == 250.0
    assert causes[0].detail["reported_by"] == "vllm"


def test_a_prefill_longer_than_the_hop_is_clamped():
    """A backend clock that claims more prefill than the gateway saw cannot make a stage negative."""
    tl = Timeline("r")
    now = time.monotonic()
    tl.stamps.update(received=now - 0.5, dispatched=now - 0.3, first_token=now - 0.1)
    last = _final(now - 0.1)
    apply_timing(last, backend_timing({"metrics": {"time_to_first_token_ms": 5000.0}}), tl)
    stamp_events(tl, last, now=now)
    d = tl.durations()
    assert d.get("engine_queue", 0.0) == 0.0 and abs(d["prefill"] - 0.2) < 1e-6
    assert all(v >= 0 for v in d.values())


def test_without_a_report_the_stages_are_labelled_derived():
    tl = Timeline("r")
    last = _final(time.monotonic())
    apply_timing(last, None, tl)
    assert last.events.scheduled is None and tl.attrs["backend_timing"] == {"source": "derived"}


def test_cached_tokens_from_llama_cpp():
    last = _final(time.monotonic())
    apply_timing(last, backend_timing(LLAMA_CPP_FINAL), Timeline("x"))
    assert last.num_cached_tokens == 3
