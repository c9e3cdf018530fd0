"""Two real `tokenpath serve` gateways (separate processes, different ports) share one real Redis
for their limits and one SQLite store for keys, in front of the same replica, driven by the real
`openai` client. The replica is a simulated one behind a real HTTP server (what the gateways see
is an OpenAI-compatible URL), so the test spends no CPU on a model.

The Redis server is a private one (scripts/redis.sh in a temporary dir) so that it can be stopped
and started again on the same port to show the fail-closed 503 and the recovery.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import uvicorn
from redis_fixtures import PrivateRedis, require_redis
from tests.simulated_replica import SimulatedConfig, SimulatedReplica

from tokenpath.api.app import create_app
from tokenpath.config import DEFAULT_CHAT_MODEL
from tokenpath.gateway import GatewayStore, Limits
from tokenpath.gateway.admin import create_key
from tokenpath.routing.models import Deployment, ModelRouter

pytestmark = pytest.mark.slow  # two gateway processes: ~20-40 s on a shared 2-core box

TOKENPATH = str(Path(sys.executable).parent / "tokenpath")
MAX_TOKENS = 40


class ReplicaServer:
    """A simulated replica behind a real loopback uvicorn server (in a thread), with the chat model's
    tokenizer so that the token ids the gateways send are in its vocabulary."""

    def __init__(self) -> None:
        from tokenpath.server.routing_config import load_tokenizer

        # 40 tokens take 2 s: every request of a burst is admitted or refused before any finishes.
        replica = SimulatedReplica("sim", SimulatedConfig(max_num_seqs=64, token_interval_s=0.05))
        dep = Deployment(name="sim", task="completion", replicas=[replica],
                         tokenizer=load_tokenizer(DEFAULT_CHAT_MODEL), max_model_len=2048)
        self.server = uvicorn.Server(uvicorn.Config(create_app(ModelRouter([dep])), host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "replica server did not start"
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@dataclass
class GatewayProc:
    proc: subprocess.Popen
    port: int
    log: Path

    def client(self, secret: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=secret, max_retries=0,
                                  timeout=60)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def start_gateway(tmp: Path, name: str, *args: str) -> GatewayProc:
    log = tmp / f"{name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([TOKENPATH, "serve", "--port", "0", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            return GatewayProc(proc, int(m.group(1)), log)
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"gateway did not start:\n{log.read_text()}")


@dataclass
class Cluster:
    redis: PrivateRedis
    data_dir: Path
    gateways: list[GatewayProc]

    def key(self, tenant: str, limits: Limits) -> tuple[str, str]:
        store = GatewayStore(self.data_dir / "gateway.sqlite3")
        try:
            secret, record = create_key(store, tenant, limits=limits)
        finally:
            store.close()
        return secret, record.prefix


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    require_redis(request.config)
    tmp = tmp_path_factory.mktemp("shared-limits")
    redis = PrivateRedis(tmp)
    url = redis.start()
    replica = ReplicaServer()
    gateways: list[GatewayProc] = []
    try:
        routes = tmp / "routes.yaml"
        routes.write_text(f"deployments:\n  - name: {DEFAULT_CHAT_MODEL}\n    replicas:\n"
                          f"      - url: {replica.start()}\n        model: sim\n        max_num_seqs: 64\n")
        data = tmp / "data"
        for name in ("gw1", "gw2"):  # one after the other: the first builds the tokenizer cache
            gateways.append(start_gateway(tmp, name, "--model", DEFAULT_CHAT_MODEL, "--routing", str(routes),
                                          "--data-dir", str(data), "--redis-url", url))
        yield Cluster(redis, data, gateways)
    finally:
        codes = [g.stop() for g in gateways]
        replica.stop()
        redis.stop()
    assert codes == [0] * len(gateways), [g.output()[-2000:] for g in gateways]


async def _chat(client: openai.AsyncOpenAI) -> tuple[str, int, int]:
    """('ok', tokens reserved, tokens used) or (error code, 0, 0). A request reserves its prompt plus
    max_tokens; its use is what the gateway counted (the simulated replica streams text, which the
    gateway re-tokenizes, so a completion can count more tokens than it reserved)."""
    try:
        r = await client.chat.completions.create(model=DEFAULT_CHAT_MODEL, max_tokens=MAX_TOKENS,
                                                 messages=[{"role": "user", "content": "Say hi."}])
        return "ok", r.usage.prompt_tokens + MAX_TOKENS, r.usage.total_tokens
    except openai.APIStatusError as exc:
        return f"{exc.status_code}:{exc.body.get('code') if isinstance(exc.body, dict) else exc.body}", 0, 0


async def _burst(cluster: Cluster, secret: str, n: int) -> list[tuple[int, str, int, int]]:
    clients = [g.client(secret) for g in cluster.gateways]
    try:
        results = await asyncio.gather(*(_chat(clients[i % 2]) for i in range(n)))
    finally:
        for c in clients:
            await c.close()
    return [(i % 2, *result) for i, result in enumerate(results)]


async def test_tpm_holds_exactly_across_two_gateways(cluster: Cluster) -> None:
    secret, prefix = cluster.key("tpm-tenant", Limits(tpm=1000))
    results = await _burst(cluster, secret, 50)
    reserved = [r for _, outcome, r, _ in results if outcome == "ok"]
    refused = [outcome for _, outcome, _, _ in results if outcome != "ok"]
    assert sum(reserved) <= 1000, f"{len(reserved)} requests admitted {sum(reserved)} tokens"
    assert sum(reserved) > 1000 - max(reserved), "exact: a refused request would not have fitted"
    assert set(refused) == {"429:rate_limit_exceeded"}, refused
    # Whichever gateway wins the race, the other refused requests that its own admissions alone
    # would have let through: it counted the winner's.
    mine = [sum(r for s, outcome, r, _ in results if s == side and outcome == "ok") for side in (0, 1)]
    loser = mine.index(min(mine))
    assert mine[loser] <= 1000 - max(reserved) and any(s == loser and o != "ok" for s, o, *_ in results), mine
    # The window is in Redis, where both gateways read it; every admission is reconciled to its use.
    import redis

    client = redis.Redis.from_url(cluster.redis.url)
    assert int(client.get(f"tokenpath:{{tpm-tenant}}:key:{prefix}:sum")) == sum(u for *_, u in results)
    client.close()


async def test_rpm_holds_exactly_across_two_gateways(cluster: Cluster) -> None:
    secret, _ = cluster.key("rpm-tenant", Limits(rpm=10))
    results = await _burst(cluster, secret, 30)
    outcomes = [outcome for _, outcome, *_ in results]
    assert outcomes.count("ok") == 10 and outcomes.count("429:rate_limit_exceeded") == 20, outcomes


async def test_redis_down_is_503_with_a_log_line_and_service_resumes(cluster: Cluster) -> None:
    secret, _ = cluster.key("outage-tenant", Limits(rpm=1000))
    assert [o for _, o, *_ in await _burst(cluster, secret, 2)] == ["ok", "ok"]
    cluster.redis.stop()
    try:
        start = time.monotonic()
        outcomes = [o for _, o, *_ in await _burst(cluster, secret, 4)]
        assert outcomes == ["503:rate_limits_unavailable"] * 4
        assert time.monotonic() - start < 15, "refused promptly, never hangs"
        for g in cluster.gateways:
            assert f"Redis at {cluster.redis.url} is unreachable" in g.output()
            assert "fail closed" in g.output()
    finally:
        cluster.redis.start()
    assert [o for _, o, *_ in await _burst(cluster, secret, 4)] == ["ok"] * 4  # no restart of the gateways
    for g in cluster.gateways:
        assert "reachable again" in g.output()
