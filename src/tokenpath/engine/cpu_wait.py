"""How long a thread has waited for a CPU: the kernel's run-queue delay (`/proc/.../schedstat`).

Why: the engine's watcher (`replica.liveness`) calls a step hung once it has run past its bound,
so a stuck kernel or a deadlock cannot hold requests for as long as it lasts. But a step can also
be slow because the machine is oversubscribed: on two cores shared with other work, a 1024-token
prefill chunk that takes 0.5 s alone took 4.7 s, and the gateway ejected its only, healthy replica
and failed all 32 requests with 503s that a wait would have served. The two differ in what the
kernel sees: a starved step thread is runnable and waiting in a run queue; a hung one is blocked
(or spinning, and then running). The second field of a thread's schedstat is that run-queue wait
in nanoseconds, kept by every Linux kernel with schedstats (`CONFIG_SCHED_INFO`), and reading it is
a sub-microsecond `pread` on a file opened once. So the step's age can leave out the time it waited
for a CPU, and only the time it ran or was blocked counts towards the hang.

Where the file does not exist (another OS, a kernel without it), `read()` returns None and the
watcher judges by the wall clock, as before.
"""

from __future__ import annotations

import os


class RunQueueWait:
    """The run-queue wait of the thread that called `attach()`, readable from any thread."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def attach(self) -> None:
        """Open the calling thread's schedstat (`/proc/thread-self` resolves to it at open time, so
        the descriptor keeps naming this thread whichever thread reads it later)."""
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> float | None:
        """Seconds the attached thread has waited for a CPU since it started, or None (no attached
        thread, no schedstat, or the thread has exited)."""
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 64, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
