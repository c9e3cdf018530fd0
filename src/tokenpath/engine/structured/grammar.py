"""A `StructuredOutput` spec -> an llguidance grammar -> a matcher for one tokenizer, cached.

The API compiles every spec once before admitting the request (so a bad schema is a 400 and a
compile over the time bound is refused there); the engine compiles it again for its own
tokenizer, from this module's cache, and hands each sequence a `deep_copy` of the cached matcher
(building a matcher is the expensive part; copying one is cheap).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.sampling_params import StructuredOutput

if TYPE_CHECKING:  # imported where a grammar is built: only structured requests pay for it (~6 MiB)
    import llguidance

# Compact JSON: a small model given flexible whitespace can spend its whole budget on newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256
# How much lower than the engine a compile or a schema check runs (Linux niceness). One request's
# constraint is that request's cost; decoding is everyone's. On 2 cores a compile at the engine's
# priority took a core from the step's two threads and doubled every stream's inter-token gap;
# lower, it takes what the step leaves. Its bound counts its CPU time, not the wait for a core
# (api/grammar_worker.py), so a busy machine does not turn a fine schema into a refusal.
COMPILE_NICENESS = 10


def lower_priority(thread_only: bool = False) -> None:
    """Run the calling thread (`thread_only`, Linux: a thread's niceness is its own) or the whole
    process at COMPILE_NICENESS below its current priority. Best effort: where the platform has
    no per-thread niceness, or refuses, nothing changes."""
    try:
        if thread_only:
            native = getattr(threading, "get_native_id", None)
            if native is None or not hasattr(os, "setpriority"):
                return
            tid = native()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS)
        else:
            os.nice(COMPILE_NICENESS)
    except OSError:
        pass


class GrammarError(InvalidRequestError):
    """The spec cannot be enforced: invalid, or using a feature the library does not implement."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message, param=param, code="invalid_grammar")


def _lark_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # Lark string literals take JSON's escapes


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a spec (raises GrammarError for a spec that is not even well-formed)."""
    import llguidance

    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if schema is True:
            schema = {}  # JSON Schema's `true`: any JSON value
        if schema is False or not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object (`false` matches nothing)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings", param="structured_outputs")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in choices))
    return llguidance.LLMatcher.grammar_from_lark(spec.spec)


@dataclass
class Compiled:
    matcher: llguidance.LLMatcher  # the template: never advanced, only copied
    seconds: float


def compile_grammar(tokenizer: llguidance.LLTokenizer, spec: StructuredOutput, text: str | None = None) -> Compiled:
    """Build (and check) a matcher; errors name what the library refused. `text`: the spec's
    grammar already made (`grammar_text`, by a grammar worker process): making it holds the GIL
    (~40 ms for a 2,000-value enum schema), where the matcher's constructor releases it."""
    import llguidance

    start = time.perf_counter()
    if text is None:
        text = grammar_text(spec)
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
    if matcher.is_error():
        raise GrammarError(_describe(spec, matcher.get_error()),
                           param="response_format" if spec.kind == "json" else "structured_outputs")
    warm_up(matcher, tokenizer.vocab_size)
    if matcher.is_error():
        raise GrammarError(_describe(spec, matcher.get_error()))
    return Compiled(matcher, time.perf_counter() - start)


def warm_up(matcher: llguidance.LLMatcher, vocab_size: int) -> None:
    """Build the matcher's lazy parts (the lexer states of the first position) now, not in the first
    decode step, by computing the first mask into a scratch buffer. Not `compute_ff_tokens`: that
    holds the GIL for as long as it runs (2.2 s for the regex `(a{1000}){2000}` here, freezing every
    thread of the process), where mask computation releases it (2.2 s, no other thread paused over
    20 ms) and the constructor does too."""
    buf = (ctypes.c_int32 * ((vocab_size + 31) // 32))()  # (not numpy: the grammar worker never imports it, 21 MiB)
    matcher.unsafe_compute_mask_ptr(ctypes.addressof(buf), ctypes.sizeof(buf))


def _describe(spec: StructuredOutput, error: str) -> str:
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}[spec.kind]
    first = error.strip().splitlines()[0] if error.strip() else "unknown error"
    if any(w in error for w in ("Unimplemented", "unimplemented", "not supported", "Unknown format")):
        return (f"this {what} uses a feature that constrained decoding cannot enforce here ({first}); "
                "remove it or express it another way")
    return f"invalid {what}: {first}"


@dataclass
class Lookup:
    matcher: llguidance.LLMatcher  # a fresh copy for one sequence
    compile_seconds: float  # 0 on a cache hit (the time to copy is negligible)
    hit: bool


class GrammarCache:
    """Compiled grammars of one tokenizer, least recently used first out. Thread-safe: the API
    compiles from worker threads while the engine thread looks up."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Compiled] = OrderedDict()

    def cached(self, spec: StructuredOutput) -> bool:
        """Whether `get` would be a cache hit (a copy, microseconds) rather than a compile."""
        with self._lock:
            return StructuredOutput(spec.kind, spec.spec) in self._cache

    def get(self, spec: StructuredOutput, text: str | None = None) -> Lookup:
        """A copy of the spec's matcher, compiled on a miss (from `text`, its grammar, if given)."""
        key = StructuredOutput(spec.kind, spec.spec)  # the `tools` flag does not change the grammar
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return Lookup(found.matcher.deep_copy(), 0.0, True)
        compiled = compile_grammar(self.tokenizer, key, text)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return Lookup(compiled.matcher.deep_copy(), compiled.seconds, False)
