"""Structured output on SmolLM2, side by side in one run (issue 22's targets):

- TPOT of `json_schema` decoding against unconstrained decoding on the same prompts, at c=1 and
  c=32. Both runs decode exactly `--tokens` tokens per request (the schema asks for a long array,
  so no constrained row finishes early and the batches keep the same shape); repeats alternate
  A/B/A/B and the medians are compared, since this machine's cores are shared. Two schemas: an
  array of plain strings (what a pydantic `str` field asks for), and the same strings bounded by
  `maxLength` — the worst case we know for llguidance: a bounded string defeats its precomputed
  token slices, so each mask inside one walks the whole vocabulary (330 us against 27 us here).
- Grammar compile time p50/p99, first request (a fresh cache) and cached, for small schemas and
  for a 50-property schema.
- Validity: >= 200 requests with varied generated schemas and temperatures; every output that
  finishes with "stop" must validate against its schema (jsonschema).

    PYTHONPATH=src python benchmarks/structured_output.py [--requests 200] [--tokens 48] [--repeats 3]

Writes benchmarks/results/structured_output.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import jsonschema

from tokenpath import SamplingParams
from tokenpath.engine.llm import LLM
from tokenpath.engine.structured import GrammarCache
from tokenpath.protocol.sampling_params import StructuredOutput

RESULTS = Path(__file__).resolve().parent / "results"
LONG = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 60}},
        "required": ["notes"]}
LONG_BOUNDED = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                           "minItems": 60}}, "required": ["notes"]}
SCHEMAS = {"plain strings": LONG, "maxLength strings": LONG_BOUNDED}
TOPICS = ["a city", "a book", "a person", "a planet", "a recipe", "a car", "a song", "a company"]


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def tpot(outs) -> list[float]:  # noqa: ANN001
    """Per request: decode time over output tokens after the first (engine events)."""
    out = []
    for o in outs:
        n = sum(len(c.token_ids) for c in o.outputs)
        if n > 1 and o.events.first_token is not None and o.events.finished is not None:
            out.append((o.events.finished - o.events.first_token) / (n - 1))
    return out


def bench_tpot(llm: LLM, conc: int, tokens: int, repeats: int, label: str) -> dict:
    prompts = [f"Write notes about {TOPICS[i % len(TOPICS)]} number {i}, as JSON:" for i in range(conc)]
    free = SamplingParams(temperature=0.8, seed=1, max_tokens=tokens, ignore_eos=True)
    schema = SamplingParams(temperature=0.8, seed=1, max_tokens=tokens,
                            structured=StructuredOutput("json", json.dumps(SCHEMAS[label])))
    llm.generate(prompts[:2], free)  # warm up
    llm.generate(prompts[:2], schema)
    runs: dict[str, list[float]] = {"free": [], "json_schema": []}
    for _ in range(repeats):
        for name, p in (("free", free), ("json_schema", schema)):
            outs = llm.generate(prompts, p)
            if any(len(o.outputs[0].token_ids) != tokens for o in outs):
                raise RuntimeError("a row finished early: the batches would not have the same shape")
            runs[name].append(statistics.median(tpot(outs)))
    a, b = statistics.median(runs["free"]), statistics.median(runs["json_schema"])
    return {"schema": label, "concurrency": conc, "tpot_free_ms": round(1000 * a, 2), "tpot_json_schema_ms": round(1000 * b, 2),
            "overhead_pct": round(100 * (b / a - 1), 1), "runs_ms": {k: [round(1000 * x, 2) for x in v]
                                                                     for k, v in runs.items()}}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "enum":
        return {"type": "string", "enum": rng.sample(["alpha", "beta", "gamma", "delta", "omega"], 3)}
    if k == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
    if k == "string":
        return {"type": "string", "maxLength": rng.randint(3, 24)}
    if k == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": rng.randint(1, 3)}
    if k == "object":
        props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    return {"type": k}


def object_schema(rng: random.Random) -> dict:
    props = {f"field_{i}": random_schema(rng) for i in range(rng.randint(1, 5))}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def big_schema(salt: int) -> dict:
    props = {f"p{i}_{salt}": [{"type": "string"}, {"type": "integer"}, {"type": "boolean"}][i % 3] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def bench_compile(llm: LLM, rng: random.Random, n: int) -> dict:
    """Each schema is new to the cache (a miss: the first request's compile), then asked again (a hit)."""
    out = {}
    cache = GrammarCache(llm.tokenizer.llg_tokenizer())
    for label, make in (("small", lambda i: {**object_schema(rng), "title": f"s{i}"}), ("50-property", big_schema)):
        first, cached = [], []
        for i in range(n):
            spec = StructuredOutput("json", json.dumps(make(i)))
            miss = cache.get(spec)
            t = time.perf_counter()
            hit = cache.get(spec)
            cached.append(time.perf_counter() - t)
            if miss.hit or not hit.hit:
                raise RuntimeError("the compile benchmark needs a miss then a hit")
            first.append(miss.compile_seconds)
        out[label] = {"first_p50_ms": round(1000 * quantile(first, 0.5), 3),
                      "first_p99_ms": round(1000 * quantile(first, 0.99), 3),
                      "cached_p50_ms": round(1000 * quantile(cached, 0.5), 3),
                      "cached_p99_ms": round(1000 * quantile(cached, 0.99), 3)}
    return out


def bench_validity(llm: LLM, rng: random.Random, n: int, batch: int = 32) -> dict:
    stop = valid = length = 0
    failures = []
    for start in range(0, n, batch):
        schemas = [object_schema(rng) for _ in range(min(batch, n - start))]
        params = [SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 1.3]), max_tokens=120, seed=start + i,
                                 structured=StructuredOutput("json", json.dumps(s))) for i, s in enumerate(schemas)]
        prompts = [f"Fill in this JSON about {rng.choice(TOPICS)}:" for _ in schemas]
        for s, o in zip(schemas, llm.generate(prompts, params), strict=True):
            c = o.outputs[0]
            if c.finish_reason == "length":
                length += 1
                continue
            stop += 1
            try:
                jsonschema.validate(json.loads(c.text), s)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append({"schema": s, "text": c.text, "error": str(exc)[:200]})
    return {"requests": n, "finished_stop": stop, "valid": valid, "cut_off_length": length,
            "valid_pct_of_stop": round(100 * valid / stop, 2) if stop else None, "failures": failures[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compiles", type=int, default=100)
    args = ap.parse_args()
    rng = random.Random(0)
    llm = LLM("smollm2-135m-instruct", max_num_seqs=32)
    result: dict = {}
    result["compile"] = bench_compile(llm, rng, args.compiles)
    print(json.dumps(result["compile"]), flush=True)
    result["tpot"] = []
    for label in SCHEMAS:
        for c in (1, 32):
            result["tpot"].append(bench_tpot(llm, c, args.tokens, args.repeats, label))
            print(json.dumps(result["tpot"][-1]), flush=True)
    result["validity"] = bench_validity(llm, rng, args.requests)
    print(json.dumps(result["validity"]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "structured_output.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
