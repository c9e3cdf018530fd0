"""The audit log loses nothing (issue 23, item 2), on real faults over real HTTP:

- the data dir on a real tmpfs filled to the last byte: serving goes on, `/health` says `degraded`
  with the cause at once, rows are spooled and counted in /metrics, and every row is written once
  there is room again;
- a private PostgreSQL cluster stopped and started again: the same;
- `kill -9` of a real `tokenpath serve` mid-stream: the restart closes the rows it left open as
  `gateway_crash`, with the tokens it had streamed as of its last progress write.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import CHAT_MODEL, EMBED_MODEL, start_server
from tests.api.sim_server import SimServer
from tests.capabilities import missing
from tests.reliability.private_pg import PrivateCluster
from tests.simulated_replica import SimulatedConfig, SimulatedReplica
from tokenpath.gateway import Gateway, GatewayStore
from tokenpath.gateway.base import CRASH_STATUS, GATEWAY_CRASH, OPEN_STATUS
from tokenpath.gateway.store import resolve_store_location


def _complete(url: str, i: int, stream: bool = False) -> str:
    body = {"model": "sim", "prompt": f"request {i}", "max_tokens": 5, "stream": stream}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"]


def _health(url: str) -> dict:
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 200
    return r.json()


def _wait_health(url: str, state: str, within: float) -> float:
    """Seconds until the audit part of /health says `state` (fails past `within`)."""
    t0 = time.monotonic()
    while (h := _health(url)).get("audit", {}).get("state") != state:
        assert time.monotonic() - t0 < within, h
        time.sleep(0.02)
    return time.monotonic() - t0


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^tokenpath:{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def _closed_ids(location: str) -> list[str]:
    store = GatewayStore(location)
    try:
        return [r.request_id for r in store.query_audit(limit=None) if r.status != OPEN_STATUS]
    finally:
        store.close()


def _fault_run(location: str, fail, repair, url: str, cause: str) -> None:  # noqa: ANN001
    """Requests before, during and after a store fault; every one must end up with one closed row.
    `fail` returns the ids of any requests it made itself."""
    ids = [_complete(url, i) for i in range(3)]
    assert _health(url)["audit"]["state"] == "ok"
    ids += fail() or []
    ids.append(_complete(url, 100))  # its open row meets the fault: the request still succeeds
    waited = _wait_health(url, "degraded", within=1.0)  # degraded within 1 s of the failed write
    health = _health(url)
    assert health["status"] == "degraded" and cause in health["audit"]["reason"], health  # the cause, named
    ids += [_complete(url, 100 + i, stream=i % 2 == 0) for i in range(1, 12)]
    assert _metric(url, "audit_rows_spooled_total") >= 12 and _metric(url, "audit_store_degraded") == 1
    repair()
    _wait_health(url, "ok", within=15)
    assert _metric(url, "audit_rows_dropped_total") == 0 and _metric(url, "audit_spool_rows") == 0
    closed = _closed_ids(location)
    assert sorted(closed) == sorted(ids), (len(closed), len(ids))  # every request once, none lost
    print(f"degraded after {waited * 1000:.0f} ms; {len(ids) - 3} requests during the fault, 0 rows lost")


@contextlib.contextmanager
def _mounted_tmpfs(config: pytest.Config, mnt: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` at `mnt` (the tests run as root here and in CI), unmounted after."""
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        missing(config, "root", f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def tmpfs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A real 16 MiB tmpfs."""
    with _mounted_tmpfs(request.config, tmp_path / "data", "16m") as mnt:
        yield mnt


def test_full_disk_spools_and_writes_every_row_later(tmpfs: Path):
    location = str(tmpfs / "gateway.sqlite3")
    gw = Gateway(GatewayStore(location))
    srv = SimServer(SimulatedReplica("r0", SimulatedConfig(token_interval_s=0.001)), guard=gw)
    url = srv.start()
    filler = tmpfs / "filler"

    def fill() -> list[str]:
        # The WAL reuses its own space after a checkpoint: truncate it so the next write must grow it.
        with sqlite3.connect(location) as c:
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert (tmpfs / "gateway.sqlite3.reserve").stat().st_size > 0  # the disk the store holds back
        _fill(tmpfs, filler)
        # The first write to meet the full disk gives the reserve back and is written into it, and
        # /health says so at once; then the disk is filled again, for good.
        first = _complete(url, 99)
        assert not (tmpfs / "gateway.sqlite3.reserve").exists()
        health = _health(url)
        assert health["status"] == "degraded" and "reserve is spent" in health["audit"]["reason"], health
        _fill(tmpfs, filler)
        return [first]

    try:
        _fault_run(location, fill, filler.unlink, url, "database or disk is full")
    finally:
        srv.stop()


def test_postgres_stopped_and_restarted_spools_and_writes_every_row_later(request: pytest.FixtureRequest):
    try:  # in a fresh directory of $TMPDIR, as scripts/postgres.sh: the `postgres` user cannot enter tmp_path
        cluster = PrivateCluster(Path(tempfile.mkdtemp(prefix="tokenpath-test-pg.")))
    except RuntimeError as exc:
        missing(request.config, "postgres", f"no private PostgreSQL cluster: {exc}")
    srv = None
    try:
        gw = Gateway(GatewayStore(cluster.url))
        srv = SimServer(SimulatedReplica("r0", SimulatedConfig(token_interval_s=0.001)), guard=gw)
        url = srv.start()
        _fault_run(cluster.url, cluster.stop, cluster.start, url, "OperationalError: ")
    finally:
        if srv is not None:
            srv.stop()
        cluster.destroy()


def _stream(url: str, got: dict, key: int, started: threading.Event) -> None:
    body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 3000, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            got[key] = [r.headers["x-request-id"], 0]
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got[key][1] += 1
                    started.set()
    except httpx.HTTPError:
        pass  # the gateway was killed under it


def test_kill_9_mid_stream_leaves_rows_the_restart_closes_as_gateway_crash(tmp_path: Path):
    srv = start_server(tmp_path, "--model", CHAT_MODEL)
    got: dict[int, list] = {}
    events = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(srv.url, got, i, events[i]), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for e in events:
            assert e.wait(120), srv.output()[-3000:]
        time.sleep(3.0)  # past one progress write (every 2 s): the open rows hold the tokens sent so far
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    for t in threads:
        t.join(30)
    location = resolve_store_location(tmp_path / "data")
    store = GatewayStore(location)
    try:
        left = {r.request_id: r for r in store.query_audit(limit=None)}
    finally:
        store.close()
    ids = [v[0] for v in got.values()]
    assert len(ids) == 3 and all(left[i].status == OPEN_STATUS for i in ids), left
    assert all(left[i].completion_tokens > 0 and left[i].prompt_tokens > 0 for i in ids), left

    # The same data dir: the gateway's start closes them (the small embedding model makes it quick).
    again = start_server(tmp_path, "--model", EMBED_MODEL)
    try:
        store = GatewayStore(location)
        try:
            rows = {r.request_id: r for r in store.query_audit(limit=None)}
        finally:
            store.close()
        for i in ids:
            row = rows[i]
            assert (row.status, row.finish_reason, row.error_type) == (CRASH_STATUS, GATEWAY_CRASH, GATEWAY_CRASH)
            # the tokens streamed as of the last progress write: some, never more than asked for
            assert 0 < row.completion_tokens <= 3000 and row.completion_tokens == left[i].completion_tokens
        assert "closed 3 audit rows left open by a crashed gateway" in again.output()
    finally:
        assert again.stop() == 0, again.output()[-3000:]


def _fill(path: Path, filler: Path) -> None:
    """The filesystem at `path` filled to the last byte (unbuffered: ENOSPC surfaces at the write)."""
    with filler.open("ab", buffering=0) as f:
        for chunk in (1 << 16, 4096, 512, 64):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    assert os.statvfs(path).f_bavail == 0


@pytest.fixture
def tiny_tmpfs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A real 3 MiB tmpfs: smaller than SQLite's WAL grows before its automatic checkpoint (1000
    pages, ~4 MiB), so once space returns the WAL alone can fill it again."""
    with _mounted_tmpfs(request.config, tmp_path / "tiny", "3m") as mnt:
        yield mnt


def test_a_3_mib_disk_filled_and_freed_twice_loses_no_row(tiny_tmpfs: Path):
    """Issue 41 item 6: on a 3 MiB disk SQLite's WAL refilled it 6 s after space came back, and the
    rows still spooled at shutdown were lost (38 of 183). Filled and freed twice, with traffic
    between, then a clean shutdown: every request has its closed row, none dropped."""
    location = str(tiny_tmpfs / "gateway.sqlite3")
    filler = tiny_tmpfs / "filler"
    gw = Gateway(GatewayStore(location))
    srv = SimServer(SimulatedReplica("r0", SimulatedConfig(token_interval_s=0.001)), guard=gw)
    url = srv.start()
    ids: list[str] = []
    try:
        for round_ in range(2):
            _fill(tiny_tmpfs, filler)
            ids += [_complete(url, 1000 * round_ + i, stream=i % 2 == 0) for i in range(20)]
            filler.unlink()
            ids += [_complete(url, 1000 * round_ + 100 + i) for i in range(200)]
        deadline = time.monotonic() + 60  # the spool drains once there is room (it may refill and drain)
        while _metric(url, "audit_spool_rows") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        dropped = _metric(url, "audit_rows_dropped_total")
    finally:
        srv.stop()
    closed = _closed_ids(location)
    assert dropped == 0
    assert sorted(set(closed) & set(ids)) == sorted(ids), (len(set(closed) & set(ids)), len(ids))
