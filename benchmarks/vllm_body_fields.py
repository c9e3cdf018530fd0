"""What the fields tokenpath's URL replica adds to vLLM's body cost vLLM itself (issue 37).

Through the gateway, vLLM's own time to the first token of the requests was longer than of the
same requests sent straight to it (`vllm_behind_gateway.py` on the AVX2 host: 30 ms paired, 2.8 ms
with vLLM's own queue + prefill taken out). The gateway's body differs from a plain client's in
the prompt (token ids, not text) and in `return_token_ids` (so usage and the audit count vLLM's own
tokens: protocol/openai_wire.py). This sends short streamed /v1/completions to one vLLM (pinned to
core 0, as `vllm_behind_gateway.py` runs it; this client on core 1) with each combination, each
round in another order, and prints the client's TTFT p50 and vLLM's own (its per-request metrics:
time to first token + queue time) per variant, and vLLM's own paired with the same round's text
prompt (the median of the rounds' differences: the same moment's load on both).

Every variant's prompt has the same number of tokens (checked): vLLM CPU's prefill on the AVX2 host
costs ~23 ms a prompt token, so prompts that differ by a few tokens differ by far more than any
body field costs. (This script's first form put the variant's name in its prompts, 10 to 23
tokens, and read the lengths' cost as `return_token_ids`'s: benchmarks/results/vllm_token_ids-loaded.md.)
Each prompt differs from the others in a digit, and all are shorter than one KV block, so none is
served from vLLM's prefix cache.

    taskset -c 1 python benchmarks/vllm_body_fields.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gateway_ttft_path import streamed  # noqa: E402
from benchmarks.vllm_peer import model_dir, start_vllm, stop_group  # noqa: E402


def prompt(tok, i: int, variant: int) -> str:
    """Round `i`'s prompt for the variant numbered `variant`: the same token count for every
    variant of a round (module docstring), which is checked, not assumed."""
    text = f"Request {i} variant {variant}: say something."
    base = f"Request {i} variant 0: say something."
    if len(tok.encode(text)) != len(tok.encode(base)):
        raise RuntimeError(f"{text!r} and {base!r} differ in token count")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    fields = {  # the body's variants: (the prompt as sent, the fields added), one prompt length
        "text prompt": lambda p: (p, {}),
        "token-id prompt": lambda p: (tok.encode(p), {}),
        "token-id prompt + return_token_ids (the gateway's body)": lambda p: (tok.encode(p), {"return_token_ids": True}),
        "text prompt + return_token_ids": lambda p: (p, {"return_token_ids": True}),
    }
    # The first form's prompts, which named the variant, as plain text prompts with no field added:
    # if its ladder was the prompts' lengths, these rows reproduce it with no `return_token_ids` at all.
    old = {k: (lambda i, k=k: f"Request {i} ({k}): say something.") for k in fields}
    old_names = {k: f"text prompt of the first form's '{k}' ({len(tok.encode(old[k](1)))} tokens)" for k in fields}
    variants = {k: (lambda i, j, make=make: make(prompt(tok, i, j))) for k, make in fields.items()}
    variants |= {old_names[k]: (lambda i, j, make=make: (make(i), {})) for k, make in old.items()}
    res: dict[str, list[tuple[float, float | None]]] = {k: [] for k in variants}
    names = list(variants)
    with tempfile.TemporaryDirectory() as out:
        vllm = start_vllm(Path(out), cpus="0")
        try:
            with httpx.Client(base_url=vllm.url, timeout=120) as http:
                for i in range(3):  # warm-up, every variant
                    for j, k in enumerate(names):
                        streamed(http, *variants[k](i + 100, j))
                for i in range(args.rounds):  # each round starts one variant later: no fixed position
                    for k in names[i % len(names):] + names[:i % len(names)]:
                        first, _, own = streamed(http, *variants[k](i, names.index(k)))
                        res[k].append((first, own))
        finally:
            stop_group(vllm.proc)
    print(f"prompt tokens, the same-length variants: {len(tok.encode(prompt(tok, 1, 0)))}")
    print("| body | client TTFT p50 (ms) | vLLM's own TTFT + queue p50 (ms) | vLLM's own, paired: this - text "
          "prompt, median of the rounds (ms) |\n|---|---|---|---|")
    base = res[names[0]]  # (the same round's text prompt: the same moment's load)
    for k, r in res.items():
        own = [e for _, e in r if e is not None]
        paired = [e - b for (_, e), (_, b) in zip(r, base, strict=True) if e is not None and b is not None]
        cells = [f"{statistics.median(f for f, _ in r):.1f}", f"{statistics.median(own):.1f}" if own else "-",
                 f"{statistics.median(paired):+.1f}" if paired else "-"]
        print(f"| {k} | {' | '.join(cells)} |")

if __name__ == "__main__":
    main()
