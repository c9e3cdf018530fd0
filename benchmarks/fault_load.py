"""What the fault soaks share (`soak_frozen.py`, `soak_faults.py`): closed-loop chat clients against a
running `tokenpath serve`, a `/health` watcher, an engine process frozen with SIGSTOP for a while,
and a flood of oversized first frames on an engine's link port.

Each soak had its own copy of these; one copy, here, and the soaks keep only what they measure.
The link-port flood is the same as tests/replica/test_link_hello.py's (tests do
not import benchmarks, so that one keeps its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

BIG = 63 * 1024 * 1024  # the first frame the flood announces and sends: under the 64 MiB frame cap


@dataclass
class Load:
    """The clients' and the watcher's records, and their switches."""

    url: Callable[[], str]  # the gateway's base URL now (it changes when a soak restarts the gateway)
    # One per request: rid, start (monotonic), dur, status (0: no response), ok, stream[, error].
    records: list[dict] = field(default_factory=list)
    # One per /health poll: t, status, healthy ({replica: bool}), audit (state), spool (rows).
    health: list[dict] = field(default_factory=list)
    stop: bool = False
    paused: bool = False  # while the gateway is down and restarting

    def start(self, model: str, clients: int, max_tokens: int = 16) -> list[asyncio.Task]:
        """The clients and the /health watcher, as tasks (stop them with `stop = True`, then gather)."""
        tasks = [asyncio.create_task(client_loop(self, model, i, max_tokens)) for i in range(clients)]
        return [*tasks, asyncio.create_task(watch_health(self))]

    def normal_s(self, before: float) -> float:
        """The median duration of the requests that succeeded and started before `before`."""
        base = [r["dur"] for r in self.records if r["start"] < before and r["ok"]]
        return statistics.median(base) if base else 0.0


async def client_loop(load: Load, model: str, i: int, max_tokens: int = 16) -> None:
    """One closed-loop client, every other request streamed, each with its own `x-request-id`. A
    success: a 200 and, streamed, a `[DONE]` with no error event before it."""
    n = 0
    async with httpx.AsyncClient(timeout=300) as c:
        while not load.stop:
            if load.paused:
                await asyncio.sleep(0.1)
                continue
            n += 1
            rid, stream = f"c{i}-{n}", n % 2 == 0
            body = {"model": model, "messages": [{"role": "user", "content": f"Client {i} request {n}: say hi."}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": stream}
            rec = {"rid": rid, "start": time.monotonic(), "status": 0, "ok": False, "stream": stream}
            try:
                async with c.stream("POST", f"{load.url()}/v1/chat/completions", json=body,
                                    headers={"x-request-id": rid}) as r:
                    rec["status"] = r.status_code
                    text = (await r.aread()).decode()
                    rec["ok"] = r.status_code == 200 and (not stream or ('"error"' not in text and "[DONE]" in text))
            except httpx.HTTPError as exc:
                rec["error"] = type(exc).__name__
            rec["dur"] = time.monotonic() - rec["start"]
            load.records.append(rec)
            if not rec["ok"]:
                await asyncio.sleep(0.2)  # (a refused client backs off a little, as a real one would)


async def watch_health(load: Load, every_s: float = 0.05) -> None:
    async with httpx.AsyncClient(timeout=2) as c:
        while not load.stop:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                r = await c.get(f"{load.url()}/health")
                h = r.json()
                audit = h.get("audit", {})
                load.health.append({
                    "t": time.monotonic(), "status": r.status_code,
                    "healthy": {k: v.get("healthy", True) for d in h["replicas"].values() for k, v in d.items()},
                    "audit": audit.get("state", "ok"), "spool": int(audit.get("spool_rows", 0))})
            await asyncio.sleep(every_s)


def first(health: list[dict], after: float, cond: Callable[[dict], bool]) -> float | None:
    """Seconds from `after` to the first /health poll at or after it for which `cond` holds."""
    return next((round(h["t"] - after, 3) for h in health if h["t"] >= after and cond(h)), None)


def healthy(replica: str) -> Callable[[dict], bool]:
    return lambda h: h["healthy"].get(replica, True)


def pct(xs: list[float], q: float) -> float | None:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


async def freeze(pid: int, seconds: float) -> tuple[float, float]:
    """SIGSTOP the process for `seconds` (SIGCONT even if cancelled); (stopped, continued) times."""
    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return frozen, time.monotonic()


def send_big_garbage(port: int) -> None:
    """A 4-byte prefix announcing `BIG` bytes, then `BIG` bytes, as fast as loopback takes them."""
    chunk = b"\xa5" * (1 << 20)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(struct.pack(">I", BIG))
            for _ in range(BIG // len(chunk)):
                s.sendall(chunk)
    except OSError:
        pass  # refused and closed under us: what should happen


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def hello_flood(pid: int, port: int, connections: int = 8) -> float:
    """`connections` floods at once on the engine link port of process `pid`: its peak RSS growth, MiB."""
    before, peak = rss_kib(pid), 0
    threads = [threading.Thread(target=send_big_garbage, args=(port,), daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_kib(pid))
        await asyncio.sleep(0.05)
    return round((max(peak, rss_kib(pid)) - before) / 1024, 1)
