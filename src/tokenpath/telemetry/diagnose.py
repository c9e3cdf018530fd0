"""The debugging map over a window: what made requests slow, how much of their latency each
thing cost, the evidence, and the lever to pull (`tokenpath diagnose`, `GET /diagnose`).

Input: the window's audit rows as `waterfall.summary` dicts (stages and causes per request) and,
when a server is asked, its engines' figures over the same window (`EngineFigures`, made
per-window by `engine_window.EngineHistory`: steps, step time, batch size in sequences and tokens,
preemptions, KV usage mean and max). The map:

- `ttft`: time to first token split by stage and by cause (queued behind, prefill, retries...);
- `batches_not_forming`: mean batch against `max_num_seqs`, and why (arrivals, KV, limits);
- `kv_pressure`: preemptions per request, tokens recomputed, who forced them, KV usage now;
- `prefix_benefit_lost`: the prefix-cache hit rate achieved against the one achievable had each
  request gone to the replica holding most of its prompt (the router hashed every prompt's blocks
  against every replica when it chose; `prefix_elsewhere` keeps what it passed over);
- `engine_busy`: the share of the window each engine spent stepping, with its window's figures
  (for a mixture of experts, its routing too: rows per expert read, the busiest expert's load);
- `expert_scatter`: a mixture of experts whose batched tokens went to experts of their own, so
  batching did not share the experts' weight reads;
- `admission_rejections`: refusals by reason;
- `model_thrash`: catalog models evicting each other and reloaded soon after, who evicted whom,
  the loads and their seconds, and whether the budget or the keep-alive is the remedy
  (telemetry.thrash).

A finding's `share` is its milliseconds over the window's total request latency (0..1), so
findings compare on one scale; `figure` says the same in words.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenpath.telemetry.engine_steps import MOE_COUNTERS
from tokenpath.telemetry.thrash import thrash
from tokenpath.telemetry.timeline import PATH_STAGES

# EngineFigures' fields of the sparse layers' counters, in EngineState.moe_experts' order.
MOE_FIELDS = tuple(name for name, _ in MOE_COUNTERS)
TTFT_STAGES = PATH_STAGES[:PATH_STAGES.index("prefill") + 1]  # every stage up to the first token


@dataclass
class Finding:
    kind: str
    figure: str
    share: float  # of the window's total request latency, 0..1 (0 when it is not latency)
    evidence: dict[str, Any] = field(default_factory=dict)
    lever: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EngineFigures:
    """One engine replica's figures: cumulative since it started as `engine_figures` reads them
    (what `/metrics` reads), or over a window once `engine_window` has taken the differences
    (`window_s` set: the counters are the window's, `kv_usage_mean`/`_max` its gauge)."""

    replica: str
    max_num_seqs: int
    steps: int
    step_seconds: float
    seqs_scheduled: float  # the sum of batch sizes over steps
    preemptions: int
    kv_usage: float  # now
    waiting: int
    running: int
    uptime_s: float  # seconds since the server started
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    tokens_scheduled: float = 0.0  # the sum of tokens per step over steps
    window_s: float | None = None  # the seconds the counters cover (None: since the server started)
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    # Mixture-of-experts counters (engine_steps.MOE_COUNTERS); zeros for a dense model.
    moe_expert_rows: int = 0
    moe_experts_read: int = 0
    moe_busiest_expert_rows: int = 0
    moe_layer_steps: int = 0

    @property
    def span_s(self) -> float:
        return self.window_s if self.window_s is not None else self.uptime_s

    def experts(self) -> dict[str, float] | None:
        """A mixture of experts' routing over the window, None for a dense model (or no sparse
        step): rows per expert read (how many tokens one read of an expert's weights served: 1.0
        when each token's experts were read for it alone), experts read per layer-step, and the
        busiest expert's rows against the mean of those read (1.0: an even load)."""
        if not self.moe_layer_steps or not self.moe_experts_read:
            return None
        per_read = self.moe_expert_rows / self.moe_experts_read
        return {"expert_rows_per_read": round(per_read, 3),
                "experts_read_per_layer_step": round(self.moe_experts_read / self.moe_layer_steps, 2),
                "expert_rows_per_layer_step": round(self.moe_expert_rows / self.moe_layer_steps, 2),
                "busiest_expert_vs_mean": round(self.moe_busiest_expert_rows / self.moe_layer_steps / per_read, 3)}

    def summary(self) -> dict[str, float | int | None]:
        """The figures an operator reads first: per step and per window (and the experts' routing,
        for a mixture of experts)."""
        steps = max(1, self.steps)
        return {"window_s": round(self.span_s, 1), "steps": self.steps, **(self.experts() or {}),
                "busy_fraction": round(self.step_seconds / self.span_s, 4) if self.span_s > 0 else 0.0,
                "mean_step_ms": round(1000 * self.step_seconds / steps, 2) if self.steps else None,
                "mean_batch_seqs": round(self.seqs_scheduled / steps, 3) if self.steps else None,
                "mean_batch_tokens": round(self.tokens_scheduled / steps, 1) if self.steps else None,
                "max_num_seqs": self.max_num_seqs, "preemptions": self.preemptions,
                "kv_usage_mean": self.kv_usage_mean, "kv_usage_max": self.kv_usage_max, "kv_usage_now": self.kv_usage}


_LEVERS = {
    "queued_behind": "more replicas or a larger --max-num-seqs; cap max_tokens of long requests; priorities",
    "prefill_uncached": "enable prefix caching and share system prompts; --long-prefill-token-threshold; "
                        "shorter prompts",
    "prefix_elsewhere": "raise the routing load_threshold or lower cache_weight so prompts follow their prefix",
    "decode_stalled_by_prefill": "lower --long-prefill-token-threshold / --max-num-batched-tokens so prefill "
                                 "chunks are smaller",
    "preempted": "more KV blocks (--kv-cache-memory), a lower --max-num-seqs, or smaller max_tokens",
    "retried": "look at the failing replica (its log and /health)",
    "replica_ejected": "look at the ejected replica (its log and /health)",
    "slow_client": "the client reads slowly: nothing to fix server-side (buffering proxy, client code)",
    "upload": "the client uploads slowly: compress or shorten the request body",
    "model_load": "warm it up (POST /v1/models/{id}/load), pin it, or raise --keep-alive / --models-memory",
    "speculation_wasted": "this traffic has little to copy: lower num_speculative_tokens or raise "
                          "prompt_lookup_min (ngram) or suffix_decoding_min_token_prob (suffix) in "
                          "--speculative-config, or serve it without speculation",
}


def _stages(row: dict[str, Any]) -> dict[str, float]:
    return {s["stage"]: float(s["ms"]) for s in row.get("stages") or ()}


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def diagnose(rows: list[dict[str, Any]], engines: list[EngineFigures] | None = None) -> list[Finding]:
    """Every finding the window supports, largest share first (findings without a latency share,
    like rejections, after)."""
    served = [r for r in rows if r.get("status") == 200]
    total_ms = sum(float(r.get("total_ms") or 0.0) for r in served) or 0.0
    out: list[Finding] = []
    if served:
        out.append(_ttft(served, total_ms))
        out += _cause_findings(served, total_ms)
        lost = _prefix_lost(served, total_ms)
        if lost is not None:
            out.append(lost)
    for e in engines or ():
        out += _engine(e, rows)
    thrashed = thrash(rows, total_ms)
    if thrashed is not None:
        out.append(Finding(**thrashed))
    rejected = _rejections(rows)
    if rejected is not None:
        out.append(rejected)
    out.sort(key=lambda f: -f.share)
    return out


def _ttft(served: list[dict[str, Any]], total_ms: float) -> Finding:
    by_stage: Counter[str] = Counter()
    ttfts = []
    for r in served:
        st = _stages(r)
        t = sum(st.get(k, 0.0) for k in TTFT_STAGES)
        ttfts.append((t, r["request_id"]))
        for k in TTFT_STAGES:
            by_stage[k] += st.get(k, 0.0)
    by_cause: Counter[str] = Counter()
    for r in served:
        for c in r.get("causes") or ():
            if (c.get("detail") or {}).get("stage") in TTFT_STAGES:
                by_cause[c["kind"]] += float(c["ms"])
    ttft_ms = sum(t for t, _ in ttfts)
    split = {k: round(v / ttft_ms, 3) for k, v in by_stage.items()} if ttft_ms else {}
    causes = {k: round(v / ttft_ms, 3) for k, v in by_cause.most_common()} if ttft_ms else {}
    top_stage = max(split, key=split.__getitem__) if split else "-"
    top_cause = next(iter(causes), None)
    values = [t for t, _ in ttfts]
    return Finding(
        "ttft", f"TTFT p50 {_quantile(values, 0.5):.0f} ms, p90 {_quantile(values, 0.9):.0f} ms over "
                f"{len(served)} requests; {100 * split.get(top_stage, 0):.0f}% of it in {top_stage}"
                + (f", {100 * causes[top_cause]:.0f}% explained by {top_cause}" if top_cause else ""),
        round(ttft_ms / total_ms, 3) if total_ms else 0.0,
        {"by_stage": split, "by_cause": causes,
         "request_ids": [rid for _, rid in sorted(ttfts, reverse=True)[:5]]},
        _LEVERS.get(top_cause or "", "the gateway stage: auth, tokenizing, rate limits") if top_cause or
        top_stage == "gateway" else f"look at the {top_stage} stage")


def _cause_findings(served: list[dict[str, Any]], total_ms: float) -> list[Finding]:
    """One finding per cause kind that cost time: its ms summed, the requests it hit, the culprits."""
    ms: Counter[str] = Counter()
    hit: dict[str, list[str]] = defaultdict(list)
    culprits: dict[str, Counter[str]] = defaultdict(Counter)
    replicas: dict[str, Counter[str]] = defaultdict(Counter)
    for r in served:
        for c in r.get("causes") or ():
            kind = c["kind"]
            if kind in ("prefill_uncached", "prefix_elsewhere"):
                continue  # (prefill cost is in `ttft`; lost prefix hits have their own finding)
            ms[kind] += float(c["ms"])
            hit[kind].append(r["request_id"])
            culprits[kind].update(c.get("request_ids") or ())
            if r.get("replica"):
                replicas[kind][r["replica"]] += 1
    out = []
    for kind, v in ms.most_common():
        if v <= 0:
            continue
        out.append(Finding(
            kind, f"{kind} cost {v:.0f} ms over {len(hit[kind])} requests ({100 * v / total_ms:.1f}% of latency)",
            round(v / total_ms, 3) if total_ms else 0.0,
            {"request_ids": hit[kind][:10], "culprits": [rid for rid, _ in culprits[kind].most_common(5)],
             "replicas": dict(replicas[kind])}, _LEVERS.get(kind, "")))
    return out


def _prefix_lost(served: list[dict[str, Any]], total_ms: float) -> Finding | None:
    prompt = sum(int(r.get("prompt_tokens") or 0) for r in served)
    cached = sum(int(r.get("cached_tokens") or 0) for r in served)
    lost_tokens, lost_ms, decisions = 0, 0.0, []
    why: Counter[str] = Counter()
    for r in served:
        for c in r.get("causes") or ():
            if c["kind"] != "prefix_elsewhere":
                continue
            d = c.get("detail") or {}
            lost_tokens += int(d.get("tokens_it_held") or 0)
            lost_ms += float(c["ms"])
            why[str(d.get("why"))] += 1
            decisions.append({"request_id": r["request_id"], "held_by": d.get("replica"), "sent_to": d.get("chosen"),
                              "blocks": d.get("blocks"), "why": d.get("why")})
    if not prompt or not decisions:
        return None
    achieved, achievable = cached / prompt, min(1.0, (cached + lost_tokens) / prompt)
    return Finding(
        "prefix_benefit_lost", f"prefix-cache hit rate {100 * achieved:.1f}% achieved, {100 * achievable:.1f}% "
        f"achievable: {len(decisions)} routing decisions sent prompts away from their prefix "
        f"({', '.join(f'{k} {n}' for k, n in why.most_common())})",
        round(lost_ms / total_ms, 3) if total_ms else 0.0,
        {"achieved_hit_rate": round(achieved, 4), "achievable_hit_rate": round(achievable, 4),
         "lost_tokens": lost_tokens, "decisions": decisions[:10]}, _LEVERS["prefix_elsewhere"])


def _engine(e: EngineFigures, rows: list[dict[str, Any]]) -> list[Finding]:
    out = []
    fig = e.summary()
    kv_peak = e.kv_usage_max if e.kv_usage_max is not None else e.kv_usage
    busy = float(fig["busy_fraction"] or 0.0)
    per_step = (f"; mean step {fig['mean_step_ms']} ms, batch {fig['mean_batch_seqs']} seqs / "
                f"{fig['mean_batch_tokens']} tokens" if e.steps else "")
    kv = f", KV mean {100 * e.kv_usage_mean:.0f}% max {100 * e.kv_usage_max:.0f}%" \
        if e.kv_usage_mean is not None and e.kv_usage_max is not None else ""
    out.append(Finding(
        "engine_busy", f"engine {e.replica} stepped {100 * busy:.1f}% of the last {e.span_s:.0f} s ({e.steps} "
        f"steps{per_step}{kv}, {e.preemptions} preemptions)", 0.0, {"replica": e.replica, **fig},
        "busy near 100%: add replicas; low while TTFT is high: the time is outside the engine (gateway, "
        "queue limits, network)"))
    if e.steps:
        mean = e.seqs_scheduled / e.steps
        if mean < 0.75 * e.max_num_seqs:
            if e.preemptions or kv_peak > 0.9:
                why, lever = "KV", _LEVERS["preempted"]
            elif e.waiting:
                why, lever = "limits", "the engine has waiting requests it cannot batch: --max-num-batched-tokens"
            elif any(c.get("kind") == "queued_behind" and (c.get("detail") or {}).get("where") == "admission"
                     for r in rows for c in r.get("causes") or ()):
                why, lever = "limits", "the gateway queued requests while the batch had room: raise max_inflight"
            else:
                why, lever = "arrivals", "not enough concurrent requests to fill a batch: nothing to fix, or " \
                    "consolidate replicas"
            out.append(Finding(
                "batches_not_forming", f"mean batch {mean:.2f} of max_num_seqs {e.max_num_seqs} on {e.replica} "
                f"(cause: {why})", 0.0, {"replica": e.replica, "mean_batch": round(mean, 3), "cause": why,
                                         "steps": e.steps}, lever))
    scatter = _expert_scatter(e)
    if scatter is not None:
        out.append(scatter)
    preempted = [r for r in rows if any(c.get("kind") == "preempted" for c in r.get("causes") or ())]
    if e.preemptions or kv_peak > 0.9:
        out.append(Finding(
            "kv_pressure", f"{e.preemptions} preemptions on {e.replica} ({e.preemptions / max(1, len(rows)):.2f} "
            f"per request in the window), KV {100 * e.kv_usage:.0f}% used now"
            + (f", {100 * e.kv_usage_max:.0f}% at most in the window" if e.kv_usage_max is not None else ""), 0.0,
            {"replica": e.replica, "preemptions": e.preemptions, "kv_usage": round(e.kv_usage, 4),
             "kv_usage_max": e.kv_usage_max,
             "request_ids": [r["request_id"] for r in preempted[:10]]}, _LEVERS["preempted"]))
    return out


# A mixture of experts' batch "scatters" when its tokens chose experts of their own: one read of an
# expert's weights serves at most this many rows on average, while steps held several tokens.
SCATTER_ROWS_PER_READ = 1.5
SCATTER_BATCH_TOKENS = 2.0


def _expert_scatter(e: EngineFigures) -> Finding | None:
    """`expert_scatter`: steps of several tokens whose tokens went to different experts, so each
    expert's weights were read for one token or little more and the step cost about what its
    tokens cost one at a time: batching bought these steps almost nothing."""
    moe = e.experts()
    if moe is None or not e.steps or e.tokens_scheduled / e.steps < SCATTER_BATCH_TOKENS:
        return None
    if moe["expert_rows_per_read"] > SCATTER_ROWS_PER_READ:
        return None
    return Finding(
        "expert_scatter", f"steps on {e.replica} held {e.tokens_scheduled / e.steps:.1f} tokens on average, but "
        f"their tokens scattered over the experts: each expert read served {moe['expert_rows_per_read']} rows "
        f"({moe['experts_read_per_layer_step']} experts read per layer-step), so a step cost about what its "
        "tokens cost one at a time", 0.0, {"replica": e.replica, **moe},
        "this traffic's routing: larger batches (more concurrent requests, a larger --max-num-batched-tokens "
        "for prefill) let more tokens share each expert's read; decode of a mixture of experts costs what a "
        "dense model of its active size costs")


def _rejections(rows: list[dict[str, Any]]) -> Finding | None:
    reasons = Counter(str(r["rejection"]) for r in rows if r.get("rejection"))
    if not reasons:
        return None
    n = sum(reasons.values())
    return Finding(
        "admission_rejections", f"{n} of {len(rows)} requests refused: "
        + ", ".join(f"{k} {v}" for k, v in reasons.most_common()), 0.0,
        {"by_reason": dict(reasons), "request_ids": [r["request_id"] for r in rows if r.get("rejection")][:10]},
        "rate_limit: raise the key's limits; admission: more replicas or a longer queue; deadline: "
        "longer timeouts or more capacity")


def render(findings: list[Finding], window: str) -> str:
    if not findings:
        return f"no requests in the window ({window})"
    lines = [f"tokenpath diagnose ({window}): {len(findings)} findings"]
    for f in findings:
        share = f"{100 * f.share:5.1f}%" if f.share else "     "
        lines.append(f"{share}  {f.kind:<26}{f.figure}")
        for label, key in (("requests", "request_ids"), ("culprits", "culprits")):
            ids = f.evidence.get(key)
            if ids:
                lines.append(f"{'':7}{'':26}{label}: {', '.join(map(str, ids[:3]))}")
        if f.lever:
            lines.append(f"{'':7}{'':26}lever: {f.lever}")
    return "\n".join(lines)


def engine_figures(deployments: Any, uptime_s: float) -> list[EngineFigures]:
    """Each chat replica's figures, read the way `/metrics` reads them (its step histograms and
    its state), whatever process its engine runs in. Replicas that report no steps are skipped."""
    out = []
    for dep in deployments:
        flow = getattr(dep, "flow", None) if getattr(dep, "replicas", None) else None
        if flow is None:
            continue
        for handle in flow.pool.handles.values():
            read = getattr(handle.replica, "step_stats", None)
            snap = read() if callable(read) else None
            if not snap or "time" not in snap or "seqs" not in snap:
                continue
            s = handle.state()
            (counts, step_s), (_, seqs) = snap["time"], snap["seqs"]
            tokens = float(snap["tokens"][1]) if "tokens" in snap else 0.0
            out.append(EngineFigures(replica=str(handle.name), max_num_seqs=int(s.max_num_seqs or 0),
                                     steps=int(sum(counts)), step_seconds=float(step_s), seqs_scheduled=float(seqs),
                                     tokens_scheduled=tokens,
                                     preemptions=int(s.num_preemptions), kv_usage=float(s.kv_usage),
                                     waiting=int(s.waiting), running=int(s.running), uptime_s=uptime_s,
                                     prefix_cache_queries=int(s.prefix_cache_queries),
                                     prefix_cache_hits=int(s.prefix_cache_hits),
                                     **dict(zip(MOE_FIELDS, map(int, getattr(s, "moe_experts", ()) or ()),
                                                strict=False))))
    return out
