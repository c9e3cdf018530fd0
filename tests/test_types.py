"""The protocol, the engine, the HTTP API (`api/`) and the other files pyproject.toml's `[tool.mypy]` lists
type-check, so their `# type: ignore`s are the ones a checker needs (`warn_unused_ignores`), not guesses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_protocol_and_engine_type_check(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(tmp_path / "mypy_cache")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
