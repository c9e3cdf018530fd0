"""Two ways a Ray deployment can go wrong for an operator, on a real head started without its
dashboard (`ray start --head --include-dashboard=false`, loopback only):

- an engine actor whose constructor fails (a model path that does not exist): `tokenpath serve`
  exits non-zero with one line naming the replica and the cause, not a remote traceback, and
  leaves no actor behind;
- `tokenpath status --ray` without Ray's state API (which the dashboard serves): it still lists
  the engines that answer, says on stderr that restarts are unknown, and exits 0.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.engine.tiny_models import save_tiny
from tests.process_logs import free_port, wait_for_log
from tests.replica.ray_cluster import private_ray_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.requires("ray"),
]

BIN = Path(sys.executable).parent




@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str], Path]]:
    tmp = tmp_path_factory.mktemp("raynodash")
    ray_tmp, env = private_ray_env()
    port = free_port()
    log = tmp / "head.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}",
                                 "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
                                 f"--temp-dir={ray_tmp}", "--disable-usage-stats"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_log(log, r"Ray runtime started", proc, 120)
        yield f"127.0.0.1:{port}", env, tmp
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _status(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "tokenpath"), "status", "--ray", address, "--json"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_an_actor_that_cannot_load_its_model_stops_serve_with_one_clear_line(head) -> None:
    address, env, tmp = head
    missing = tmp / "no-such-model"
    out = subprocess.run([str(BIN / "tokenpath"), "serve", "--port", "0", "--ray", address, "--replicas", "1",
                          "--model", str(missing)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("tokenpath:")]
    assert lines and "failed to start" in lines[-1] and "no-such-model" in lines[-1], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert _status(address, env).stdout.strip() == ""  # nothing left behind


def test_status_without_the_state_api_lists_the_engines_that_answer(head) -> None:
    address, env, tmp = head
    model = save_tiny("llama", tmp / "tiny")
    log = tmp / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen([str(BIN / "tokenpath"), "serve", "--port", "0", "--ray", address, "--replicas", "1",
                                  "--model", str(model), "--num-kv-blocks", "64"], stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_log(log, r"listening on http://127\.0\.0\.1:\d+/v1", serve, 240)
        got = _status(address, env)
        assert got.returncode == 0, got.stderr[-2000:]
        rows = [json.loads(line) for line in got.stdout.splitlines()]
        assert [r["name"] for r in rows] == ["tiny-0"], rows
        assert rows[0]["state"] == "ALIVE" and rows[0]["restarts"] is None and rows[0]["node_ip"] == "127.0.0.1"
        assert rows[0]["model"] and rows[0]["pid"] > 0
        assert "restarts are unknown" in got.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(90) == 0, log.read_text()[-3000:]
