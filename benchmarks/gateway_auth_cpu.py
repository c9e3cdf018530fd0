"""The CPU the gateway's key check takes on a request's path with no keys (issue 37's 2 ms target).

    python benchmarks/gateway_auth_cpu.py [--calls 3000] [--database-url postgresql://...]

`Gateway.authenticate` of a request with no credential against a store with no keys, as the
gateway asks it before every request, with one commit by another connection of the store between
calls (the audit writer's open and close rows of the request before: on SQLite they reset the loop
reader's page cache). The store is a SQLite file in a temporary directory, or, with
`--database-url`, a fresh schema of that PostgreSQL database (dropped afterwards), where the check
was a thread hop and a round trip per request until a "no keys" was kept against a LISTEN.
Reported: the loop thread's CPU (`time.thread_time_ns`) per call and the wall time per call
(`time.perf_counter_ns`: it includes the worker thread and the server, and on shared cores the
other processes), p50 and mean in us, after `--warmup-s` of calls (both trees get the same: the
listener connects during it). Run it pinned (`taskset -c 1`) beside the same script on the other
source tree (`PYTHONPATH=<src>`), alternating, for an A/B; on shared cores say the figures are loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote

from tokenpath.gateway import Gateway, GatewayStore


@contextlib.contextmanager
def _location(database_url: str | None) -> Iterator[tuple[str, Callable[[], Callable[[], None]]]]:
    """Where the store lives, and a factory of the other connection's commit (closed at the end)."""
    if database_url is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "gateway.sqlite3"
            conns: list[sqlite3.Connection] = []

            def sqlite_commit() -> Callable[[], None]:
                other = sqlite3.connect(str(path), isolation_level=None)  # as the audit writer's commits
                other.execute("CREATE TABLE bench_rows (x INTEGER)")
                conns.append(other)

                def insert() -> None:
                    other.execute("INSERT INTO bench_rows VALUES (1)")
                return insert

            try:
                yield str(path), sqlite_commit
            finally:
                for c in conns:
                    c.close()
        return
    import psycopg

    schema = f"tp_bench_{uuid.uuid4().hex[:12]}"
    sep = "&" if "?" in database_url else "?"
    url = f"{database_url}{sep}options={quote(f'-csearch_path={schema}')}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        try:
            with psycopg.connect(url, autocommit=True) as other:
                def pg_commit() -> Callable[[], None]:
                    other.execute("CREATE TABLE bench_rows (x BIGINT)")

                    def insert() -> None:
                        other.execute("INSERT INTO bench_rows VALUES (1)")
                    return insert

                yield url, pg_commit
        finally:
            admin.execute(f"DROP SCHEMA {schema} CASCADE")


async def measure(calls: int, database_url: str | None = None, warmup_s: float = 0.5) -> dict[str, float]:
    with _location(database_url) as (location, commit_factory):
        store = GatewayStore(location)
        commit = commit_factory()
        gw = Gateway(store)
        try:
            end = time.monotonic() + warmup_s
            while time.monotonic() < end:
                commit()
                await gw.authenticate({})
            cpu, wall = [], []
            for _ in range(calls):
                commit()
                w0, t0 = time.perf_counter_ns(), time.thread_time_ns()
                await gw.authenticate({})
                cpu.append(time.thread_time_ns() - t0)
                wall.append(time.perf_counter_ns() - w0)
        finally:
            store.close()
    return {"p50_us": round(statistics.median(cpu) / 1e3, 2), "mean_us": round(statistics.fmean(cpu) / 1e3, 2),
            "wall_p50_us": round(statistics.median(wall) / 1e3, 2),
            "wall_mean_us": round(statistics.fmean(wall) / 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--database-url", default=None, help="postgresql://...: a fresh schema there (default: SQLite)")
    ap.add_argument("--warmup-s", type=float, default=0.5)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(measure(args.calls, args.database_url, args.warmup_s))))


if __name__ == "__main__":
    main()
