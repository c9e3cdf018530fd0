"""Which grammar library to constrain decoding with: xgrammar, llguidance or outlines-core, measured
on this CPU with the default model's tokenizer (SmolLM2, vocabulary 49152).

For each library: the compile time of a small schema and of a 50-property one, the per-step cost
of filling the token mask while a valid document is decoded (batch 1, and batch 32 with the
library's own batch call where it has one), and which JSON-schema features compile (a feature
that raises or is refused counts as not covered; outlines-core has no error for most features it
ignores, so its column is "compiles", an upper bound).

    PYTHONPATH=src python benchmarks/grammar_libs.py [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.tokenizer import Tokenizer

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
         "required": ["name", "age", "tags"], "additionalProperties": False}


def big_schema(n: int = 50) -> dict:
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"type": "string", "enum": ["a", "b", "c"]}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def doc_for(schema: dict) -> str:
    vals = {"string": "xyz", "integer": 7, "number": 1.5, "boolean": True}
    out = {}
    for k, s in schema["properties"].items():
        out[k] = s["enum"][0] if "enum" in s else (["t1", "t2"] if s["type"] == "array" else vals[s["type"]])
    return json.dumps(out)


FEATURES: dict[str, dict] = {
    "enum/const": {"type": "object", "properties": {"a": {"enum": [1, "x"]}, "b": {"const": 3}}},
    "string length": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[a-z]+[0-9]{2}$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "min/max": {"type": "integer", "minimum": 3, "maximum": 90},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "$ref/$defs": {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array",
                                                                                  "items": {"$ref": "#/$defs/n"}}}}},
                       "$ref": "#/$defs/n"},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "minProperties": {"type": "object", "minProperties": 1},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 1}, "else": {"type": "string"}},
    "not": {"not": {"type": "string"}},
    "nullable type list": {"type": ["string", "null"]},
}


def timed(fn, *args):  # noqa: ANN001, ANN002, ANN201
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


# -- llguidance ---------------------------------------------------------------------------------
class LLG:
    name = "llguidance"

    def __init__(self, hf) -> None:  # noqa: ANN001
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        self.m, self.lt = llguidance, lt
        self.tok = llguidance.hf.from_tokenizer(hf)

    def compile(self, schema: dict):  # noqa: ANN201
        g = self.m.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.m.LLMatcher(self.tok, g)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        matcher.compute_ff_tokens()  # llguidance is lazy: the first mask pays for part of the build
        return matcher

    def run(self, compiled, tokens: list[int], batch: int) -> list[float]:  # noqa: ANN001
        ms = [compiled.deep_copy() for _ in range(batch)]
        mask = self.lt.allocate_token_bitmask(batch, self.tok.vocab_size)
        times = []
        for t in tokens:
            s = time.perf_counter()
            if batch == 1:
                self.lt.fill_next_token_bitmask(ms[0], mask, 0)
            else:
                self.lt.fill_next_token_bitmask_par(self.exec, [(m, i) for i, m in enumerate(ms)], mask)
            times.append(time.perf_counter() - s)
            for m in ms:
                m.consume_token(t)
        return times

    @property
    def exec(self):  # noqa: ANN201
        if not hasattr(self, "_exec"):
            self._exec = self.m.LLExecutor()
        return self._exec


# -- xgrammar -----------------------------------------------------------------------------------
class XGR:
    name = "xgrammar"

    def __init__(self, hf) -> None:  # noqa: ANN001
        import xgrammar as xgr

        self.x = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.batcher = xgr.BatchGrammarMatcher()

    def compile(self, schema: dict):  # noqa: ANN201
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def run(self, compiled, tokens: list[int], batch: int) -> list[float]:  # noqa: ANN001
        ms = [self.x.GrammarMatcher(compiled) for _ in range(batch)]
        mask = self.x.allocate_token_bitmask(batch, self.info.vocab_size)
        times = []
        for t in tokens:
            s = time.perf_counter()
            if batch == 1:
                ms[0].fill_next_token_bitmask(mask, 0)
            else:
                self.batcher.batch_fill_next_token_bitmask(ms, mask)
            times.append(time.perf_counter() - s)
            for m in ms:
                m.accept_token(t)
        return times


# -- outlines-core ------------------------------------------------------------------------------
class OC:
    name = "outlines-core"

    def __init__(self, hf) -> None:  # noqa: ANN001
        import outlines_core as oc

        self.oc = oc
        vocab: dict[str, list[int]] = {}
        for text, i in hf.get_vocab().items():
            if i != hf.eos_token_id:
                vocab.setdefault(text, []).append(i)
        self.vocab = oc.Vocabulary(hf.eos_token_id, vocab)
        self.n = len(hf)

    def compile(self, schema: dict):  # noqa: ANN201
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocab)

    def run(self, compiled, tokens: list[int], batch: int) -> list[float]:  # noqa: ANN001
        gs = [self.oc.Guide(compiled) for _ in range(batch)]
        mask = torch.zeros((batch, (self.n + 31) // 32), dtype=torch.int32)
        times = []
        for t in tokens:
            s = time.perf_counter()
            for i, g in enumerate(gs):
                g.write_mask_into(mask[i].data_ptr(), mask[i].numel(), mask.element_size())
            times.append(time.perf_counter() - s)
            try:
                for g in gs:
                    g.advance(t)
            except ValueError:  # its regex tokenizes the document differently: stop the walk here
                break
        return times


def measure(lib, hf, steps: int) -> dict:  # noqa: ANN001
    out: dict = {"library": lib.name}
    for label, schema in (("small", SMALL), ("50-property", big_schema())):
        compiled, first = timed(lib.compile, schema)
        again = [timed(lib.compile, schema)[1] for _ in range(3)]
        out[f"compile_{label}_ms"] = round(1000 * min([first, *again]), 2)
        tokens = hf.encode(doc_for(schema), add_special_tokens=False)[:steps]
        for batch in (1, 32):
            times = lib.run(compiled, tokens, batch)
            out[f"mask_{label}_b{batch}_us"] = round(1e6 * statistics.median(times), 1)
            out[f"mask_{label}_b{batch}_steps"] = len(times)
    covered = []
    for feat, schema in FEATURES.items():
        try:
            lib.compile(schema)
            covered.append(feat)
        except Exception:  # noqa: BLE001 - a refusal is exactly what is measured
            pass
    out["features_covered"] = f"{len(covered)}/{len(FEATURES)}"
    out["features_missing"] = [f for f in FEATURES if f not in covered]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hf = Tokenizer(resolve_model_path("smollm2-135m-instruct"))._hf
    results = []
    for cls in (LLG, XGR, OC):
        try:
            lib = cls(hf)
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})")
            continue
        r = measure(lib, hf, args.steps)
        print(json.dumps(r))
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
