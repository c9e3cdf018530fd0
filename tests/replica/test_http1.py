"""The lean HTTP/1.1 client of a URL replica's generate call and polls (`replica/http1.py`), against
raw asyncio servers that answer byte for byte: what it sends, keep-alive, and every way a response
can go wrong (each a clean `Http1Error`, or a 503 from the replica, never a hang)."""

import asyncio
import contextlib
import json

import pytest

from tokenpath.errors import ServiceUnavailableError
from tokenpath.protocol import GenerateRequest, Submission
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.replica.http1 import Http1Error, Http1Pool, lean_applies
from tokenpath.replica.remote import RemoteReplica, RemoteReplicaConfig
from tokenpath.telemetry.timeline import Timeline

SSE_OK = (b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
          b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\ndata: [DONE]\n\n')


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@contextlib.asynccontextmanager
async def raw_server(answer):
    """A server whose `answer(request_bytes, writer)` writes the response by hand; yields its URL
    and the list of requests it read (the bytes of each, headers and body)."""
    seen: list[bytes] = []
    conns: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(id(writer))
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                seen.append(head + body)
                if await answer(head + body, writer) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # (a cancel: the server closing at the test's end)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen, conns
    finally:
        server.close()
        await server.wait_closed()


def req(rid: str = "r1") -> Submission:
    return Submission(GenerateRequest(rid, [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0)), Timeline(rid))


async def test_a_stream_is_sent_as_json_with_its_headers_and_its_connection_kept():
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD + chunked(SSE_OK[:40], SSE_OK[40:]))

    async with raw_server(answer) as (url, seen, conns):
        rep = RemoteReplica("lean", RemoteReplicaConfig(url=url, api_key="sk-x"))
        assert rep._lean is not None
        for i in range(3):
            outs = [o async for o in rep.generate(req(f"r{i}"))]
            assert [c.text for o in outs for c in o.outputs] == ["a", "b"] and outs[-1].finished
        await rep.close()
    head, _, body = seen[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/completions HTTP/1.1"
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    assert headers["authorization"] == "Bearer sk-x" and headers["x-request-id"] == "r0"
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body)
    assert json.loads(body)["prompt"] == [5, 6, 7]
    assert len(seen) == 3 and len(conns) == 1  # one connection for all three


async def test_a_body_without_length_or_chunks_ends_with_its_connection():
    """HTTP/1.0-style framing (no Content-Length, no chunks): the body is what came before the
    close, a whole response, not a cut one."""
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + SSE_OK)
        await writer.drain()
        return False

    async with raw_server(answer) as (url, _, _):
        rep = RemoteReplica("lean", RemoteReplicaConfig(url=url))
        outs = [o async for o in rep.generate(req())]
        assert [c.text for o in outs for c in o.outputs] == ["a", "b"] and outs[-1].finished
        await rep.close()


@pytest.mark.parametrize("response", [
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nnot hex\r\n",  # a malformed chunk
    STREAM_HEAD + b"40\r\n" + SSE_OK[:20],  # the connection closes mid-chunk
    b"NOT HTTP AT ALL\r\n\r\n",
])
async def test_a_broken_response_is_a_503_naming_the_replica(response):
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(response)
        await writer.drain()
        return False  # (then close)

    async with raw_server(answer) as (url, _, _):
        rep = RemoteReplica("lean", RemoteReplicaConfig(url=url))
        with pytest.raises(ServiceUnavailableError, match="lean"):
            _ = [o async for o in rep.generate(req())]
        await rep.close()


async def test_a_silent_server_times_out_and_a_closed_port_is_unreachable():
    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async with raw_server(answer) as (url, _, _):
        pool = Http1Pool(url, {}, connect_timeout=1.0, read_timeout=0.2)
        with pytest.raises(Http1Error, match="no data"):
            async with pool.stream("POST", "/v1/completions", b"{}", {}) as _:
                pass
        await pool.aclose()
    rep = RemoteReplica("gone", RemoteReplicaConfig(url=url))
    with pytest.raises(ServiceUnavailableError, match="unreachable"):
        _ = [o async for o in rep.generate(req())]
    await rep.close()


async def test_an_unread_body_pauses_the_socket(monkeypatch):
    """Back-pressure: a consumer that stops reading stops the socket being read (as httpx did), so
    the server's writes wait on the client and nothing piles up in the gateway unbounded."""
    import tokenpath.replica.http1 as http1

    monkeypatch.setattr(http1, "PAUSE_READING_BYTES", 1000)
    big = b"data: " + b"x" * 1000 + b"\n\n"
    events = 4000  # 4 MB: many socket reads

    async def answer(request: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(STREAM_HEAD + chunked(*[big] * events))

    async with raw_server(answer) as (url, _, _):
        pool = Http1Pool(url, {}, connect_timeout=1.0, read_timeout=5.0)
        async with pool.stream("POST", "/x", b"{}", {}) as resp:
            await asyncio.sleep(0.2)  # (nothing read meanwhile)
            conn = resp._conn
            assert conn.paused and resp._buffered < 1000 + 512 * 1024  # (the cap, and one read past it)
            body = await resp.aread()
            assert body.count(b"data: ") == events and not conn.paused
        await pool.aclose()


async def test_header_injection_is_refused_and_proxies_keep_httpx(monkeypatch):
    pool = Http1Pool("http://127.0.0.1:9", {}, connect_timeout=1.0, read_timeout=1.0)
    with pytest.raises(ValueError, match="invalid HTTP header"):
        async with pool.stream("POST", "/x", b"{}", {"x-request-id": "a\r\nEvil: 1"}) as _:
            pass
    assert lean_applies("http://10.0.0.1:8000") and not lean_applies("https://10.0.0.1:8000")
    monkeypatch.setenv("http_proxy", "http://proxy.invalid:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert not lean_applies("http://10.0.0.1:8000")
    assert RemoteReplica("p", RemoteReplicaConfig(url="http://10.0.0.1:8000"))._lean is None
