"""Engine actors across two Ray nodes, and two gateways in front of them, all real processes:

- a Ray cluster of two nodes on loopback (`tests.replica.ray_cluster`: why not two `ray start`s is
  explained there), each node with one `engine_slot`; a deployment whose actors each need one,
  so Ray places one engine actor on each node;
- `tokenpath serve --routing` (gateway 1) creates the actors; a second `tokenpath serve` with the
  same deployment finds them by name and routes to them too; with `--redis-url` both gateways
  share one key's limits; the actors outlive the first gateway and stop with the last one;
- `tokenpath status --ray` lists both actors with their node (Ray's public state API);
- `POST /reset_prefix_cache` reaches the actors;
- with `--otlp-endpoint`, an actor's engine spans join the gateway's trace (over the engine link).

The engine is a tiny random-weight Llama with SmolLM2's tokenizer: the test spends its time on
the path, not on a model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from tests.engine.tiny_models import save_tiny
from tests.process_logs import wait_for_log
from tests.replica.ray_cluster import private_ray_env
from tests.telemetry.otlp_receiver import OtlpReceiver

from tokenpath.gateway import GatewayStore, Limits
from tokenpath.gateway.admin import create_key

pytestmark = [
    pytest.mark.slow,
    pytest.mark.requires("ray"),
]

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]




def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(30)


@dataclass
class Gateway:
    proc: subprocess.Popen
    base_url: str
    log: Path

    def client(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120)


@dataclass
class Setup:
    tmp: Path
    address: str
    env: dict[str, str]
    args: list[str]  # the serve flags of every gateway here
    admin: str  # an admin key (auth is on: the gateways share one key store)
    data_dir: Path
    redis_url: str | None
    receiver: OtlpReceiver
    gateways: list[Gateway] = field(default_factory=list)

    def start_gateway(self, name: str) -> Gateway:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([str(BIN / "tokenpath"), "serve", "--port", "0", *self.args], stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env)
        gw = Gateway(proc, "", log)
        self.gateways.append(gw)  # stopped at the end even if it never comes up
        gw.base_url = wait_for_log(log, r"listening on (http://127\.0\.0\.1:\d+/v1)", proc, 300).group(1)
        return gw

    def status(self, *flags: str) -> subprocess.CompletedProcess:
        out = subprocess.run([str(BIN / "tokenpath"), "status", "--ray", self.address, *flags], env=self.env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out

    def rows(self) -> dict[str, dict]:
        return {r["name"]: r for r in map(json.loads, self.status("--json").stdout.splitlines())}

    def key(self, tenant: str, limits: Limits | None = None, admin: bool = False) -> str:
        store = GatewayStore(self.data_dir / "gateway.sqlite3")
        try:
            return create_key(store, tenant, limits=limits, admin=admin)[0]
        finally:
            store.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("ray2")
    model = save_tiny("llama", tmp / "tiny")
    ray_tmp, env = private_ray_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    redis = None
    if importlib.util.find_spec("redis") is not None and shutil.which("redis-server"):
        sys.path.insert(0, str(ROOT / "tests" / "gateway"))
        from redis_fixtures import PrivateRedis

        redis = PrivateRedis(tmp)
    node = json.dumps({"num_cpus": 1, "resources": {"engine_slot": 1}})
    log = tmp / "cluster.log"
    with log.open("wb") as out:
        cluster = subprocess.Popen([sys.executable, "-m", "tests.replica.ray_cluster", "--node", node, "--node", node,
                                    "--temp-dir", ray_tmp], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    data_dir = tmp / "data"
    receiver = OtlpReceiver().start()
    s: Setup | None = None
    codes: list[int] = []
    try:
        address = wait_for_log(log, r"RAY_ADDRESS (127\.0\.0\.1:\d+)", cluster, 180).group(1)
        routes = tmp / "routes.yaml"
        routes.write_text(
            f"deployments:\n  - name: tiny\n    model: '{model}'\n    policy: round_robin\n"
            "    pool: {eject_max_s: 5.0}\n"
            f"    replicas:\n      - ray: {{num_replicas: 2, address: '{address}', num_cpus: 0.5,\n"
            "               resources: {engine_slot: 1}, engine: {num_kv_blocks: 256, max_num_seqs: 8}}\n")
        args = ["--model", str(model), "--routing", str(routes), "--data-dir", str(data_dir),
                "--otlp-endpoint", receiver.url]
        if redis is not None:
            args += ["--redis-url", redis.start()]
        s = Setup(tmp, address, env, args, "", data_dir, redis.url if redis else None, receiver)
        s.admin = s.key("ops", admin=True)
        s.start_gateway("gw1")
        yield s
    finally:
        if s is not None:
            codes = [_stop(g.proc) for g in s.gateways if g.proc.poll() is None]
        _stop(cluster)
        receiver.stop()
        if redis is not None:
            redis.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert all(c == 0 for c in codes), [g.log.read_text()[-2000:] for g in s.gateways]


async def _ask(client: openai.AsyncOpenAI, text: str) -> openai.types.chat.ChatCompletion:
    return await client.chat.completions.create(model="tiny", max_tokens=8, extra_body={"ignore_eos": True},
                                                messages=[{"role": "user", "content": text}])


async def test_one_engine_actor_on_each_node_and_both_serve(setup: Setup) -> None:
    rows = setup.rows()
    assert sorted(rows) == ["tiny-0", "tiny-1"], rows
    assert {r["state"] for r in rows.values()} == {"ALIVE"} and {r["restarts"] for r in rows.values()} == {0}
    nodes = {r["node_id"] for r in rows.values()}
    assert len(nodes) == 2 and "" not in nodes, rows  # the engine_slot resource put one on each node
    table = setup.status().stdout
    for node_id in nodes:
        assert node_id[:8] in table, table
    client = setup.gateways[0].client(setup.admin)
    for i in range(6):  # round robin: three each
        r = await _ask(client, f"request {i}: {'a story ' * i}")
        assert r.usage.completion_tokens == 8
    await client.close()
    served = {name: r["served"] for name, r in setup.rows().items()}
    assert all(n and n > 0 for n in served.values()), served


async def test_an_actors_engine_spans_join_the_gateways_trace(setup: Setup) -> None:
    client = setup.gateways[0].client(setup.admin)
    stream = await client.chat.completions.create(model="tiny", max_tokens=8, stream=True,
                                                  extra_body={"ignore_eos": True},
                                                  messages=[{"role": "user", "content": "traced over Ray"}])
    async for _ in stream:
        pass
    await client.close()
    rid = stream.response.headers["x-request-id"]
    roots = setup.receiver.wait_for(lambda s: s["service"] == "tokenpath" and s["kind"] == "SPAN_KIND_SERVER"
                                    and s["attributes"].get("gen_ai.response.id") == rid, timeout=30)
    assert len(roots) == 1, roots
    trace_id = roots[0]["trace_id"]
    engine = setup.receiver.wait_for(lambda s: s["trace_id"] == trace_id and s["service"] == "tokenpath-engine"
                                     and s["name"] == "engine.decode", timeout=30)
    assert engine, {s["service"] for s in setup.receiver.spans}
    spans = setup.receiver.trace(trace_id)
    dispatch = next(s for s in spans if s["name"].startswith("dispatch ") and s["service"] == "tokenpath")
    engine_root = next(s for s in spans if s["service"] == "tokenpath-engine" and s["kind"] == "SPAN_KIND_SERVER")
    assert engine_root["parent_id"] == dispatch["span_id"]
    assert dispatch["attributes"]["tokenpath.replica"] in ("tiny-0", "tiny-1")
    # Each engine span once: the actor exported them, so the gateway built none under dispatch.
    engine_spans = [s for s in setup.receiver.trace(trace_id) if s["name"].startswith("engine.")]
    assert sorted(s["name"] for s in engine_spans) == ["engine.decode", "engine.prefill", "engine.queue"]
    assert engine_root["attributes"]["gen_ai.operation.name"] == "chat"


async def test_reset_prefix_cache_reaches_the_actors(setup: Setup) -> None:
    client = setup.gateways[0].client(setup.admin)
    prompt = "a long shared instruction that fills several KV blocks. " * 12

    async def cached() -> int:
        r = await _ask(client, prompt)
        return r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0

    await cached(), await cached()  # round robin: once on each engine
    assert await cached() >= 64 and await cached() >= 64  # both engines have its blocks now
    resp = httpx.post(setup.gateways[0].base_url.removesuffix("/v1") + "/reset_prefix_cache",
                      headers={"Authorization": f"Bearer {setup.admin}"}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert sorted(resp.json()["replicas"]) == ["tiny-0", "tiny-1"]
    assert await cached() == 0 and await cached() == 0  # forgotten by both: computed again from scratch
    await client.close()


async def test_a_second_gateway_attaches_to_the_same_actors(setup: Setup) -> None:
    before = setup.rows()
    gw1 = setup.gateways[0]
    gw2 = setup.start_gateway("gw2")
    assert "exists in namespace 'tokenpath': routing to it" in gw2.log.read_text()
    deadline = time.monotonic() + 30
    while {r["gateways"] for r in setup.rows().values()} != {2}:  # both poll both actors
        assert time.monotonic() < deadline, setup.rows()
        await asyncio.sleep(0.5)
    after = setup.rows()
    assert sorted(after) == sorted(before) and all(after[n]["pid"] == before[n]["pid"] for n in before), after

    # Both gateways route to both actors.
    clients = [gw1.client(setup.admin), gw2.client(setup.admin)]
    served = {n: r["served"] for n, r in after.items()}
    for i in range(8):
        assert (await _ask(clients[i % 2], f"second gateway {i}")).usage.completion_tokens == 8
    assert all(r["served"] > served[n] for n, r in setup.rows().items()), setup.rows()

    if setup.redis_url is not None:  # one key's limit holds across both gateways (Redis)
        limited = setup.key("rpm-tenant", Limits(rpm=4))
        limited_clients = [gw1.client(limited), gw2.client(limited)]
        outcomes = []
        for i in range(8):
            try:
                await _ask(limited_clients[i % 2], f"limited {i}")
                outcomes.append("ok")
            except openai.RateLimitError:
                outcomes.append("429")
        assert outcomes.count("ok") == 4 and outcomes.count("429") == 4, outcomes
        for c in limited_clients:
            await c.close()

    # The first gateway leaves: the actors stay, for the second one.
    assert _stop(gw1.proc) == 0
    assert "stays up: 1 other gateway(s) route to it" in gw1.log.read_text()
    assert (await _ask(clients[1], "after gw1 left")).usage.completion_tokens == 8
    assert {r["state"] for r in setup.rows().values()} == {"ALIVE"}
    # The last one out stops them.
    assert _stop(gw2.proc) == 0
    deadline = time.monotonic() + 30
    while setup.rows():
        assert time.monotonic() < deadline, setup.rows()
        await asyncio.sleep(0.5)
    for c in clients:
        await c.close()
