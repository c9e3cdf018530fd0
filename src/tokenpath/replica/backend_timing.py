"""A backend's own account of a request's stages (a URL replica's): read from the chunks of its
stream in whichever dialect the server speaks, and placed on the request's engine events in the
gateway's clock, so a URL replica's `engine_queue`, `prefill` and `decode` are the backend's, not
one lump from dispatch to the first chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenpath.protocol.outputs import RequestOutput
from tokenpath.telemetry.timeline import PATH_STAGES, Timeline


@dataclass(frozen=True)
class BackendTiming:
    """A backend's own account of one request, in milliseconds of its clock: how long it queued,
    its prefill (scheduled -> first token) and its decode. `source` names the dialect it came in."""

    source: str
    prefill_ms: float
    queue_ms: float | None = None
    decode_ms: float | None = None
    cached_tokens: int | None = None

    def as_attrs(self) -> dict:
        return {k: v for k, v in (("source", self.source), ("queue_ms", self.queue_ms),
                                  ("prefill_ms", self.prefill_ms), ("decode_ms", self.decode_ms)) if v is not None}


def _ms(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value < 0:
        return None  # absent, malformed or negative: never trusted into the Timeline
    return float(value)


def backend_timing(data: dict) -> BackendTiming | None:
    """The stage times a chunk carries, in whichever dialect its server speaks:
    - vLLM (`--enable-per-request-metrics`): `metrics` on the final usage chunk, with
      `queue_time_ms` (queued -> scheduled), `time_to_first_token_ms` (scheduled -> first token)
      and `generation_time_ms` (first -> last token);
    - llama.cpp's server: `timings` on the last chunk, `prompt_ms`, `predicted_ms` and `cache_n`
      (it reports no queue time);
    - tokenpath: `tokenpath.timing`, its stages in seconds (queue = its gateway's and engine's).
    None when the chunk carries none (the stages are then derived from the stream alone)."""
    m = data.get("metrics")
    if isinstance(m, dict) and (prefill := _ms(m.get("time_to_first_token_ms"))) is not None:
        return BackendTiming("vllm", prefill, _ms(m.get("queue_time_ms")), _ms(m.get("generation_time_ms")))
    t = data.get("timings")
    if isinstance(t, dict) and (prefill := _ms(t.get("prompt_ms"))) is not None:
        cache_n = t.get("cache_n")
        return BackendTiming("llama.cpp", prefill, None, _ms(t.get("predicted_ms")),
                             cache_n if isinstance(cache_n, int) and cache_n >= 0 else None)
    ext = data.get("tokenpath")
    stages = ext.get("timing") if isinstance(ext, dict) else None
    if isinstance(stages, dict) and (prefill := _ms(stages.get("prefill"))) is not None:
        cut = PATH_STAGES.index("prefill")  # (the stage table: what a tokenpath backend sends)
        parts = [_ms(stages.get(k)) for k in PATH_STAGES[:cut]]
        after = [_ms(stages.get(k)) for k in PATH_STAGES[cut + 1:]]
        return BackendTiming("tokenpath", 1000 * prefill, 1000 * sum(p or 0.0 for p in parts),
                             1000 * sum(p or 0.0 for p in after))
    return None


def apply_timing(last: RequestOutput, timing: BackendTiming | None, timeline: Timeline) -> None:
    """The backend's stages onto the request's engine events, in the gateway's clock: it was
    scheduled its prefill before the first token reached us (the first token's own trip back is a
    few ms, left in prefill), so `engine_queue` is the HTTP hop plus the backend's queue, and
    `stamp_events` clamps the result into what the gateway saw. Without a report the stages are
    derived from the stream (dispatch -> first chunk is all `prefill`), and the Timeline says so."""
    ev = last.events
    if timing is None or ev.first_token is None:
        timeline.attrs["backend_timing"] = {"source": "derived"}
        return
    ev.scheduled = ev.first_token - timing.prefill_ms / 1000
    timeline.attrs["backend_timing"] = timing.as_attrs()
    if timing.cached_tokens and not last.num_cached_tokens:
        last.num_cached_tokens = timing.cached_tokens
