"""For the tests that start real servers (Ray heads, gateways): a free loopback port to give one,
waiting on a child process's log (it is up when a line appears; fail fast, with the log, if
the child dies first), and reading a gateway's audit row for one request."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A loopback port nothing listens on now (for servers whose port must be known before they start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_log(path: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> re.Match:
    """The first match of `pattern` in the log at `path`; raises with the log's tail if `proc`
    exits or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, path.read_text(errors="replace"))
        if m:
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}:\n{path.read_text()[-3000:]}")
        time.sleep(0.25)
    raise RuntimeError(f"{proc.args[:4]} not ready in {timeout}s:\n{path.read_text()[-3000:]}")


def audit_timing(data_dir: Path, request_id: str, timeout: float = 20.0) -> dict:
    """The timing of a request's audit row in the gateway's store under `data_dir` (which replica
    served it, `retried_after` when another one was tried first), once the writer has stored it.
    `request_id`: the server's id, or the client's own (`x-request-id` sent) when only one request
    sent it, as `tokenpath trace` takes either."""
    from tokenpath.gateway.store import GatewayStore, resolve_store_location

    store = GatewayStore(resolve_store_location(data_dir))
    try:
        deadline = time.monotonic() + timeout
        while not (rows := store.query_audit(request_id=request_id)
                   or store.query_audit(client_request_id=request_id)):
            if time.monotonic() > deadline:
                raise AssertionError(f"no audit row for {request_id} within {timeout}s")
            time.sleep(0.1)
        assert len(rows) == 1, [r.request_id for r in rows]
        return json.loads(rows[0].timing)
    finally:
        store.close()
