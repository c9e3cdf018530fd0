"""Benchmark: models on demand (issue 38's targets), on `tokenpath serve --models-dir`.

1. Cold start: the first request to an unloaded SmolLM2 GGUF (time to first token, streamed) against
   the load's own measured time (`load_seconds` on /v1/models) and the warm TTFT (median of the
   next requests, each after /reset_prefix_cache so its prefill is as uncached as the cold one's).
   Target: cold TTFT <= load time + 1.2 x warm TTFT.
2. Idle unload: the server's RSS before the first load, loaded, and after the model was unloaded
   by its `keep_alive` (a request's `keep_alive: "1s"`). Target: back within 10% of before.
3. Two models alternating under a budget that fits one (`--models-memory` = 1.5 x the measured
   footprint of one): N requests, A B A B ..., each served (none an error, none an OOM); loads
   counted, and the `model_load` stage (Server-Timing) summed against the loads' measured time.
4. The same two files behind llama-server's router mode (`--models-dir`, `--models-max 1`), when
   the llama.cpp build is there: its cold and warm TTFT and the same alternation, side by side.

The two models are two catalog entries of the same GGUF file (each its own engine). The tokenizer
cache is seeded first (a user's second start), so a load is the weights and the engine.

    nice -n 10 .venv/bin/python benchmarks/model_load.py                    # ~2 minutes on 2 cores
    nice -n 10 .venv/bin/python benchmarks/model_load.py --alternating 100 --out .cache/bench/model_load

Writes benchmarks/results/model_load.md and .json (or into --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.procs import LLAMA_SERVER, port_of, serve  # noqa: E402
from tests.server_data import seed_tokenizers  # noqa: E402 - the repo's own helper

RESULTS = Path(__file__).resolve().parent / "results"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")
MIB = 1024 * 1024
PROMPT = [{"role": "user", "content": "Name three colours."}]


def serve_models(tmp: Path, models_dir: Path, *flags: str) -> tuple[subprocess.Popen, int, Path]:
    log = tmp / f"server-{time.monotonic_ns()}.log"
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(tmp / "data"), "OMP_NUM_THREADS": "1"}
    proc, url = serve([TOKENPATH, "serve", "--port", "0", "--models-dir", str(models_dir), "--kv-cache-memory",
                       "64MiB", "--max-model-len", "1024", *flags], log, env=env, timeout=120)
    return proc, port_of(url), log


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def rss_mib(pid: int) -> float:
    """The server's RSS and its engine processes' (`--replicas N`), together."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return total


def logged_stages(log: Path, request_id: str) -> dict[str, float]:
    """A request's stages (seconds) from the server's log line for it (a stream's Server-Timing
    header is sent before its model has loaded)."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if request_id in line and line.startswith("{") and '"stages_ms"' in line:
            return {k: v / 1000 for k, v in json.loads(line)["stages_ms"].items()}
    return {}


def stream_ttft(client: httpx.Client, model: str, **extra: object) -> tuple[float, str]:
    """(seconds to the first content token, the request's id)."""
    body = {"model": model, "messages": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True, **extra}
    began = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        request_id = r.headers.get("x-request-id", "")
        for line in r.iter_lines():
            if first is None and line.startswith("data:") and _has_text(line[5:]):
                first = time.perf_counter() - began
    return (first if first is not None else time.perf_counter() - began), request_id


def _has_text(data: str) -> bool:
    """Does this SSE chunk carry generated text (not a role-only chunk, whose content is null or "")?"""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return False
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ())


def llama_router(tmp: Path, models_dir: Path, warm_n: int, alternating_n: int) -> dict | None:
    """The same two files behind llama-server's router mode (`--models-dir`, `--models-max 1`: one
    model loaded at a time, each in a child llama-server it spawns): the first request's TTFT,
    warm TTFTs, and requests alternating between the two. The router reports no load time, so
    its load is estimated as cold TTFT - warm TTFT p50."""
    if not LLAMA_SERVER.is_file():
        return None
    from benchmarks.procs import free_port, stop_group, wait_healthy

    port = free_port()
    log = tmp / "llama-router.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(LLAMA_SERVER), "--models-dir", str(models_dir), "--models-max", "1", "--host",
                                 "127.0.0.1", "--port", str(port), "-t", "2", "-c", "1024"], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(port, proc, log, 60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
            cold = stream_ttft(c, "smol-a")[0]
            warm = [stream_ttft(c, "smol-a", cache_prompt=False)[0] for _ in range(warm_n)]
            statuses, began = [], time.perf_counter()
            for i in range(alternating_n):
                r = c.post("/v1/chat/completions", json={"model": "smol-b" if i % 2 == 0 else "smol-a",
                                                         "messages": PROMPT, "max_tokens": 8, "temperature": 0})
                statuses.append(r.status_code)
            wall = time.perf_counter() - began
    finally:
        stop_group(proc)
    warm_p50 = statistics.median(warm)
    return {"cold_ttft_s": round(cold, 3), "warm_ttft_p50_s": round(warm_p50, 3),
            "load_estimate_s": round(cold - warm_p50, 3), "alternating": alternating_n,
            "alternating_served_200": statuses.count(200), "alternating_wall_s": round(wall, 1)}


def card(client: httpx.Client, model: str) -> dict:
    return next(m for m in client.get("/v1/models").json()["data"] if m["id"] == model)


def cold_warm_idle(tmp: Path, models_dir: Path, warm_n: int, flags: list[str]) -> dict:
    proc, port, log = serve_models(tmp, models_dir, "--keep-alive", "-1", *flags)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
            time.sleep(2)
            before = rss_mib(proc.pid)
            cold, cold_id = stream_ttft(c, "smol-a")
            load_s = card(c, "smol-a")["load_seconds"]
            warm = []
            for _ in range(warm_n):  # each as uncached as the cold one was: no prefix-cache hit
                c.post("/reset_prefix_cache").raise_for_status()
                warm.append(stream_ttft(c, "smol-a")[0])
            loaded_rss = rss_mib(proc.pid)
            footprint = card(c, "smol-a")["memory_bytes"]
            stream_ttft(c, "smol-a", keep_alive="1s")  # idle unload after one second
            for _ in range(120):
                if card(c, "smol-a")["state"] == "unloaded":
                    break
                time.sleep(0.5)
            time.sleep(2)
            after = rss_mib(proc.pid)
            state = card(c, "smol-a")["state"]
            cold_stages = logged_stages(log, cold_id)
    finally:
        stop(proc)
    warm_p50 = statistics.median(warm)
    return {"cold_ttft_s": round(cold, 3), "load_s": load_s, "model_load_stage_s": round(cold_stages.get("model_load", 0), 3),
            "warm_ttft_p50_s": round(warm_p50, 3), "target_s": round(load_s + 1.2 * warm_p50, 3),
            "cold_within_target": cold <= load_s + 1.2 * warm_p50, "footprint_mib": round(footprint / MIB, 1),
            "rss_before_load_mib": round(before, 1), "rss_loaded_mib": round(loaded_rss, 1),
            "rss_after_idle_unload_mib": round(after, 1), "state_after_keep_alive": state,
            "rss_within_10pct": after <= before * 1.10}


def alternating(tmp: Path, models_dir: Path, n: int, footprint: int, flags: list[str]) -> dict:
    budget = int(footprint * 1.5)
    proc, port, _ = serve_models(tmp, models_dir, "--keep-alive", "-1", "--models-memory", str(budget), *flags)
    statuses: list[int] = []
    stage_sum = 0.0
    began = time.perf_counter()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
            for i in range(n):
                model = "smol-a" if i % 2 == 0 else "smol-b"
                r = c.post("/v1/chat/completions", json={"model": model, "messages": PROMPT, "max_tokens": 8,
                                                         "temperature": 0})
                statuses.append(r.status_code)
                timing = dict(re.findall(r"(\w+);dur=([\d.]+)", r.headers.get("server-timing", "")))
                stage_sum += float(timing.get("model_load", 0)) / 1000
            cards = {m: card(c, m) for m in ("smol-a", "smol-b")}
            peak = rss_mib(proc.pid)
    finally:
        stop(proc)
    loads = sum(cd["loads"] for cd in cards.values())
    load_s = sum(cd["load_seconds"] for cd in cards.values())
    return {"requests": n, "served_200": statuses.count(200), "errors": len(statuses) - statuses.count(200),
            "budget_mib": round(budget / MIB, 1), "loads": loads, "loads_measured_s": round(load_s, 3),
            "model_load_stage_sum_s": round(stage_sum, 3),
            "stage_vs_measured_pct": round(100 * (stage_sum - load_s) / load_s, 2) if load_s else None,
            "wall_s": round(time.perf_counter() - began, 1), "rss_end_mib": round(peak, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--warm", type=int, default=5, help="warm requests after the cold one")
    ap.add_argument("--alternating", type=int, default=20, help="requests alternating between two models (0: skip)")
    ap.add_argument("--replicas", type=int, default=1, help="each model as N engine processes (1: in-process)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--llama-router", action=argparse.BooleanOptionalAction, default=True,
                    help="also time llama-server's router mode on the same files (the build of "
                         "benchmarks/engine_vs_llamacpp.py; skipped when it is not built)")
    args = ap.parse_args()
    from tokenpath.engine.loader import resolve_model_path

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        models_dir = tmp / "models"
        models_dir.mkdir()
        gguf = resolve_model_path("smollm2-135m-instruct")
        for name in ("smol-a", "smol-b"):
            os.symlink(gguf, models_dir / f"{name}.gguf")
        seed_tokenizers(tmp / "data", ["smollm2-135m-instruct"])
        flags = ["--replicas", str(args.replicas)] if args.replicas > 1 else []
        first = cold_warm_idle(tmp, models_dir, args.warm, flags)
        alt = (alternating(tmp, models_dir, args.alternating, int(first["footprint_mib"] * MIB), flags)
               if args.alternating else None)
        router = llama_router(tmp, models_dir, args.warm, args.alternating) if args.llama_router else None
    result = {"host": platform.node(), "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
              "note": "not quiet: a shared 2-core box with other work running", "replicas": args.replicas,
              "cold_warm_idle": first,
              "alternating": alt, "llama_router": router}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "model_load" if args.replicas <= 1 else f"model_load-replicas{args.replicas}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    c, a = first, alt
    alt_md = "" if a is None else f"""
| two models alternating, budget {a['budget_mib']} MiB (fits one) | value |
|---|---|
| requests / served 200 / errors | {a['requests']} / {a['served_200']} / {a['errors']} |
| loads | {a['loads']} |
| loads' measured time | {a['loads_measured_s']} s |
| `model_load` stage, summed | {a['model_load_stage_sum_s']} s ({a['stage_vs_measured_pct']}% vs measured) |
| wall | {a['wall_s']} s |
"""
    lr = router
    router_md = ("Not measured: llama-server's router mode (its build, benchmarks/engine_vs_llamacpp.py's, is "
                 "missing).\n") if lr is None else f"""
| the same files, side by side | tokenpath (`--models-dir`) | llama-server router (`--models-dir --models-max 1`) |
|---|---|---|
| first request's TTFT (cold) | {c['cold_ttft_s']} s | {lr['cold_ttft_s']} s |
| warm TTFT p50 | {c['warm_ttft_p50_s']} s | {lr['warm_ttft_p50_s']} s |
| the load | {c['load_s']} s (measured) | {lr['load_estimate_s']} s (cold - warm: it reports none) |
| {lr['alternating']} requests alternating, one model loaded at a time: served | {'-' if a is None else a['served_200']} | {lr['alternating_served_200']} |
| their wall time | {'-' if a is None else a['wall_s']} s | {lr['alternating_wall_s']} s |
"""
    md = f"""# Models on demand (benchmarks/model_load.py)

{result['note']} (load average {result['loadavg_1m']:.1f} on {result['cpus']} CPUs). SmolLM2-135M-Instruct
Q4_1 GGUF as two catalog entries (`smol-a`, `smol-b`), `--kv-cache-memory 64MiB`, {'in-process engines' if args.replicas <= 1 else f'{args.replicas} engine processes per model'}.
RSS is the server's and its engine processes', together.

| cold start | value |
|---|---|
| first request's TTFT (cold) | {c['cold_ttft_s']} s |
| the load, measured (`load_seconds`) | {c['load_s']} s |
| its `model_load` stage (Server-Timing) | {c['model_load_stage_s']} s |
| warm TTFT p50 ({args.warm} requests, prefix cache reset before each) | {c['warm_ttft_p50_s']} s |
| target: load + 1.2 x warm | {c['target_s']} s ({'met' if c['cold_within_target'] else 'missed'}) |
| footprint measured after load | {c['footprint_mib']} MiB |

| idle unload (keep_alive "1s") | RSS |
|---|---|
| before the load | {c['rss_before_load_mib']} MiB |
| loaded | {c['rss_loaded_mib']} MiB |
| after the idle unload | {c['rss_after_idle_unload_mib']} MiB ({'within' if c['rss_within_10pct'] else 'not within'} 10%) |

{alt_md}
{router_md}"""
    (args.out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
