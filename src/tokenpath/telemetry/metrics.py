"""Prometheus metrics with vLLM's names and meanings under a `tokenpath:` prefix and a `model_name` label.

Gauges and engine counters (running, waiting, KV usage, prefix-cache queries/hits, preemptions)
are read from the replicas' state at scrape time (in-process, or pushed over the engine link), so
they can never drift from the engine. Per-request histograms and token counters are observed once
per finished request from its Timeline, the same source as the Server-Timing header and the audit
row. vLLM's meanings hold where the names are vLLM's, so its Grafana dashboard works with the
prefix swapped: `request_queue_time_seconds` is the engine's wait (the gateway's admission queue is
`request_gateway_queue_time_seconds`), `time_per_output_token_seconds` is the per-token gap,
`request_inference_time_seconds` is prefill plus decode. Embedding requests have their own series
(`embedding_*`): they have no first token and no decode.

Every served model's series exist from the start (at zero), and `model_name` only ever takes a
served model's name: a request for an unknown model counts under `unknown`, so clients cannot grow
the label set. Tenant series (`tenant_tokens`, the tenant label of `queue_depth`) are rendered only
for callers allowed to see tenant names (`render(tenants=True)`); the public view sums them away.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from tokenpath.telemetry.engine_steps import MOE_COUNTERS, prometheus_buckets
from tokenpath.telemetry.engine_steps import SERIES as STEP_SERIES
from tokenpath.telemetry.record import FinishedRequest
from tokenpath.telemetry.series import RoutingMetricsCollector
from tokenpath.telemetry.stages import after_first_token
from tokenpath.telemetry.timeline import PATH_STAGES, Timeline
from tokenpath.telemetry.tracing import annotate_step

PREFIX = "tokenpath:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's build_1_2_5_buckets, to a context far beyond any model served here.
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
UNKNOWN_MODEL = "unknown"  # the model_name of requests for a model this server does not serve
TENANT_LABEL = "tenant"
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _StateCollector(Collector):
    """Scrape-time view of every deployment's replicas, summed per model."""

    def __init__(self, deployments: Callable[[], Iterable[Any]]) -> None:
        self._deployments = deployments

    def collect(self) -> Iterator[Any]:
        gauges = {
            "num_requests_running": "Number of requests in model execution batches.",
            "num_requests_waiting": "Number of requests waiting to be processed.",
            "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
            # vLLM's older name for the same gauge, which its published Grafana dashboard still reads.
            "gpu_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage (vLLM's older name).",
            "kv_cache_resident_bytes": "Bytes of the KV pool in the engines' memory: blocks ever written on the "
                                       "native kernels (resident from first use), the whole pool elsewhere. The "
                                       "share of RSS that is the KV budget, not weights.",
        }
        counters = {
            "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
            "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
            "num_preemptions": "Cumulative number of preemptions from the engine.",
        }
        g = {k: GaugeMetricFamily(PREFIX + k, doc, labels=["model_name"]) for k, doc in gauges.items()}
        by_reason = GaugeMetricFamily(PREFIX + "num_requests_waiting_by_reason",
                                      "Number of waiting requests by reason: 'capacity' = waiting for scheduling "
                                      "capacity; 'deferred' = passed over for a reason of their own (an adapter not "
                                      "ready, shared prefix blocks in flight). The sum is num_requests_waiting.",
                                      labels=["model_name", "reason"])
        # vLLM's cache_config_info: a remote gateway reads the block size (for prefix hashes) and
        # the pool size (how much of its routing memory the replica can actually hold) from it.
        cache_info = GaugeMetricFamily(PREFIX + "cache_config_info", "Information of the KV cache config.",
                                       labels=["model_name", "block_size", "num_gpu_blocks"])
        c = {k: CounterMetricFamily(PREFIX + k, doc, labels=["model_name"]) for k, doc in counters.items()}
        # vLLM's lora_requests_info: the adapters of running and waiting requests (comma-separated
        # label values) and the slots per step; the value is the scrape's wall time, as vLLM's.
        lora_info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                                      labels=["model_name", "max_lora", "waiting_lora_adapters",
                                              "running_lora_adapters"])
        spec, moe = SpecDecodeMetrics(), MoeMetrics()
        for dep in self._deployments():  # (embedding models too: their replicas report running requests)
            running = waiting = deferred = 0
            usage: list[float] = []
            queries = hits = preemptions = resident = 0
            config: tuple[int, int] | None = None
            max_lora, lora_run, lora_wait = 0, {}, {}
            for replica in dep.replicas:
                st = replica.state()
                max_lora = max(max_lora, st.max_loras)
                lora_run.update(dict.fromkeys(st.running_loras))
                lora_wait.update(dict.fromkeys(st.waiting_loras))
                if config is None and st.num_blocks > 0:
                    config = (st.block_size, st.num_blocks)
                running += st.running
                waiting += st.waiting
                deferred += min(st.waiting, getattr(st, "waiting_deferred", 0))
                usage.append(st.kv_usage)
                resident += st.kv_resident_bytes
                queries += st.prefix_cache_queries
                hits += st.prefix_cache_hits
                preemptions += st.num_preemptions
                spec.add(dep.name, getattr(st, "spec_decode", None))  # (embedding replicas have none)
                moe.add(dep.name, getattr(st, "moe_experts", None))
            g["num_requests_running"].add_metric([dep.name], running)
            g["num_requests_waiting"].add_metric([dep.name], waiting)
            by_reason.add_metric([dep.name, "capacity"], waiting - deferred)
            by_reason.add_metric([dep.name, "deferred"], deferred)
            for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):
                g[name].add_metric([dep.name], sum(usage) / len(usage) if usage else 0.0)
            g["kv_cache_resident_bytes"].add_metric([dep.name], resident)
            c["prefix_cache_queries"].add_metric([dep.name], queries)
            c["prefix_cache_hits"].add_metric([dep.name], hits)
            c["num_preemptions"].add_metric([dep.name], preemptions)
            if config is not None:
                cache_info.add_metric([dep.name, str(config[0]), str(config[1])], 1.0)
            if max_lora:
                lora_info.add_metric([dep.name, str(max_lora), ",".join(sorted(lora_wait)),
                                      ",".join(sorted(lora_run))], time.time())
        yield from g.values()
        yield by_reason
        yield cache_info
        yield lora_info
        yield from c.values()
        yield from spec.families()
        yield from moe.families()


class ModelSums:
    """Lists of cumulative counters summed per model over its replicas; a replica that reports an
    empty list (an engine without the feature) adds nothing, so such models get no series."""

    def __init__(self) -> None:
        self._sums: dict[str, list[int]] = {}

    def add(self, model: str, counts: Sequence[int] | None) -> None:
        if not counts:
            return
        total = self._sums.setdefault(model, [])
        total.extend([0] * (len(counts) - len(total)))
        for i, v in enumerate(counts):
            total[i] += v


class SpecDecodeMetrics(ModelSums):
    """vLLM's spec_decode_* counters, for models whose engines speculate."""

    def families(self) -> Iterator[Metric]:
        if not self._sums:
            return
        docs = {"spec_decode_num_drafts": "Number of spec decoding drafts.",
                "spec_decode_num_draft_tokens": "Number of draft tokens.",
                "spec_decode_num_accepted_tokens": "Number of accepted tokens."}
        fams = {k: CounterMetricFamily(PREFIX + k, doc, labels=["model_name"]) for k, doc in docs.items()}
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=["model_name", "position"])
        for model, sums in self._sums.items():
            for i, fam in enumerate(fams.values()):
                fam.add_metric([model], sums[i])
            for pos, v in enumerate(sums[3:]):
                per_pos.add_metric([model, str(pos)], v)
        yield from fams.values()
        yield per_pos


class MoeMetrics(ModelSums):
    """The sparse layers' expert counters (`engine_steps.MOE_COUNTERS`), for mixture-of-experts
    models: rows / experts read is how many tokens one read of an expert's weights served."""

    def families(self) -> Iterator[Metric]:
        if not self._sums:
            return
        fams = [CounterMetricFamily(PREFIX + name, doc, labels=["model_name"]) for name, doc in MOE_COUNTERS]
        for model, sums in self._sums.items():
            for fam, v in zip(fams, sums, strict=False):
                fam.add_metric([model], v)
        yield from fams


class EngineStepCollector(Collector):
    """Engine step time and batch size per replica, read at scrape time from each replica's
    `step_stats()` (its own engine's counts in-process, the engine's last state frame over the
    link), so the series have the same names and labels whichever process the engine runs in."""

    def __init__(self, deployments: Callable[[], Iterable[Any]]) -> None:
        self._deployments = deployments

    def collect(self) -> Iterator[Any]:
        fams = {key: HistogramMetricFamily(PREFIX + name, doc, labels=["model_name", "replica"])
                for key, (name, doc, _) in STEP_SERIES.items()}
        for dep in self._deployments():
            for replica in getattr(dep, "replicas", ()):
                read = getattr(replica, "step_stats", None)
                snap = read() if callable(read) else None
                for key, fam in fams.items():
                    if not snap or key not in snap:
                        continue
                    try:
                        buckets, total = prometheus_buckets(key, snap[key])
                    except (ValueError, TypeError):
                        continue
                    fam.add_metric([dep.name, str(replica.name)], buckets, total)
        yield from fams.values()


class ServerMetrics:
    """One registry per app (tests start several apps in one process)."""

    def __init__(self, deployments: Callable[[], Iterable[Any]]) -> None:
        self.registry = CollectorRegistry()
        self._deployments = deployments
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # (`_of`)
        self.registry.register(_StateCollector(deployments))
        # Queue depth per band and tenant, rejections by reason, routing decisions by policy.
        self.registry.register(RoutingMetricsCollector())
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.",
                                         m, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                                       m + ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram(PREFIX + "time_to_first_answer_token_seconds",
                              "Histogram of time to the first answer token of a reply that reasoned first (after "
                              "its think block), in seconds.", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             m, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot_token = Histogram(PREFIX + "time_per_output_token_seconds",
                                    "Histogram of time per output token in seconds (the gap between tokens; "
                                    "vLLM's name for inter_token_latency_seconds).", m, buckets=_ITL_BUCKETS,
                                    registry=r)
        self.gateway = Histogram(PREFIX + "request_gateway_time_seconds",
                                 "Histogram of time from arrival to admission (auth, routing, tokenizing, "
                                 "rate limits), in seconds.", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.gateway_queue = Histogram(PREFIX + "request_gateway_queue_time_seconds",
                                       "Histogram of time spent in the gateway's admission queue, in seconds.",
                                       m, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request (dispatch to the "
                               "engine's first schedule), in seconds.", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram(PREFIX + "request_prefill_time_seconds",
                                 "Histogram of time spent in the prefill phase, in seconds.",
                                 m, buckets=_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram(PREFIX + "request_decode_time_seconds",
                                "Histogram of time spent in the decode phase, in seconds.",
                                m, buckets=_LATENCY_BUCKETS, registry=r)
        self.inference = Histogram(PREFIX + "request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request (prefill + decode), "
                                   "in seconds.", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request: decode time over "
                              "output tokens after the first.", m, buckets=_ITL_BUCKETS, registry=r)
        self.req_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Number of prefill tokens processed.",
                                           m, buckets=_TOKEN_BUCKETS, registry=r)
        self.req_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                               "Number of generation tokens processed.", m, buckets=_TOKEN_BUCKETS,
                                               registry=r)
        self.req_max_tokens = Histogram(PREFIX + "request_max_num_generation_tokens",
                                        "Histogram of maximum number of requested generation tokens.", m,
                                        buckets=_TOKEN_BUCKETS, registry=r)
        self.req_params_max_tokens = Histogram(PREFIX + "request_params_max_tokens",
                                               "Histogram of the max_tokens request parameter.", m,
                                               buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens_cached = Counter(PREFIX + "prompt_tokens_cached",
                                            "Number of prompt tokens served from the prefix cache.", m, registry=r)
        self.req_kv_computed = Histogram(PREFIX + "request_prefill_kv_computed_tokens",
                                         "Histogram of new KV tokens computed during prefill per request "
                                         "(prompt tokens not served from the prefix cache).", m,
                                         buckets=_TOKEN_BUCKETS, registry=r)
        self.req_preemptions = Histogram(PREFIX + "request_num_preemptions",
                                         "Histogram of the number of times each request was preempted.", m,
                                         buckets=(0, 1, 2, 4, 8, 16), registry=r)
        self.embed_latency = Histogram(PREFIX + "embedding_request_latency_seconds",
                                       "Histogram of embedding request latency (arrival to vectors), in seconds.",
                                       m, buckets=_LATENCY_BUCKETS, registry=r)
        self.embed_tokens = Counter(PREFIX + "embedding_input_tokens", "Number of embedding input tokens encoded.",
                                    m, registry=r)
        self.stage = Histogram(PREFIX + "request_stage_seconds",
                               "Time per request stage (gateway, queue, engine_queue, prefill, reasoning, decode), from "
                               "the request's Timeline: the same numbers as Server-Timing.",
                               m + ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished requests by HTTP status and error code "
                                "(499: the client disconnected).", m + ["endpoint", "status", "code"], registry=r)
        self.rejections = Counter(PREFIX + "request_rejections",
                                  "Requests refused by the gateway, by reason (auth, acl, rate_limit, "
                                  "admission, deadline).", m + ["reason"], registry=r)
        self.tenant_tokens = Counter(PREFIX + "tenant_tokens", "Tokens per tenant, by kind (prompt, cached, "
                                     "generation).", m + ["tenant", "kind"], registry=r)
        self.structured_requests = Counter(PREFIX + "structured_requests", "Requests with constrained output, by "
                                           "kind (json, regex, choice, grammar, tools).", ["kind"], registry=r)
        self.registry.register(EngineStepCollector(deployments))
        for dep in deployments():  # the trace's prefill chunks, from the in-process engine's own thread
            for replica in getattr(dep, "replicas", ()):
                core = getattr(getattr(replica, "engine", None), "core", None)
                if core is not None and hasattr(core, "step_observers") and annotate_step not in core.step_observers:
                    core.step_observers.append(annotate_step)
        self._init_series()

    def _served(self) -> set[str]:
        return {d.name for d in self._deployments()}

    def _init_series(self) -> None:
        """Every served model's series exist at zero from the start, as vLLM's do: a dashboard or
        an alert sees 0, not "no data", before the first request."""
        per_model = (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot_token, self.e2e,
                     self.gateway, self.gateway_queue, self.queue, self.prefill, self.decode, self.inference,
                     self.tpot, self.req_prompt_tokens, self.req_generation_tokens, self.req_max_tokens)
        for dep in self._deployments():
            if getattr(dep, "task", None) == "embedding":
                self.embed_latency.labels(dep.name)
                self.embed_tokens.labels(dep.name)
                continue
            for series in per_model:
                series.labels(dep.name)
            for reason in ("stop", "length", "abort"):
                self.request_success.labels(dep.name, reason)

    def model_label(self, rec: FinishedRequest) -> str:
        """The deployment that served it, or the name asked for when this server serves it (a
        refusal before routing), else `unknown`: clients never choose label values."""
        if rec.model is not None:
            return rec.model
        if rec.requested_model is not None and rec.requested_model in self._served():
            return rec.requested_model
        return UNKNOWN_MODEL

    def _of(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, each label set's child looked up once: prometheus_client's
        `labels` checks, converts and locks on every call, and a finished request made ~45 of them
        (3% of the gateway's CPU per request in front of vLLM, cProfile, issue 37). No series is
        ever removed from these metrics, so a child once made stays the registry's."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def observe_finished(self, rec: FinishedRequest) -> None:
        """Every finished request, whatever its ending: status, rejection, tenant tokens, stages."""
        model = self.model_label(rec)
        self._of(self.requests, model, rec.endpoint, str(rec.status), rec.error_code or rec.error_type or "").inc()
        reason = rec.rejection_reason
        if reason is not None:
            self._of(self.rejections, model, reason).inc()
        for kind, n in (("prompt", rec.prompt_tokens), ("cached", rec.cached_tokens),
                        ("generation", rec.completion_tokens)):
            if n:
                self._of(self.tenant_tokens, model, rec.tenant, kind).inc(n)
        if rec.status not in (200, 499) or rec.model is None:
            return
        stages = rec.stages()
        for stage in PATH_STAGES:
            if stage in stages:
                self._of(self.stage, model, stage).observe(stages[stage])
        if rec.operation == "embeddings":  # (and score, rerank) no first token, no decode: series of their own
            self._of(self.embed_tokens, model).inc(rec.prompt_tokens)
            self._of(self.embed_latency, model).observe(rec.timeline.durations()["total"])
            return
        decode = after_first_token(stages)
        if decode is not None and rec.completion_tokens > 1:
            self._of(self.tpot, model).observe(decode / (rec.completion_tokens - 1))
        self._of(self.req_prompt_tokens, model).observe(rec.prompt_tokens)
        self._of(self.req_generation_tokens, model).observe(rec.completion_tokens)
        if rec.max_tokens is not None:
            self._of(self.req_max_tokens, model).observe(rec.max_tokens)
            self._of(self.req_params_max_tokens, model).observe(rec.max_tokens)
        self._of(self.prompt_tokens_cached, model).inc(rec.cached_tokens)
        self._of(self.req_kv_computed, model).observe(max(0, rec.prompt_tokens - rec.cached_tokens))
        self._of(self.req_preemptions, model).observe(int(rec.timeline.attrs.get("preemptions", 0) or 0))  # type: ignore[call-overload]
        finish_reason = rec.finish_reasons[0] if rec.finish_reasons else None
        self.observe_request(model, rec.timeline, prompt_tokens=rec.prompt_tokens,
                             completion_tokens=rec.completion_tokens, finish_reason=finish_reason,
                             token_times=rec.token_times)

    def observe_request(self, model: str, timeline: Timeline, *, prompt_tokens: int, completion_tokens: int,
                        finish_reason: str | None, token_times: list[float]) -> None:
        """Everything about one finished generation, derived from its Timeline."""
        self._of(self.prompt_tokens, model).inc(prompt_tokens)
        self._of(self.generation_tokens, model).inc(completion_tokens)
        if finish_reason in ("stop", "length", "abort"):
            self._of(self.request_success, model, finish_reason).inc()
        ttft = timeline.between("received", "first_token")
        if ttft is not None:
            self._of(self.ttft, model).observe(ttft)
        ttfa = timeline.between("received", "first_answer")  # (a reply that thought, then answered)
        if ttfa is not None:
            self._of(self.ttfa, model).observe(ttfa)
        d = timeline.durations()
        self._of(self.e2e, model).observe(d["total"])
        for name, hist in (("gateway", self.gateway), ("queue", self.gateway_queue), ("engine_queue", self.queue),
                           ("prefill", self.prefill)):
            if name in d:
                self._of(hist, model).observe(d[name])
        decode = after_first_token(d)
        if decode is not None:
            self._of(self.decode, model).observe(decode)
        if "prefill" in d:
            self._of(self.inference, model).observe(d["prefill"] + (decode or 0.0))
        if len(token_times) > 1:
            gaps = [max(0.0, b - a) for a, b in zip(token_times, token_times[1:], strict=False)]
            observe_many(self._of(self.itl, model), gaps)
            observe_many(self._of(self.tpot_token, model), gaps)

    def render(self, tenants: bool = True) -> bytes:
        """The exposition text; without `tenants`, series with a tenant label are summed over it
        (queue depth) or left out (tenant tokens), so no tenant name leaves."""
        return generate_latest(self.registry if tenants else _WithoutTenants(self.registry))


def observe_many(child: Any, values: list[float]) -> None:
    """`child.observe(v)` for each of `values`, as one update per bucket: the same counts and sum.
    A finished request's inter-token gaps went into two histograms one `observe` at a time, each
    ~2.7 us (a bucket walk and two locked increments): 1.4 ms for a 256-token reply, all of it on
    the event loop (issue 37). A histogram child that is not prometheus_client's own (no bucket
    list to count into) is observed value by value."""
    bounds, buckets, total = (getattr(child, name, None) for name in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            child.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:  # (bucket i holds the values <= bounds[i], above bounds[i - 1], as `observe` counts)
        i = bisect_left(bounds, v)
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        buckets[i].inc(n)
    total.inc(sum(values))


class _WithoutTenants(Collector):
    """A registry's metrics with the tenant label summed away (families that only make sense per
    tenant are dropped)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        for fam in self._registry.collect():
            if not any(TENANT_LABEL in s.labels for s in fam.samples):
                yield fam
                continue
            if fam.name == PREFIX + "tenant_tokens":
                continue
            summed: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for s in fam.samples:
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != TENANT_LABEL)))
                summed[key] = summed.get(key, 0.0) + s.value
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [Sample(name, dict(labels), value) for (name, labels), value in summed.items()]
            yield out
