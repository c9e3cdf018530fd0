"""SIGTERM drains: no new connections, in-flight requests finish or, past --shutdown-timeout, end
with finish_reason `abort`; the process exits 0. And no open server on a public address by accident."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

CHAT = "smollm2-135m-instruct"


def test_sigterm_finishes_short_requests_and_aborts_long_ones(server_factory):
    srv = server_factory("--model", CHAT, "--shutdown-timeout", "4", "--max-model-len", "1024")
    models = httpx.get(srv.base_url + "/models", timeout=30).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(CHAT, 1024)]  # engine flags reach the engine
    events: list[dict] = []
    short: dict = {}
    got_chunks = threading.Event()

    def stream_long() -> None:
        body = {"model": CHAT, "prompt": "Tell a long story.", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=120) as client, client.stream("POST", srv.base_url + "/completions",
                                                                json=body) as resp:
            if resp.status_code != 200:
                events.append({"status": resp.status_code, "body": resp.read().decode()})
                got_chunks.set()
                return
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]) if line != "data: [DONE]" else {"done": True})
                    if len(events) == 2:
                        got_chunks.set()

    long_thread = threading.Thread(target=stream_long)
    long_thread.start()
    assert got_chunks.wait(120)
    assert "status" not in events[0], events

    def short_request() -> None:
        with httpx.Client(timeout=120) as client:
            r = client.post(srv.base_url + "/completions", json={"model": CHAT, "prompt": "Hi", "max_tokens": 2})
            short.update(status=r.status_code, body=r.json())

    short_thread = threading.Thread(target=short_request)
    short_thread.start()
    short_thread.join(timeout=0.3)
    signalled = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    long_thread.join(timeout=120)
    short_thread.join(timeout=120)
    assert srv.proc.wait(timeout=60) == 0, srv.output()[-3000:]
    assert time.monotonic() - signalled < 4 + 2, "shutdown must fit in --shutdown-timeout plus 2 s"

    assert short["status"] == 200 and short["body"]["choices"][0]["finish_reason"] == "length"
    assert events[-1] == {"done": True}
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "abort"
    assert "total" in final["tokenpath"]["timing"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)


def test_refuses_public_host_without_keys(tmp_path: Path):
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(tmp_path)}
    tokenpath = str(Path(sys.executable).parent / "tokenpath")
    proc = subprocess.run([tokenpath, "serve", "--host", "0.0.0.0", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--insecure" in proc.stderr


def test_invalid_config_file_is_a_clear_error(tmp_path: Path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("caps:\n  max_n: -3\n")
    tokenpath = str(Path(sys.executable).parent / "tokenpath")
    proc = subprocess.run([tokenpath, "serve", "--config", str(cfg)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TOKENPATH_DATA_DIR": str(tmp_path)})
    assert proc.returncode == 2 and "max_n" in proc.stderr
