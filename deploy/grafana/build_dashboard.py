"""Writes tokenpath.json, the Grafana dashboard for `tokenpath serve`'s /metrics (Prometheus data
source). The panels are declared here once; `python deploy/grafana/build_dashboard.py` rewrites the
JSON, and tests/telemetry/test_prometheus_dashboard.py checks that the committed file is this
script's output and that every query returns data from a live server scraped by Prometheus.

Variables: `$model_name` (label_values of tokenpath series) and Grafana's `$__rate_interval`.
"""

from __future__ import annotations

import json
from pathlib import Path

M = 'model_name="$model_name"'
STAGES = ("gateway", "queue", "engine_queue", "prefill", "decode")


def q(p: float, metric: str, by: str = "le", sel: str = M) -> str:
    return f"histogram_quantile({p}, sum by({by}) (rate(tokenpath:{metric}_bucket{{{sel}}}[$__rate_interval])))"


# (title, unit, [(legend, expr)]) in rows of two panels.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Stage p50 (where the time goes)", "s",
     [(st, q(0.5, "request_stage_seconds", "le", f'{M},stage="{st}"')) for st in STAGES]),
    ("Stage p99", "s", [(st, q(0.99, "request_stage_seconds", "le", f'{M},stage="{st}"')) for st in STAGES]),
    ("Time to first token", "s", [("p50", q(0.5, "time_to_first_token_seconds")),
                                  ("p99", q(0.99, "time_to_first_token_seconds"))]),
    ("Inter-token latency", "s", [("p50", q(0.5, "inter_token_latency_seconds")),
                                  ("p99", q(0.99, "inter_token_latency_seconds"))]),
    ("Time per output token (per request)", "s", [("p50", q(0.5, "request_time_per_output_token_seconds")),
                                                  ("p99", q(0.99, "request_time_per_output_token_seconds"))]),
    ("E2E request latency", "s", [("p50", q(0.5, "e2e_request_latency_seconds")),
                                  ("p99", q(0.99, "e2e_request_latency_seconds"))]),
    ("Token throughput", "short", [
        ("prompt tok/s", f"rate(tokenpath:prompt_tokens_total{{{M}}}[$__rate_interval])"),
        ("generation tok/s", f"rate(tokenpath:generation_tokens_total{{{M}}}[$__rate_interval])")]),
    ("Requests running and waiting", "short", [
        ("running", f"tokenpath:num_requests_running{{{M}}}"),
        ("waiting (engine)", f"tokenpath:num_requests_waiting{{{M}}}"),
        ("queued (gateway)", 'tokenpath:gateway_queue_depth{deployment="$model_name"}')]),
    ("Queue time p99", "s", [("gateway queue", q(0.99, "request_gateway_queue_time_seconds")),
                             ("engine queue", q(0.99, "request_queue_time_seconds"))]),
    ("KV cache usage", "percentunit", [("kv usage", f"tokenpath:kv_cache_usage_perc{{{M}}}")]),
    ("Batch size (sequences per step)", "short", [
        ("mean", f"sum(rate(tokenpath:iteration_seqs_sum{{{M}}}[$__rate_interval])) / "
                 f"sum(rate(tokenpath:iteration_seqs_count{{{M}}}[$__rate_interval]))"),
        ("p99", q(0.99, "iteration_seqs"))]),
    ("Prefix cache hit rate", "percentunit", [
        ("hit rate", f"rate(tokenpath:prefix_cache_hits_total{{{M}}}[$__rate_interval]) / "
                     f"rate(tokenpath:prefix_cache_queries_total{{{M}}}[$__rate_interval])")]),
    ("Requests by status", "reqps", [
        ("{{status}}", f"sum by(status) (rate(tokenpath:requests_total{{{M}}}[$__rate_interval]))")]),
    ("Error rate (5xx share)", "percentunit", [
        ("5xx", f'(sum(rate(tokenpath:requests_total{{{M},status=~"5.."}}[$__rate_interval])) or vector(0)) / '
                f"sum(rate(tokenpath:requests_total{{{M}}}[$__rate_interval]))")]),
    ("Rejections by reason", "reqps", [
        ("{{reason}}", f"sum by(reason) (rate(tokenpath:request_rejections_total{{{M}}}[$__rate_interval]))")]),
    ("Preemptions", "short", [("preemptions/s", f"rate(tokenpath:num_preemptions_total{{{M}}}[$__rate_interval])")]),
    ("Tokens per tenant (admin scrape)", "short", [
        ("{{tenant}} {{kind}}", f"sum by(tenant, kind) (rate(tokenpath:tenant_tokens_total{{{M}}}"
                                "[$__rate_interval]))")]),
    ("Finish reasons", "short", [
        ("{{finished_reason}}", f"sum by(finished_reason) (increase(tokenpath:request_success_total{{{M}}}"
                                "[$__rate_interval]))")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend, "range": True}
                        for j, (legend, expr) in enumerate(targets)],
        })
    return {
        "title": "tokenpath", "uid": "tokenpath-overview", "schemaVersion": 39, "version": 1,
        "description": "tokenpath serve: the six stages, latency, throughput, queues, KV, batches, errors, tenants",
        "time": {"from": "now-15m", "to": "now"}, "refresh": "10s", "tags": ["tokenpath", "llm"],
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "type": "datasource", "query": "prometheus", "label": "datasource"},
            {"name": "model_name", "type": "query", "label": "model", "refresh": 1,
             "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
             "definition": 'label_values({__name__=~"tokenpath:.*"}, model_name)',
             "query": {"query": 'label_values({__name__=~"tokenpath:.*"}, model_name)', "refId": "models"}},
        ]},
        "panels": panels,
    }


def main() -> None:
    out = Path(__file__).with_name("tokenpath.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
