"""Process helpers the benchmarks share: a free loopback port, and memory of a server's process group.

A server under test runs as its own process group (``start_new_session=True``), so its engine
children count too: summing one /proc status field over the group is what "the server's RSS" means
in every results table.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

# llama.cpp's server, as benchmarks/engine_vs_llamacpp.py builds it (`--build-only`) from the
# llama-cpp-python sdist's vendored source.
LLAMA_SERVER = (Path(__file__).resolve().parents[1] / ".cache" / "peers" / "llama_cpp_python-0.3.36" / "vendor"
                / "llama.cpp" / "build" / "bin" / "llama-server")


def free_port() -> int:
    """A port nothing listens on now (the kernel picks it; never a hard-coded one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gauge_sum(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """One `tokenpath:` gauge summed over every model of a server's /metrics (`url`: its root);
    0 where no model has it."""
    req = urllib.request.Request(url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^tokenpath:{name}\{{[^}}]*\}} (\S+)$", text, re.M))


def group_status_kib(pgid: int, field: str = "VmRSS") -> int:
    """``field`` of /proc/PID/status (VmRSS, VmHWM, ...) in KiB, summed over one process group."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
        except (OSError, StopIteration, ProcessLookupError):
            continue
    return total


def serve(
    argv: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 300, new_session: bool = False
) -> tuple[subprocess.Popen, str]:
    """Start a server command whose log says ``listening on http://127.0.0.1:PORT/v1`` (``tokenpath
    serve --port 0 ...``: the kernel picks the port); return the process and its base URL (no /v1).
    Its output goes to ``log``; a server that exits or stays silent for ``timeout`` s is killed and
    its log's tail raised. `new_session`: in a process group of its own, for stop_group()."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)/v1", log.read_text(errors="replace"))
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start ({argv[0]}):\n{log.read_text(errors='replace')[-3000:]}")


def port_of(url: str) -> int:
    """The port of a base URL that serve() returned."""
    return int(url.rsplit(":", 1)[1])


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to a server's whole process group (started with ``start_new_session=True``), SIGKILL
    after 60 s; children left behind by a leader that already exited are stopped too."""
    try:
        os.killpg(proc.pid, signal.SIGCONT)  # (a paused one cannot act on SIGTERM)
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Until ``GET /health`` answers 200; a server that exits, or is not healthy in ``timeout`` s,
    raises with its log's tail."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy in {timeout:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")
