"""A gateway with no keys keeps the store's "no keys" between requests (SQLite: one `access()` of the
key mark, no read), and still sees the first key stored by another process at the next request."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tokenpath
from tokenpath.errors import AuthenticationError
from tokenpath.gateway import Gateway, GatewayStore, Principal
from tokenpath.gateway.admin import create_key

_SRC = str(Path(tokenpath.__file__).resolve().parents[1])


def _statements(store: GatewayStore) -> list[str]:
    """The SQL the store's loop reader runs from now on (SQLite's own trace of that connection)."""
    assert store.has_keys_nowait() is not None  # (the reader is opened by its first read)
    seen: list[str] = []
    reader = store.db._reader
    assert isinstance(reader, sqlite3.Connection)
    reader.set_trace_callback(seen.append)
    return seen


async def test_no_keys_is_kept_across_requests_without_a_read(tmp_path, clock):
    store = GatewayStore(tmp_path / "gateway.sqlite3", no_keys_recheck_s=3600)
    try:
        gw = Gateway(store, clock=clock)
        assert await gw.authenticate({}) == Principal()
        seen = _statements(store)
        for _ in range(5):
            assert await gw.authenticate({}) == Principal()
        assert seen == []
        store.close()
        assert store.has_keys_nowait() is None  # (closed: nothing answered from what was kept)
    finally:
        store.close()


async def test_a_key_made_by_another_process_ends_the_kept_answer_at_the_next_request(tmp_path, clock):
    data_dir = tmp_path / "data"
    store = GatewayStore(data_dir / "gateway.sqlite3", no_keys_recheck_s=3600)
    try:
        gw = Gateway(store, clock=clock)
        assert await gw.authenticate({}) == Principal()
        assert await gw.authenticate({}) == Principal()  # (kept: see the test above)
        made = subprocess.run(
            [sys.executable, "-c", "import sys; from tokenpath.cli import main; sys.exit(main(sys.argv[1:]))",
             "keys", "create", "--tenant", "acme", "--data-dir", str(data_dir)],
            env={**os.environ, "PYTHONPATH": _SRC}, capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        assert made.stdout.strip().startswith("tp-")
        with pytest.raises(AuthenticationError):
            await gw.authenticate({})
        p = await gw.authenticate({"Authorization": f"Bearer {made.stdout.strip()}"})
        assert p.tenant == "acme"
    finally:
        store.close()


async def test_a_key_stored_around_the_store_is_seen_within_the_recheck(tmp_path, clock):
    """Raw SQL leaves no mark: the kept answer lasts at most `no_keys_recheck_s`."""
    path = tmp_path / "gateway.sqlite3"
    store = GatewayStore(path, no_keys_recheck_s=0.2)
    other = GatewayStore(path)
    try:
        gw = Gateway(store, clock=clock)
        assert await gw.authenticate({}) == Principal()
        create_key(other, "acme", now=clock())
        store.db.keys_marker.unlink()  # as if the row had been written by hand
        assert await gw.authenticate({}) == Principal()  # kept for now
        time.sleep(0.25)
        with pytest.raises(AuthenticationError):
            await gw.authenticate({})
    finally:
        other.close()
        store.close()


def test_storing_a_key_marks_the_store_readable_by_its_owner_only(tmp_path, clock):
    store = GatewayStore(tmp_path / "gateway.sqlite3")
    try:
        assert store.db.keys_unmarked()
        create_key(store, "acme", now=clock())
        assert not store.db.keys_unmarked()
        assert store.db.keys_marker.stat().st_mode & 0o777 == 0o600
    finally:
        store.close()
