"""tokenpath's gateway in front of a real vLLM (issue 37): what reaches vLLM, what comes back, and
what the gateway learns from it.

    python benchmarks/vllm_behind_gateway.py [--requests 20] [--model-dir DIR]

Starts vLLM's CPU build (benchmarks/.venv-vllm, the mends of ../shared/PEERS.md) on the bf16
SmolLM2 safetensors (benchmarks/make_smollm2_hf.py) with `--enable-per-request-metrics`,
`--enable-prompt-tokens-details` and its ZMQ KV events (live and replay endpoints), then a
`tokenpath serve --routing` gateway whose only replica is that vLLM (`url:` with `kv_events` and
`kv_events_replay`). Then, through the gateway:
1. structured output (choice, regex, json_schema), `--requests` of each: the share valid;
2. logprobs (`top_logprobs: 3`): one entry per completion token;
3. usage: the gateway's completion_tokens against vLLM's own for the same seeded request;
4. stages: `engine_queue` and `prefill` as vLLM reported them (backend_timing in the log);
5. prefix routing: a long shared prefix sent twice; the second's routing reason must be
   `prefix_hit` (confirmed by vLLM's KV events), not `prefix_predicted`. Then the gateway is
   restarted and the same prefix sent again: `prefix_hit` again, from vLLM's replayed events,
   where a gateway that predicts from its own memory has none;
6. overhead: TTFT p50 of `--overhead-requests` short streamed requests straight to vLLM and
   through the gateway, alternating (the gateway's added milliseconds). One client per side, its
   connection kept alive, each stream read to its end: a new client per request (a TLS context
   built inside the timed span, ~10-40 ms on two busy cores) was noise larger than the figure.
   Beside it, as benchmarks/gateway_ttft_path.py reports them: the paired median, the added
   time with vLLM's own queue + prefill of each request taken out (`engine_out`), and the
   gateway's own time by its Timeline (the log line's `gateway_path_ms`).

Writes benchmarks/results/vllm_behind_gateway.md and .json (`--results NAME`: NAME.md and .json). Two
cores: vLLM runs pinned to core 0, the gateway and the load generator to core 1, so neither takes
the other's core (`--no-pin`: vLLM and the gateway share both, the generator on core 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gateway_ttft_path import pair_prompts, same_length, streamed, summarize  # noqa: E402
from benchmarks.vllm_peer import MODEL_DIR, NAME, ROOT, request_lines, start_gateway, start_vllm, stop_group  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PREFIX = "You are a careful assistant. " * 60  # ~360 tokens: several of vLLM's blocks


def structured(http: httpx.Client, n: int) -> dict:
    cases = {
        "choice": ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        "regex": ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
                  lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t) is not None),
        "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": {
            "type": "object", "properties": {"mood": {"type": "string", "enum": ["good", "bad"]}},
            "required": ["mood"], "additionalProperties": False}}}},
            lambda t: json.loads(t)["mood"] in ("good", "bad")),
    }
    out = {}
    for name, (extra, valid) in cases.items():
        ok = 0
        for i in range(n):
            body = {"model": NAME, "max_tokens": 24, "temperature": 0.8, "seed": i,
                    "messages": [{"role": "user", "content": f"Tell me about day {i}."}], **extra}
            r = http.post("/v1/chat/completions", json=body)
            with contextlib.suppress(ValueError, KeyError, TypeError):
                ok += r.status_code == 200 and bool(valid(r.json()["choices"][0]["message"]["content"]))
        out[name] = ok / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--overhead-requests", type=int, default=40)
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "bench" / "vllm_behind_gateway")
    ap.add_argument("--results", default="vllm_behind_gateway",
                    help="the name of the .md and .json in benchmarks/results/ (a loaded run: another name, "
                         "so the quiet figures stay)")
    ap.add_argument("--no-pin", action="store_true", help="vLLM and the gateway on both cores")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.sched_setaffinity(0, {1})  # (this process generates the load)
    pin = not args.no_pin
    gw_cpus = "1" if pin else None
    vllm = start_vllm(args.out, args.model_dir, cpus="0" if pin else None)
    vport = vllm.port
    result: dict = {"vllm_ready_s": vllm.ready_s, "pinned": pin}
    try:
        gw, gport = start_gateway(vllm, args.out, "1", cpus=gw_cpus)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{gport}", timeout=300) as http:
                result["structured_valid"] = structured(http, args.requests)
                lp = http.post("/v1/chat/completions", json={
                    "model": NAME, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3,
                    "messages": [{"role": "user", "content": "Hello"}]}).json()
                result["logprobs_entries_vs_tokens"] = [len(lp["choices"][0]["logprobs"]["content"]),
                                                        lp["usage"]["completion_tokens"]]
                body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.9,
                        "seed": 3, "ignore_eos": True}
                via = http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]
                direct = httpx.post(f"http://127.0.0.1:{vport}/v1/completions", json=body,
                                    timeout=300).json()["usage"]["completion_tokens"]
                result["completion_tokens_gateway_vs_vllm"] = [via, direct]
                timing = http.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 8}).json()
                result["stages_ms"] = {k: round(v * 1000, 1) for k, v in timing["tokenpath"]["timing"].items()}
                for i in range(2):
                    http.post("/v1/completions", json={"model": NAME, "prompt": PREFIX + f"Question {i}?",
                                                       "max_tokens": 4})
                    time.sleep(1.0)  # (the events of the first one's blocks arrive)
            rows = request_lines(args.out / "gateway-1.log")
            result["prefix_routing_reasons"] = [r.get("routing_reason") for r in rows[-2:]]
            result["backend_timing_logged"] = [r.get("backend_timing") for r in rows[-3:-2]]
        finally:
            stop_group(gw)
        gw, gport = start_gateway(vllm, args.out, "2", cpus=gw_cpus)  # a restarted gateway
        try:
            time.sleep(2.0)  # (the replay is read at start)
            httpx.post(f"http://127.0.0.1:{gport}/v1/completions", timeout=300,
                       json={"model": NAME, "prompt": PREFIX + "Question 9?", "max_tokens": 4})
            time.sleep(0.5)  # (a whole reply's log line follows its last byte: api/replies.py WholeReply)
            result["after_restart_reason"] = request_lines(args.out / "gateway-2.log")[-1].get("routing_reason")
            direct_r, via_r = [], []
            with httpx.Client(base_url=f"http://127.0.0.1:{vport}", timeout=120) as direct, \
                    httpx.Client(base_url=f"http://127.0.0.1:{gport}", timeout=120) as via:
                # (each pair the same length: pair_prompts says why, same_length checks it)
                result["overhead_prompt_tokens"] = same_length(direct, via, pair_prompts(args.overhead_requests))
                for i in range(3):  # (both connections open, both paths warm)
                    warm = pair_prompts(args.overhead_requests + 1 + i)
                    streamed(direct, warm[0])
                    streamed(via, warm[1])
                for i in range(args.overhead_requests):
                    to_direct, to_via = pair_prompts(i)
                    if i % 2:  # (alternating which goes first)
                        direct_r.append(streamed(direct, to_direct))
                        via_r.append(streamed(via, to_via))
                    else:
                        via_r.append(streamed(via, to_via))
                        direct_r.append(streamed(direct, to_direct))
            time.sleep(0.5)  # (the last request's log line follows its last byte)
            part = summarize(direct_r, via_r, args.out / "gateway-2.log")
            result["ttft_p50_ms"] = {"vllm": round(part["wall"]["direct_p50"], 1),
                                     "via_gateway": round(part["wall"]["via_p50"], 1)}
            result["added_ms_p50"] = round(result["ttft_p50_ms"]["via_gateway"] - result["ttft_p50_ms"]["vllm"], 1)
            result["added_ms_paired_median"] = part["wall"]["added_paired_median"]
            result["added_ms_engine_out"] = part["engine_out"]["added_paired_median"]
            result["gateway_own_ms_p50"] = part["timeline"]
        finally:
            stop_group(gw)
    finally:
        vllm.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.results}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# tokenpath's gateway in front of vLLM CPU 0.32 (benchmarks/vllm_behind_gateway.py)", "",
             "| check | result |", "|---|---|"]
    lines += [f"| {k} | `{json.dumps(v)}` |" for k, v in result.items()]
    (RESULTS / f"{args.results}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
