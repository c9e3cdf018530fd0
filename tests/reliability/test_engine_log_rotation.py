"""An engine process's output goes to a size-rotated log, never an unbounded file (issue 10).

`tokenpath serve` puts these logs under `<data dir>/logs/engines/` (checked end to end in
`tests/api/test_replicas.py` and `test_engine_faults_over_the_link.py`); this checks that they
rotate: a chatty child fills `<name>.log` and at most `LOG_BACKUPS` older files, each near
`LOG_MAX_BYTES`, and its newest line is in `<name>.log`. The child is a real process started
through `EngineProcess` (its `command` replaced by a script that prints and never links).
"""

from __future__ import annotations

import sys

import pytest

from tokenpath.errors import ModelLoadError
from tokenpath.replica import processes
from tokenpath.replica.processes import EngineProcess

CHATTY = ("import time\n"
          "for i in range(4000):\n"
          "    print(f'line {i:05d} ' + 'x' * 60)\n"
          "time.sleep(60)\n")


async def test_engine_output_is_rotated_by_size(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "LOG_MAX_BYTES", 20_000)
    log_dir = tmp_path / "logs" / "engines"
    proc = EngineProcess("chatty", None, [], log_dir, command=[sys.executable, "-c", CHATTY])
    with pytest.raises(ModelLoadError, match="did not link"):
        await proc.start(timeout=5)
    await proc.stop()
    files = sorted(p.name for p in log_dir.iterdir())
    assert files == ["chatty.log"] + [f"chatty.log.{i}" for i in range(1, processes.LOG_BACKUPS + 1)], files
    assert all((log_dir / f).stat().st_size <= 20_000 + 200 for f in files)
    assert "line 03999" in (log_dir / "chatty.log").read_text()  # the newest line is in the live file
    assert not any("line 00000" in (log_dir / f).read_text() for f in files)  # the oldest rotated away
