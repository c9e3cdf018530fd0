"""Two gateways in front of one vLLM, interleaved request by request: the A/B of a gateway change
on a machine whose load drifts (issue 37's "<= 2 ms added TTFT").

    python benchmarks/vllm_gateway_ab.py --a-src /path/to/worktree/src [--rounds 40] [--repeat 2] [--key]

Starts vLLM's CPU build (benchmarks/vllm_peer.py), or uses a running one (`--vllm-port` with its
KV-event ports), then gateway A (`tokenpath serve` with `PYTHONPATH` to `--a-src`: an older
checkout's source, e.g. a `git worktree` of the commit before a change) and gateway B (this
source), each a `url:` replica of that vLLM. Each round sends one short streamed request straight
to vLLM and one through each gateway, the order rotating every round, so load changes hit all
three alike. Reported per path: TTFT p50 (and p25/p75), the added p50 against vLLM direct (and
the median of the per-round differences, paired at the same moment's load; B - A likewise), each
gateway's CPU per request (its process's, measured around each request), and each gateway's CPU
per second while idle (its polls of vLLM). One client per path, kept alive, each stream read to
its end; the load generator runs pinned to core 1, as in vllm_behind_gateway.py. `--whole`: the
same requests not streamed, each timed to its whole body (a non-streaming reply's latency, where
the gateway's work after the last token used to come before the reply). `--key`: each
gateway's store gets a stored key (`tokenpath keys create`, no limits; its reservations are still
recorded), sent with every request, so the key's lookups and the rate limits' reservation are on
the path, as in a gateway with keys on.

Pinned by default: vLLM on core 0, the gateways and this load generator on core 1, so vLLM's
compute and a gateway's work do not take each other's core (unpinned, the added p50 moved by
several ms between runs); `--no-pin` runs them as before (the generator alone pinned, to core 1).
Each gateway also gets, from its log lines, its own time per request by its Timeline
(`gateway_path_ms`: received -> sent to vLLM, vLLM's first token -> the client's first byte; a
source tree older than those stamps reports none) and the added TTFT with vLLM's own queue +
prefill of each request taken out, paired (`engine_out`; streamed only: the direct request reads
them from its usage chunk), as benchmarks/gateway_ttft_path.py reports them.

Prints JSON; `--out` keeps it. The Markdown table in results/ is written by hand with the time
and the machine's load, which this script reports (`loadavg` before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gateway_ttft_path import streamed, summarize  # noqa: E402
from benchmarks.procs import stop_group  # noqa: E402
from benchmarks.vllm_peer import NAME, ROOT, Vllm, start_gateway, start_vllm  # noqa: E402

# A gateway's CPU per request is read this long after its reply is in: what it does once the last
# byte is sent (the audit row's close, the log line, metrics) is that request's cost, and read at
# once it fell into the next path's request, where no gateway's CPU is read.
SETTLE_S = 0.02


def cpu_ms(pid: int) -> float:
    """CPU of a process (its live threads), in milliseconds: each thread's run time from
    /proc/PID/task/TID/schedstat, in nanoseconds. /proc/PID/stat's utime+stime count clock ticks
    (10 ms each), as coarse as a whole request's cost over a few dozen rounds; the gateway's
    threads (event loop, audit writer, executor workers) live as long as it does."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # (a thread that ended meanwhile)
            continue
    return total / 1e6


Timed = tuple[float, str | None, float | None]  # ms, the server's request id, vLLM's own queue + prefill ms


def whole(http: httpx.Client, prompt: str) -> Timed:
    """Milliseconds to the whole body of the same short request, not streamed."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    t0 = time.perf_counter()
    r = http.post("/v1/completions", json=body)
    ms = (time.perf_counter() - t0) * 1000
    if r.status_code != 200 or not r.json()["choices"]:
        raise RuntimeError(f"no reply: {r.status_code} {r.text[:200]}")
    return ms, r.headers.get("x-request-id"), None


def own_time(runs: list[Timed], direct: list[Timed], log: Path) -> dict:
    """A gateway's own time per request by its Timeline (its log line's `gateway_path_ms`), and
    the added TTFT with vLLM's own time on each request taken out, paired (`gateway_ttft_path.py`)."""
    part = summarize(direct, runs, log)
    return {"engine_out_added_paired_median": part["engine_out"]["added_paired_median"],
            "timeline_to_backend_p50": part["timeline"]["to_backend_p50"],
            "timeline_to_client_p50": part["timeline"]["to_client_p50"],
            "timeline_sum_p50": part["timeline"]["sum_p50"]}


def measure(paths: dict[str, str], pids: dict[str, int], rounds: int, keys: dict[str, str],
            timed: Callable[[httpx.Client, str], Timed] = streamed, logs: dict[str, Path] | None = None) -> dict:
    clients = {name: httpx.Client(base_url=url, timeout=120,
                                  headers={"Authorization": f"Bearer {keys[name]}"} if name in keys else None)
               for name, url in paths.items()}
    names = list(paths)
    ms: dict[str, list[float]] = {n: [] for n in names}
    got: dict[str, list[Timed]] = {n: [] for n in names}
    cpu: dict[str, float] = {n: 0.0 for n in pids}
    try:
        for i in range(3):  # (every connection open, every path warm)
            for n in names:
                timed(clients[n], f"Warm-up {i}.{' ' if n != 'vllm' else ''}")
        for i in range(rounds):
            for n in names[i % len(names):] + names[:i % len(names)]:
                before = cpu_ms(pids[n]) if n in pids else 0.0
                got[n].append(timed(clients[n], f"Request {i}: say something.{' ' if n != 'vllm' else ''}"))
                ms[n].append(got[n][-1][0])
                if n in pids:
                    time.sleep(SETTLE_S)  # (its work after the reply's last byte is its request's too)
                    cpu[n] += cpu_ms(pids[n]) - before
    finally:
        for c in clients.values():
            c.close()
    out: dict = {}
    for n, v in ms.items():
        q = statistics.quantiles(v, n=4)
        out[n] = {"p50": round(statistics.median(v), 2), "p25": round(q[0], 2), "p75": round(q[2], 2)}
        if n in pids:
            out[n]["cpu_ms_per_request"] = round(cpu[n] / rounds, 2)
    for n in names:
        if n != "vllm":
            out[n]["added_p50"] = round(out[n]["p50"] - out["vllm"]["p50"], 2)
            # Paired within each round (the same moment's load): steadier than a difference of p50s.
            out[n]["added_paired_median"] = round(statistics.median(
                [x - d for x, d in zip(ms[n], ms["vllm"], strict=True)]), 2)
    if logs:
        time.sleep(0.5)  # (the last request's log line follows its last byte)
        for n, log in logs.items():
            out[n].update(own_time(got[n], got["vllm"], log))
    if "A" in ms and "B" in ms:
        out["B_minus_A_paired_median"] = round(statistics.median(
            [b - a for a, b in zip(ms["A"], ms["B"], strict=True)]), 2)
    return out


def stored_key(work: Path, tag: str) -> str:
    """A key in gateway `tag`'s store (the data dir `start_gateway` gives it), made by the source
    on PYTHONPATH now (the one the gateway will run): its secret."""
    out = subprocess.run([sys.executable, "-m", "tokenpath.cli", "keys", "create", "--data-dir",
                          str(work / f"data-{tag}"), "--tenant", "bench"], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def idle_cpu(pids: dict[str, int], seconds: float = 5.0) -> dict[str, float]:
    before = {n: cpu_ms(p) for n, p in pids.items()}
    time.sleep(seconds)
    return {n: round((cpu_ms(p) - before[n]) / seconds, 1) for n, p in pids.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a-src", type=Path, required=True, help="gateway A's source folder (PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=2, help="measurements, each --rounds rounds")
    ap.add_argument("--vllm-port", type=int, help="a running vLLM (then --kv-live and --kv-replay too)")
    ap.add_argument("--kv-live", type=int)
    ap.add_argument("--kv-replay", type=int)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench" / "vllm_gateway_ab")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--key", action="store_true", help="a stored key on each gateway, sent with every request")
    ap.add_argument("--whole", action="store_true", help="non-streaming requests, timed to the whole body")
    ap.add_argument("--no-pin", action="store_true", help="vLLM and the gateways on both cores (the way before)")
    args = ap.parse_args()
    pin = not args.no_pin
    if args.key:  # (stores of their own: a store with a key turns auth on for every later run on it)
        args.work = args.work / "with-key"
    args.work.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {1})
    vllm = (Vllm(None, args.vllm_port, args.kv_live, args.kv_replay, Path(os.devnull), 0.0)  # type: ignore[arg-type]
            if args.vllm_port else start_vllm(args.work, cpus="0" if pin else None))
    gw_cpus = "1" if pin else None
    gateways = []
    keys: dict[str, str] = {}
    saved = os.environ.get("PYTHONPATH")
    try:
        os.environ["PYTHONPATH"] = str(args.a_src.resolve())
        if args.key:
            keys["A"] = stored_key(args.work, "A")
        gateways.append(start_gateway(vllm, args.work, "A", cpus=gw_cpus))
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
        if args.key:
            keys["B"] = stored_key(args.work, "B")
        gateways.append(start_gateway(vllm, args.work, "B", cpus=gw_cpus))
        paths = {"vllm": vllm.url, "A": f"http://127.0.0.1:{gateways[0][1]}", "B": f"http://127.0.0.1:{gateways[1][1]}"}
        pids = {"A": gateways[0][0].pid, "B": gateways[1][0].pid}
        time.sleep(2.0)
        logs = {tag: args.work / f"gateway-{tag}.log" for tag in ("A", "B")}
        result: dict = {"a_src": str(args.a_src), "key": args.key, "whole": args.whole, "pinned": pin,
                        "idle_cpu_ms_per_s": idle_cpu(pids), "runs": []}
        for _ in range(args.repeat):
            load = os.getloadavg()
            t0 = time.strftime("%H:%M:%S", time.gmtime())
            run = measure(paths, pids, args.rounds, keys, whole if args.whole else streamed, logs)
            run.update(utc=f"{t0}-{time.strftime('%H:%M:%S', time.gmtime())}",
                       loadavg=[round(load[0], 2), round(os.getloadavg()[0], 2)])
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
    finally:
        for proc, _ in gateways:
            stop_group(proc)
        if vllm.proc is not None:
            vllm.stop()
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
