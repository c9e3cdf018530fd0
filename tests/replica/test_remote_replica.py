"""RemoteReplica against a real HTTP server on loopback (a small OpenAI-compatible stand-in)."""

import asyncio
import contextlib
import json
import logging
import socket
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from tokenpath.errors import InvalidRequestError, ServiceUnavailableError
from tokenpath.protocol import GenerateRequest, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.replica.base import ReplicaBusyError
from tokenpath.replica.remote import RemoteReplica, RemoteReplicaConfig, parse_metrics, parse_slots
from tokenpath.telemetry.timeline import Timeline

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",num_gpu_blocks="2048"} 1.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 100.0
"""


def test_parse_vllm_metrics():
    s = parse_metrics(VLLM_METRICS, "x")
    assert (s.running, s.waiting, s.kv_usage, s.block_size, s.num_blocks) == (4, 2, 0.25, 32, 2048)


def test_parse_tokenpath_and_llamacpp_metrics():
    tp = "tokenpath:num_requests_running 2\ntokenpath:num_requests_waiting 5\ntokenpath:kv_cache_usage_perc 0.5\n"
    s = parse_metrics(tp, "x")
    assert (s.running, s.waiting, s.kv_usage) == (2, 5, 0.5)
    lc = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 4\nllamacpp:kv_cache_usage_ratio 0.75\n"
    s = parse_metrics(lc, "y")
    assert (s.running, s.waiting, s.kv_usage) == (1, 4, 0.75)


def test_parse_metrics_reads_whole_names_only_and_skips_what_is_not_a_sample():
    """The samples are taken by one regex pass over the page (not prometheus_client's parser): a
    longer series that starts with a wanted name is not it, HELP/TYPE lines and a sample's
    timestamp are not values, a quoted label value may hold braces and escaped quotes, a value
    that is not a number is skipped, and a CRLF page reads as an LF one."""
    page = (
        "# HELP vllm:num_requests_waiting Number of requests waiting 7\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0 1700000000000\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n'
        'vllm:num_requests_running{engine="0",model_name="a}\\"b"} 3\n'
        "vllm:num_requests_running_total 40\n"
        "vllm:kv_cache_usage_perc NaNx\n"
        'vllm:cache_config_info{block_size="64",note="x=\\"1\\"",num_gpu_blocks="100"} 1.0\n'
    )
    for text in (page, page.replace("\n", "\r\n")):
        s = parse_metrics(text, "x")
        assert (s.waiting, s.running, s.kv_usage, s.block_size, s.num_blocks) == (2, 3, 0.0, 64, 100)
    assert parse_metrics("", "x").running == 0


class FakeServer:
    """Streams `max_tokens` text chunks; records bodies, request ids and disconnects."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.request_ids: list[str] = []
        self.client_ports: list[int] = []  # the connection each generation came on
        self.disconnected: list[str] = []
        self.metrics = "tokenpath:num_requests_running 1\ntokenpath:num_requests_waiting 0\n"
        self.health = 200
        self.token_ids = False  # answer `return_token_ids` as vLLM does (ids per chunk, the prompt's first)
        self.app = FastAPI()
        self.app.get("/metrics")(self._metrics)
        self.app.get("/health")(self._health)
        self.app.post("/v1/completions")(self._completions)

    async def _metrics(self) -> PlainTextResponse:
        return PlainTextResponse(self.metrics)

    async def _health(self) -> PlainTextResponse:
        return PlainTextResponse("", status_code=self.health)

    async def _completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        rid = request.headers.get("x-request-id", "")
        self.request_ids.append(rid)
        self.client_ports.append(request.client.port if request.client else -1)
        if body.get("max_tokens", 0) > 10_000:
            return PlainTextResponse(json.dumps({"error": {"message": "too long"}}), status_code=400)
        if body.get("user") == "busy":
            return PlainTextResponse(json.dumps({"error": {"message": "queue full"}}), status_code=429)

        async def stream():
            try:
                n = body["max_tokens"]
                for i in range(n):
                    await asyncio.sleep(0.01)
                    choice = {"index": 0, "text": f"w{i} ", "finish_reason": "length" if i == n - 1 else None}
                    if self.token_ids and body.get("return_token_ids"):
                        choice |= {"prompt_token_ids": body["prompt"]} if i == 0 else {}
                        choice["token_ids"] = [100 + i]
                    yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    if body.get("user") == "cut" and i == 1:
                        return  # the stream ends without a finish
                usage = {"prompt_tokens": 3, "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                self.disconnected.append(rid)
                raise

        return StreamingResponse(stream(), media_type="text/event-stream")


@contextlib.asynccontextmanager
async def serve(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await task
        sock.close()


def req(rid="abc", max_tokens=3, session=None):
    return Submission(GenerateRequest(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      stop=["x"])), Timeline(rid), session_id=session)


async def test_stream_state_and_body():
    fake = FakeServer()
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("remote-0", RemoteReplicaConfig(url=url, max_num_seqs=8), model="m")
        await rep.start()
        s = rep.state()
        assert s.healthy and s.running == 1 and s.max_num_seqs == 8
        outs = [o async for o in rep.generate(req())]
        assert "".join(o.outputs[0].text for o in outs) == "w0 w1 w2 "
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)  # one chunk, one token (id unknown)
        body = fake.bodies[0]
        assert body["prompt"] == [5, 6, 7] and body["model"] == "m" and body["stream"] is True
        assert body["temperature"] == 0.0 and body["stop"] == ["x"] and "seed" not in body
        assert fake.request_ids == ["abc"]
        await rep.close()


async def test_token_ids_are_the_backends_and_its_echoed_prompt_ids_are_skipped():
    """With the backend's ids (vLLM's `return_token_ids`), each output carries them, not a
    re-encoding of the text; the prompt's ids echoed on the first chunk are not read back
    (`openai_wire.prompt_payload`): the request's own prompt ids stay the outputs'."""
    fake = FakeServer()
    fake.token_ids = True
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("remote-0", RemoteReplicaConfig(url=url, max_num_seqs=8), model="m")
        await rep.start()
        outs = [o async for o in rep.generate(req())]
        assert [o.outputs[0].token_ids for o in outs] == [[100], [101], [102]]
        assert all(o.prompt_token_ids == [5, 6, 7] for o in outs)
        assert fake.bodies[0]["return_token_ids"] is True
        await rep.close()


async def test_finished_streams_reuse_one_connection():
    """A stream read to its `[DONE]` is read to its end too, so its connection goes back to the
    pool: a new TCP connection per request (the connect and the server's accept) was ~1 ms of the
    gateway's added TTFT in front of vLLM."""
    fake = FakeServer()
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("remote-0", RemoteReplicaConfig(url=url))
        for i in range(3):
            assert [o async for o in rep.generate(req(f"r{i}"))][-1].finished
        assert len(fake.client_ports) == 3 and len(set(fake.client_ports)) == 1
        await rep.close()


async def test_closing_the_stream_disconnects_the_server_request():
    fake = FakeServer()
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("remote-0", RemoteReplicaConfig(url=url))
        gen = rep.generate(req("gone", max_tokens=500))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if fake.disconnected:
                break
            await asyncio.sleep(0.02)
        assert fake.disconnected == ["gone"]
        await rep.close()


async def test_client_errors_and_cut_streams():
    fake = FakeServer()
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("remote-0", RemoteReplicaConfig(url=url))
        with pytest.raises(InvalidRequestError):
            _ = [o async for o in rep.generate(req(max_tokens=20_000))]
        with pytest.raises(ServiceUnavailableError) as cut:
            _ = [o async for o in rep.generate(req(max_tokens=5, session="cut"))]
        # Every 503 carries Retry-After (issue 37: a request in flight when its backend was killed
        # got a 503 without one).
        assert cut.value.status_code == 503 and int(cut.value.headers["Retry-After"]) >= 1
        with pytest.raises(ReplicaBusyError):
            _ = [o async for o in rep.generate(req(session="busy"))]
        await rep.close()


async def test_dead_server_turns_unhealthy_and_refuses():
    fake = FakeServer()
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("remote-0", RemoteReplicaConfig(url=url, poll_interval_s=0.05, unhealthy_after=2))
        await rep.start()
        assert rep.state().healthy
    for _ in range(100):  # server gone
        if not rep.state().healthy:
            break
        await asyncio.sleep(0.02)
    assert not rep.state().healthy and "poll failed" in (rep.state().detail or "")
    with pytest.raises(ServiceUnavailableError):
        _ = [o async for o in rep.generate(req())]
    await rep.close()


async def test_a_server_whose_health_fails_is_unhealthy_though_metrics_answer():
    """vLLM keeps serving /metrics after its engine died; its /health says 503 (issue 10, defect 2)."""
    fake = FakeServer()
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("remote-h", RemoteReplicaConfig(url=url, poll_interval_s=0.05))
        await rep.start()
        assert rep.state().healthy
        fake.health = 503
        await rep.poll()
        assert not rep.state().healthy and "503" in (rep.state().detail or "")
        fake.health = 200
        await rep.poll()
        assert rep.state().healthy
        await rep.close()


async def test_death_and_recovery_are_logged_once_each(caplog):
    """The gateway's log names a remote replica going unhealthy and coming back (issue 10,
    defect 12: before, a replica's death was never logged), once each, not once per poll.
    (httpx's own per-request lines are turned down to WARNING by `tokenpath serve`.)"""
    fake = FakeServer()
    caplog.set_level(logging.INFO)
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("remote-log", RemoteReplicaConfig(url=url, poll_interval_s=0.05))
        await rep.start()
        assert rep.state().healthy
        fake.health = 503
        while rep.state().healthy:
            await asyncio.sleep(0.02)
        fake.health = 200
        while not rep.state().healthy:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # a few more polls
        await rep.close()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("tokenpath")]
    assert (logging.WARNING, "replica remote-log: unhealthy: /health answered 503") in lines, lines
    assert (logging.INFO, "replica remote-log: healthy again") in lines, lines
    assert len(lines) == 2, lines  # one line per change, none per poll


SLOTS = json.loads((Path(__file__).parent / "data" / "llamacpp_slots.json").read_text())
# (a real llama-server's /slots, the llama.cpp vendored by llama-cpp-python 0.3.36, `-np 2 -c 2048`,
# one request decoding: 53 prompt tokens, 20 decoded)


def test_parse_llamacpp_slots():
    s = parse_slots(SLOTS, "x")
    assert (s.running, s.waiting, s.max_num_seqs) == (1, 0, 2)
    assert s.kv_usage == pytest.approx((53 + 20) / 2048)
    with pytest.raises(ValueError, match="/slots"):
        parse_slots({"error": "no"}, "x")


class LlamaServerLike:
    """/health, /metrics answering 501 (llama-server without --metrics), /slots from a real one;
    /health can be slowed to make polls lag."""

    def __init__(self) -> None:
        self.health_delay = 0.0
        self.app = FastAPI()
        self.app.get("/health")(self._health)
        self.app.get("/metrics")(lambda: PlainTextResponse("metrics are off", status_code=501))
        self.app.get("/slots")(lambda: SLOTS)

    async def _health(self) -> PlainTextResponse:
        await asyncio.sleep(self.health_delay)
        return PlainTextResponse('{"status":"ok"}')


async def test_a_llama_server_without_metrics_is_read_from_its_slots():
    """llama-server answers /metrics with 501 unless started with --metrics: that is not a failed
    poll (it was: the replica went unhealthy after two polls); its /slots gives the load."""
    fake = LlamaServerLike()
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("llama-0", RemoteReplicaConfig(url=url, poll_interval_s=0.05), model="m")
        await rep.start()
        await asyncio.sleep(0.3)  # several polls
        s = rep.state()
        assert s.healthy, s.detail
        assert (s.running, s.max_num_seqs) == (1, 2) and s.kv_usage == pytest.approx(73 / 2048)
        await rep.close()


async def test_stale_load_figures_count_as_saturated():
    """Polls that lag (here /health answers after 1.5 s) leave the last figures in place; past
    `stale_after_s` they count as saturated (kv 1.0, a batch more waiting) while the replica is
    still healthy, so a least-loaded pick prefers a replica whose figures are fresh."""
    from tokenpath.routing.replicas import load_score

    fake = LlamaServerLike()
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("llama-0", RemoteReplicaConfig(url=url, poll_interval_s=0.05, stale_after_s=0.4,
                                                           connect_timeout_s=5.0), model="m")
        await rep.start()
        fresh = rep.state()
        assert fresh.healthy and fresh.kv_usage < 0.1 and fresh.detail is None
        fake.health_delay = 1.5
        await asyncio.sleep(0.9)
        stale = rep.state()
        assert stale.healthy and stale.kv_usage == 1.0 and stale.waiting == fresh.waiting + 2
        assert "s old: counted as saturated" in (stale.detail or "")
        assert load_score(stale) > load_score(fresh) + 1.5
        fake.health_delay = 0.0
        await asyncio.sleep(1.2)  # the lagging poll answers, the next ones are prompt
        assert rep.state().kv_usage < 0.1 and rep.state().detail is None
        await rep.close()


class CountingServer(FakeServer):
    """FakeServer that counts its /health and /metrics GETs."""

    def __init__(self, metrics: str) -> None:
        super().__init__()
        self.metrics = metrics
        self.gets = {"health": 0, "metrics": 0}

    async def _metrics(self) -> PlainTextResponse:
        self.gets["metrics"] += 1
        return await super()._metrics()

    async def _health(self) -> PlainTextResponse:
        self.gets["health"] += 1
        return await super()._health()


IDLE = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.0\n"


async def test_an_idle_backends_metrics_are_read_less_often_and_never_go_stale():
    """Idle (its figures: nothing running or waiting; nothing of ours open), the page is read at
    most every `stale_after_s / 2`, while /health is still asked every poll; the figures never
    count as stale meanwhile. Figures that say busy are read every poll, as before (issue 37)."""
    fake = CountingServer(IDLE)
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("v", RemoteReplicaConfig(url=url, poll_interval_s=0.05, stale_after_s=0.6), model="m")
        await rep.start()
        await asyncio.sleep(1.2)
        idle = dict(fake.gets)
        assert idle["health"] >= 12
        assert 2 <= idle["metrics"] <= 6, idle  # every 0.3 s, not every 0.05 s
        s = rep.state()
        assert s.healthy and s.detail is None and s.kv_usage == 0.0  # never stale between reads
        fake.metrics = IDLE.replace("running 0", "running 2")  # another client's requests arrive
        await asyncio.sleep(0.45)
        assert rep.state().running == 2  # seen within the idle bound
        before = dict(fake.gets)
        await asyncio.sleep(0.5)
        busy = {k: fake.gets[k] - before[k] for k in before}
        assert busy["metrics"] >= busy["health"] - 1 >= 3, busy  # busy: every poll reads the page
        await rep.close()


async def test_an_open_stream_keeps_the_metrics_read_every_poll():
    fake = CountingServer(IDLE)
    async with serve(fake.app) as (url, _):
        rep = RemoteReplica("v", RemoteReplicaConfig(url=url, poll_interval_s=0.05), model="m")
        await rep.start()
        before = dict(fake.gets)
        outs = [o async for o in rep.generate(req(max_tokens=40))]  # ~0.4 s of stream
        during = {k: fake.gets[k] - before[k] for k in before}
        assert outs[-1].finished
        # A poll at each edge may still see nothing of ours open (before the response is registered,
        # after it ends), so two may skip the page; idle, it would be read at most once in 0.4 s.
        assert during["metrics"] >= during["health"] - 2 >= 3, during
        await rep.close()


def test_polls_sparser_than_the_stale_bound_are_refused_naming_both():
    """Figures polled every 5 s with a 1 s stale bound read as saturated between polls: the replica
    would never be routed to, silently. The config refuses it (the benchmarks' diagnostic hook
    met exactly this)."""
    with pytest.raises(ValueError, match=r"stale_after_s \(1.0\) must be above poll_interval_s \(5.0\)"):
        RemoteReplicaConfig(url="http://127.0.0.1:1", poll_interval_s=5.0)
    assert RemoteReplicaConfig(url="http://127.0.0.1:1", poll_interval_s=5.0, stale_after_s=20.0).stale_after_s == 20.0
