"""A request body's output constraint -> one `StructuredOutput`, checked and compiled before admission.

The names clients send, OpenAI's first: `response_format` (`json_object`, `json_schema` with its
`strict`), then vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`) and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be given.

Every constraint is enforced, `strict` or not: a JSON-schema feature the grammar library cannot
enforce is a 400 naming it, never dropped (OpenAI's non-strict mode guarantees nothing; here it
guarantees the same as strict). The schema must be valid JSON Schema (checked against the 2020-12
metaschema), and the compile is bounded in time: a grammar that takes longer is a 400.

Cheapest first: on the event loop only linear, bounded checks (api/spec_limits.py: depth, size,
enums, regexes); the meta-validation, the finite-instance check and the compile run in a worker
process (api/grammar_worker.py) that is killed at the bound. Only a spec the worker compiled within
it is then compiled here for the gateway's grammar cache (which an in-process engine shares), from
the grammar text the worker made (making it from a schema holds the GIL), on a thread below the
engine's priority (`GrammarWorkers.local`): llguidance's constructor and mask computation release
the GIL, but at full priority they took a core from the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

from tokenpath.api.grammar_worker import COMPILE_TIMEOUT_S, GrammarWorkers
from tokenpath.api.spec_limits import check_json_shape, check_regex
from tokenpath.engine.structured import GrammarCache, GrammarError
from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.limits import CHOICES, SPEC_BYTES
from tokenpath.protocol.sampling_params import StructuredOutput

__all__ = ["COMPILE_TIMEOUT_S", "CompileInfo", "check_schema", "compile_checked", "requested", "warm_grammars"]


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def check_schema(schema: Any, param: str, checks: list[tuple[str, str]] | None = None) -> str:
    """The schema serialized, after the cheap checks (shape, depth, enums, regexes, size). Whether
    it is valid JSON Schema is the grammar worker's to say (`compile_checked`): jsonschema's check
    can take seconds of pure Python: `checks` collects (param, text) for it."""
    if not isinstance(schema, dict | bool):
        raise _bad(param, f"{param} must be a JSON Schema object")
    check_json_shape(schema, param)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > SPEC_BYTES.value:
        raise _bad(param, f"{param} is {len(text.encode())} bytes, over the limit of {SPEC_BYTES.value}; send a "
                   "smaller schema")
    if checks is not None:
        checks.append((param, text))
    return text


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(param, f"{param} must be a non-empty string")
    if len(value) > SPEC_BYTES.value:
        raise _bad(param, f"{param} is {len(value)} characters, over the limit of {SPEC_BYTES.value}")
    return value


def _regex(value: Any, param: str) -> str:
    text = _text(value, param)
    check_regex(text, param)
    return text


def _choice(value: Any, param: str) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad(param, f"{param} must be a non-empty list of non-empty strings")
    if len(value) > CHOICES.value:
        raise _bad(param, f"{param} has {len(value)} choices, over the limit of {CHOICES.value}")
    return _text(json.dumps(value, ensure_ascii=False), param)


def _schema_value(value: Any, param: str, checks: list[tuple[str, str]] | None) -> str:
    if isinstance(value, str):  # vLLM accepts the schema as a JSON string too
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(param, f"{param} is a string that is not JSON; send the schema as an object") from None
    return check_schema(value, param, checks)


def from_response_format(rf: dict[str, Any], checks: list[tuple[str, str]] | None = None) -> StructuredOutput | None:
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json", '{"type":"object"}')
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js and "json_schema" not in js:
            raise _bad("response_format.json_schema", "response_format.json_schema must be an object with a "
                       "'name' and a 'schema'")
        if not isinstance(js.get("strict", False), bool | None):
            raise _bad("response_format.json_schema.strict", "strict must be a boolean")
        return StructuredOutput("json", check_schema(js.get("schema", js.get("json_schema")),
                                                     "response_format.json_schema.schema", checks))
    raise _bad("response_format.type", f"response_format.type must be 'text', 'json_object' or 'json_schema', "
               f"got {kind!r}")


_VLLM_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def from_vllm(so: dict[str, Any], checks: list[tuple[str, str]] | None = None) -> StructuredOutput | None:
    given = {k: v for k, v in so.items() if v is not None}
    unknown = sorted(set(given) - set(_VLLM_KEYS) - {"json_object", "disable_fallback", "disable_any_whitespace",
                                                      "disable_additional_properties", "whitespace_pattern"})
    if unknown:
        raise _bad(f"structured_outputs.{unknown[0]}", f"structured_outputs.{unknown[0]} is not supported; use one "
                   "of json, regex, choice, grammar")
    kinds = [k for k in _VLLM_KEYS if k in given]
    if given.get("json_object"):
        kinds.append("json_object")
    if len(kinds) > 1:
        raise _bad("structured_outputs", f"structured_outputs takes one constraint, got {', '.join(kinds)}")
    if not kinds:
        return None
    k = kinds[0]
    param = f"structured_outputs.{k}"
    if k == "json_object":
        return StructuredOutput("json", '{"type":"object"}')
    if k == "json":
        return StructuredOutput("json", _schema_value(given[k], param, checks))
    if k == "choice":
        return StructuredOutput("choice", _choice(given[k], param))
    if k == "regex":
        return StructuredOutput(k, _regex(given[k], param))
    return StructuredOutput(k, _text(given[k], param))


def requested(body: Any, checks: list[tuple[str, str]] | None = None) -> StructuredOutput | None:
    """The one constraint a body asks for, or None. Two ways of asking at once is a 400. Its JSON
    schema, if any, goes into `checks` with its parameter, for the worker's meta-validation."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = getattr(body, "response_format", None)
    if rf:
        spec = from_response_format(rf, checks)
        if spec is not None:
            found.append(("response_format", spec))
    if body.structured_outputs:
        spec = from_vllm(body.structured_outputs, checks)
        if spec is not None:
            found.append(("structured_outputs", spec))
    if body.guided_json is not None:
        found.append(("guided_json", StructuredOutput("json", _schema_value(body.guided_json, "guided_json", checks))))
    if body.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput("regex", _regex(body.guided_regex, "guided_regex"))))
    if body.guided_choice is not None:
        found.append(("guided_choice", StructuredOutput("choice", _choice(body.guided_choice, "guided_choice"))))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutput("grammar", _text(body.guided_grammar, "guided_grammar"))))
    if len(found) > 1:
        raise _bad(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output; send only one")
    return found[0][1] if found else None


@dataclass(frozen=True)
class CompileInfo:
    """For the trace and the audit row."""

    kind: str
    compile_ms: float
    cache_hit: bool


async def compile_checked(workers: GrammarWorkers, tokenizer: Any, spec: StructuredOutput | None, param: str,
                          schemas: list[tuple[str, str]] | None = None) -> CompileInfo | None:
    """Meta-validate `schemas` and compile `spec` in a grammar worker, bounded; then, for a spec that
    passed, compile it here too, for the gateway's cache. What the library refuses, or a job over
    the bound, becomes a 400 naming the parameter."""
    source = await asyncio.to_thread(tokenizer.grammar_source)  # serialized once per tokenizer
    reply = await workers.check(source, list(schemas or []), spec, param)
    if reply[0] in ("timeout", "died"):
        how = (f"took longer than {workers.timeout:g} s of CPU time" if reply[0] == "timeout"
               else "exhausted the compiler (its worker process died)")
        raise InvalidRequestError(f"{param}: compiling this constraint {how}; simplify it", param=param,
                                  code="grammar_too_complex")
    if reply[0] == "bad":
        _, where, message, code = reply
        if code == "invalid_grammar":
            raise GrammarError(message, param=where)
        raise InvalidRequestError(message, param=where)
    if spec is None:
        return None
    loop = asyncio.get_running_loop()
    cache: GrammarCache = await loop.run_in_executor(workers.local, lambda: tokenizer.grammars)  # first use: ~1 s
    text = reply[2] if len(reply) > 2 else None  # the grammar the worker made: making it holds the GIL
    start = time.perf_counter()
    try:
        found = await loop.run_in_executor(workers.local, cache.get, spec, text)
    except GrammarError as exc:
        raise GrammarError(f"{param}: {exc.message}", param=param) from None
    return CompileInfo(spec.kind, round(1000 * (time.perf_counter() - start), 3) if not found.hit else 0.0,
                       found.hit)


def grammar_tokenizers(tokenizers: list[Any]) -> list[Any]:
    """The tokenizers that structured output can use (a chat model's; not an embedding model's)."""
    return [t for t in tokenizers if t is not None and hasattr(t, "grammar_source")]


def warm_grammar_caches(tokenizers: list[Any]) -> None:
    """At start-up, before serving (blocking: run it on a thread): serialize each tokenizer for the
    grammar workers and read its vocabulary into llguidance for the gateway's grammar cache. Both
    hold the GIL (~0.3 s and ~0.8 s for SmolLM2's 49k tokens), so on the first structured request
    they froze every stream of the process for a second; here they delay start-up instead."""
    for tok in grammar_tokenizers(tokenizers):
        with contextlib.suppress(Exception):  # (if it cannot be read, the first structured request says why)
            tok.grammar_source()
            _ = tok.grammars


async def warm_grammars(workers: GrammarWorkers, tokenizers: list[Any]) -> None:
    """Start a grammar worker with each tokenizer loaded (in the background, once serving: a
    spawn, imports and a vocabulary, ~2 s of CPU in a process of its own, which the first
    structured request paid before)."""
    for tok in grammar_tokenizers(tokenizers):
        await workers.start(tok.grammar_source())
