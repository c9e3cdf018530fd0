"""The dashboard's data: requests in flight (and the stage each is in, and the tokens each has
streamed so far), recent ones, per-stage percentiles, the error rate, per-tenant rows, queue depth
per priority band, KV usage and tokens per replica.

One `LiveRequests` per app (it lives on the app's state, never in a module global). The API
layer tells it when a request starts and ends; everything else is read from the Timelines and
from the deployments' replicas at the moment the dashboard asks.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.request_log import request_fields
from tokenpath.telemetry.stages import current_stage, stage_ms
from tokenpath.telemetry.timeline import PATH_STAGES, STAGES, Timeline


@dataclass
class _Live:
    timeline: Timeline
    endpoint: str
    token_times: list[float]  # the request's own list, appended as its tokens reach the API


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class LiveRequests:
    def __init__(self, keep: int = 500) -> None:
        self.inflight: dict[str, _Live] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self.tokens_by_replica: Counter[str] = Counter()

    def started(self, timeline: Timeline, endpoint: str, token_times: list[float]) -> None:
        self.inflight[timeline.request_id] = _Live(timeline, endpoint, token_times)

    def finished(self, rec: FinishedRequest, fields: Callable[[], dict[str, Any]] | None = None) -> None:
        """The request leaves the in-flight set and joins the recent rows; `fields`: its request
        line's fields when they are shared (`publish`), else built here."""
        self.inflight.pop(rec.request_id, None)
        row = fields() if fields is not None else request_fields(rec)
        row.pop("prompt_text", None)
        row.pop("completion_text", None)
        row["time"] = rec.timeline.wall_start
        row["stages_ms"] = stage_ms(rec.timeline)  # the six stages, for the waterfall
        self.recent.append(row)
        if rec.replica:
            self.tokens_by_replica[rec.replica] += rec.completion_tokens

    def snapshot(self, deployments: Iterable[Any], window_s: float = 300.0, show: int = 30) -> dict[str, Any]:
        now_wall, now = time.time(), time.monotonic()
        inflight = []
        for rid, live in list(self.inflight.items()):
            t = live.timeline
            so_far = stage_ms(t)
            stage = current_stage(t)
            if stage in PATH_STAGES:  # the stage it is in now, up to this moment
                so_far[stage] = round(max(0.0, so_far["total"] - sum(v for k, v in so_far.items() if k != "total")), 1)
            inflight.append({
                "request_id": rid, "client_request_id": t.client_request_id, "endpoint": live.endpoint, "stage": stage,
                "model": t.attrs.get("deployment"), "tenant": t.attrs.get("tenant"),
                "replica": t.attrs.get("replica"), "age_ms": round((now - t.stamps["received"]) * 1000, 1),
                "tokens": len(live.token_times), "stages_ms": so_far,
            })
        recent = [r for r in self.recent if r["time"] >= now_wall - window_s]
        per_stage: dict[str, dict[str, float | int]] = {}
        for stage in STAGES:
            values = [r["stages_ms"][stage] for r in recent if stage in r["stages_ms"] and r["status"] == 200]
            if values:
                per_stage[stage] = {"p50": _quantile(values, 0.5), "p99": _quantile(values, 0.99), "n": len(values)}
        streamed = Counter[str]()  # tokens of requests still streaming, per replica: tok/s moves during decode
        for row in inflight:
            if row["replica"]:
                streamed[row["replica"]] += row["tokens"]
        return {"time": now_wall, "window_s": window_s, "inflight": inflight, "recent": list(recent)[-show:][::-1],
                "stages": per_stage, "errors": _errors(recent), "tenants": _tenants(recent),
                "deployments": [_deployment(d, self.tokens_by_replica + streamed) for d in deployments]}


def _errors(recent: list[dict[str, Any]]) -> dict[str, Any]:
    """Finished requests in the window by status class; `rate` is the 5xx share (what alerts use)."""
    n = len(recent)
    c4 = sum(1 for r in recent if 400 <= r["status"] < 500)
    c5 = sum(1 for r in recent if r["status"] >= 500)
    return {"requests": n, "4xx": c4, "5xx": c5, "rate": round(c5 / n, 4) if n else 0.0}


def _tenants(recent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per tenant over the window: requests, errors, tokens and total latency."""
    rows: dict[str, dict[str, Any]] = {}
    totals: dict[str, list[float]] = {}
    for r in recent:
        t = rows.setdefault(r["tenant"], {"tenant": r["tenant"], "requests": 0, "errors": 0, "prompt_tokens": 0,
                                          "completion_tokens": 0})
        t["requests"] += 1
        t["errors"] += r["status"] >= 400
        t["prompt_tokens"] += r["prompt_tokens"] or 0
        t["completion_tokens"] += r["completion_tokens"] or 0
        if r["status"] == 200 and "total" in r["stages_ms"]:
            totals.setdefault(r["tenant"], []).append(r["stages_ms"]["total"])
    for tenant, values in totals.items():
        rows[tenant]["p50_total_ms"] = _quantile(values, 0.5)
    return sorted(rows.values(), key=lambda t: -t["requests"])


def _deployment(dep: Any, tokens_by_replica: Counter[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": dep.name, "task": dep.task, "queue_by_band": {}, "replicas": []}
    if not dep.replicas:
        return out
    flow = dep.flow
    bands: Counter[str] = Counter()
    for (band, _tenant), n in flow.queue.depth().items():
        bands[str(band)] += n
    out["queue_by_band"] = dict(bands)
    for handle in flow.pool.handles.values():
        s = handle.state()
        engine = getattr(handle.replica, "engine", None)
        in_process = engine is not None and hasattr(engine, "core")  # (an in-process chat engine)
        tokens = engine.state().generation_tokens if in_process else tokens_by_replica[handle.name]
        out["replicas"].append({"name": handle.name, "healthy": s.healthy, "running": s.running,
                                "waiting": s.waiting, "kv_usage": round(s.kv_usage, 4),
                                "inflight": handle.inflight, "generation_tokens": tokens})
    return out
