"""What the fields tokenpath's URL replica adds to vLLM's body cost vLLM itself (issue 37).

Through the gateway, vLLM's own time to the first token of the requests was longer than of the
same requests sent straight to it (`vllm_behind_gateway.py` on the AVX2 host: 30 ms paired, 2.8 ms
with vLLM's own queue + prefill taken out). The gateway's body differs from a plain client's in
the prompt (token ids, not text) and in `return_token_ids` (so usage and the audit count vLLM's own
tokens: protocol/openai_wire.py). This sends short streamed /v1/completions to one vLLM (pinned to
core 0, as `vllm_behind_gateway.py` runs it; this client on core 1) with each combination, each
round in another order, and prints the client's TTFT p50 and vLLM's own (its per-request metrics:
time to first token + queue time) per variant.

    taskset -c 1 python benchmarks/vllm_body_fields.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vllm_peer import NAME, model_dir, start_vllm, stop_group  # noqa: E402


def ttft(http: httpx.Client, body: dict) -> tuple[float, float | None]:
    """(client ms to the first token, vLLM's own ms: time_to_first_token + queue_time)."""
    t0 = time.perf_counter()
    first: float | None = None
    engine: float | None = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if first is None and data.get("choices"):
                first = (time.perf_counter() - t0) * 1000
            m = data.get("metrics")
            if isinstance(m, dict) and m.get("time_to_first_token_ms") is not None:
                engine = float(m["time_to_first_token_ms"]) + float(m.get("queue_time_ms") or 0.0)
    if first is None:
        raise RuntimeError("no token")
    return first, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    variants = {
        "text prompt": lambda p: {"prompt": p},
        "token-id prompt": lambda p: {"prompt": tok.encode(p)},
        "token-id prompt + return_token_ids (the gateway's body)": lambda p: {"prompt": tok.encode(p),
                                                                               "return_token_ids": True},
        "text prompt + return_token_ids": lambda p: {"prompt": p, "return_token_ids": True},
    }
    base = {"model": NAME, "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    res: dict[str, list[tuple[float, float | None]]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as out:
        vllm = start_vllm(Path(out), cpus="0")
        try:
            with httpx.Client(base_url=vllm.url, timeout=120) as http:
                for i in range(3):  # warm-up, every variant
                    for k, make in variants.items():
                        ttft(http, {**base, **make(f"Warm {i}, {k}.")})
                names = list(variants)
                for i in range(args.rounds):  # each round starts one variant later: no fixed position
                    for k in names[i % len(names):] + names[:i % len(names)]:
                        res[k].append(ttft(http, {**base, **variants[k](f"Request {i} ({k}): say something.")}))
        finally:
            stop_group(vllm.proc)
    print("| body | client TTFT p50 (ms) | vLLM's own TTFT + queue p50 (ms) |\n|---|---|---|")
    for k, r in res.items():
        own = [e for _, e in r if e is not None]
        print(f"| {k} | {statistics.median(f for f, _ in r):.1f} | "
              f"{statistics.median(own):.1f} |" if own else f"| {k} | {statistics.median(f for f, _ in r):.1f} | - |")


if __name__ == "__main__":
    main()
