"""A real `tokenpath serve` or `tokenpath engine` whose engine can be made to hang in a step (test double).

Run as `python <this file> serve ...` (the in-process engine), or as a routing file's
`engine_command: [python, <this file>, engine]` (engine processes, which inherit the gateway's
environment): the real entry point with every flag, but each engine's `runner.execute` is first
wrapped so that, while the file `$FROZEN_STEP_DIR/freeze` (any engine) or
`$FROZEN_STEP_DIR/freeze.<pid>` (the engine of that process only) exists, the next step blocks
(the step thread waits, as in a native call that never returns, while the process's event loop
runs on) until the file `$FROZEN_STEP_DIR/thaw` appears. The hook lives only here: nothing in the
package can trigger it. Each hang prints `FROZEN` and `THAWED` lines to the process's output (for
an engine process, its log under the gateway's data dir), where a test can wait for them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tokenpath.cli import main
from tokenpath.engine.async_engine import AsyncEngine

FROZEN, THAWED = "frozen_step_server: step blocked", "frozen_step_server: step released"


class Hang:
    """Wraps `runner.execute`: blocks the step thread while the freeze file exists, until thawed."""

    def __init__(self, execute, control: Path) -> None:  # noqa: ANN001 - the runner's bound method
        self.execute, self.thaw = execute, control / "thaw"
        self.freezes = (control / "freeze", control / f"freeze.{os.getpid()}")

    def __call__(self, scheduled):  # noqa: ANN001, ANN204 - whatever the runner takes and returns
        if armed := next((f for f in self.freezes if f.exists()), None):
            armed.unlink()
            print(f"{FROZEN} ({len(scheduled)} sequence(s))", flush=True)
            while not self.thaw.exists():
                time.sleep(0.02)
            self.thaw.unlink()
            print(THAWED, flush=True)
        return self.execute(scheduled)


_real_start = AsyncEngine.start


async def _hanging_start(self: AsyncEngine) -> None:
    self.core.runner.execute = Hang(self.core.runner.execute, Path(os.environ["FROZEN_STEP_DIR"]))
    await _real_start(self)


if __name__ == "__main__":
    AsyncEngine.start = _hanging_start
    sys.exit(main())  # (no argv: as the console script runs it, so its exit is the real one, `cli.exit_now`)
