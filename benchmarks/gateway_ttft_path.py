"""Where the gateway's added TTFT in front of vLLM goes, and a steadier measure of it (issue 37).

    python benchmarks/gateway_ttft_path.py [--pairs 200] [--no-pin] [--profile] [--out FILE]

Starts vLLM's CPU build pinned to core 0, and `tokenpath serve` (whose one `url:` replica is that
vLLM) pinned to core 1 with this load generator, so vLLM's compute and the gateway's work never
take each other's core: on two shared cores the added p50 moved by several ms between runs, vLLM's
prefill taking the gateway's cycles and the other way round. `--no-pin`: both on both cores, as
benchmarks/vllm_behind_gateway.py measures (the generator on core 1).

Then `--pairs` rounds of one short streamed request straight to vLLM and the same through the
gateway, the order alternating each round. Reported, p50s over the rounds:
- `wall`: TTFT each way, the added p50 (difference of p50s) and the paired median (each round's
  via - direct, the same moment's load);
- `engine_out`: each request's TTFT less vLLM's own time on it (its per-request metrics, queue +
  prefill: the direct request reads them from its usage chunk, the gateway logs them as
  `backend_timing`), paired: what the gateway adds, with vLLM's compute (the largest noise) taken
  out; the rest is the HTTP hops and vLLM's API server, on both paths;
- `timeline`: the gateway's own time by its Timeline (the log line's `gateway_path_ms`: received
  -> sent to vLLM, vLLM's first token -> the client's first byte) and their sum;
- `windows`: the same two stretches measured from outside the app (benchmarks/ttft_path_hooks.py:
  from uvicorn's receipt of the bytes to the write to vLLM, and from vLLM's first data to the
  client's first body bytes): wall, the loop thread's CPU and the process's CPU, each and summed;
- `--profile`: cProfile inside those windows only: the critical path's functions (their shares,
  not their milliseconds: the profiler inflates them), written beside `--out` and its top printed.

Prints JSON; `--out` keeps it. Loaded runs are loaded: say so where a figure is quoted.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.procs import stop_group  # noqa: E402
from benchmarks.vllm_peer import NAME, ROOT, Vllm, request_lines, start_gateway, start_vllm  # noqa: E402


def streamed(http: httpx.Client, prompt: str | list[int], extra: dict | None = None) -> tuple[float, str | None, float | None]:
    """One short streamed request read to its end: (ms to its first token, the server's request id
    header, vLLM's own queue + prefill ms from its usage chunk's `metrics` where it sent them).
    `extra`: fields added to the body (benchmarks/vllm_body_fields.py)."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    first: float | None = None
    engine: float | None = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        rid = r.headers.get("x-request-id")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if first is None and data.get("choices"):
                first = (time.perf_counter() - t0) * 1000
            m = data.get("metrics")
            if isinstance(m, dict) and isinstance(m.get("time_to_first_token_ms"), int | float):
                engine = float(m["time_to_first_token_ms"]) + float(m.get("queue_time_ms") or 0.0)
    if first is None:
        raise RuntimeError("no token")
    return first, rid, engine


def pair_prompts(i: int) -> tuple[str, str]:
    """Round `i`'s prompts, straight to vLLM and through the gateway: the same number of tokens,
    different in one digit, each shorter than one KV block (so neither is served from the other's
    prefix cache). Equal lengths matter more than anything the gateway does: vLLM CPU's prefill
    costs ~23 ms a prompt token on the AVX2 host, and the gateway's prompt once had a trailing
    space (one token more), most of the 30 ms "added" of results/vllm_behind_gateway-avx2.md
    (results/vllm_token_ids-loaded.md). `same_length` checks it against both servers' usage."""
    return f"Request {i} side 0: say something.", f"Request {i} side 1: say something."


def same_length(direct: httpx.Client, via: httpx.Client, prompts: tuple[str, str]) -> int:
    """The prompt tokens of a pair as vLLM (direct) and the gateway (via) count them; raises where
    they differ, so an unequal pair is never timed as the gateway's overhead."""
    counts = [http.post("/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 1}).json()
              ["usage"]["prompt_tokens"] for http, p in zip((direct, via), prompts, strict=True)]
    if counts[0] != counts[1]:
        raise RuntimeError(f"the paired prompts {prompts} have {counts} tokens (direct, via)")
    return counts[0]


def p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def backend_engine_ms(row: dict) -> float | None:
    """vLLM's queue + prefill for a request, as the gateway logged it (`backend_timing`)."""
    t = row.get("backend_timing") or {}
    return t["prefill_ms"] + (t.get("queue_ms") or 0.0) if t.get("source") == "vllm" and "prefill_ms" in t else None


def summarize(direct: list[tuple[float, str | None, float | None]], via: list[tuple[float, str | None, float | None]],
              log: Path) -> dict:
    """The `wall`, `engine_out` and `timeline` sections (module docstring) of paired rounds."""
    rows = {r.get("request_id"): r for r in request_lines(log)}
    d_ms, v_ms = [d[0] for d in direct], [v[0] for v in via]
    out: dict = {"wall": {"direct_p50": p50(d_ms), "via_p50": p50(v_ms),
                          "added_p50": round(statistics.median(v_ms) - statistics.median(d_ms), 2),
                          "added_paired_median": p50([v - d for v, d in zip(v_ms, d_ms, strict=True)]),
                          "direct_p25_p75": [round(q, 2) for q in statistics.quantiles(d_ms, n=4)[::2]]}}
    adjusted, to_backend, to_client, own = [], [], [], []
    for (d, _, d_engine), (v, rid, _) in zip(direct, via, strict=True):
        row = rows.get(rid, {})
        v_engine = backend_engine_ms(row)
        if d_engine is not None and v_engine is not None:
            adjusted.append((v - v_engine) - (d - d_engine))
        path = row.get("gateway_path_ms")
        if path:
            to_backend.append(path["to_backend"])
            to_client.append(path["to_client"])
            own.append(path["to_backend"] + path["to_client"])
    out["engine_out"] = {"added_paired_median": p50(adjusted), "rounds": len(adjusted)}
    out["timeline"] = {"to_backend_p50": p50(to_backend), "to_client_p50": p50(to_client), "sum_p50": p50(own),
                       "rounds": len(own)}
    return out


def windows(path: Path, skip: int) -> dict:
    """The hooks' windows (benchmarks/ttft_path_hooks.py), p50 per measure, the warm-up left out."""
    rows = json.loads(path.read_text())[skip:] if path.exists() else []
    out: dict = {"rounds": len(rows)}
    rows = [r for r in rows if "b_wall" in r]
    for measure in ("wall", "cpu", "proc"):
        a, b = [r[f"a_{measure}"] for r in rows], [r[f"b_{measure}"] for r in rows]
        out[measure] = {"a_p50": p50(a), "b_p50": p50(b), "sum_p50": p50([x + y for x, y in zip(a, b, strict=True)]),
                        "sum_mean": round(statistics.fmean(x + y for x, y in zip(a, b, strict=True)), 2) if a else None}
    gc_ms = [r.get("a_gc", 0.0) + r.get("b_gc", 0.0) for r in rows]
    out["gc"] = {"ms_mean": round(statistics.fmean(gc_ms), 3) if gc_ms else None,
                 "windows_with_one": sum(1 for x in gc_ms if x), "max_ms": round(max(gc_ms, default=0.0), 2),
                 "collections": {g: sum(r.get(f"a_gc{g}", 0) + r.get(f"b_gc{g}", 0) for r in rows) for g in (0, 1, 2)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-pin", action="store_true", help="vLLM and the gateway on both cores")
    ap.add_argument("--profile", action="store_true", help="cProfile inside the gateway's windows")
    ap.add_argument("--gateway-flags", default="", help="more `tokenpath serve` flags, space-separated")
    ap.add_argument("--freeze", action="store_true", help="the gateway's heap frozen before the first request")
    ap.add_argument("--poll-s", type=float, help="the URL replica's poll interval (a diagnostic; default 0.25 s)")
    ap.add_argument("--vllm-port", type=int, help="a running vLLM (then --kv-live and --kv-replay too; its pinning is its own)")
    ap.add_argument("--kv-live", type=int)
    ap.add_argument("--kv-replay", type=int)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench" / "gateway_ttft_path")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    pin = not args.no_pin
    os.sched_setaffinity(0, {1})  # (the load generator: with the gateway when pinned)
    vllm = (Vllm(None, args.vllm_port, args.kv_live, args.kv_replay, Path(os.devnull), 0.0)  # type: ignore[arg-type]
            if args.vllm_port else start_vllm(args.work, cpus="0" if pin else None))
    win_path, prof_path = args.work / "windows.json", args.work / "windows.pstats"
    for stale in (win_path, prof_path):
        stale.unlink(missing_ok=True)
    env = {"TOKENPATH_TTFT_PATH_OUT": str(win_path)}
    if args.profile:
        env["TOKENPATH_TTFT_PATH_PROFILE"] = str(prof_path)
    if args.poll_s:
        env["TOKENPATH_TTFT_PATH_POLL_S"] = str(args.poll_s)
    if args.freeze:
        env["TOKENPATH_TTFT_PATH_FREEZE"] = "1"
    result: dict = {"pinned": pin, "pairs": args.pairs, "profile": args.profile, "poll_s": args.poll_s}
    try:
        gw, port = start_gateway(vllm, args.work, "path", *args.gateway_flags.split(), cpus="1" if pin else None,
                                 module="benchmarks.ttft_path_hooks", env=env)
        direct_r, via_r = [], []
        try:
            load = os.getloadavg()[0]
            t0 = time.strftime("%H:%M:%S", time.gmtime())
            with httpx.Client(base_url=vllm.url, timeout=120) as direct, \
                    httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as via:
                result["prompt_tokens"] = same_length(direct, via, pair_prompts(args.pairs))
                for i in range(args.warmup):  # (both connections open, both paths warm)
                    warm = pair_prompts(args.pairs + 1 + i)
                    streamed(direct, warm[0])
                    streamed(via, warm[1])
                for i in range(args.pairs):
                    to_direct, to_via = pair_prompts(i)
                    if i % 2:
                        direct_r.append(streamed(direct, to_direct))
                        via_r.append(streamed(via, to_via))
                    else:
                        via_r.append(streamed(via, to_via))
                        direct_r.append(streamed(direct, to_direct))
            result.update(utc=f"{t0}-{time.strftime('%H:%M:%S', time.gmtime())}",
                          loadavg=[round(load, 2), round(os.getloadavg()[0], 2)])
            time.sleep(0.5)  # (the last request's log line follows its last byte)
        finally:
            stop_group(gw)
        result.update(summarize(direct_r, via_r, args.work / "gateway-path.log"))
        result["windows"] = windows(win_path, args.warmup)
    finally:
        if vllm.proc is not None:
            vllm.stop()
    if args.profile and prof_path.exists():
        text = args.work / "windows-profile.txt"
        with open(text, "w") as f:
            stats = pstats.Stats(str(prof_path), stream=f)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(60)
        print(text.read_text()[:12000])
        result["profile"] = str(text.relative_to(ROOT)) if text.is_relative_to(ROOT) else text.name
    out = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(out + "\n")
    print(out)


if __name__ == "__main__":
    main()
