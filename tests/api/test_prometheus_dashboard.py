"""The Grafana dashboard and Prometheus rules that ship in deploy/, against Debian's real Prometheus
scraping a real `tokenpath serve`: every panel's query returns data, and so does every query of
vLLM's own Grafana dashboard with its `vllm:` prefix swapped for `tokenpath:` (its series names
are listed below, not copied: they are what that dashboard reads). `promtool` checks the rules,
and Prometheus evaluates them."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.process_logs import free_port, wait_for_log

from tokenpath.gateway.admin import create_key
from tokenpath.gateway.base import Limits
from tokenpath.gateway.store import GatewayStore

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHAT = "smollm2-135m-instruct"
KEY = "prom-test-admin-key"
pytestmark = pytest.mark.requires("prometheus")

# What vLLM's published Grafana dashboard (examples/online_serving/prometheus_grafana) queries,
# per model_name, with the prefix swapped.
VLLM_DASHBOARD = [
    "histogram_quantile(0.99, sum by(le) (rate(tokenpath:e2e_request_latency_seconds_bucket{M}[R])))",
    "rate(tokenpath:prompt_tokens_total{M}[R])",
    "rate(tokenpath:generation_tokens_total{M}[R])",
    "histogram_quantile(0.99, sum by(le) (rate(tokenpath:time_per_output_token_seconds_bucket{M}[R])))",
    "tokenpath:num_requests_running{M}",
    "tokenpath:num_requests_waiting{M}",
    "histogram_quantile(0.99, sum by(le) (rate(tokenpath:time_to_first_token_seconds_bucket{M}[R])))",
    "tokenpath:gpu_cache_usage_perc{M}",
    "tokenpath:kv_cache_usage_perc{M}",
    "sum by(le) (increase(tokenpath:request_prompt_tokens_bucket{M}[R]))",
    "sum by(le) (increase(tokenpath:request_generation_tokens_bucket{M}[R]))",
    "sum by(finished_reason) (increase(tokenpath:request_success_total{M}[R]))",
    "rate(tokenpath:request_queue_time_seconds_sum{M}[R])",
    "rate(tokenpath:request_prefill_time_seconds_sum{M}[R])",
    "rate(tokenpath:request_decode_time_seconds_sum{M}[R])",
    "rate(tokenpath:request_inference_time_seconds_sum{M}[R])",
    "rate(tokenpath:request_max_num_generation_tokens_sum{M}[R])",
]


def _dashboard_exprs() -> list[str]:
    doc = json.loads((DEPLOY / "grafana" / "tokenpath.json").read_text())
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def test_the_committed_dashboard_is_what_its_script_builds():
    spec = importlib.util.spec_from_file_location("build_dashboard", DEPLOY / "grafana" / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert json.loads((DEPLOY / "grafana" / "tokenpath.json").read_text()) == mod.dashboard()


def test_rules_pass_promtool():
    out = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "prometheus" / "tokenpath-rules.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def scraped(server_factory, tmp_path_factory):
    """A server (static admin key: Prometheus scrapes the tenant series too), traffic while a
    private Prometheus scrapes it every second, then that Prometheus' query URL."""
    srv = server_factory("--model", CHAT, "--api-key", KEY)
    tmp = tmp_path_factory.mktemp("prom")
    port = free_port()
    rules = tmp / "rules.yml"  # the shipped rules, evaluated every second instead of every 30 s
    rules.write_text((DEPLOY / "prometheus" / "tokenpath-rules.yml").read_text().replace("interval: 30s",
                                                                                        "interval: 1s"))
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n"
        "  - job_name: tokenpath\n"
        f"    authorization: {{credentials: {KEY}}}\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{srv.port}']}}]\n")
    log = tmp / "prometheus.log"
    with log.open("wb") as out:
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_log(log, r"Server is ready to receive web requests", prom, 120)
        stop = threading.Event()

        store = GatewayStore(srv.log.parent / "data" / "gateway.sqlite3")
        try:
            limited = create_key(store, "limited", limits=Limits(rpm=1))[0]
        finally:
            store.close()

        def load() -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as http:
                for _ in range(2):  # the second one is a rate_limit rejection of this model
                    http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {limited}"},
                              json={"model": CHAT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
                while not stop.is_set():
                    http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                              json={"model": CHAT, "messages": [{"role": "user", "content": "Count to ten."}],
                                    "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}})

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        url = f"http://127.0.0.1:{port}/api/v1/query"
        # Scrapes with traffic between them, until every query the tests make has data (a few
        # seconds: rates need two scrapes, the rules one evaluation after them), or a minute:
        # then the tests fail naming the empty ones.
        deadline = time.monotonic() + 60
        while _empty(url, _all_exprs()) and time.monotonic() < deadline:
            time.sleep(1)
        stop.set()
        worker.join(120)
        yield url
    finally:
        prom.send_signal(signal.SIGTERM)
        prom.wait(30)


def _vllm_exprs() -> list[str]:
    return [e.replace("{M}", '{model_name="$model_name"}').replace("[R]", "[$__rate_interval]")
            for e in VLLM_DASHBOARD]


RECORDING_RULES = ("tokenpath:time_to_first_token_seconds:p99_5m", "tokenpath:generation_tokens:rate5m",
                   "tokenpath:request_stage_seconds:p99_5m", "tokenpath:error_ratio:rate5m")


def _all_exprs() -> list[str]:
    return [*_dashboard_exprs(), *_vllm_exprs(), *RECORDING_RULES, 'up{job="tokenpath"} == 1']


def _empty(url: str, exprs: list[str]) -> list[str]:
    return [e for e in exprs if not _query(url, e)]


def _query(url: str, expr: str) -> list:
    expr = expr.replace('"$model_name"', f'"{CHAT}"').replace("$__rate_interval", "30s")
    body = httpx.get(url, params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_every_dashboard_panel_has_data(scraped):
    empty = _empty(scraped, _dashboard_exprs())
    assert not empty, empty


def test_every_query_of_vllms_dashboard_has_data_with_the_prefix_swapped(scraped):
    empty = _empty(scraped, _vllm_exprs())
    assert not empty, empty


def test_recording_rules_evaluate(scraped):
    for record in RECORDING_RULES:
        assert _query(scraped, record), record
    assert _query(scraped, 'up{job="tokenpath"} == 1')
