"""Issue 41 (item 3, names): odd strings where the API and the CLIs take a name, a path or a
priority are a 4xx naming the parameter (never a 500, never registered), and the server keeps
serving. Real `tokenpath serve` processes and the real `tokenpath keys` command.

Each case failed before `protocol/names.py`: a NUL in `lora_path` was a 500; `a\\x00b`, `../../x`
and a right-to-left override registered as adapter names; a `model` with a control character was
a 404 (or a 200, once such an adapter existed) and a 100 KB one was echoed back whole;
`x-priority: 2**64` was accepted (over the engine link it overflowed the codec in the engine
process); `--lora-modules` with a NUL path stopped start-up with a traceback; a control character
in `--served-model-name` or a tenant name was accepted."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import TOKENPATH
from tests.engine.lora_adapters import q_proj_tensors, write_adapter
from tests.reliability.nasty_bodies import CHAT_MODEL, EMBED_MODEL
from tests.server_data import seed_tokenizers

NORMAL = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
HIDDEN = 576  # SmolLM2-135M's hidden size (q_proj is 576 -> 576)

BAD_ADAPTER_NAMES = {
    "nul": "a\x00b",
    "traversal": "../../x",
    "rtl_override": "x\u202eevil",
    "slash": "org/adapter",
    "backslash": "a\\b",
    "c1_control": "\x85c1",
    "isolate": "a\u2066b",
    "escape": "a\x1b[31mred",
    "too_long": "a" * 257,
}
BAD_MODEL_NAMES = {
    "nul": "a\x00b",
    "escape": "a\x1b[2Jb",
    "rtl_override": "gpt\u202eevil",
    "newline": "smollm2\nINFO forged log line",
    "too_long": "m" * 100_000,
}


@pytest.fixture(scope="module")
def client(gateway):
    with httpx.Client(base_url=gateway.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A real adapter for the served chat model: refusals below are for the name, not the adapter."""
    return write_adapter(tmp_path_factory.mktemp("adapter") / "ok", q_proj_tensors(4, HIDDEN, HIDDEN))


def assert_refused(r: httpx.Response, param: str, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    assert len(r.content) < 2000, "the error echoes the whole value"
    return err


def assert_serving(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json=NORMAL)
    assert r.status_code == 200, r.text[:300]


def test_the_adapter_itself_loads(client, adapter):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "fine-adapter", "lora_path": str(adapter)})
    assert r.status_code == 200, r.text
    assert client.post("/v1/completions", json={"model": "fine-adapter", "prompt": "Hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("name", list(BAD_ADAPTER_NAMES.values()), ids=list(BAD_ADAPTER_NAMES))
def test_unsafe_adapter_names_are_refused(client, adapter, name):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)})
    assert_refused(r, "lora_name")
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert name not in ids
    assert_serving(client)


@pytest.mark.parametrize("suffix", ["\x00", "\x00/../etc", "\x1b[31m", "\u202e"], ids=["nul", "nul_then_more", "escape", "rtl"])
def test_control_characters_in_lora_path_are_a_400(client, adapter, suffix):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "path-case", "lora_path": str(adapter) + suffix})
    assert assert_refused(r, "lora_path")["code"] == "invalid_path"
    assert "path-case" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert_serving(client)


def test_unsafe_base_model_name_is_a_400(client, adapter):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "based", "lora_path": str(adapter),
                                                   "base_model_name": "smollm2\x00"})
    assert_refused(r, "base_model_name")


REQUESTS = {
    "chat": ("/v1/chat/completions", NORMAL),
    "completion": ("/v1/completions", {"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 2}),
    "embedding": ("/v1/embeddings", {"model": EMBED_MODEL, "input": "Hi"}),
    "tokenize": ("/tokenize", {"model": CHAT_MODEL, "prompt": "Hi"}),
}


@pytest.mark.parametrize("endpoint", list(REQUESTS))
@pytest.mark.parametrize("name", list(BAD_MODEL_NAMES.values()), ids=list(BAD_MODEL_NAMES))
def test_unsafe_model_field_is_a_400(client, endpoint, name):
    path, body = REQUESTS[endpoint]
    err = assert_refused(client.post(path, json={**body, "model": name}), "model")
    assert err["code"] == "invalid_name"
    assert_serving(client)


@pytest.mark.parametrize("name", ["a%00b", "a%1Bb", "m" * 5000], ids=["nul", "escape", "too_long"])
def test_unsafe_model_id_in_the_path_is_a_400(client, name):
    assert_refused(client.get(f"/v1/models/{name}"), "model")


def test_hf_style_model_names_keep_their_slash(client):
    """'/' is refused in adapter names only: an org/model id is a 404 here, not a name error."""
    r = client.post("/v1/chat/completions", json={**NORMAL, "model": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


@pytest.mark.parametrize("value", [str(2**64), str(-(2**64)), str(2**31), str(-(2**31) - 1)],
                         ids=["2^64", "-2^64", "2^31", "-2^31-1"])
@pytest.mark.parametrize("endpoint", ["chat", "embedding"])
def test_out_of_range_x_priority_is_a_400(client, endpoint, value):
    path, body = REQUESTS[endpoint]
    err = assert_refused(client.post(path, json=body, headers={"x-priority": value}), "x-priority")
    assert "between" in err["message"]
    assert_serving(client)


def test_x_priority_in_range_is_served(client):
    r = client.post("/v1/chat/completions", json=NORMAL, headers={"x-priority": str(2**31 - 1)})
    assert r.status_code == 200, r.text


# -- start-up and the operator's CLI: a clear error and a non-zero exit, never a traceback ----------

def _serve(tmp: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    seed_tokenizers(tmp / "data", [CHAT_MODEL])
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(tmp / "data"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([TOKENPATH, "serve", "--port", "0", "--model", CHAT_MODEL, *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_clear_failure(out: subprocess.CompletedProcess, *words: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    for word in words:
        assert word in out.stderr, out.stderr[-2000:]


def test_lora_modules_with_a_nul_in_the_path_stops_start_up_cleanly(tmp_path, adapter):
    module = json.dumps({"name": "nul-path", "path": str(adapter) + "\x00x"})  # JSON escapes the NUL
    assert "\\u0000" in module
    assert_clear_failure(_serve(tmp_path, "--lora-modules", module), "--lora-modules", "lora_path", "U+0000")


def test_lora_modules_with_an_unsafe_name_stops_start_up_cleanly(tmp_path, adapter):
    assert_clear_failure(_serve(tmp_path, "--lora-modules", f"../../x={adapter}"), "--lora-modules", "lora_name")


def test_unsafe_served_model_name_stops_start_up_cleanly(tmp_path):
    out = _serve(tmp_path, "--served-model-name", "alias\x1b[2J", timeout=120)
    assert_clear_failure(out, "--served-model-name", "U+001B")


def _keys(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TOKENPATH, "keys", "create", "--data-dir", str(tmp / "data"), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [("--tenant", "acme\x1b[2J"), ("--tenant", "acme\u202e"), ("--tenant", "a" * 300),
                                  ("--tenant", "acme", "--priority", str(2**64)),
                                  ("--tenant", "acme", "--models", "smollm2\x07")],
                         ids=["tenant_escape", "tenant_rtl", "tenant_long", "priority_2^64", "models_bell"])
def test_keys_create_refuses_unsafe_names_and_priorities(tmp_path, args):
    out = _keys(tmp_path, *args)
    assert out.returncode == 2, out.stdout + out.stderr  # argparse's usage error, no key printed
    assert "Traceback" not in out.stderr and not out.stdout.strip()


def test_keys_create_takes_an_org_style_tenant(tmp_path):
    out = _keys(tmp_path, "--tenant", "acme/research", "--priority", "3")
    assert out.returncode == 0, out.stderr
