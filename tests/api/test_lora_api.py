"""LoRA adapters through `tokenpath serve`: vLLM's `--lora-modules` (both forms), `/v1/models`
with `parent`, requests naming an adapter (in-process and over two engine processes), dynamic
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` (admin key when auth is on), every bad
adapter a clear 400 that changes nothing served, an unknown adapter a 404, an unload while a
request uses the adapter lets it finish, and the `lora_requests_info` gauge."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.engine.lora_adapters import make_peft_adapter, q_proj_tensors, write_adapter
from tests.engine.tiny_models import cached_tiny

from tokenpath import LLM, SamplingParams
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.store import GatewayStore, resolve_store_location
from tokenpath.protocol.lora import LoraRef

PROMPTS = [[1, 504, 2240, 314, 253, 1345, 30], [1, 2135, 15, 1345, 416, 11, 8701, 2240, 2098, 253, 31]]
TOKENS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = cached_tiny("llama")
    root = tmp_path_factory.mktemp("adapters")
    a = make_peft_adapter(base, root / "a", r=8, seed=11)
    b = make_peft_adapter(base, root / "b", r=4, seed=12, targets=["q_proj", "v_proj", "down_proj"])
    c = make_peft_adapter(base, root / "c", r=8, seed=13, targets=["o_proj", "up_proj"])
    llm = LLM(str(base), dtype="float32", quantization="none", num_kv_blocks=128)
    p = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    want = {name: [o.outputs[0].text for o in llm.generate(PROMPTS, p, lora=None if d is None else LoraRef(name, str(d)))]
            for name, d in (("a", a), ("b", b), ("c", c), ("base", None))}
    return base, {"a": a, "b": b, "c": c}, want


def _complete(client: httpx.Client, model: str, prompt: list[int], **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": TOKENS,
                                                "temperature": 0, "ignore_eos": True, **extra})


@pytest.fixture(scope="module")
def served(setup, server_factory):
    base, ad, _ = setup
    srv = server_factory("--model", str(base), "--quantization", "none", "--dtype", "float32",
                         "--num-kv-blocks", "128", "--max-lora-rank", "8",
                         "--lora-modules", f"a={ad['a']}",
                         "--lora-modules", json.dumps({"name": "b", "path": str(ad["b"]), "base_model_name": "hf"}))
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client


def test_models_lists_adapters_with_their_parent(served, setup):
    cards = {m["id"]: m for m in served.get("/v1/models").json()["data"]}
    assert cards["a"]["parent"] == "hf" and cards["b"]["parent"] == "hf"
    assert cards["a"]["root"] == str(setup[1]["a"])
    assert cards["hf"]["parent"] is None  # (vLLM sets it only for adapters)
    assert served.get("/v1/models/b").json()["parent"] == "hf"


def test_requests_name_an_adapter(served, setup):
    want = setup[2]
    with ThreadPoolExecutor(6) as pool:  # adapters and the base model mixed in the engine's steps
        jobs = {(m, i): pool.submit(_complete, served, m, p) for m in ("a", "b", "hf") for i, p in enumerate(PROMPTS)}
    for (model, i), job in jobs.items():
        r = job.result()
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == want["base" if model == "hf" else model][i], (model, i)
    assert want["a"] != want["base"]


def test_unknown_adapter_is_a_404(served):
    r = _complete(served, "no-such-adapter", PROMPTS[0])
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


def test_load_use_unload(served, setup):
    _, ad, want = setup
    r = served.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(ad["c"])})
    assert r.status_code == 200, r.text
    assert "c" in {m["id"] for m in served.get("/v1/models").json()["data"]}
    assert _complete(served, "c", PROMPTS[1]).json()["choices"][0]["text"] == want["c"][1]
    again = served.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(ad["c"])})
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_already_loaded"
    assert served.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    assert _complete(served, "c", PROMPTS[1]).status_code == 404
    gone = served.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"


def test_unload_while_in_use_lets_the_request_finish(served):
    body = {"model": "a", "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    served.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": served.get("/v1/models/a").json()["root"]})
    body["model"] = "a2"
    finish = None
    with served.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "error" not in first
        assert served.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
        for line in lines:
            if line.startswith("data: {"):
                reason = json.loads(line[6:])["choices"][0].get("finish_reason")
                finish = reason or finish
    assert finish == "length"


def test_bad_adapters_are_400s_and_change_nothing(served, setup, tmp_path):
    before = served.get("/v1/models").json()
    base_dir = setup[0]
    (tmp_path / "empty").mkdir()
    cases = {
        "lora_path_not_found": str(tmp_path / "nowhere"),
        "lora_not_peft": str(tmp_path / "empty"),
        "lora_rank_too_large": str(write_adapter(tmp_path / "big", q_proj_tensors(16, 64, 64), {"r": 16})),
        "lora_unsupported_modules": str(write_adapter(tmp_path / "gpt2", q_proj_tensors(4, 64, 64),
                                                      {"target_modules": ["c_attn"]})),
        "lora_base_mismatch": str(write_adapter(tmp_path / "wide", q_proj_tensors(4, 128, 128))),
    }
    for code, path in cases.items():
        r = served.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{code}", "lora_path": path})
        assert r.status_code == 400, (code, r.text)
        assert r.json()["error"]["code"] == code, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    shadow = served.post("/v1/load_lora_adapter", json={"lora_name": "hf", "lora_path": str(setup[1]["c"])})
    assert shadow.status_code == 400 and "already the name of a model" in shadow.json()["error"]["message"]
    no_base = served.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(setup[1]["c"]),
                                                         "base_model_name": "nope"})
    assert no_base.status_code == 404
    assert served.post("/v1/load_lora_adapter", json={"lora_name": "z"}).status_code == 400
    assert served.get("/v1/models").json() == before
    assert served.post("/v1/completions", json={"model": "a", "prompt": PROMPTS[0], "max_tokens": 2}).status_code == 200
    del base_dir


def _lora_info(text: str) -> dict[str, str]:
    m = re.search(r'^tokenpath:lora_requests_info\{([^}]*)\} \S+$', text, re.M)
    assert m, [line for line in text.splitlines() if "lora_requests" in line]
    return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))


def test_lora_requests_info_gauge(served):
    labels = _lora_info(served.get("/metrics").text)
    assert labels["model_name"] == "hf" and labels["max_lora"] == "4"
    assert {"waiting_lora_adapters", "running_lora_adapters"} <= set(labels)


def test_two_engine_processes_with_auth(setup, server_factory):
    """`--replicas 2`: adapters travel with each request to the engine processes; loading needs an
    admin key; each process reports its resident adapters (the router's affinity)."""
    base, ad, want = setup
    srv = server_factory("--model", str(base), "--quantization", "none", "--dtype", "float32", "--replicas", "2",
                         "--num-kv-blocks", "128", "--api-key", "sekret", "--lora-modules", f"a={ad['a']}")
    auth = {"Authorization": "Bearer sekret"}
    with httpx.Client(base_url=srv.url, timeout=120, headers=auth) as client:
        with ThreadPoolExecutor(6) as pool:
            jobs = {(m, i, k): pool.submit(_complete, client, m, p) for m in ("a", "hf")
                    for i, p in enumerate(PROMPTS) for k in range(2)}
        for (model, i, _), job in jobs.items():
            assert job.result().json()["choices"][0]["text"] == want["base" if model == "hf" else model][i]
        body = {"lora_name": "b", "lora_path": str(ad["b"])}
        assert httpx.post(srv.url + "/v1/load_lora_adapter", json=body).status_code == 401
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert [_complete(client, "b", p).json()["choices"][0]["text"] for p in PROMPTS] == want["b"]
        assert _lora_info(client.get("/metrics").text)["max_lora"] == "4"


def test_tenant_keys_see_adapter_names_not_server_paths(setup, server_factory):
    """/v1/models shows an adapter's path (`root`, as vLLM) only to an operator: a tenant's key with
    no model list sees every adapter, by name only (issue 41: it saw each absolute path)."""
    base, ad, _ = setup
    srv = server_factory("--model", str(base), "--quantization", "none", "--dtype", "float32",
                         "--num-kv-blocks", "64", "--api-key", "sekret", "--lora-modules", f"a={ad['a']}")
    store = GatewayStore(resolve_store_location(srv.log.parent / "data"))
    try:
        tenant_key = create_key(store, "acme")[0]
    finally:
        store.close()
    as_tenant = {"Authorization": f"Bearer {tenant_key}"}
    listed = httpx.get(srv.url + "/v1/models", headers=as_tenant)
    assert listed.status_code == 200, listed.text
    cards = {m["id"]: m for m in listed.json()["data"]}
    assert (cards["a"]["root"], cards["a"]["parent"]) == ("a", "hf"), cards["a"]
    one = httpx.get(srv.url + "/v1/models/a", headers=as_tenant).json()
    assert one["root"] == "a", one
    for text in (listed.text, json.dumps(one)):
        assert str(ad["a"]) not in text and str(ad["a"].parent) not in text, text
    admin = httpx.get(srv.url + "/v1/models/a", headers={"Authorization": "Bearer sekret"}).json()
    assert admin["root"] == str(ad["a"])  # the operator still sees where it is loaded from
