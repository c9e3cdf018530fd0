"""The grammar worker process's side (see api/grammar_worker.py): JSON-schema meta-validation, the
finite-instance check and the llguidance compile, one job at a time, answered over a pipe.

Imports only jsonschema, llguidance and the grammar module (not torch, not transformers), so a
fresh worker is ready in about a second. Every reply is a tuple: ("ok", seconds), or ("ok",
seconds, grammar text) for a compiled spec (the gateway builds its own matcher from that text: making
it from a schema holds the GIL, the matcher's constructor does not), or ("bad", param, message,
code); nothing is raised across the pipe.
"""

from __future__ import annotations

import json
import time
from multiprocessing.connection import Connection
from typing import Any

import jsonschema
import llguidance

from tokenpath.engine.heap import trim_heap
from tokenpath.engine.structured.finite import has_finite_instance
from tokenpath.engine.structured.grammar import GrammarError, compile_grammar, grammar_text, lower_priority
from tokenpath.protocol.sampling_params import StructuredOutput

Reply = tuple[Any, ...]


def meta_check(schema: Any, param: str) -> Reply | None:
    """The schema against its own metaschema (2020-12 unless it names another): None when valid."""
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return ("bad", param, f"{param} is not a valid JSON Schema: at {where}: {exc.message}", "invalid_request_error")
    return None


def check(tokenizer: llguidance.LLTokenizer, schemas: list[tuple[str, str]], spec: StructuredOutput | None,
          param: str) -> Reply:
    start = time.perf_counter()
    for where, text in schemas:
        bad = meta_check(json.loads(text), where)
        if bad is not None:
            return bad
    if spec is None:
        return ("ok", time.perf_counter() - start)
    if spec.kind == "json" and not spec.tools and not has_finite_instance(json.loads(spec.spec)):
        return ("bad", param, f"{param}: this schema has no finite instance (a required property refers back to "
                "its own object at every level), so no reply could ever match it; make the recursion optional",
                "invalid_grammar")
    try:
        text = grammar_text(spec)
        compile_grammar(tokenizer, spec, text)
    except GrammarError as exc:
        return ("bad", param, f"{param}: {exc.message}", "invalid_grammar")
    return ("ok", time.perf_counter() - start, text)


def serve(conn: Connection) -> None:
    """The worker's loop: until the pipe closes (the gateway exits, or kills it for a slow job).
    From its first check on it runs below the engine's priority (grammar.COMPILE_NICENESS), so a
    check takes only what decoding leaves of the cores. Its start and first tokenizer load come
    before that, at full priority: they are every structured request's first wait, not one spec's
    cost, and at low priority on a busy machine they took 7-20 s."""
    tokenizers: dict[str, llguidance.LLTokenizer] = {}
    lowered = False
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if msg[0] == "tokenizer":
                _, key, text, n_vocab, eos = msg
                tokenizers[key] = llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
                msg, text = ("tokenizer", key), ""  # (the message's text freed before the trim)
                trim_heap()  # the build's freed buffers (about a third of what it left resident)
                reply: Reply = ("ok", 0.0)
            else:
                if not lowered:
                    lower_priority()
                    lowered = True
                _, key, schemas, spec, param = msg
                reply = check(tokenizers[key], schemas, spec, param)
        except Exception as exc:  # the spec's fault, in a process where it can hurt nobody
            reply = ("bad", msg[-1] if msg[0] == "check" else "response_format",
                     f"the constraint could not be compiled: {type(exc).__name__}: {exc}", "invalid_grammar")
        conn.send(reply)


def main(argv: list[str]) -> None:
    """The worker over the socket whose descriptor its parent passed as argv[1] (grammar_worker._start)."""
    serve(Connection(int(argv[1])))
