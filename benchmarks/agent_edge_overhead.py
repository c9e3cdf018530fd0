"""Benchmark: what the agent APIs' edge adds over chat completions for the same generation
(issue 35's target: at most 1 ms p50).

`/v1/responses` and `/v1/messages` are shapes at the edge over the chat pipeline: a request is
translated into the chat request, the same generation runs, and its outputs are written back as
Responses items/events or Messages blocks/events (and a Responses turn is stored). This sends
the same conversation (one user message), the same greedy `max_tokens` and the same sampling
to all of them, non-streamed and streamed, interleaved round by round (each round in a rotated
order), to one `tokenpath serve`, one request at a time.

Measured server-side so other load on a shared box distorts it least: each request's audit row
(`timing.stages_ms`, the Timeline) gives `total` (received -> finished, the last byte written)
and `gateway` (auth, routing, the translation, the chat template, tokenizing). The edge's cost is
the p50 of `total` minus chat completions' p50 for the same mode; the generation is the same
(same prompt tokens, same output tokens: checked), so the difference is the edge. Client wall
time is reported beside it.

The default model is a tiny random-weight llama with SmolLM2's tokenizer and chat template
(tests/engine/tiny_models.py): its generation takes a few ms, so the engine's own jitter hides
less of the edge than a real model's would. `--model smollm2-135m-instruct` times the real one.

    PYTHONPATH=src .venv/bin/python benchmarks/agent_edge_overhead.py             # ~1 minute
    PYTHONPATH=src .venv/bin/python benchmarks/agent_edge_overhead.py --rounds 5 --out "$(mktemp -d)"  # smoke

Writes benchmarks/results/agent_edge_overhead.md and .json (or into --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.procs import serve  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BIN = Path(sys.executable).parent
ASK = "Write one sentence about the sea."
# (name, path, body for max_tokens M) — the same conversation, tokens and sampling in each shape
APIS = {
    "chat": ("/v1/chat/completions",
             lambda m, n: {"model": m, "messages": [{"role": "user", "content": ASK}], "max_tokens": n,
                           "temperature": 0}),
    "responses": ("/v1/responses",
                  lambda m, n: {"model": m, "input": ASK, "max_output_tokens": n, "temperature": 0}),
    "responses_nostore": ("/v1/responses",
                          lambda m, n: {"model": m, "input": ASK, "max_output_tokens": n, "temperature": 0,
                                        "store": False}),
    "messages": ("/v1/messages",
                 lambda m, n: {"model": m, "messages": [{"role": "user", "content": ASK}], "max_tokens": n,
                               "temperature": 0}),
}


def serve_model(model: str, name: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(tmp / "data"), "OMP_NUM_THREADS": "1"}
    return serve([str(BIN / "tokenpath"), "serve", "--port", "0", "--model", model, "--served-model-name", name,
                  "--log-level", "warning"], tmp / "server.log", env=env)


def one(client: httpx.Client, url: str, api: str, stream: bool, model: str, max_tokens: int) -> tuple[str, float]:
    """(the server's request id, client wall ms) of one request, read to its end."""
    path, body = APIS[api]
    t0 = time.perf_counter()
    if stream:
        with client.stream("POST", url + path, json={**body(model, max_tokens), "stream": True}) as r:
            r.raise_for_status()
            for _ in r.iter_bytes():
                pass
    else:
        r = client.post(url + path, json=body(model, max_tokens))
        r.raise_for_status()
    return r.headers["x-request-id"], (time.perf_counter() - t0) * 1000


def audit_rows(data_dir: Path, ids: list[str]) -> dict[str, object]:
    from tokenpath.gateway import GatewayStore
    from tokenpath.gateway.base import OPEN_STATUS

    store = GatewayStore(data_dir / "gateway.sqlite3")
    out: dict[str, object] = {}
    try:
        deadline = time.monotonic() + 60
        for rid in ids:
            while True:
                rows = store.query_audit(request_id=rid)
                if (rows and rows[0].status != OPEN_STATUS) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            out[rid] = rows[0]
    finally:
        store.close()
    return out


def micro(max_tokens: int, repeat: int = 2000) -> dict[str, float]:
    """The edge's own work per request, in-process (best of 5 runs of `repeat`), in us: what a
    Messages or Responses request does beyond the chat request it becomes. Request side: its body
    validated and translated into the chat request (chat validates only its own body); reply
    side: the finished chat body written as a Message / Response, or each of the stream's chunks
    re-shaped into Messages events. And the Responses store's write (SQLite, the default)."""
    import asyncio

    from tokenpath.api.anthropic.schemas import MessagesRequest
    from tokenpath.api.anthropic.stream import message_events
    from tokenpath.api.anthropic.translate import message_body, to_chat
    from tokenpath.api.formatting import Accumulator
    from tokenpath.api.responses.schemas import ResponsesRequest
    from tokenpath.api.responses.translate import chat_messages, chat_request, input_items, stored_item
    from tokenpath.api.responses.turn import Turn, output_of
    from tokenpath.api.schemas import ChatCompletionRequest
    from tokenpath.gateway import GatewayStore
    from tokenpath.gateway.responses_store import SqlResponses
    from tokenpath.protocol.outputs import CompletionOutput, RequestOutput

    model = "m"
    words = [f" w{i}" for i in range(max_tokens)]
    acc = Accumulator(n=1)
    acc.add(0, RequestOutput("r", [CompletionOutput(0, "".join(words), list(range(max_tokens)), finish_reason="length")],
                             prompt_token_ids=list(range(30)), num_cached_tokens=0, finished=True))
    chat = {"id": "r", "model": model, "choices": [{"index": 0, "message": {"role": "assistant",
            "content": "".join(words)}, "finish_reason": "length"}], "usage": {"prompt_tokens": 30,
            "completion_tokens": max_tokens, "total_tokens": 30 + max_tokens}}
    chunks = [{"id": "r", "object": "chat.completion.chunk", "created": 0, "model": model,
               "choices": [{"index": 0, "delta": {"content": w}, "logprobs": None, "finish_reason": None}]}
              for w in words] + [{"id": "r", "object": "chat.completion.chunk", "created": 0, "model": model,
                                  "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]}]
    chat_body = APIS["chat"][1](model, max_tokens)
    msg_body = APIS["messages"][1](model, max_tokens)
    resp_body = APIS["responses"][1](model, max_tokens)

    def key() -> bytes:
        return b"k"

    async def drain() -> None:
        async def source():  # noqa: ANN202
            for c in chunks:
                yield c
        async for _ in message_events(source(), acc, None, key):
            pass

    def messages_request() -> None:
        to_chat(MessagesRequest.model_validate(msg_body))

    def responses_request() -> None:
        req = ResponsesRequest.model_validate(resp_body)
        items = [stored_item(it) for it in input_items(req.input)]
        chat_request(req, chat_messages(items, req.instructions))

    def responses_reply() -> None:
        req = ResponsesRequest.model_validate(resp_body)
        Turn(req, [], None, "t").response(model, "incomplete", output_of(chat["choices"][0]["message"]), chat["usage"])

    loop = asyncio.new_event_loop()
    tmp = Path(tempfile.mkdtemp(prefix="agent-edge-store-"))
    store = GatewayStore(tmp / "gateway.sqlite3")
    sql = SqlResponses(store, 86400.0)
    record = {"response": {"id": "x", "output": output_of(chat["choices"][0]["message"])},
              "input": [stored_item(it) for it in input_items(ASK)]}
    counter = iter(range(10**9))
    cases = {
        "chat: body validated": lambda: ChatCompletionRequest.model_validate(chat_body),
        "messages: body validated + to_chat": messages_request,
        "messages: reply body": lambda: message_body(chat, acc, None, key),
        "messages: stream re-shaped (all events)": lambda: loop.run_until_complete(drain()),
        "responses: body validated + chat request": responses_request,
        "responses: reply body": responses_reply,
        "responses: store write (SQLite)": lambda: sql.put(f"r{next(counter)}", "t", time.time(), record),
    }
    out = {}
    try:
        for name, fn in cases.items():
            n = repeat if "store" not in name else max(50, repeat // 20)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                best = min(best, (time.perf_counter() - t0) / n)
            out[name] = best * 1e6
    finally:
        loop.close()
        store.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model to serve (default: a tiny random llama made here)")
    ap.add_argument("--rounds", type=int, default=40, help="requests per (API, mode) cell")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="agent-edge-"))
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from tests.engine.tiny_models import save_tiny

        model, name = str(save_tiny("llama", tmp / "tiny")), "tiny-llama"
    else:
        model = name = args.model
    proc, url = serve_model(model, name, tmp)
    cells = [(api, stream) for stream in (False, True) for api in APIS]
    sent: dict[tuple[str, bool], list[tuple[str, float]]] = {c: [] for c in cells}
    try:
        with httpx.Client(timeout=300) as client:
            for c in cells * 2:  # warm-up (discarded): templates, grammar-free paths, the prefix cache
                one(client, url, c[0], c[1], name, args.max_tokens)
            for r in range(args.rounds):
                k = r % len(cells)
                for api, stream in cells[k:] + cells[:k]:
                    sent[(api, stream)].append(one(client, url, api, stream, name, args.max_tokens))
        rows = audit_rows(tmp / "data", [rid for v in sent.values() for rid, _ in v])
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    table: dict[str, dict] = {}
    for (api, stream), got in sent.items():
        timings = [json.loads(rows[rid].timing)["stages_ms"] for rid, _ in got]  # type: ignore[attr-defined]
        table[f"{api}{' stream' if stream else ''}"] = {
            "total_p50_ms": statistics.median(t["total"] for t in timings),
            "gateway_p50_ms": statistics.median(t["gateway"] for t in timings),
            "client_p50_ms": statistics.median(ms for _, ms in got),
            "stages_p50_ms": {k: round(statistics.median(t.get(k, 0.0) for t in timings), 2) for k in timings[0]},
            "prompt_tokens": sorted({rows[rid].prompt_tokens for rid, _ in got}),  # type: ignore[attr-defined]
            "completion_tokens": sorted({rows[rid].completion_tokens for rid, _ in got}),  # type: ignore[attr-defined]
        }
    for key, cell in table.items():
        base = table["chat stream" if key.endswith(" stream") else "chat"]
        cell["edge_total_ms"] = cell["total_p50_ms"] - base["total_p50_ms"]
        cell["edge_gateway_ms"] = cell["gateway_p50_ms"] - base["gateway_p50_ms"]
        cell["same_generation"] = (cell["prompt_tokens"], cell["completion_tokens"]) == (
            base["prompt_tokens"], base["completion_tokens"])

    us = micro(args.max_tokens)
    load = os.getloadavg()
    meta = {"micro_us": us, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": name, "rounds": args.rounds,
            "max_tokens": args.max_tokens, "cpus": os.cpu_count(), "loadavg": load, "python": platform.python_version(),
            "cells": table}
    lines = [f"# Agent API edge overhead vs chat completions ({meta['date']})", "",
             f"Model `{name}`, {args.max_tokens} greedy tokens, {args.rounds} requests per cell, one at a time, "
             f"interleaved; {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min) "
             "at the end: a loaded, shared box. Server-side p50s from each request's audit row (Timeline).", "",
             "| API | total p50 ms | edge vs chat (total) ms | gateway p50 ms | edge vs chat (gateway) ms "
             "| client p50 ms | same generation |",
             "|---|---:|---:|---:|---:|---:|:---:|"]
    for key, c in table.items():
        lines.append(f"| {key} | {c['total_p50_ms']:.1f} | {c['edge_total_ms']:+.2f} | {c['gateway_p50_ms']:.1f} | "
                     f"{c['edge_gateway_ms']:+.2f} | {c['client_p50_ms']:.1f} | {'yes' if c['same_generation'] else 'NO'} |")
    lines += ["", "The edge's own work per request, in-process (best of 5; us):", "", "| work | us |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in us.items()]
    md = "\n".join(lines) + "\n"
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent_edge_overhead.json").write_text(json.dumps(meta, indent=2))
    (args.out / "agent_edge_overhead.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
