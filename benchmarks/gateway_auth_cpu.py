"""The CPU the gateway's key check takes on a request's path with no keys (issue 37's 2 ms target).

    python benchmarks/gateway_auth_cpu.py [--calls 3000]

`Gateway.authenticate` of a request with no credential against a SQLite store with no keys, as
the gateway asks it before every request, with one commit by another connection of the store
between calls (the audit writer's open and close rows of the request before, which reset the loop
reader's page cache). Reported: the loop thread's CPU (`time.thread_time_ns`) per call, p50 and
mean in us. Run it pinned (`taskset -c 1`) beside the same script on the other source tree
(`PYTHONPATH=<src>`), alternating, for an A/B; on shared cores say the figures are loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from tokenpath.gateway import Gateway, GatewayStore


async def measure(calls: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gateway.sqlite3"
        store = GatewayStore(path)
        other = sqlite3.connect(str(path), isolation_level=None)  # as the audit writer's commits
        other.execute("CREATE TABLE bench_rows (x INTEGER)")
        gw = Gateway(store)
        try:
            await gw.authenticate({})
            spent = []
            for _ in range(calls):
                other.execute("INSERT INTO bench_rows VALUES (1)")
                t0 = time.thread_time_ns()
                await gw.authenticate({})
                spent.append(time.thread_time_ns() - t0)
        finally:
            other.close()
            store.close()
    return {"p50_us": round(statistics.median(spent) / 1e3, 2), "mean_us": round(statistics.fmean(spent) / 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    print(json.dumps(asyncio.run(measure(ap.parse_args().calls))))


if __name__ == "__main__":
    main()
