"""Keep the gateway's C heap from creeping up under long mixed traffic (glibc only).

Why: the gateway allocates on several threads: the embedding forward on its own thread, store
calls through asyncio's default executor, the tokenizers' Rust pool, torch's intra-op threads.
glibc gives each thread that contends for `malloc` an arena of its own (up to 8 per core), and
memory freed into an arena stays in that arena: variable-size tensors and token lists leave every
arena holding its own high-water mark of free chunks, resident but unused. A 20-minute soak of
`serve --replicas 2` showed the gateway's RSS climbing in steps (+55%, 432 -> 871 MiB), most of
it in 64 MiB arena heaps. Two standard remedies, both cheap:

- at start-up, before the worker threads exist, cap the arenas at `ARENA_MAX` (what
  `MALLOC_ARENA_MAX=2` in the environment does; an operator's own setting is left alone), so
  freed memory is reused across threads instead of parked per thread;
- at start-up, fix glibc's mmap threshold at `MMAP_THRESHOLD` (what `MALLOC_MMAP_THRESHOLD_`
  does). glibc otherwise raises the threshold each time a large mmapped block is freed (up to
  32 MiB), after which large short-lived buffers (request bodies, embedding tensors) land in the
  heap and leave holes there; with the threshold fixed they are mapped and unmapped whole;
- every `TRIM_INTERVAL_S`, `malloc_trim(0)` hands the free pages inside the heaps back to the OS
  (a few milliseconds on the event loop). The soak's first run trimmed once a minute and the
  main heap swung 28 -> 112 MiB between trims.

Both are no-ops where glibc is absent (musl, macOS).

Python's own heap gets one remedy too, `freeze_startup_heap`, for time rather than memory: see there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import os

log = logging.getLogger("tokenpath.memory")

M_ARENA_MAX = -8  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3
ARENA_MAX = 2
MMAP_THRESHOLD = 512 * 1024
TRIM_INTERVAL_S = 15.0
LOG_RELEASED_MIB = 16.0  # a trim that returns at least this much is worth a log line


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    return libc


def limit_arenas(arena_max: int = ARENA_MAX, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Cap glibc's malloc arenas and fix its mmap threshold (before threads start). Each is left
    alone where the operator set it (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_). False if not glibc
    or the arena cap was not applied."""
    libc = _glibc()
    if libc is None:
        return False
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    return libc.mallopt(M_ARENA_MAX, arena_max) == 1


def freeze_startup_heap() -> int:
    """Take every object alive once start-up is done (imported modules, the model's and the
    tokenizer's Python side) out of the cyclic garbage collector's sight; returns how many.

    Why: a full collection walks every tracked object, ~227k in a process with SmolLM2 loaded,
    and took 97 ms here with the GIL held, so an engine's step stalls that long whenever one runs
    (an ITL spike; the collector runs one after enough surviving allocations, on whichever thread
    allocated). After the freeze a full collection walks only what serving allocated since: under
    0.1 ms on the same process. vLLM freezes its engine's start-up heap the same way. What is frozen
    is never collected, so call this once, after loading, when the start-up garbage is collected,
    and only where the loaded engine lives as long as the process: `tokenpath engine` (a dead
    engine is a new process). Not `serve` with an in-process engine: that one is rebuilt in place
    after its step loop dies, and the dead engine's reference cycles would then never be freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def rss_mib(pid: int | str = "self") -> float:
    """A process's resident memory (this one's by default), from /proc (0.0 where there is none)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def trim_heap() -> float:
    """Return free heap pages to the OS now; the MiB of RSS that went (0.0 without glibc)."""
    libc = _glibc()
    if libc is None:
        return 0.0
    before = rss_mib()
    libc.malloc_trim(0)
    return max(0.0, before - rss_mib())


async def trim_periodically(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Run `trim_heap` every `interval_s` until cancelled; log the trims that returned much."""
    if _glibc() is None:
        return
    while True:
        await asyncio.sleep(interval_s)
        with contextlib.suppress(OSError):
            released = trim_heap()
            if released >= LOG_RELEASED_MIB:
                log.info("returned %.0f MiB of freed heap memory to the OS (RSS now %.0f MiB)", released, rss_mib())
