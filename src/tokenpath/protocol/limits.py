"""Every bound a request is held to, declared once: one typed `Limit` per cap.

Before this table the caps lived in several homes (`Caps` in api/settings.py, the `MAX_*` constants
of protocol/sampling_params.py, api/schemas.py, api/structured.py, api/tools.py, ...), and some were
written twice (`MAX_TOP_LOGPROBS`; `Caps.max_n`'s ceiling and `MAX_N`). Now each place that
enforces a cap reads it here, and its error message takes the number from the entry, so a cap
cannot drift between the check, the message, the setting's default and the docs.

It sits in `protocol`, the lowest layer that enforces caps (the engine's own `SamplingParams`
checks), so the API, the gateway and the engine can all import it without importing upwards.
`tests/test_limits_table.py` keeps it the only home: a module-level `MAX_*`/`MIN_*` constant
elsewhere in src/ fails it (unless it is listed there as an internal bound, not a request's), as
does a cap written as a literal in a request schema's `Field(...)`; and
`tests/api/test_limits_enforced.py` sends each entry a request just over it, which must be
refused naming the entry's `param`.
`docs/limits.md` is generated from it (`markdown()`), and the same test checks it is current.

Where an operator can change a cap (`setting`, a `ServerConfig` field; `caps.*` in its YAML), the
entry's `value` is the default, and `least`/`most` are the range the setting accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
MIB = 1024 * 1024


@dataclass(frozen=True)
class Limit:
    """One cap. `value` is the largest allowed (a count, characters, bytes or seconds, as `unit`
    says); `least` is the smallest (0 but for the few ranges: a seed, a priority, top_k). `param` is
    the field an over-the-cap request's error names (None: refused before the body is parsed, by
    status code alone). `setting` is the config field that changes it (None: fixed), and
    `setting_least`/`setting_most` the values that setting accepts."""

    name: str
    value: int
    unit: str
    bounds: str
    param: str | None
    setting: str | None = None
    setting_least: int | None = None
    setting_most: int | None = None
    least: int = 0
    status: int = 400


# --- Operator-settable (`ServerConfig`; `caps:` in the YAML) --------------------------------------
N = Limit("n", 8, "choices", "choices generated for one request (`n`)", "n", "caps.max_n", 1, 16)
MAX_TOKENS = Limit("max_tokens", 4096, "tokens", "tokens one choice may generate (`max_tokens`, "
                   "`max_completion_tokens`)", "max_tokens", "caps.max_tokens", 1)
STOP = Limit("stop", 16, "sequences", "stop sequences in one request", "stop", "caps.max_stop", 0, 16)
MESSAGES = Limit("messages", 256, "messages", "messages in one chat request", "messages", "caps.max_messages", 1)
PROMPTS = Limit("prompts", 32, "prompts", "prompts in one /v1/completions request", "prompt", "caps.max_prompts", 1)
EMBEDDING_INPUTS = Limit("embedding_inputs", 2048, "inputs", "inputs in one /v1/embeddings request (OpenAI's "
                         "limit), and distinct texts in one rerank/score request", "input",
                         "caps.max_embedding_inputs", 1)
# Without it, 32 prompts x n=8 x 4096 tokens is a million tokens in one call.
REQUEST_TOKENS = Limit("request_tokens", 65536, "tokens", "tokens one request may cost: its prompt tokens "
                       "+ n x max_tokens for every prompt", "max_tokens", "caps.max_request_tokens", 1)
HEADER_BYTES = Limit("header_bytes", 16 * KIB, "bytes", "request headers (431 before the app runs)", None,
                     "caps.max_header_bytes", KIB, status=431)
BODY_BYTES = Limit("body_bytes", 4 * MIB, "bytes", "a request body (413 before it is parsed)", None,
                   "max_body_size", status=413)
CONVERSATION_BYTES = Limit("conversation_bytes", MIB, "bytes", "a stored Responses API conversation (a "
                           "`previous_response_id` chain with its new input)", "input",
                           "responses_max_bytes", KIB)
STREAM_UNSENT_BYTES = Limit("stream_unsent_bytes", MIB, "bytes", "output waiting in the gateway for one "
                            "streaming client that stopped reading; past it the stream is aborted", None,
                            "stream_max_unsent", KIB, status=499)

# --- Fixed: what the API accepts --------------------------------------------------------------------
TOP_LOGPROBS = Limit("top_logprobs", 20, "logprobs", "alternatives per token (`top_logprobs`, `logprobs`, "
                     "`prompt_logprobs`; OpenAI's bound)", "top_logprobs")
LOGIT_BIAS = Limit("logit_bias", 300, "entries", "entries in one `logit_bias` map", "logit_bias")
STOP_TOKEN_IDS = Limit("stop_token_ids", 64, "ids", "ids in `stop_token_ids`", "stop_token_ids")
SEED = Limit("seed", 2**63 - 1, "", "a request's `seed`: a signed 64-bit integer (OpenAI's and vLLM's)", "seed",
             least=-(2**63))
TIMEOUT_S = Limit("timeout", 86400, "seconds", "a request's own first-token `timeout`", "timeout")
KEEP_ALIVE_CHARS = Limit("keep_alive", 32, "characters", "Ollama's `keep_alive` as a string", "keep_alive")
PARSED_MESSAGES = Limit("parsed_messages", 4096, "messages", "messages in a /tokenize or /v1/messages body "
                        "(the schema's bound; generation then holds them to `messages`)", "messages")
DETOKENIZE_TOKENS = Limit("detokenize_tokens", 1_000_000, "ids", "token ids in one /detokenize request", "tokens")
TOOLS = Limit("tools", 128, "tools", "tools in one request", "tools")
TOOL_NAME_CHARS = Limit("tool_name_chars", 64, "characters", "a tool's name (letters, digits, '_', '.', '-'; "
                        "OpenAI's bound)", "tools.0.function.name")
TOOLS_CHARS = Limit("tools_chars", 128 * KIB, "characters", "the tool list, serialized", "tools")
PARALLEL_CALLS = Limit("parallel_calls", 8, "calls", "tool calls one constrained reply may make (the grammar's "
                       "bound; not a refusal)", None)
SPEC_BYTES = Limit("spec_bytes", 64 * KIB, "bytes", "one JSON schema, regex or grammar, serialized (a tool "
                   "grammar may be 4x this)", "response_format")
CHOICES = Limit("choices", 256, "choices", "entries of `guided_choice`", "guided_choice")
SCHEMA_DEPTH = Limit("schema_depth", 64, "levels", "JSON nesting of one schema (objects and arrays both count)",
                     "response_format")
SCHEMA_NODES = Limit("schema_nodes", 20_000, "values", "values in one schema", "response_format")
ENUM = Limit("enum", 500, "entries", "entries of one `enum` in a schema", "response_format")
ENUM_TOTAL = Limit("enum_total", 2_000, "entries", "entries of all `enum`s of one schema", "response_format")
PATTERN_CHARS = Limit("pattern_chars", 4_096, "characters", "one regex (`pattern`, `guided_regex`)",
                      "guided_regex")
REGEX_REPEAT = Limit("regex_repeat", 100_000, "characters", "a regex's bounded repetitions, multiplied out "
                     "through nested groups", "guided_regex")
METADATA = Limit("metadata", 16, "pairs", "`metadata` pairs of a Responses API request (OpenAI's limit)", "metadata")
RESPONSE_ID = Limit("response_id", 128, "characters", "a Responses API response id (longer: no such response)",
                    "previous_response_id", status=404)
NAME_CHARS = Limit("name_chars", 256, "characters", "a model, alias or LoRA adapter name", "lora_name")
PATH_CHARS = Limit("path_chars", 4096, "characters", "a LoRA adapter path (PATH_MAX on Linux)", "lora_path")
PRIORITY = Limit("priority", 2**31 - 1, "", "a request's scheduling priority (`x-priority`, `priority`): int32",
                 "priority", least=-(2**31))

# --- Fixed: what the engine accepts from any caller (the offline LLM, the link) ---------------------
ENGINE_N = Limit("engine_n", N.setting_most or 0, "choices", "`SamplingParams.n` (the most `caps.max_n` may be "
                 "set to)", "n")
ENGINE_STOP = Limit("engine_stop", STOP.setting_most or 0, "sequences", "`SamplingParams.stop` (the most "
                    "`caps.max_stop` may be set to)", "stop")
ENGINE_SPEC_CHARS = Limit("engine_spec_chars", 256 * KIB, "characters", "one structured-output spec at the "
                          "engine (the API caps it lower: `spec_bytes`)", "structured_outputs")
TOP_K = Limit("top_k", 2**31 - 1, "", "`top_k` (an int32 tensor element; larger than the vocabulary is "
              "disabled)", "top_k", least=-1)
TOKEN_ID = Limit("token_id", 2**31 - 1, "", "any token id (int32 in tensors and the native kernels)",
                 "stop_token_ids")
ENGINE_SEED = Limit("engine_seed", 2**64 - 1, "", "`SamplingParams.seed`: any 64-bit integer, signed or not "
                    "(seeded modulo 2**64)", "seed", least=-(2**63))

TABLE: tuple[Limit, ...] = (
    N, MAX_TOKENS, STOP, MESSAGES, PROMPTS, EMBEDDING_INPUTS, REQUEST_TOKENS, HEADER_BYTES, BODY_BYTES,
    CONVERSATION_BYTES, STREAM_UNSENT_BYTES,
    TOP_LOGPROBS, LOGIT_BIAS, STOP_TOKEN_IDS, SEED, TIMEOUT_S, KEEP_ALIVE_CHARS, PARSED_MESSAGES,
    DETOKENIZE_TOKENS, TOOLS, TOOL_NAME_CHARS, TOOLS_CHARS, PARALLEL_CALLS, SPEC_BYTES, CHOICES, SCHEMA_DEPTH, SCHEMA_NODES, ENUM,
    ENUM_TOTAL, PATTERN_CHARS, REGEX_REPEAT, METADATA, RESPONSE_ID, NAME_CHARS, PATH_CHARS, PRIORITY,
    ENGINE_N, ENGINE_STOP, ENGINE_SPEC_CHARS, TOP_K, TOKEN_ID, ENGINE_SEED,
)


def size_text(n: int) -> str:
    """A byte count as a setting writes it ("4MiB", "16KiB"), for the defaults of byte settings."""
    for unit, size in (("MiB", MIB), ("KiB", KIB)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _number(n: int) -> str:
    return f"{n:,}"


def markdown() -> str:
    """docs/limits.md: the table as a reader sees it (tests/test_limits_table.py keeps the file equal)."""
    lines = [
        "# Request limits",
        "",
        "Generated from `src/tokenpath/protocol/limits.py` (`python -m tokenpath.protocol.limits > docs/limits.md`);",
        "`tests/test_limits_table.py` fails when this file and the table differ. A request over a limit",
        "is refused with the status shown and an error whose `param` names the field. Where a setting",
        "is given, the value is its default and the operator may change it (`--config server.yaml`).",
        "",
        "| limit | value | bounds | param | status | setting (accepted range) |",
        "|---|---|---|---|---|---|",
    ]
    for lim in TABLE:
        value = _number(lim.value) if lim.least == 0 else f"{_number(lim.least)} .. {_number(lim.value)}"
        if lim.unit:
            value += f" {lim.unit}"
        setting = ""
        if lim.setting is not None:
            low = "" if lim.setting_least is None else _number(lim.setting_least)
            high = "" if lim.setting_most is None else _number(lim.setting_most)
            setting = f"`{lim.setting}` ({low} .. {high})" if low or high else f"`{lim.setting}`"
        param = "" if lim.param is None else f"`{lim.param}`"
        lines.append(f"| `{lim.name}` | {value} | {lim.bounds} | {param} | {lim.status} | {setting} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
