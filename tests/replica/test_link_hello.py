"""The engine link's door (issue 23): the hello is capped at a few KB and the secret is checked
before anything bigger is read, and refusals are counted and logged at a bounded rate.

Against a real `tokenpath engine` process (a tiny model): 8 connections each announcing a 63 MiB
first frame and sending it grew the engine by 554 MiB before the fix; now by under 10 MiB. A flood
of 300 refused connections writes one or two log lines, not 300, and the real link keeps working.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import pytest
import pytest_asyncio
from tests.engine.tiny_models import save_tiny

from tokenpath.protocol import GenerateRequest, SamplingParams, Submission
from tokenpath.replica.processes import spawn_engines

in_module_loop = pytest.mark.asyncio(loop_scope="module")
BIG = 63 * 1024 * 1024


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hello")
    model = save_tiny("llama", tmp / "tiny")
    (proc,) = await spawn_engines(1, str(model), ["--max-num-seqs", "2"], log_dir=tmp / "logs",
                                  deployment="hello-test")
    yield proc
    await proc.stop()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def send_big_garbage(port: int, done: list) -> None:
    """A 4-byte prefix announcing 63 MiB, then 63 MiB, as fast as loopback takes it."""
    chunk = b"\xa5" * (1 << 20)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(struct.pack(">I", BIG))
            for _ in range(BIG // len(chunk)):
                s.sendall(chunk)
    except OSError:
        pass  # refused and closed under our feet: what should happen
    done.append(1)


async def generate_ok(engine, rid: str) -> None:
    request = GenerateRequest(rid, [1000 + i for i in range(8)],
                              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outs = [o async for o in engine.replica.generate(Submission(request))]
    assert outs[-1].finished


@in_module_loop
async def test_big_garbage_before_the_hello_is_refused_without_being_read(engine):
    pid = engine.proc.pid
    await generate_ok(engine, "before")
    before = rss_kib(pid)
    done: list = []
    threads = [threading.Thread(target=send_big_garbage, args=(engine.port, done), daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    peak = before
    while len(done) < len(threads):
        peak = max(peak, rss_kib(pid))
        await asyncio.sleep(0.02)
    peak = max(peak, rss_kib(pid))
    assert (peak - before) / 1024 < 10, f"engine RSS grew by {(peak - before) / 1024:.1f} MiB"
    await generate_ok(engine, "after-big")


@in_module_loop
async def test_a_flood_of_refusals_is_counted_and_logged_at_a_bounded_rate(engine):
    def flood() -> None:
        for i in range(300):
            with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as s:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n" if i % 2 else struct.pack(">I", 1 << 20) + b"x" * 100)
                s.settimeout(3)
                try:
                    while s.recv(4096):
                        pass
                except TimeoutError:
                    raise AssertionError(f"connection {i} held open: the engine waits to read its frame") from None
                except OSError:
                    pass

    await asyncio.to_thread(flood)
    await generate_ok(engine, "after-flood")
    log = engine.log_path.read_text()
    lines = [line for line in log.splitlines() if "refused" in line and "launch secret" in line]
    assert 1 <= len(lines) <= 2, lines
