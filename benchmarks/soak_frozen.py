"""Frozen-engine soak (issue 23): steady load on `tokenpath serve --replicas 2`, one engine process
SIGSTOPped for `--freeze` seconds, then SIGCONT.

Reported (benchmarks/results/soak_frozen.md and .json): requests sent, succeeded and lost (any
non-200, or a stream that ended in an error event) overall and among those sent during the freeze;
time from SIGSTOP to the gateway's `/health` calling the engine down (time to eject); from SIGCONT to
healthy again (time to recover); latency p50/p99/max before and during the freeze. Targets: none
waits more than 5 s beyond normal; >= 99% of requests sent during the freeze succeed.

    .venv/bin/python benchmarks/soak_frozen.py                     # 60 s freeze, 5 s stall bound
    .venv/bin/python benchmarks/soak_frozen.py --freeze 15 --before 10 --after 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_load import Load, first, freeze, healthy, pct  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")


async def drive(args: argparse.Namespace, url: str, victim_pid: int, victim: str) -> dict:
    load = Load(lambda: url)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    tasks = load.start(model, args.concurrency)
    await asyncio.sleep(args.before)
    frozen, resumed = await freeze(victim_pid, args.freeze)
    await asyncio.sleep(args.after)
    load.stop = True
    await asyncio.gather(*tasks)
    log = load.records
    base = [r["dur"] for r in log if r["start"] < frozen and r["ok"]]
    during = [r for r in log if frozen <= r["start"] < resumed]
    normal = load.normal_s(frozen)
    return {
        "requests": len(log), "succeeded": sum(r["ok"] for r in log), "lost": sum(not r["ok"] for r in log),
        "sent_during_freeze": len(during), "succeeded_during_freeze": sum(r["ok"] for r in during),
        "success_during_freeze": round(sum(r["ok"] for r in during) / max(1, len(during)), 4),
        "time_to_eject_s": first(load.health, frozen, lambda h: not healthy(victim)(h)),
        "time_to_recover_s": first(load.health, resumed, healthy(victim)),
        "latency_before_s": {"p50": pct(base, 0.5), "p99": pct(base, 0.99), "max": pct(base, 1.0)},
        "latency_during_s": {"p50": pct([r["dur"] for r in during], 0.5), "p99": pct([r["dur"] for r in during], 0.99),
                             "max": pct([r["dur"] for r in during], 1.0)},
        "worst_over_normal_s": round(max((r["dur"] for r in during), default=0.0) - normal, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--freeze", type=float, default=60.0, help="seconds the engine stays SIGSTOPped")
    ap.add_argument("--before", type=float, default=20.0)
    ap.add_argument("--after", type=float, default=20.0)
    ap.add_argument("--stall-timeout", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default="soak_frozen")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="soak-frozen-"))
    log_path = tmp / "server.log"
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(tmp / "data")}
    with log_path.open("wb") as out:
        proc = subprocess.Popen([TOKENPATH, "serve", "--port", "0", "--model", args.model, "--replicas", "2",
                                 "--stall-timeout", str(args.stall_timeout)], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    try:
        while not (m := re.search(r"listening on (http://\S+)/v1", log_path.read_text(errors="replace"))):
            if proc.poll() is not None:
                sys.exit(f"server exited:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        engines = tmp / "data" / "logs" / "engines"
        victim = "engine-0"
        pid = int(re.findall(r"started \(pid (\d+)\)", (engines / f"{victim}.log").read_text())[-1])
        res = asyncio.run(drive(args, m.group(1), pid, victim))
        res["ejections_logged"] = sum('"event":"replica_ejected"' in line and '"reason":"stalled"' in line
                                      for line in log_path.read_text().splitlines())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    res["args"] = vars(args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(res, indent=2))
    rows = "\n".join(f"| {k} | {v} |" for k, v in res.items() if k != "args")
    (RESULTS / f"{args.out}.md").write_text(
        f"# Frozen engine soak\n\n`{' '.join(sys.argv[1:]) or '(defaults)'}`: 2 engine processes, "
        f"{args.concurrency} clients, engine-0 SIGSTOPped for {args.freeze:g} s.\n\n| figure | value |\n|---|---|\n"
        f"{rows}\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
