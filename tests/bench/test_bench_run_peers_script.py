"""benchmarks/run_peers.sh: the parts that can run without installing or starting a peer."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_peers.sh"


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_unknown_peer_is_refused_before_anything_is_installed(tmp_path):
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PEERS": "tokenpath,vllm-on-a-toaster", "RESULTS": str(tmp_path / "r"),
                              "TP_VENV": sys.prefix})
    assert res.returncode == 2
    assert "unknown peer 'vllm-on-a-toaster'" in res.stderr
    assert not (tmp_path / "r").exists()  # refused before writing anything
