"""What the gateway spends reading the prompt ids vLLM echoes on a stream's first chunk (issue 37).

With `return_token_ids` (so usage and quotas count the backend's own tokens), vLLM 0.32 sends the
prompt's token ids once, in the first chunk, the one that carries the first token; the URL replica
reads that chunk before it can pass the token on. This times, in this thread's CPU time, parsing
such a chunk whole (`json.loads`) against cutting the ids out first (`openai_wire.prompt_payload`,
as the replica reads chunks), interleaved (A, B, A, B ...), medians of `--samples` samples of
`--calls` parses each, for prompts of several lengths.

    PYTHONPATH=src python benchmarks/sse_prompt_ids.py [--samples 200] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tokenpath.protocol.openai_wire import prompt_payload


def first_chunk(prompt_tokens: int, rng: random.Random) -> str:
    """vLLM's first streamed completions chunk with `return_token_ids`, as it spells it (compact)."""
    choice = {"index": 0, "text": " Hello", "logprobs": None, "finish_reason": None, "stop_reason": None,
              "prompt_token_ids": [rng.randrange(49152) for _ in range(prompt_tokens)], "token_ids": [9906]}
    if not prompt_tokens:  # (a later chunk: no prompt ids, what every other chunk pays for the search)
        del choice["prompt_token_ids"]
    return json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 1, "model": "m",
                       "choices": [choice]}, separators=(",", ":"))


def cpu_us(fn, payload: str, calls: int) -> float:
    t = time.thread_time_ns()
    for _ in range(calls):
        fn(payload)
    return (time.thread_time_ns() - t) / calls / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    whole = json.loads
    cut = lambda p: json.loads(prompt_payload(p))  # noqa: E731
    rng = random.Random(0)
    print("| prompt tokens | first chunk (bytes) | parsed whole (us CPU) | ids cut out first (us CPU) |\n|---|---|---|---|")
    for n in (0, 10, 128, 512, 2048, 4096):
        payload = first_chunk(n, rng)
        a, b = [], []
        for _ in range(args.samples):
            a.append(cpu_us(whole, payload, args.calls))
            b.append(cpu_us(cut, payload, args.calls))
        print(f"| {n or 'none (a later chunk)'} | {len(payload)} | {statistics.median(a):.1f} | {statistics.median(b):.1f} |")


if __name__ == "__main__":
    main()
