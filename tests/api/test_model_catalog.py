"""`tokenpath serve --models-dir DIR`: models loaded on their first request, evicted under
`--max-loaded-models`, unloaded when idle, listed with their state, and every bad input of
issue 38 a clear error while the other models keep serving. One real server (SmolLM2 GGUF in the
catalog dir, and the packaged MiniLM embeddings as the second model), loads counted from
/v1/models."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.api.conftest import EMBED_MODEL, TOKENPATH, running_server

from tokenpath.engine.loader import resolve_model_path

SMOL = "smol"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def models_dir(root: Path) -> Path:
    d = root / "models"
    d.mkdir()
    os.symlink(resolve_model_path("smollm2-135m-instruct"), d / f"{SMOL}.gguf")
    (d / "junk.gguf").write_text("this is not a model\n")
    (d / "README.txt").write_text("not a model, and not a .gguf: ignored\n")
    return d


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("catalog")
    args = ("--models-dir", str(models_dir(tmp)), "--max-loaded-models", "1", "--keep-alive", "-1",
            "--kv-cache-memory", "32MiB", "--max-model-len", "512")
    with running_server(tmp, *args) as srv, httpx.Client(base_url=srv.url, timeout=300) as client:
        client.server = srv  # type: ignore[attr-defined]
        yield client


def cards(http: httpx.Client) -> dict[str, dict]:
    return {m["id"]: m for m in http.get("/v1/models").json()["data"]}


def chat(http: httpx.Client, model: str, **extra: object) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, **CHAT, **extra})


def test_the_catalog_lists_every_entry_with_its_state(http):
    listed = cards(http)
    assert {"smollm2-135m-instruct", "gemma-3-270m", EMBED_MODEL, SMOL, "junk"} <= set(listed)
    assert "README" not in listed
    assert listed[SMOL]["state"] == "unloaded" and listed[SMOL]["object"] == "model"
    assert listed["junk"]["state"] == "failed" and "not a GGUF file" in listed["junk"]["failure"]
    assert listed[EMBED_MODEL]["task"] == "embedding"


def test_first_requests_share_one_load_and_see_a_model_load_stage(http):
    http.post(f"/v1/models/{SMOL}/unload")
    before = cards(http)[SMOL]["loads"]
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(chat(http, SMOL))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in results] == [200] * 3, [r.text for r in results]
    assert all("model_load;dur=" in r.headers["server-timing"] for r in results)
    card = cards(http)[SMOL]
    assert card["loads"] == before + 1 and card["state"] == "loaded" and card["memory_bytes"] > 0
    warm = chat(http, SMOL)
    assert warm.status_code == 200 and "model_load" not in warm.headers["server-timing"]
    assert 'stage="model_load"' in http.get("/metrics").text


def test_unknown_ids_and_paths_are_404s_that_load_nothing(http):
    for model in ("no-such-model", str(resolve_model_path("smollm2-135m-instruct"))):
        r = chat(http, model)
        assert r.status_code == 404 and f"'{model}'" in r.json()["error"]["message"], r.text
    r = http.post("/v1/models/no-such-model/load")
    assert r.status_code == 404 and "not in the model catalog" in r.json()["error"]["message"]


def test_a_file_that_is_not_a_model_is_a_503_naming_it_and_the_rest_serve(http):
    r = chat(http, "junk")
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    err = r.json()["error"]
    assert err["code"] == "model_load_failed" and "'junk'" in err["message"] and "GGUF" in err["message"]
    assert chat(http, SMOL).status_code == 200


def test_a_second_model_evicts_the_idle_one_under_max_loaded_models(http):
    assert chat(http, SMOL).status_code == 200
    r = http.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": "hello", "keep_alive": "5m"})
    assert r.status_code == 200, r.text
    listed = cards(http)
    assert listed[EMBED_MODEL]["state"] == "loaded" and listed[SMOL]["state"] == "unloaded"
    r = chat(http, SMOL)  # and back: the embedding model goes
    assert r.status_code == 200 and "model_load;dur=" in r.headers["server-timing"]
    assert cards(http)[EMBED_MODEL]["state"] == "unloaded"
    line = http.server.request_log(r.headers["x-request-id"])  # type: ignore[attr-defined]
    assert "model_load" in {c["kind"] for c in line["causes"]}


def test_unloading_a_model_with_a_request_in_flight_is_a_409_unless_forced(http):
    assert http.post(f"/v1/models/{SMOL}/load").json()["state"] == "loaded"
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Count to one hundred."}], "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is generating
        r = http.post(f"/v1/models/{SMOL}/unload")
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy", r.text
        r = http.post(f"/v1/models/{SMOL}/unload", params={"force": "true"})
        assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text
        rest = "\n".join(lines)  # the stream ends, it does not hang
    assert '"finish_reason":"abort"' in rest.replace(" ", ""), rest[-2000:]
    assert cards(http)[SMOL]["state"] == "unloaded"
    assert chat(http, SMOL).status_code == 200  # and it loads again on demand


def test_a_requests_keep_alive_unloads_the_idle_model(http):
    r = chat(http, SMOL, keep_alive="1s")
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while cards(http)[SMOL]["state"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cards(http)[SMOL]["state"] == "unloaded"
    bad = chat(http, SMOL, keep_alive="soon")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive", bad.text


def test_vllms_sleep_mode_frees_the_loaded_models_and_wake_up_loads_them(http):
    """vLLM's /sleep, /wake_up and /is_sleeping over the catalog: sleep unloads what is loaded
    (refused while a model serves, unless forced), wake_up loads the same models, and a request to
    a sleeping model wakes it too."""
    assert http.post(f"/v1/models/{SMOL}/load").json()["state"] == "loaded"
    assert http.get("/is_sleeping").json() == {"is_sleeping": False, "models": []}
    body = {"model": SMOL, "messages": [{"role": "user", "content": "Count to one hundred."}], "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is generating
        r = http.post("/sleep")
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy", r.text
        assert cards(http)[SMOL]["state"] == "loaded"  # a refused sleep puts nothing to sleep
        r = http.post("/sleep", params={"force": "true", "level": 2})
        assert r.status_code == 200 and r.json()["sleeping"] == [SMOL], r.text
        rest = "\n".join(lines)
    assert '"finish_reason":"abort"' in rest.replace(" ", ""), rest[-2000:]
    assert cards(http)[SMOL]["state"] == "unloaded"
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "models": [SMOL]}
    for bad, params in (("/sleep", {"level": 3}), ("/wake_up", {"tags": "gpu"})):
        r = http.post(bad, params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(params)), r.text
    r = http.post("/wake_up", params={"tags": "weights"})
    assert r.status_code == 200 and r.json()["woken"] == [SMOL], r.text
    assert cards(http)[SMOL]["state"] == "loaded"
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
    assert http.post("/sleep").json()["sleeping"] == [SMOL]
    assert chat(http, SMOL).status_code == 200  # a request wakes it as well
    assert http.get("/is_sleeping").json()["is_sleeping"] is False
    assert http.post("/wake_up").json()["woken"] == []


def test_sleep_without_a_catalog_is_a_404_and_changes_nothing(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/sleep")
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_model_catalog", r.text
        assert client.get("/is_sleeping").json() == {"is_sleeping": False, "models": []}
        assert chat(client, "smollm2-135m-instruct").status_code == 200


def test_two_entries_with_one_id_stop_the_start(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    os.symlink(resolve_model_path("smollm2-135m-instruct"), d / "smollm2-135m-instruct.gguf")
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(tmp_path / "data")}
    done = subprocess.run([TOKENPATH, "serve", "--port", "0", "--models-dir", str(d)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "two catalog entries have the id 'smollm2-135m-instruct'" in done.stderr


def test_key_acls_apply_to_catalog_ids_and_load_unload_need_an_admin_key(tmp_path, launch_server):
    data = tmp_path / "data"
    out = subprocess.run([TOKENPATH, "keys", "create", "--data-dir", str(data), "--tenant", "acme",
                          "--models", EMBED_MODEL], capture_output=True, text=True, check=True)
    tenant = {"Authorization": f"Bearer {out.stdout.split()[0]}"}
    admin = {"Authorization": "Bearer sk-catalog-admin"}
    empty = tmp_path / "models"
    empty.mkdir()
    srv = launch_server(tmp_path, "--models-dir", str(empty), "--api-key", "sk-catalog-admin")
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            listed = http.get("/v1/models", headers=tenant).json()["data"]
            assert [(m["id"], m["state"]) for m in listed] == [(EMBED_MODEL, "unloaded")]
            r = http.post("/v1/chat/completions", headers=tenant, json={"model": "smollm2-135m-instruct", **CHAT})
            assert r.status_code == 403, r.text  # refused by the key before any load starts
            assert cards_as(http, admin)["smollm2-135m-instruct"]["loads"] == 0
            for path in (f"/v1/models/{EMBED_MODEL}/load", "/sleep", "/wake_up"):
                r = http.post(path, headers=tenant)
                assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
            assert http.post(f"/v1/models/{EMBED_MODEL}/load", headers=admin).json()["state"] == "loaded"
            r = http.post("/v1/embeddings", headers=tenant, json={"model": EMBED_MODEL, "input": "hi"})
            assert r.status_code == 200 and "model_load" not in r.headers["server-timing"], r.text
    finally:
        assert srv.stop() == 0, srv.output()[-3000:]


def cards_as(http: httpx.Client, headers: dict[str, str]) -> dict[str, dict]:
    return {m["id"]: m for m in http.get("/v1/models", headers=headers).json()["data"]}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_an_unload_hands_the_engines_memory_back_at_once(tmp_path):
    """Issue 38's target: an unloaded model's memory goes back (RSS within 10% of before the load).
    The first unload of a server freed nothing: the catalog still held the deployment when its
    closer collected, so the engine's cycles stayed until a later load's collection (measured:
    271 MiB before, 413 loaded, 412 after the unload)."""
    args = ("--models-dir", str(models_dir(tmp_path)), "--kv-cache-memory", "32MiB", "--max-model-len", "512")
    with running_server(tmp_path, *args) as srv, httpx.Client(base_url=srv.url, timeout=300) as http:
        before = _rss_mib(srv.proc.pid)
        assert http.post(f"/v1/models/{SMOL}/load").status_code == 200
        assert chat(http, SMOL).status_code == 200
        loaded = _rss_mib(srv.proc.pid)
        assert http.post(f"/v1/models/{SMOL}/unload").status_code == 200
        after = _rss_mib(srv.proc.pid)  # (no wait: the unload's reply comes after its collection)
        assert loaded - before > 60, (before, loaded)  # the engine is visible in RSS: a test of something
        assert after < before * 1.10, (before, loaded, after)
