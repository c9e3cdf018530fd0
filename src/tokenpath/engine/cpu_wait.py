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

import contextlib
import os


class RunQueueWait:
    """The summed run-queue wait of the threads that called `attach()`, readable from any thread.

    Why more than one thread: the step thread runs Python between its kernels, and for that it
    needs the GIL. On a crowded machine the thread holding the GIL (the event loop's) may itself
    be waiting in a run queue, and then the step thread sleeps on the GIL: blocked, not runnable,
    so its own run-queue wait does not show it. Attaching the loop's thread too counts that wait
    (a step failed a liveness test at load 17 by it). It can count a little too much, a loop wait
    while the step ran native code without the GIL; that only happens on a crowded machine, and
    a hung step's age still grows at nearly the wall clock's rate (an idle loop waits in no run
    queue), so a hang is still noticed, a little later."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    def attach(self) -> None:
        """Add the calling thread's schedstat (`/proc/thread-self` resolves to it at open time, so
        the descriptor keeps naming this thread whichever thread reads it later)."""
        with contextlib.suppress(OSError):
            self._fds.append(os.open("/proc/thread-self/schedstat", os.O_RDONLY))

    def read(self) -> float | None:
        """Seconds the attached threads have waited for a CPU since they started, summed, or None
        (no attached thread, no schedstat, or every attached thread has exited)."""
        total, seen = 0, False
        for fd in self._fds:
            try:
                total += int(os.pread(fd, 64, 0).split()[1])
                seen = True
            except (OSError, IndexError, ValueError):
                continue
        return total / 1e9 if seen else None

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
