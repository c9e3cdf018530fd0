"""Metric arithmetic, exactly as `vllm bench serve` defines it, so numbers are comparable.

- TTFT: send -> first chunk carrying content. ITL: gaps between consecutive content chunks.
- E2EL: send -> last content chunk. TPOT: (E2EL - TTFT) / (output_tokens - 1), only when > 1 token.
- Percentiles: linear interpolation (numpy's default, which vllm uses).
- Throughput: over the run's wall duration (first send -> last completion), successful requests only.
- Goodput: successful requests per second that meet every given SLO; a request with a single output
  token has no TPOT and meets any TPOT SLO (vllm counts its TPOT as 0).
- Prefix-cache hit rate: cached prompt tokens / prompt tokens, over the successful requests whose
  server reported `usage.prompt_tokens_details.cached_tokens` (None when none did).
Reported latencies are milliseconds; the records keep seconds.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tokenpath.bench.records import RequestRecord
from tokenpath.telemetry.timeline import STAGES

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy default); None for no data."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass
class Stats:
    """Distribution of one latency metric, in milliseconds."""

    count: int = 0
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None
    std: float | None = None

    @classmethod
    def of(cls, seconds: Iterable[float]) -> Stats:
        ms = [s * 1000.0 for s in seconds]
        if not ms:
            return cls()
        arr = np.asarray(ms, dtype=float)
        return cls(
            count=len(ms),
            mean=float(arr.mean()),
            median=percentile(ms, 50),
            p90=percentile(ms, 90),
            p99=percentile(ms, 99),
            std=float(arr.std()),
        )


def parse_duration(text: str) -> float:
    """'500ms' / '0.5s' / '500' (ms) -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 500ms or 0.5s)")
    value = float(m.group(1))
    return value if m.group(2) == "s" else value / 1000.0


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=100ms' -> {'ttft': 0.5, 'tpot': 0.1} (seconds)."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().lower()
        if key not in SLO_METRICS or not value:
            raise ValueError(f"bad SLO term {part!r}: use {'/'.join(SLO_METRICS)}=<duration>")
        out[key] = parse_duration(value)
    return out


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request meets the SLO when every given bound holds (ITL: its worst gap)."""
    if not rec.success:
        return False
    observed = {
        "ttft": rec.ttft,
        "tpot": rec.tpot if rec.tpot is not None else 0.0,
        "itl": max(rec.itl) if rec.itl else 0.0,
        "e2el": rec.e2el,
    }
    return all(observed[k] is not None and observed[k] <= bound for k, bound in slo.items())


def error_counts(records: Iterable[RequestRecord]) -> dict[str, Any]:
    """Failures by HTTP status (or the transport error kind), with 429s called out."""
    by: Counter[str] = Counter()
    for r in records:
        if not r.success:
            by[str(r.status) if r.status is not None else (r.error or "error").split(":")[0]] += 1
    return {"total": sum(by.values()), "http_429": by.get("429", 0), "by_status": dict(sorted(by.items()))}


def server_stage_stats(records: Iterable[RequestRecord]) -> dict[str, dict[str, float | None]]:
    """Mean and p99 (ms) of each server-reported stage, over the requests that reported it."""
    out: dict[str, dict[str, float | None]] = {}
    recs = [r for r in records if r.success and r.server_timing]
    for stage in STAGES:
        vals = [r.server_timing[stage] for r in recs if stage in r.server_timing]  # type: ignore[index]
        if vals:
            s = Stats.of(vals)
            out[stage] = {"mean": s.mean, "p99": s.p99, "count": s.count}
    return out


@dataclass
class Summary:
    """Everything one (target, load point) run is judged by."""

    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    request_throughput: float = 0.0  # successful requests / s
    output_throughput: float = 0.0  # output tokens / s
    total_token_throughput: float = 0.0  # (prompt + output) tokens / s
    total_output_tokens: int = 0
    total_prompt_tokens: int = 0
    mean_prompt_tokens: float | None = None  # as the server counted them (usage)
    mean_output_tokens: float | None = None
    exact_output_fraction: float | None = None  # share of successes with exactly the asked length
    ttft_ms: Stats = field(default_factory=Stats)
    tpot_ms: Stats = field(default_factory=Stats)
    itl_ms: Stats = field(default_factory=Stats)
    e2el_ms: Stats = field(default_factory=Stats)
    slo: dict[str, float] = field(default_factory=dict)  # seconds
    good_requests: int | None = None
    goodput: float | None = None  # requests / s meeting the SLO
    errors: dict[str, Any] = field(default_factory=dict)
    server_ms: dict[str, dict[str, float | None]] = field(default_factory=dict)
    cached_prompt_tokens: int | None = None
    prefix_cache_hit_rate: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Summary:
        d = dict(d)
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            d[k] = Stats(**d.get(k, {}))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> Summary:
    """Reduce per-request records to the vllm-style summary."""
    ok = [r for r in records if r.success]
    slo = slo or {}
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    prompt_tokens = sum(prompt_known) if prompt_known else sum(r.intended_input_len for r in ok)
    dur = duration_s if duration_s > 0 else math.nan
    s = Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        request_throughput=_rate(len(ok), dur),
        output_throughput=_rate(out_tokens, dur),
        total_token_throughput=_rate(out_tokens + prompt_tokens, dur),
        total_output_tokens=out_tokens,
        total_prompt_tokens=prompt_tokens,
        mean_prompt_tokens=float(np.mean(prompt_known)) if prompt_known else None,
        mean_output_tokens=(out_tokens / len(ok)) if ok else None,
        exact_output_fraction=(sum(r.output_tokens == r.intended_output_len for r in ok) / len(ok)) if ok else None,
        ttft_ms=Stats.of(r.ttft for r in ok if r.ttft is not None),
        tpot_ms=Stats.of(t for r in ok if (t := r.tpot) is not None),
        itl_ms=Stats.of(g for r in ok for g in r.itl),
        e2el_ms=Stats.of(r.e2el for r in ok if r.e2el is not None),
        slo=dict(slo),
        errors=error_counts(records),
        server_ms=server_stage_stats(ok),
    )
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    if reported:
        s.cached_prompt_tokens = sum(r.cached_tokens or 0 for r in reported)
        s.prefix_cache_hit_rate = s.cached_prompt_tokens / sum(r.prompt_tokens or 0 for r in reported)
    if slo:
        s.good_requests = sum(meets_slo(r, slo) for r in ok)
        s.goodput = _rate(s.good_requests, dur)
    return s


def _rate(n: float, duration: float) -> float:
    return 0.0 if not n or math.isnan(duration) else n / duration
