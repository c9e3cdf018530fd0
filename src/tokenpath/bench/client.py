"""Streaming OpenAI-compatible client that times every content chunk on the client's monotonic clock.

The SSE parsing is our own (a few lines) rather than the `openai` SDK's, because the SDK hides the
arrival time of each chunk and the extension fields (tokenpath's server timing) we need to read.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx

from tokenpath.bench.records import RequestRecord, RequestSpec, Target

HF_NO_EOS = json.dumps({"eos_token_id": -1})


class SSEDecoder:
    """Turns lines of a text/event-stream into event payloads (the joined `data:` fields).

    Only what OpenAI-style streams use: `data:` lines, blank-line event boundaries, `:` comments.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Feed one line (without its newline); return a complete event's data, if one ended."""
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_server_timing(header: str | None) -> dict[str, float] | None:
    """`queue;dur=12.3, prefill;dur=4` (ms) -> {'queue': 0.0123, 'prefill': 0.004} (seconds)."""
    if not header:
        return None
    out: dict[str, float] = {}
    for metric in header.split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for p in params:
            key, _, value = p.partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(value.strip('"')) / 1000.0
                except ValueError:
                    continue
    return out or None


def build_messages(spec: RequestSpec, history: Iterable[dict[str, str]] = ()) -> list[dict[str, str]]:
    """Chat messages: optional shared system prompt, any earlier turns, then this turn's user text."""
    msgs: list[dict[str, str]] = []
    if spec.system_text:
        msgs.append({"role": "system", "content": spec.system_text})
    msgs.extend(history)
    msgs.append({"role": "user", "content": spec.user_text})
    return msgs


def messages_as_prompt(messages: list[dict[str, str]]) -> str:
    """The completions API has no roles: a plain transcript stands in for the chat history."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


def build_body(target: Target, spec: RequestSpec, messages: list[dict[str, str]]) -> dict[str, Any]:
    """Request body with the length-forcing fields this target accepts (see records.ExactMode)."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.api == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = messages_as_prompt(messages)
    if target.exact == "vllm":
        body.update(ignore_eos=True, min_tokens=spec.output_len)
    elif target.exact == "min_tokens":
        body["min_tokens"] = spec.output_len
    elif target.exact == "hf":
        body["generation_config"] = HF_NO_EOS
    return body


def endpoint(target: Target) -> str:
    path = "chat/completions" if target.api == "chat" else "completions"
    return f"{target.base_url.rstrip('/')}/{path}"


def chunk_content(data: dict[str, Any], api: str) -> str | None:
    """The text a chunk carries, if any (role-only and usage chunks carry none)."""
    choices = data.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    text = (c.get("delta") or {}).get("content") if api == "chat" else c.get("text")
    return text or None


async def _lines(resp: httpx.Response) -> AsyncIterator[str]:
    async for line in resp.aiter_lines():
        yield line
    yield ""  # a stream that ends without a blank line still ends its last event


async def send(client: httpx.AsyncClient, target: Target, spec: RequestSpec,
               messages: list[dict[str, str]], total_timeout: float | None = None) -> RequestRecord:
    """Send one streaming request and time it. Never raises for server or transport failures:
    they become an unsuccessful record with the status (or error kind), so they can be counted.
    `total_timeout` bounds the whole request (httpx's own timeouts only bound each read)."""
    rec = RequestRecord(index=spec.index, intended_input_len=spec.input_len, intended_output_len=spec.output_len,
                        group=spec.group, session=spec.session, turn=spec.turn)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    body = build_body(target, spec, messages)
    st = time.perf_counter()
    try:
        async with asyncio.timeout(total_timeout), \
                client.stream("POST", endpoint(target), json=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = f"http:{(await resp.aread()).decode(errors='replace')[:200]}"
                return rec
            rec.server_timing = parse_server_timing(resp.headers.get("server-timing"))
            await _read_stream(resp, target.api, rec, st)
    except httpx.TimeoutException as exc:
        rec.error = f"timeout:{type(exc).__name__}"
    except TimeoutError:
        rec.error = f"timeout:no answer within {total_timeout} s"
    except httpx.ConnectError as exc:
        rec.error = f"connect:{exc}"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"transport:{type(exc).__name__}: {exc}"
    return rec


async def _read_stream(resp: httpx.Response, api: str, rec: RequestRecord, st: float) -> None:
    decoder = SSEDecoder()
    last = st
    chunks: list[str] = []
    async for line in _lines(resp):
        payload = decoder.feed(line)
        if payload is None:
            continue
        if payload.strip() == "[DONE]":
            break
        now = time.perf_counter()
        data = json.loads(payload)
        if "error" in data and not data.get("choices"):
            rec.error = f"stream_error:{json.dumps(data['error'])[:200]}"
            return
        text = chunk_content(data, api)
        if text is not None:
            if rec.ttft is None:
                rec.ttft = now - st
            else:
                rec.itl.append(now - last)
            last = now
            chunks.append(text)
        if usage := data.get("usage"):
            if usage.get("completion_tokens") is not None:
                rec.output_tokens = int(usage["completion_tokens"])
                rec.output_tokens_source = "usage"
            if usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(usage["prompt_tokens"])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                rec.cached_tokens = int(cached)
        timing = (data.get("tokenpath") or {}).get("timing")
        if isinstance(timing, dict):
            rec.server_timing = {k: float(v) for k, v in timing.items() if isinstance(v, int | float)}
    rec.text = "".join(chunks)
    if rec.ttft is None:
        rec.error = "no_content: stream ended without a content chunk"
        return
    rec.e2el = last - st
    if rec.output_tokens_source != "usage":
        rec.output_tokens = len(chunks)
    rec.success = True
