"""Benchmark: what tracing costs. Two `tokenpath serve` processes, one with tracing off and one
exporting every request's spans over OTLP/HTTP to a receiver process on loopback that decodes
them, both started once and kept up; the same `tokenpath bench` load (c=32) is sent to each in
turn: a discarded warm-up round, then pairs in ABBA order (off-on, on-off, ...).

Each pair runs back to back, so the machine's drift hits both alike; the alternating order means
"second in the pair" favours each mode equally often. Beside throughput and TTFT, the script
reads each process's CPU time (/proc) around every run and divides it by the output tokens: CPU
per token does not move with other load on the box the way throughput does, so it shows what
tracing costs the server even where the throughput ratios cannot resolve a few percent.

    .venv/bin/python benchmarks/tracing_overhead.py                   # defaults: ~10-11 minutes on a quiet 2-core box
    .venv/bin/python benchmarks/tracing_overhead.py --pairs 1 --num-requests 32 --out "$(mktemp -d)"  # smoke, ~3 min

Writes benchmarks/results/tracing_overhead.md and .json (or into --out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BIN = Path(sys.executable).parent
TICK = os.sysconf("SC_CLK_TCK")


def run_receiver() -> int:
    """The receiver process: an OTLP/HTTP trace endpoint that decodes each export and counts the
    spans; GET returns the count. A process of its own, so its CPU is measured apart from the
    server's (in production the collector runs elsewhere)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    count = [0]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            req = ExportTraceServiceRequest()
            req.ParseFromString(self.rfile.read(int(self.headers.get("content-length", 0))))
            count[0] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            self._reply(b"")

        def do_GET(self) -> None:  # noqa: N802
            self._reply(str(count[0]).encode())

        def _reply(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"receiver http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


class Receiver:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--receiver"], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        self.url = line.split()[-1]

    def spans(self) -> int:
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
        with opener.open(self.url + "/count", timeout=10) as r:
            return int(r.read())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def proc_tree(pid: int) -> list[int]:
    """The process and its descendants (engine processes, if the serve args start any)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far, all its threads (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def tree_cpu_s(pid: int) -> dict[str, float]:
    pids = proc_tree(pid)
    return {"server": cpu_s(pid), "engine_procs": sum(cpu_s(p) for p in pids[1:])}


def serve(extra: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    # No OTEL_* from the caller's shell: only --otlp-endpoint may turn tracing on.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["TOKENPATH_DATA_DIR"] = str(log.parent / f"data-{log.stem}")
    with log.open("wb") as out:
        proc = subprocess.Popen([str(BIN / "tokenpath"), "serve", "--port", "0", "--model", "smollm2-135m-instruct",
                                 "--log-level", "warning", *extra], stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.2)
    raise RuntimeError("server did not start")


def bench(port: int, args: argparse.Namespace, out: Path, seed: int, warmup: int = 0) -> tuple[dict, float]:
    """One `tokenpath bench` run; its summary and the client process's own CPU seconds. The prefix
    cache is reset first and each pair has prompts of its own: a server kept up for the whole
    benchmark must not answer a later run from its cache (the run would time the cache, not prefill)."""
    cmd = [str(BIN / "tokenpath"), "bench", "--base-url", f"http://127.0.0.1:{port}/v1",
           "--model", "smollm2-135m-instruct", "--concurrency", str(args.concurrency),
           "--num-requests", str(args.num_requests), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--warmup", str(warmup), "--seed", str(seed), "--reset-cache", "--no-progress",
           "--json", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"bench failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    return summary, usage.ru_utime + usage.ru_stime


class Ledger:
    """CPU per output token of each run, per process. A run's window on its server (and, for
    tracing-on runs, on the receiver) lasts until that server's next run starts, so the batch
    processor's last export of a run (up to 5 s after it) is counted with it, without waiting."""

    def __init__(self, servers: dict[str, tuple[subprocess.Popen, int]], receiver: Receiver) -> None:
        self.servers, self.receiver = servers, receiver
        self.open: dict[str, tuple[dict, dict[str, float]]] = {}  # mode -> (its run's record, CPU at start)

    def _snapshot(self, mode: str) -> dict[str, float]:
        snap = tree_cpu_s(self.servers[mode][0].pid)
        snap["receiver"] = cpu_s(self.receiver.proc.pid) if mode == "on" else 0.0
        snap["spans"] = float(self.receiver.spans()) if mode == "on" else 0.0
        return snap

    def _close(self, mode: str, snap: dict[str, float]) -> None:
        if mode not in self.open:
            return
        rec, start = self.open.pop(mode)
        toks = rec["output_tokens"]
        for k in ("server", "engine_procs", "receiver"):
            rec["cpu_ms_per_tok"][k] = 1000 * (snap[k] - start[k]) / toks
        rec["spans_received"] = int(snap["spans"] - start["spans"])

    def run(self, mode: str, args: argparse.Namespace, out: Path, seed: int, warmup: int = 0) -> dict:
        snap = self._snapshot(mode)
        self._close(mode, snap)
        s, client_cpu = bench(self.servers[mode][1], args, out, seed, warmup)
        toks = max(1, int(s["total_output_tokens"]))
        rec = {"mode": mode, "output_tok_s": float(s["output_throughput"]),
               "ttft_p50_ms": float(s["ttft_ms"]["median"]), "ttft_p99_ms": float(s["ttft_ms"]["p99"]),
               "completed": int(s["completed"]), "failed": int(s["failed"]), "output_tokens": toks,
               "cpu_ms_per_tok": {"bench_client": 1000 * client_cpu / toks}, "loadavg_1m": os.getloadavg()[0]}
        self.open[mode] = (rec, snap)
        return rec

    def close_all(self) -> None:
        time.sleep(6.0)  # the batch processor exports every 5 s: let the last batch go
        for mode in list(self.open):
            self._close(mode, self._snapshot(mode))


def span_cost(receiver: Receiver, n: int = 2000) -> dict:
    """CPU per request of building and exporting its spans (record_trace + the batch exporter's
    thread, flushed) with a realistic Timeline, measured alone in this process (the receiver's
    decoding is in its own process and not counted)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from tokenpath.telemetry.otel import PresetIdGenerator, begin_trace
    from tokenpath.telemetry.record import FinishedRequest
    from tokenpath.telemetry.timeline import Timeline
    from tokenpath.telemetry.tracing import record_trace

    provider = TracerProvider(id_generator=PresetIdGenerator())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.url + "/v1/traces"),
                                                   max_queue_size=16 * n))  # a tight loop: drop nothing

    def one(i: int) -> FinishedRequest:
        t = Timeline(f"chatcmpl-{i}")
        begin_trace(t, {}, provider)
        t0 = t.stamps["received"]
        for k, stage in enumerate(("authenticated", "routed", "tokenized", "admitted", "dispatched", "scheduled",
                                   "first_token", "finished")):
            t.stamp(stage, at=t0 + 0.01 * (k + 1))
        t.attrs.update(replica="r0", policy="prefix_aware", reason="cold", prefill_chunks=[(t0 + 0.07, 128)])
        return FinishedRequest(t, "/v1/chat/completions", 200, requested_model="m", model="m", prompt_tokens=128,
                               completion_tokens=32, finish_reasons=["length"], tenant="acme", key_prefix="tp-x",
                               token_times=[t0 + 0.08 + 0.01 * k for k in range(32)])

    recs = [one(i) for i in range(n)]
    before = receiver.spans()
    cpu0 = time.process_time()
    for rec in recs:
        record_trace(rec, provider)
    provider.force_flush()
    cpu = time.process_time() - cpu0
    provider.shutdown()
    return {"requests": n, "spans": receiver.spans() - before, "cpu_ms_per_request": 1000 * cpu / n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10, help="measured on/off pairs, ABBA order (default 10)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--serve-args", default="", help="extra `tokenpath serve` arguments for both servers")
    p.add_argument("--load-note", default="", help="what else ran on the machine (printed under the table)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where tracing_overhead.md/.json go (default results/)")
    p.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.receiver:
        return run_receiver()
    from tracing_overhead_report import report  # noqa: PLC0415 - next to this script

    receiver = Receiver()
    tmp = Path(tempfile.mkdtemp(prefix="tp-tracing-bench-"))
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    started = time.monotonic()
    try:
        micro = span_cost(receiver)
        print(json.dumps(micro), flush=True)
        extra = args.serve_args.split()
        servers["off"] = serve(extra, tmp / "serve-off.log")
        servers["on"] = serve([*extra, "--otlp-endpoint", receiver.url], tmp / "serve-on.log")
        ledger = Ledger(servers, receiver)
        warm = [ledger.run(m, args, tmp / f"warm-{m}.json", seed=999, warmup=4) for m in ("off", "on")]
        pairs = []
        for i in range(args.pairs):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            runs = {m: ledger.run(m, args, tmp / f"bench-{i}-{m}.json", seed=1000 + i) for m in order}
            pairs.append({"pair": i, "order": "-".join(order), "off": runs["off"], "on": runs["on"]})
            print(json.dumps({k: pairs[-1][k] for k in ("pair", "order")}
                             | {m: round(runs[m]["output_tok_s"], 1) for m in order}), flush=True)
        ledger.close_all()
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(60)
        receiver.close()
    meta = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "receiver")}, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "span_cost": micro,
            "warm_up_discarded": warm, "pairs": pairs, "runtime_s": time.monotonic() - started}
    write_results(args.out, "tracing_overhead", meta, report(meta))
    return 0


def write_results(out: Path, name: str, meta: dict, md: str) -> None:
    """Print the table and keep it with its data: out/NAME.md and out/NAME.json (causes_overhead too)."""
    print(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(meta, indent=2))
    (out / f"{name}.md").write_text(md)


if __name__ == "__main__":
    sys.exit(main())
