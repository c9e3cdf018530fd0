"""Waiting on a child process's log: the tests that start real servers (Ray heads, gateways)
know they are up when a line appears, and must fail fast, with the log, if the child dies first."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path


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
