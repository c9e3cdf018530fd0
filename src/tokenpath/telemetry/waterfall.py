"""One request's stages as a terminal waterfall (what `tokenpath trace` prints).

Pure formatting over the audit row's fields and its `timing` JSON: each stage is a bar that
starts where the previous one ended, to scale with the total, with its ms and share.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tokenpath.telemetry.stages import dominant_stage
from tokenpath.telemetry.timeline import PATH_STAGES

WIDTH = 48


def timing_of(row: dict[str, Any]) -> dict[str, Any]:
    """The row's stage ms and routing facts; rows written before the `timing` column get the
    old queue/prefill/decode/total seconds instead."""
    if row.get("timing"):
        return json.loads(row["timing"])
    stages = {k.removesuffix("_s"): round(row[k] * 1000, 1) for k in ("queue_s", "prefill_s", "decode_s", "total_s")
              if row.get(k) is not None}
    return {"stages_ms": stages}


def summary(row: dict[str, Any]) -> dict[str, Any]:
    """What `--json` prints for one request: the stages with shares, and why it went where it went."""
    timing = timing_of(row)
    stages: dict[str, float] = timing.get("stages_ms", {})
    total = stages.get("total") or sum(v for k, v in stages.items() if k != "total")
    dominant = dominant_stage(stages)
    return {
        "request_id": row["request_id"], "client_request_id": row.get("client_request_id"), "time": row["time"],
        "model": row.get("model"), "status": row["status"],
        "endpoint": row.get("endpoint"), "tenant": row.get("tenant"), "finish_reason": row.get("finish_reason"),
        "error_type": row.get("error_type"), "prompt_tokens": row.get("prompt_tokens"),
        "cached_tokens": row.get("cached_tokens"), "completion_tokens": row.get("completion_tokens"),
        "replica": timing.get("replica"), "routing_policy": timing.get("policy"),
        "routing_reason": timing.get("reason"), "admission": timing.get("admission"),
        "trace_id": timing.get("trace_id"), "total_ms": total,
        "stages": [{"stage": k, "ms": v, "percent": round(100 * v / total, 1) if total else 0.0}
                   for k, v in stages.items() if k != "total"],
        "dominant_stage": dominant,
        "predicted_wait_s": timing.get("predicted_wait_s"), "rejection": timing.get("rejection"),
        "causes": timing.get("causes") or [],
        # A reasoning model's reply: when its think block began and when its answer did.
        "time_to_first_reasoning_ms": timing.get("time_to_first_reasoning_ms"),
        "time_to_first_answer_ms": timing.get("time_to_first_answer_ms"),
    }


def render(s: dict[str, Any]) -> str:
    total = s["total_ms"] or 0.0
    head = (f"{s['request_id']}  {s['model'] or '-'}  status {s['status']}"
            f"{'  ' + s['finish_reason'] if s.get('finish_reason') else ''}"
            f"{'  error ' + s['error_type'] if s.get('error_type') else ''}")
    facts = [f"tenant {s.get('tenant') or '-'}", f"replica {s['replica'] or '-'}",
             f"tokens {s['prompt_tokens'] or 0} prompt ({s['cached_tokens'] or 0} cached) + "
             f"{s['completion_tokens'] or 0} completion"]
    if s.get("routing_policy") or s.get("routing_reason"):
        facts.append(f"routing {s.get('routing_policy') or '-'}: {s.get('routing_reason') or '-'}")
    if s.get("client_request_id"):
        facts.append(f"client id {s['client_request_id']}")
    if s.get("trace_id"):
        facts.append(f"trace {s['trace_id']}")
    if s.get("time_to_first_reasoning_ms") is not None:
        answer = s.get("time_to_first_answer_ms")
        facts.append(f"first reasoning token {s['time_to_first_reasoning_ms']:.1f} ms, first answer token "
                     + ("-" if answer is None else f"{answer:.1f} ms"))
    lines = [head, "  " + "  |  ".join(facts), f"  {'stage':<13}{'ms':>10}{'%':>7}  0{'':{WIDTH - 6}}{total:.0f} ms"]
    offset = 0.0
    order = {k: i for i, k in enumerate(PATH_STAGES)}
    for st in sorted(s["stages"], key=lambda x: order.get(x["stage"], len(order))):
        start = int(round(WIDTH * offset / total)) if total else 0
        width = int(round(WIDTH * (offset + st["ms"]) / total)) - start if total else 0
        bar = " " * start + ("█" * width if width else "▏")
        lines.append(f"  {st['stage']:<13}{st['ms']:>10.1f}{st['percent']:>6.1f}%  {bar}")
        offset += st["ms"]
    lines.append(f"  {'total':<13}{total:>10.1f}{100.0 if total else 0.0:>6.1f}%")
    if s["dominant_stage"]:
        share = next(x["percent"] for x in s["stages"] if x["stage"] == s["dominant_stage"])
        lines.append(f"  dominant stage: {s['dominant_stage']} ({share:.1f}% of the total)")
    lines += render_causes(s.get("causes") or [], total)
    return "\n".join(lines)


def render_causes(causes: list[dict[str, Any]], total: float) -> list[str]:
    """One line per cause: kind, ms and share of the total, the culprits, then the facts."""
    if not causes:
        return []
    out = ["  causes:"]
    for c in causes:
        share = f"{100 * c['ms'] / total:5.1f}%" if total else "    -"
        who = f"  <- {', '.join(c['request_ids'][:3])}" if c.get("request_ids") else ""
        out.append(f"    {c['kind']:<26}{c['ms']:>9.1f} ms {share}{who}")
        facts = ", ".join(f"{k}={_short(v)}" for k, v in (c.get("detail") or {}).items()
                          if v not in (None, [], {}) and k not in ("holders", "prefills"))
        if facts:
            out.append(f"      {facts}")
    return out


def _short(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
    return text if len(text) <= 60 else text[:57] + "..."


def render_matches(client_id: str, rows: list[dict[str, Any]]) -> str:
    """The requests one client id names (clients choose it: several tenants, or one reusing it)."""
    lines = [f"{len(rows)} requests sent client id {client_id!r}; `tokenpath trace ID` with a server id for one:",
             f"  {'time (UTC)':<21}{'tenant':<20}{'status':>6}  {'total ms':>10}  {'model':<24}server id"]
    for s in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s["time"]))
        total = f"{s['total_ms']:.1f}" if s["total_ms"] is not None else "-"
        lines.append(f"  {when:<21}{(s.get('tenant') or '-')[:19]:<20}{s['status']:>6}  {total:>10}  "
                     f"{(s['model'] or '-')[:23]:<24}{s['request_id']}")
    return "\n".join(lines)


def render_slowest(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'total ms':>10}  {'dominant':<13}{'top cause':<27}{'status':>6}  {'model':<24}request id"]
    for s in rows:
        top = (s.get("causes") or [{}])[0].get("kind") or "-"
        lines.append(f"{s['total_ms']:>10.1f}  {s['dominant_stage'] or '-':<13}{top:<27}{s['status']:>6}  "
                     f"{(s['model'] or '-')[:23]:<24}{s['request_id']}")
    return "\n".join(lines)
