"""Traces into a real Arize Phoenix, read back over its REST API (issue 26, traces).

Phoenix is the OTLP backend the issue's users tried. It starts in about a minute here (database
migrations, under load), too slow for the test suite, whose OTLP checks use the in-test receiver
(tests/telemetry/otlp_receiver.py); this script is the end-to-end check against Phoenix itself.

It starts a private Phoenix (its own working dir, loopback, free ports, no telemetry), then
`tokenpath serve --replicas N --otlp-endpoint <phoenix>`, sends streamed chat and completion
requests, and reads every span back from `GET /v1/projects/default/spans`. It fails (exit 1)
unless each request is one trace with one gateway root, each `engine.queue/prefill/decode`
appears exactly once, and the engine's SERVER span has the right `gen_ai.operation.name`.

Phoenix pins its own dependency set, so it lives in a venv of its own (checked: it pulls no torch),
beside the checkout and gitignored:

    python -m venv .phoenix-venv
    .phoenix-venv/bin/pip install arize-phoenix
    PYTHONPATH=src python benchmarks/phoenix_traces.py --phoenix .phoenix-venv/bin/phoenix

Phoenix takes traces only: the GenAI metrics (`gen_ai.server.*`) need a metrics backend (an OTel
collector, Prometheus' OTLP receiver); the test suite checks them with the in-test receiver.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, check, timeout: float, proc: subprocess.Popen, log: Path):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    sys.exit(f"{what} did not start in {timeout:.0f}s:\n{log.read_text(errors='replace')[-3000:]}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phoenix", default=os.environ.get("PHOENIX_BIN") or shutil.which("phoenix") or "phoenix",
                    help="the `phoenix` executable (of its own venv)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--requests", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tp-phoenix-"))
    port = _free_port()
    phoenix_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PHOENIX_WORKING_DIR": str(tmp / "phoenix"), "PHOENIX_HOST": "127.0.0.1",
           "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(_free_port()), "PHOENIX_TELEMETRY_ENABLED": "false"}
    plog, slog = tmp / "phoenix.log", tmp / "server.log"
    t0 = time.monotonic()
    with plog.open("wb") as out:
        phoenix = subprocess.Popen([args.phoenix, "serve"], stdout=out, stderr=subprocess.STDOUT, env=env)
    server: subprocess.Popen | None = None
    try:
        _wait("phoenix", lambda: _healthy(phoenix_url), 300, phoenix, plog)
        print(f"phoenix up in {time.monotonic() - t0:.1f}s at {phoenix_url}")
        senv = {**os.environ, "TOKENPATH_DATA_DIR": str(tmp / "data"), "OTEL_BSP_SCHEDULE_DELAY": "200"}
        with slog.open("wb") as out:
            server = subprocess.Popen([str(Path(sys.executable).parent / "tokenpath"), "serve", "--port", "0", "--model", MODEL,
                                       "--replicas", str(args.replicas), "--otlp-endpoint", phoenix_url],
                                      stdout=out, stderr=subprocess.STDOUT, env=senv)
        m = _wait("tokenpath", lambda: re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1",
                                                 slog.read_text(errors="replace")), 600, server, slog)
        base = m.group(1)
        sent: dict[str, str] = {}  # request id -> operation
        with httpx.Client(base_url=base, timeout=300) as http:
            for i in range(args.requests):
                if i % 2 == 0:
                    with http.stream("POST", "/v1/chat/completions", json={
                            "model": MODEL, "messages": [{"role": "user", "content": f"Say hello {i}."}],
                            "max_tokens": 8, "temperature": 0, "stream": True}) as resp:
                        resp.raise_for_status()
                        "".join(resp.iter_lines())
                        sent[resp.headers["x-request-id"]] = "chat"
                else:
                    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": f"Count {i}",
                                                              "max_tokens": 4, "temperature": 0})
                    resp.raise_for_status()
                    sent[resp.headers["x-request-id"]] = "text_completion"
        server.send_signal(signal.SIGTERM)  # flushes both processes' batched spans
        server.wait(timeout=120)
        return _check(phoenix_url, sent)
    finally:
        for proc in (server, phoenix):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _spans(phoenix_url: str) -> list[dict]:
    out: list[dict] = []
    cursor = None
    while True:
        params = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
        body = httpx.get(f"{phoenix_url}/v1/projects/default/spans", params=params, timeout=30).json()
        out += body["data"]
        cursor = body.get("next_cursor")
        if not cursor:
            return out


def _check(phoenix_url: str, sent: dict[str, str]) -> int:
    deadline, spans = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        spans = _spans(phoenix_url)
        roots = {s["attributes"].get("gen_ai.response.id") for s in spans if s["parent_id"] is None}
        if set(sent) <= roots:
            break
        time.sleep(1)
    failures = []
    print(f"{len(spans)} spans in Phoenix for {len(sent)} requests")
    print(f"{'request':<32} {'op':<16} {'spans':>5}  engine spans (count)")
    for rid, op in sent.items():
        roots = [s for s in spans if s["parent_id"] is None and s["attributes"].get("gen_ai.response.id") == rid]
        if len(roots) != 1:
            failures.append(f"{rid}: {len(roots)} gateway roots")
            continue
        trace = [s for s in spans if s["context"]["trace_id"] == roots[0]["context"]["trace_id"]]
        counts = Counter(s["name"] for s in trace if s["name"].startswith("engine."))
        print(f"{rid:<32} {op:<16} {len(trace):>5}  {dict(sorted(counts.items()))}")
        if counts != Counter({"engine.queue": 1, "engine.prefill": 1, "engine.decode": 1}):
            failures.append(f"{rid}: engine spans {dict(counts)}")
        engine = [s for s in trace if s["name"].startswith("engine ")]
        if len(engine) != 1 or engine[0]["attributes"].get("gen_ai.operation.name") != op:
            failures.append(f"{rid}: engine SERVER span(s) {[s['attributes'] for s in engine]}")
    for f in failures:
        print("FAIL", f)
    print("ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
