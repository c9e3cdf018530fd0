"""The layer contract: server > api > gateway, routing > admission > replica > engine > protocol >
telemetry, errors, config; nothing imports upwards.

`import-linter` checks it (the contract is `[tool.importlinter]` in pyproject.toml). The test
runs it twice: on the source tree, where it must be kept, and on a copy of the tree with one
upward import injected (the engine importing the API), where it must be broken and name that
import. So the contract can fail, and this test shows it failing:

    $ echo "import tokenpath.api.app" >> src/tokenpath/engine/sampler.py && lint-imports
    tokenpath layers import downwards only BROKEN
    tokenpath.engine.sampler -> tokenpath.api.app (l.N)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run([LINT, "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layers_import_downwards_only():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    sampler = tmp_path / "src" / "tokenpath" / "engine" / "sampler.py"
    sampler.write_text(sampler.read_text() + "\nimport tokenpath.api.app  # noqa: E402,F401 - injected upward import\n")
    out = lint(tmp_path)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and "tokenpath.engine.sampler -> tokenpath.api.app" in out.stdout, out.stdout
