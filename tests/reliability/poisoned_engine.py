"""A real `tokenpath engine` process whose forward raises for one marked request (test double).

Started by a test's routing file as `engine_command: [python, <this file>]`: it runs the real
`tokenpath engine` entry point with every flag the gateway passes, but first wraps each engine's
runner so that a step whose batch holds a request with seed `POISON_SEED` raises, as a kernel
fault would (the seed, because it reaches the engine as the client sent it; request ids are the
gateway's own). Each injected fault is printed, so it lands in the engine's log under the
gateway's data dir, where the test counts them (a retry on another replica would print twice).
"""

from __future__ import annotations

import sys

from tokenpath.cli import main
from tokenpath.engine.async_engine import AsyncEngine

POISON_SEED = 24_680_135  # the `seed` that marks a request to fail
FAULT_LINE = "injected kernel fault"  # the exception's message, which the client must see
INJECTED = "poisoned_engine: raising in a step"  # printed once per injected fault, counted by tests


class Poison:
    """Wraps `runner.execute`: raises when the scheduled batch holds a poisoned request."""

    def __init__(self, execute) -> None:  # noqa: ANN001 - the runner's bound method
        self.execute = execute

    def __call__(self, scheduled):  # noqa: ANN001, ANN204 - whatever the runner takes and returns
        if any(seq.params.seed == POISON_SEED for seq, _ in scheduled):
            print(f"{INJECTED} of {len(scheduled)} sequence(s)", flush=True)
            raise RuntimeError(FAULT_LINE)
        return self.execute(scheduled)


_real_start = AsyncEngine.start


async def _poisoned_start(self: AsyncEngine) -> None:
    self.core.runner.execute = Poison(self.core.runner.execute)
    await _real_start(self)


if __name__ == "__main__":
    AsyncEngine.start = _poisoned_start
    sys.exit(main(sys.argv[1:]))
