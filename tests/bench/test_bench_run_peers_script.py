"""benchmarks/run_peers.sh: the parts that can run without installing or starting a peer."""

import json
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


def test_merge_from_earlier_runs_writes_table_ratios_reasons_and_plots(tmp_path):
    from stub_server import StubServer, StubState

    from tokenpath.cli import main

    raw = []
    # a slow and a fast stub stand in for tokenpath and llama.cpp (25x apart: the ratio cannot flip)
    for name, delay in (("tokenpath", 0.05), ("llamacpp", 0.002)):
        with StubServer(StubState(delay=delay)) as srv:
            path = tmp_path / f"{name}.json"
            assert main(["bench", "--target", f"{name}={srv.url}", "--concurrency", "1", "--num-requests", "2",
                         "--warmup", "0", "--input-len", "4", "--output-len", "8", "--tokenizer", "approx",
                         "--no-progress", "--note", f"{name}=stub", "--json", str(path)]) == 0
            raw.append(str(path))
    out = tmp_path / "results"
    res = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PEERS": "tokenpath,llamacpp", "MERGE_FROM": " ".join(raw),
                              "RESULTS": str(out), "TP_VENV": sys.prefix})
    assert res.returncode == 0, res.stderr[-2000:]
    md = (out / "peers.md").read_text()
    for needle in ("# tokenpath vs peers", "- machine:", "cores", "## Targets", "## Ratios",
                   "- tokenpath loses to llamacpp at c=1", "## Why tokenpath loses there", "**llamacpp**",
                   "## Machine"):
        assert needle in md, needle
    assert "**transformers**" not in md  # reasons only for the peers it lost to
    assert {p.name for p in (out / "peers-plots").iterdir()} >= {"ttft_cdf.png", "itl_cdf.png", "stages.png"}
    assert len(json.loads((out / "peers.json").read_text())["runs"]) == 2
