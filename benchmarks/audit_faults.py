"""The audit log under store faults: a full disk, and PostgreSQL down, for a minute under load.

    sudo python benchmarks/audit_faults.py [--fault-s 60] [--clients 8] [--only disk|postgres]

A gateway (the real app and `Gateway`, in this process, on a real loopback HTTP server) in front of
a simulated replica (no model: the store is what is measured) takes closed-loop requests from
`--clients` clients. After a warm-up the store fails for `--fault-s` seconds, then comes back:
- disk: the data dir is a real 16 MiB tmpfs (needs root to mount), filled to the last byte;
- postgres: a private PostgreSQL cluster (tests/reliability/private_pg.py), stopped and started.
Reported per fault: requests answered (and how many were not 200), the time from the fault to
`/health` saying `degraded` (polled every 20 ms), rows spooled and the most held at once, rows
dropped, the time from the repair until the spool was empty, and rows lost: requests with no
closed row in the store at the end (the target is 0). Results: benchmarks/results/audit_faults.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the simulated replica and the private cluster are test helpers
from tests.api.sim_server import SimServer  # noqa: E402
from tests.reliability.private_pg import PrivateCluster  # noqa: E402
from tests.simulated_replica import SimulatedConfig, SimulatedReplica  # noqa: E402

from tokenpath.gateway import Gateway, GatewayStore  # noqa: E402
from tokenpath.gateway.base import OPEN_STATUS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


async def _load(url: str, clients: int, stop: asyncio.Event, ids: list[str], statuses: dict[int, int]) -> None:
    async def client(i: int) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            n = 0
            while not stop.is_set():
                n += 1
                r = await http.post(f"{url}/v1/completions", json={"model": "sim", "prompt": f"c{i} r{n}",
                                                                    "max_tokens": 8})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if "x-request-id" in r.headers:
                    ids.append(r.headers["x-request-id"])

    await asyncio.gather(*(client(i) for i in range(clients)))


async def _audit(http: httpx.AsyncClient, url: str) -> dict:
    return (await http.get(f"{url}/health")).json().get("audit", {})


async def run_fault(name: str, location: str, fail: Callable[[], None], repair: Callable[[], None],
                    fault_s: float, clients: int) -> dict:
    gw = Gateway(GatewayStore(location))
    srv = SimServer(SimulatedReplica("r0", SimulatedConfig(max_num_seqs=64, token_interval_s=0.002)), guard=gw)
    url = srv.start()
    ids: list[str] = []
    statuses: dict[int, int] = {}
    stop = asyncio.Event()
    load = asyncio.create_task(_load(url, clients, stop, ids, statuses))
    out: dict = {"fault": name, "fault_s": fault_s, "clients": clients}
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            await asyncio.sleep(5)
            t_fail = time.monotonic()
            await asyncio.to_thread(fail)
            out["fault_injected_s"] = round(time.monotonic() - t_fail, 3)
            degraded_at = None
            max_spool = 0
            while time.monotonic() - t_fail < fault_s:
                a = await _audit(http, url)
                if degraded_at is None and a.get("state") == "degraded":
                    degraded_at = time.monotonic()
                    out["reason"] = a.get("reason")
                max_spool = max(max_spool, a.get("spool_rows", 0))
                await asyncio.sleep(0.02)
            t_repair = time.monotonic()
            await asyncio.to_thread(repair)
            while (a := await _audit(http, url)).get("state") != "ok" or a.get("spool_rows"):
                max_spool = max(max_spool, a.get("spool_rows", 0))
                if time.monotonic() - t_repair > 120:
                    break
                await asyncio.sleep(0.05)
            out["drained_after_repair_s"] = round(time.monotonic() - t_repair, 2)
            stop.set()
            await load
            metrics = (await http.get(f"{url}/metrics")).text
        out["time_to_degraded_s"] = None if degraded_at is None else round(degraded_at - t_fail, 3)
        out["max_spool_rows"] = max_spool
        for line in metrics.splitlines():
            for key in ("audit_rows_spooled_total", "audit_rows_dropped_total"):
                if line.startswith(f"tokenpath:{key} "):
                    out[key.removeprefix("audit_").removesuffix("_total")] = int(float(line.split()[1]))
    finally:
        stop.set()
        srv.stop()
    store = GatewayStore(location)
    try:
        closed = {r.request_id for r in store.query_audit(limit=None) if r.status != OPEN_STATUS}
    finally:
        store.close()
    out["requests"] = len(ids)
    out["statuses"] = statuses
    out["rows_lost"] = len(set(ids) - closed)
    return out


def disk_fault(fault_s: float, clients: int) -> dict:
    mnt = Path(tempfile.mkdtemp(prefix="tokenpath-audit-disk."))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)], check=True)
    location = str(mnt / "gateway.sqlite3")
    filler = mnt / "filler"

    def fill() -> None:
        with sqlite3.connect(location) as c:  # so the next write must grow the WAL
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        with filler.open("wb", buffering=0) as f:
            for chunk in (1 << 16, 512):
                try:
                    while True:
                        f.write(b"\0" * chunk)
                except OSError:
                    pass

    try:
        return asyncio.run(run_fault("disk full (tmpfs)", location, fill, filler.unlink, fault_s, clients))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


def postgres_fault(fault_s: float, clients: int) -> dict:
    cluster = PrivateCluster(Path(tempfile.mkdtemp(prefix="tokenpath-audit-pg.")))
    try:
        return asyncio.run(run_fault("postgres down", cluster.url, cluster.stop, cluster.start, fault_s, clients))
    finally:
        cluster.destroy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fault-s", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--only", choices=["disk", "postgres"])
    args = ap.parse_args()
    results = []
    for name, fn in (("disk", disk_fault), ("postgres", postgres_fault)):
        if args.only in (None, name):
            results.append(fn(args.fault_s, args.clients))
            print(json.dumps(results[-1]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "audit_faults.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["rows_lost"] == 0 and r.get("rows_dropped", 0) == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
