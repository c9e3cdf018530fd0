"""`serve --ray auto` with no cluster is one clear line; `serve --ray local` starts a private Ray
head on loopback for the server alone, serves through its actors, and leaves nothing behind
(no Ray process, no temp dir) when the server stops."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from tests.engine.tiny_models import save_tiny
from tests.process_logs import wait_for_log

pytestmark = pytest.mark.requires("ray")
BIN = Path(sys.executable).parent


def _env(tmpdir: str) -> dict[str, str]:
    """No cluster to find: RAY_ADDRESS unset, Ray's and Python's temp dirs private and empty."""
    os.makedirs(os.path.join(tmpdir, "ray"), exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_TMPDIR": tmpdir, "TMPDIR": tmpdir, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}


def _ray_processes_under(path: str) -> list[str]:
    out = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if path in line]


def test_ray_auto_without_a_cluster_is_one_line(tmp_path: Path) -> None:
    tmpdir = tempfile.mkdtemp(prefix="tpr", dir="/tmp")
    try:
        out = subprocess.run([str(BIN / "tokenpath"), "serve", "--port", "0", "--ray", "auto", "--replicas", "1",
                              "--model", str(tmp_path / "unused")], env=_env(tmpdir), capture_output=True,
                             text=True, timeout=180)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "--ray auto: no Ray cluster is running" in last and "--ray local" in last, out.stderr[-3000:]


def test_ray_local_serves_on_a_private_head_and_leaves_nothing(tmp_path: Path) -> None:
    model = save_tiny("llama", tmp_path / "tiny")
    tmpdir = tempfile.mkdtemp(prefix="tpr", dir="/tmp")  # short: Ray's socket paths must fit
    log = tmp_path / "serve.log"
    try:
        with log.open("wb") as out:
            serve = subprocess.Popen([str(BIN / "tokenpath"), "serve", "--port", "0", "--ray", "local",
                                      "--replicas", "1", "--model", str(model), "--num-kv-blocks", "64",
                                      "--data-dir", str(tmp_path / "data")],
                                     stdout=out, stderr=subprocess.STDOUT, env=_env(tmpdir))
        try:
            port = wait_for_log(log, r"listening on http://127\.0\.0\.1:(\d+)/v1", serve, 300).group(1)
            assert _ray_processes_under(tmpdir), "no Ray process runs in the private temp dir"
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        finally:
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(120) == 0, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while _ray_processes_under(tmpdir) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _ray_processes_under(tmpdir), _ray_processes_under(tmpdir)
        assert not [p for p in Path(tmpdir).iterdir() if p.name != "ray"], list(Path(tmpdir).iterdir())
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
