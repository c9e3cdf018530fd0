"""Engine replicas as Ray actors, end to end: a real Ray head (`ray start --head`, loopback only, its
own auth token and temp dir), a real `tokenpath serve --ray ADDRESS --replicas 2` in front of two
engine actors (a tiny random-weight Llama with SmolLM2's tokenizer, so the test spends its time
on the path, not on a model), the real `openai` client, and `tokenpath status --ray` to watch.

Routing is by session (`session_affinity`): a request without a session goes to the less loaded
actor, as `least_loaded` sends it, and one with a session goes to the actor a test chose for it.
The stall bound is short (`STALL_S`), for the test of a frozen actor (issue 23).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from tests.engine.tiny_models import save_tiny
from tests.process_logs import audit_timing, free_port, wait_for_log
from tests.replica.ray_cluster import private_ray_env

from tokenpath.routing.replicas import _hrw

pytestmark = [
    pytest.mark.slow,
    pytest.mark.requires("ray"),
]

BIN = Path(sys.executable).parent
STALL_S = 3.0  # the gateway's --stall-timeout


@dataclass
class RayGateway:
    address: str
    env: dict[str, str]
    base_url: str
    log: Path
    data: Path  # the gateway's data dir (its audit rows)

    def status(self) -> dict[str, dict]:
        out = subprocess.run([str(BIN / "tokenpath"), "status", "--ray", self.address, "--json"], env=self.env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return {row["name"]: row for row in map(json.loads, out.stdout.splitlines())}

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120)

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def ray_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayGateway]:
    tmp = tmp_path_factory.mktemp("ray")
    model = save_tiny("llama", tmp / "tiny", max_position_embeddings=4096)  # (room for a long request)
    ray_tmp, env = private_ray_env()
    port = free_port()
    head_log, serve_log = tmp / "head.log", tmp / "serve.log"
    with head_log.open("wb") as out:
        head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}",
                                 "--node-ip-address=127.0.0.1",
                                 # Ray's logical CPUs, one per actor: the gateway's two, and the catalog's
                                 # (last test), which would otherwise wait for a free CPU for ever.
                                 "--num-cpus=3",
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
                                      "--max-num-seqs", "8", "--routing-policy", "session_affinity",
                                      "--stall-timeout", str(STALL_S), "--data-dir", str(tmp / "data")],
                                     stdout=out, stderr=subprocess.STDOUT, env=env)
        m = wait_for_log(serve_log, r"listening on (http://127\.0\.0\.1:\d+/v1)", serve, 240)
        yield RayGateway(address, env, m.group(1), serve_log, tmp / "data")
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            code = serve.wait(60)
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        head.wait(60)
        # What the engine actors wrote (Ray's worker logs): no traceback, at shutdown or before.
        actor_logs = {p.name: p.read_text(errors="replace") for p in Path(ray_tmp).glob("session_*/logs/worker-*")}
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert code == 0, serve_log.read_text()[-3000:]
    assert actor_logs, "no engine actor log found"
    for name, text in actor_logs.items():
        assert "Traceback" not in text and "Exception in callback" not in text, (name, text[-3000:])


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
    at once reach both actors (no session: the less loaded one), a JSON schema and a choice side by side."""
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


@dataclass
class Sent:
    """One request of the freeze test and how it ended: status, error code, Retry-After, the raw SSE
    lines of a stream (with arrival times), when it was sent and when it ended."""

    rid: str
    session: str
    max_tokens: int
    stream: bool = False
    status: int = 0
    code: str | None = None
    retry_after: str | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0

    async def send(self, client: openai.AsyncOpenAI) -> Sent:
        kw = dict(model="tiny", max_tokens=self.max_tokens, temperature=0, extra_body={"ignore_eos": True},
                  messages=[{"role": "user", "content": f"{self.rid}: tell me a story"}],
                  extra_headers={"x-request-id": self.rid, "x-session-id": self.session})
        self.started = time.monotonic()
        try:
            if self.stream:  # (the raw lines, to see the error event and [DONE] as they came)
                async with client.chat.completions.with_streaming_response.create(stream=True, **kw) as r:
                    self.status = r.status_code
                    async for line in r.iter_lines():
                        if line:
                            self.lines.append((time.monotonic(), line))
            else:
                await client.chat.completions.create(**kw)
                self.status = 200
        except openai.APIStatusError as exc:
            self.status, self.retry_after = exc.status_code, exc.response.headers.get("retry-after")
            self.code = exc.body.get("code") if isinstance(exc.body, dict) else None
        finally:
            self.ended = time.monotonic()
        return self

    @property
    def took(self) -> float:
        return self.ended - self.started


def session_for(replica: str) -> str:
    """A session id whose home actor (rendezvous hash, as the router computes it) is `replica`."""
    return next(s for i in range(1000) if (s := f"s{i}")
                and max(("tiny-0", "tiny-1"), key=lambda r: _hrw(s, r)) == replica)


async def until(cond: Callable[[], bool | Awaitable[bool]], timeout: float, what: str) -> float:
    """Seconds until `cond()` (awaited if it must be) holds; fails after `timeout`."""
    start = time.monotonic()
    while not ((await ok) if inspect.isawaitable(ok := cond()) else ok):
        assert time.monotonic() - start < timeout, what
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def replica_is(http: httpx.AsyncClient, name: str, **want: object) -> bool:
    """Whether the gateway's live view of a replica (/dashboard/data: healthy, running...) says `want`."""
    rows = {r["name"]: r for d in (await http.get("/dashboard/data")).json()["deployments"] for r in d["replicas"]}
    return all(rows[name][k] == v for k, v in want.items())


async def test_a_frozen_actor_is_ejected_its_requests_retried_or_cut_cleanly_and_it_recovers(
        ray_gateway: RayGateway) -> None:
    """Issue 23 for Ray actors: SIGSTOP one engine actor's process under traffic. It is ejected
    within the stall bound (logged `replica_ejected`, reason stalled); its requests that had sent
    no token are retried on the other actor and succeed; the stream and the non-streaming request
    it was generating end cleanly (an SSE error event then [DONE]; a 503 with Retry-After) soon
    after the bound, never hanging for the freeze; nothing new is routed to it while frozen; after
    SIGCONT it takes the aborts it was sent, is recovered and serves again. (tiny-1: the kill test
    before this one restarted tiny-0.)"""
    victim, other = "tiny-1", "tiny-0"
    pid = (await asyncio.to_thread(ray_gateway.status))[victim]["pid"]
    on_victim, on_other = session_for(victim), session_for(other)
    client = ray_gateway.client()
    http = httpx.AsyncClient(base_url=ray_gateway.root, timeout=10)
    warm = [await Sent(f"f-warm-{i}", s, 8).send(client) for i, s in enumerate((on_victim, on_other) * 2)]
    assert [w.status for w in warm] == [200] * 4
    normal = max(w.took for w in warm[2:])
    # A stream and a non-streaming request generating on the victim (long: cut by the freeze).
    stream = Sent("f-stream", on_victim, 3000, stream=True)
    tasks = [asyncio.ensure_future(stream.send(client))]
    await until(lambda: len(stream.lines) >= 3, 60, "the long stream never started")
    whole = Sent("f-whole", on_victim, 3000)
    tasks.append(asyncio.ensure_future(whole.send(client)))
    sent = len(stream.lines)  # (the two share the victim's batch: more of the stream means `whole` runs too)
    await until(lambda: len(stream.lines) >= sent + 30, 60, "the long stream stopped")
    assert not any(t.done() for t in tasks), "the long requests finished before the freeze"

    os.kill(pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        # Sent at once, before the bound: routed to the victim, no token there, to be retried.
        early = [Sent(f"f-early-{i}", on_victim, 8) for i in range(3)] + [Sent("f-early-s", on_victim, 8, True)]
        control = Sent("f-control", on_other, 8)
        tasks += [asyncio.ensure_future(c.send(client)) for c in (*early, control)]
        ejected = await until(lambda: replica_is(http, victim, healthy=False), STALL_S + 5,
                              "the frozen actor was never ejected")
        late = [Sent(f"f-late-{i}", on_victim, 8) for i in range(3)]  # past the bound: never to the victim
        tasks += [asyncio.ensure_future(c.send(client)) for c in late]
        _, pending = await asyncio.wait(tasks, timeout=STALL_S + 10)
        assert not pending, [c.rid for c in (stream, whole, *early, control, *late) if not c.ended]
        health = (await http.get("/health")).json()
    finally:
        os.kill(pid, signal.SIGCONT)
    thawed = time.monotonic()

    # Ejected at the bound (counted from its last frame, just before the freeze) plus a tick and the
    # poll of /dashboard/data, logged once, with its reason.
    assert STALL_S - 0.5 <= ejected < STALL_S + 1.5, ejected
    log = ray_gateway.log.read_text()
    assert log.count(f"replica {victim}: ejected: stalled") == 1, log[-3000:]
    assert not health["replicas"]["tiny"][victim]["healthy"] and health["status"] == "degraded", health
    # The stream it was generating: an SSE error event naming the stall, then [DONE], soon after the bound.
    assert stream.status == 200 and '"error"' in stream.lines[-2][1] and "replica_stalled" in stream.lines[-2][1], \
        stream.lines[-3:]
    assert stream.lines[-1][1] == "data: [DONE]" and stream.lines[-1][0] - frozen < STALL_S + 5
    # The non-streaming one it was generating: a 503 with Retry-After, as soon.
    assert (whole.status, whole.code) == (503, "replica_stalled") and whole.retry_after, vars(whole)
    assert whole.ended - frozen < STALL_S + 5
    # Sent to the victim and not started there: retried on the other actor (same id), within 5 s of normal.
    for c in early:
        assert c.status == 200 and c.took < normal + STALL_S + 5, (c.rid, c.status, c.code, c.took, normal)
        timing = await asyncio.to_thread(audit_timing, ray_gateway.data, c.rid)
        assert (timing.get("retried_after"), timing["replica"]) == (victim, other), (c.rid, timing)
    assert early[-1].lines[-1][1] == "data: [DONE]" and not any('"error"' in x for _, x in early[-1].lines)
    # Sent past the bound, or to the other actor: served at once by the other, never tried on the victim.
    for c in (control, *late):
        assert c.status == 200 and c.took < normal + 5, (c.rid, c.status, c.code, c.took)
        timing = await asyncio.to_thread(audit_timing, ray_gateway.data, c.rid)
        assert (timing.get("retried_after"), timing["replica"]) == (None, other), (c.rid, timing)

    # Continued: recovered (logged), the aborts taken (its engine stops the long requests at once,
    # not 3000 tokens later), and it serves again.
    recovered = await until(lambda: replica_is(http, victim, healthy=True), 10, "the actor never recovered")
    assert f"replica {victim}: recovered" in ray_gateway.log.read_text()
    await until(lambda: replica_is(http, victim, running=0), 5,
                "the actor went on generating what it was told to abort")
    back = await Sent("f-back", on_victim, 8).send(client)
    assert back.status == 200, vars(back)
    assert (await asyncio.to_thread(audit_timing, ray_gateway.data, "f-back"))["replica"] == victim
    await client.close()
    await http.aclose()
    print(f"normal {normal:.2f}s; ejected {ejected:.2f}s after the freeze; retried requests "
          f"{max(c.took for c in early):.2f}s; stream cut {stream.lines[-1][0] - frozen:.2f}s after the freeze; "
          f"recovered {recovered:.2f}s after SIGCONT ({time.monotonic() - thawed:.2f}s to traffic)")


def test_a_catalog_on_ray_creates_actors_at_the_first_request_and_kills_them_at_unload(
        ray_gateway: RayGateway, tmp_path: Path) -> None:
    """`serve --models-dir DIR --ray ADDRESS` (issue 38 item 5): a catalog chat model has no
    actor until its first request, which creates them and waits in its `model_load` stage;
    unloading kills them. (Last in the module: its actors must not be in the other tests' status.)"""
    models = tmp_path / "models"
    models.mkdir()
    # A copy under its own name: an actor's name is its model directory's, and the module's
    # gateway already runs `tiny-0` and `tiny-1` on this cluster.
    shutil.copytree(next(ray_gateway.log.parent.glob("tiny")), models / "tinycat")
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen([str(BIN / "tokenpath"), "serve", "--port", "0", "--ray", ray_gateway.address,
                                  "--models-dir", str(models), "--num-kv-blocks", "64", "--max-num-seqs", "4",
                                  "--data-dir", str(tmp_path / "data")],
                                 stdout=out, stderr=subprocess.STDOUT, env=ray_gateway.env)
    try:
        base = wait_for_log(log, r"listening on (http://127\.0\.0\.1:\d+/v1)", serve, 240).group(1)
        with httpx.Client(base_url=base, timeout=300) as http:
            assert {m["id"]: m["state"] for m in http.get("/models").json()["data"]}["tinycat"] == "unloaded"
            assert not [n for n in ray_gateway.status() if n.startswith("tinycat")]
            r = http.post("/chat/completions", json={"model": "tinycat", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and "model_load;dur=" in r.headers["server-timing"], r.text
            actors = {n: row for n, row in ray_gateway.status().items() if n.startswith("tinycat")}
            assert [row["state"] for row in actors.values()] == ["ALIVE"], actors
            assert http.post("/models/tinycat/unload").json()["state"] == "unloaded"
            after = {n: row["state"] for n, row in ray_gateway.status().items() if n.startswith("tinycat")}
            assert set(after.values()) <= {"DEAD"}, after
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(60)
    assert code == 0, log.read_text()[-3000:]
