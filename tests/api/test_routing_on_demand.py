"""A routing file's `load: on_demand` deployment (issue 38 item 1, and item 5's "an unloaded
model's engine processes do not exist"): served through the catalog, with a real engine process
spawned by its first request and stopped by its unload. One real server: the SmolLM2 GGUF as a
`local: 1` deployment loaded on demand, beside the packaged embedding model."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx
import pytest
from tests.api.conftest import running_server

MODEL = "smol-on-demand"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("on_demand")
    routes = tmp / "routing.yaml"
    routes.write_text(f"deployments:\n  - name: {MODEL}\n    model: smollm2-135m-instruct\n    load: on_demand\n"
                      "    replicas:\n      - local: 1\n        engine: {kv_cache_memory: 32MiB, max_model_len: 512}\n")
    with running_server(tmp, "--routing", str(routes)) as srv, \
            httpx.Client(base_url=srv.url, timeout=300) as client:
        yield client, tmp / "data" / "logs" / "engines"


def card(http: httpx.Client) -> dict:
    return next(m for m in http.get("/v1/models").json()["data"] if m["id"] == MODEL)


def engine_pids(logs: Path) -> list[int]:
    """Every engine process the server spawned, from its engine logs' `started (pid N)` lines."""
    text = "".join(p.read_text(errors="replace") for p in logs.glob("*.log")) if logs.is_dir() else ""
    return [int(p) for p in re.findall(r"started \(pid (\d+)\)", text)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_listed_unloaded_with_no_engine_process_until_its_first_request(served):
    http, logs = served
    assert card(http)["state"] == "unloaded"
    assert engine_pids(logs) == []
    r = http.post("/v1/chat/completions", json={"model": MODEL, **CHAT})
    assert r.status_code == 200, r.text
    assert "model_load;dur=" in r.headers["server-timing"]
    loaded = card(http)
    assert loaded["state"] == "loaded" and loaded["memory_bytes"] > 0
    pids = engine_pids(logs)
    assert len(pids) == 1 and alive(pids[0])
    warm = http.post("/v1/chat/completions", json={"model": MODEL, **CHAT})
    assert warm.status_code == 200 and "model_load" not in warm.headers["server-timing"]


def test_unloading_stops_its_engine_process_and_the_next_request_loads_it_again(served):
    http, logs = served
    assert http.post(f"/v1/models/{MODEL}/load").json()["state"] == "loaded"
    pid = engine_pids(logs)[-1]
    r = http.post(f"/v1/models/{MODEL}/unload")
    assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid)
    r = http.post("/v1/chat/completions", json={"model": MODEL, **CHAT})
    assert r.status_code == 200 and "model_load;dur=" in r.headers["server-timing"], r.text
    assert engine_pids(logs)[-1] != pid and card(http)["loads"] >= 2
