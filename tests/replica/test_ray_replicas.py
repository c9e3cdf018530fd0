"""Engine replicas as Ray actors, end to end: a real Ray head (`ray start --head`, loopback only, its
own auth token and temp dir), a real `tokenpath serve --ray ADDRESS --replicas 2` in front of two
engine actors (a tiny random-weight Llama with SmolLM2's tokenizer, so the test spends its time
on the path, not on a model), the real `openai` client, and `tokenpath status --ray` to watch.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from tests.engine.tiny_models import save_tiny
from tests.process_logs import free_port, wait_for_log
from tests.replica.ray_cluster import private_ray_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                       reason="Ray is not installed (pip install 'tokenpath[ray]')"),
]

BIN = Path(sys.executable).parent




@dataclass
class RayGateway:
    address: str
    env: dict[str, str]
    base_url: str
    log: Path

    def status(self) -> dict[str, dict]:
        out = subprocess.run([str(BIN / "tokenpath"), "status", "--ray", self.address, "--json"], env=self.env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return {row["name"]: row for row in map(json.loads, out.stdout.splitlines())}

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120)




@pytest.fixture(scope="module")
def ray_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayGateway]:
    tmp = tmp_path_factory.mktemp("ray")
    model = save_tiny("llama", tmp / "tiny")
    ray_tmp, env = private_ray_env()
    port = free_port()
    head_log, serve_log = tmp / "head.log", tmp / "serve.log"
    with head_log.open("wb") as out:
        head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}",
                                 "--node-ip-address=127.0.0.1", "--num-cpus=2",
                                 # the dashboard serves Ray's state API (`tokenpath status` reads restarts there)
                                 "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                 f"--dashboard-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                                 f"--metrics-export-port={free_port()}",
                                 f"--temp-dir={ray_tmp}", "--disable-usage-stats"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    serve: subprocess.Popen | None = None
    try:
        wait_for_log(head_log, r"Ray runtime started", head, 120)
        address = f"127.0.0.1:{port}"
        with serve_log.open("wb") as out:
            serve = subprocess.Popen([str(BIN / "tokenpath"), "serve", "--port", "0", "--ray", address,
                                      "--replicas", "2", "--model", str(model), "--num-kv-blocks", "256",
                                      "--max-num-seqs", "8", "--routing-policy", "least_loaded"],
                                     stdout=out, stderr=subprocess.STDOUT, env=env)
        m = wait_for_log(serve_log, r"listening on (http://127\.0\.0\.1:\d+/v1)", serve, 240)
        yield RayGateway(address, env, m.group(1), serve_log)
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            code = serve.wait(60)
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        head.wait(60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 0, serve_log.read_text()[-3000:]


async def _one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
    """(outcome, tokens received): 'ok'; '503:<code>' refused or failed before any token;
    'stream_error' ended by an error event after tokens. Anything else fails the test."""
    kw = dict(model="tiny", max_tokens=48, extra_body={"ignore_eos": True},
              messages=[{"role": "user", "content": f"request {i}: tell me a story"}])
    received = 0
    try:
        if i % 2:
            r = await client.chat.completions.create(**kw)
            return "ok", r.usage.completion_tokens
        stream = await client.chat.completions.create(stream=True, **kw)
        async for chunk in stream:
            received += sum(1 for c in chunk.choices if c.delta.content)
        return "ok", received
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc
        return f"503:{exc.body.get('code') if isinstance(exc.body, dict) else exc.body}", received
    except openai.APIError as exc:  # an error event in the stream
        assert received > 0 and "internal server error" not in str(exc), exc
        return "stream_error", received


async def test_structured_output_is_enforced_inside_the_actors(ray_gateway: RayGateway) -> None:
    """Issue 22: the grammar runs where the tokenizer and sampler are, in each engine actor. The
    tiny model has random weights, so only the grammar can make its replies valid; six requests
    at once reach both actors (least_loaded), a JSON schema and a choice side by side."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "answer"}]
    async with ray_gateway.client() as client:
        calls = [client.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=1.0,
                                                response_format=fmt) for _ in range(4)]
        calls += [client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=1.0,
                                                 extra_body={"guided_choice": ["alpha", "beta"]}) for _ in range(2)]
        replies = await asyncio.gather(*calls)
    for r in replies[:4]:
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert all(r.choices[0].message.content in ("alpha", "beta") for r in replies[4:]), replies[4:]


async def test_two_actors_serve_40_requests_and_a_killed_one_comes_back(ray_gateway: RayGateway) -> None:
    before = ray_gateway.status()
    assert sorted(before) == ["tiny-0", "tiny-1"]
    assert {r["state"] for r in before.values()} == {"ALIVE"} and {r["node_ip"] for r in before.values()} == {"127.0.0.1"}
    victim = before["tiny-0"]

    client = ray_gateway.client()
    load = asyncio.gather(*(_one(client, i) for i in range(40)))
    task = asyncio.ensure_future(load)
    # Kill the actor's process (SIGKILL: a crash, not a goodbye) while it is generating. The
    # gateway's own view (/dashboard/data, milliseconds) says when it has requests in flight there:
    # `tokenpath status` connects to Ray on each call (seconds), and the tiny model's whole load
    # can finish between two of its answers.
    deadline = time.monotonic() + 60
    dashboard = ray_gateway.base_url.removesuffix("/v1") + "/dashboard/data"
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            deployments = (await http.get(dashboard)).json()["deployments"]
            replicas = {r["name"]: r for d in deployments for r in d["replicas"]}
            if (replicas.get("tiny-0") or {}).get("inflight"):
                break
            assert time.monotonic() < deadline and not task.done(), "tiny-0 never got work"
            await asyncio.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(task, 180)  # no hang: every request ends

    outcomes = [o for o, _ in results]
    assert set(outcomes) <= {"ok", "stream_error", "503:replica_failed", "503:service_unavailable"}, outcomes
    # Only requests the killed engine had started can fail (it runs at most --max-num-seqs 8 at
    # once); those still queued there, with no token sent, were retried on the other actor.
    assert len(outcomes) - outcomes.count("ok") <= 8, outcomes
    metrics = httpx.get(ray_gateway.base_url.removesuffix("/v1") + "/metrics").text
    retried = float(re.search(r'^tokenpath:replica_retries_total\{deployment="tiny"\} (\S+)$', metrics, re.M).group(1))

    # Ray restarts it, and the gateway routes to it again, within 30 s of the kill.
    routed_again = False
    while time.monotonic() - killed_at < 30 and not routed_again:
        row = (await asyncio.to_thread(ray_gateway.status))["tiny-0"]
        if row["state"] == "ALIVE" and row["restarts"] >= 1 and row["pid"] != victim["pid"]:
            await asyncio.gather(*(_one(client, 100 + i) for i in range(1, 9, 2)))  # non-streaming
            routed_again = ((await asyncio.to_thread(ray_gateway.status))["tiny-0"]["served"] or 0) > 0
        else:
            await asyncio.sleep(0.5)
    await client.close()
    print("OUTCOMES", sorted(outcomes), "RETRIED", retried, "ROUTED_AFTER", round(time.monotonic() - killed_at, 1))
    assert routed_again, f"not routed to the restarted actor within 30 s:\n{ray_gateway.log.read_text()[-2000:]}"
    log = ray_gateway.log.read_text()
    assert "Ray replica tiny-0 is down" in log and "Ray replica tiny-0 restarted" in log
