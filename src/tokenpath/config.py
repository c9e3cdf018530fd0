"""One configuration object behind `LLM(...)` keyword arguments and `tokenpath serve` flags.

`EngineConfig` holds the engine's knobs, each declared once here with its description: the
`serve` and `engine` commands generate their engine flags from these fields (`add_model_flags`),
so a new knob is one field. The server and gateway settings live beside it in `ServerConfig`
(`tokenpath.server.config`), a pydantic model that takes EngineConfig in as its `engine`. The
engine's settings are plain dataclasses checked by `tokenpath.knobs`, so the engine path (`LLM`,
an engine process's engine) imports no pydantic; YAML files, the engine link and CLI flags all
build them through the same checks. `ENV_VARS` lists every `TOKENPATH_*` environment variable the
package reads (`tokenpath --help` prints it; a test keeps it complete).
"""

from __future__ import annotations

import json
import os
import re
import stat
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tokenpath.knobs import KnobInfo, Settings, knob

if TYPE_CHECKING:  # argparse is the CLI's (0.4 MiB): `LLM(...)` and an engine build no parser
    import argparse

DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"
DEFAULT_POLICY = "prefix_aware"  # the replica picker when none is named (routing.replicas has them all)
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2, "MIB": 1024**2,
          "G": 1000**3, "GB": 1000**3, "GIB": 1024**3}


def parse_bytes(value: str | int) -> int:
    """'2GiB' -> 2147483648. Integers are bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a memory size: {value!r} (use e.g. '512MiB' or '2GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


_DURATION = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str | float | int) -> float:
    """Seconds from Ollama's `keep_alive` spellings: a number of seconds, or '90s', '5m', '1h',
    '1h30m'. A negative value means for ever (returned as -1.0); 0 means at once."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r} (use e.g. '5m', '30s' or seconds)")
    if isinstance(value, (int, float)):
        return -1.0 if value < 0 else float(value)
    text = str(value).strip().lower()
    if text.startswith("-"):
        parse_duration(text[1:])  # (still checked)
        return -1.0
    parts = re.findall(r"([0-9]*\.?[0-9]+)\s*(ms|s|m|h|d|)", text)
    if not parts or re.sub(r"[0-9.]+\s*(ms|s|m|h|d)?", "", text).strip():
        raise ValueError(f"not a duration: {value!r} (use e.g. '5m', '30s' or seconds)")
    return sum(float(n) * _DURATION[u] for n, u in parts)


# The gateway's Redis limits (gateway.redis_limits, `serve --redis-timeout`): how long one check
# waits on Redis (connecting, or a command's reply) before Redis counts as unreachable. A refused
# connection fails at once whatever this is; it bounds a Redis that is slow or blackholed. 1 s was
# too short on a loaded host: a burst of requests opening their connections on a busy event loop
# took longer than that, and limits failed closed (503) with Redis healthy.
REDIS_TIMEOUT_S = 5.0


KERNEL_MASK_ALL = 0b11111  # the native kernels' five matmuls: qkv, o, gate_up, down, head


def kernel_isa_from_env() -> str:
    """TOKENPATH_KERNELS_ISA, lower-cased; unset, or a value other than avx2 / avx512, is auto (as
    the variable always read)."""
    value = os.environ.get("TOKENPATH_KERNELS_ISA", "").strip().lower()
    return value if value in ("avx2", "avx512") else "auto"


def kernel_mask_from_env(name: str) -> int | None:
    """A kernel bit mask from the variable `name`: 1/all/true = all five matmuls, 0 = none, or a
    number such as 0x8 (higher bits ignored); unset: None (the kernels' default)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "all", "true"):
        return KERNEL_MASK_ALL
    try:
        return int(value, 0) & KERNEL_MASK_ALL
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected 1, all, 0 or a bit mask such as 0x8 "
                         "(bits: qkv, o, gate_up, down, head)") from None


# llama.cpp's and vLLM's other names for the n-gram (prompt lookup) proposer.
SPEC_METHOD_ALIASES = {"ngram": "ngram", "prompt_lookup": "ngram", "ngram-simple": "ngram", "ngram_simple": "ngram",
                       "draft_model": "draft_model", "draft": "draft_model", "suffix": "suffix"}
MAX_SPEC_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig(Settings):
    """Speculative decoding, in vLLM's `--speculative-config` JSON spelling. Three proposers: n-gram
    (prompt lookup) proposes the K tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min); draft_model runs
    a smaller model of the same vocabulary (`model`) greedily for K tokens; suffix drafts the most
    frequent continuation from suffix tries over the request and recent requests' outputs
    (engine/spec/suffix.py, the suffix_decoding_* fields). Each is verified in one forward pass
    (engine/spec/). As in vLLM, `model` without a method means draft_model.
    Checked once, at start-up: a wrong field is an error naming it, never a silently slower engine."""

    method: str | None = knob(None, description="proposer: ngram (aliases: prompt_lookup, ngram-simple), "
                                                   "draft_model (alias: draft) or suffix (default: draft_model "
                                                   "where `model` is given, else ngram)")
    model: str | None = knob(None, description="draft_model: the draft model (a GGUF file or a checkpoint "
                                                "directory) sharing the target's vocabulary")
    num_speculative_tokens: int = knob(ge=1, le=MAX_SPEC_TOKENS, description="K: draft tokens per step")
    prompt_lookup_max: int = knob(3, ge=1, le=64, description="longest n-gram matched")
    prompt_lookup_min: int = knob(1, ge=1, le=64, description="shortest n-gram matched")
    # Batching: above this many decoding sequences nobody drafts (the step is compute-bound, rejected drafts
    # cost the batch). 4, measured (benchmarks/spec_batch.py, copy + free, K = 16, CPU time): c = 2 1.31x,
    # c = 4 0.99x, c = 8 0.88x on/off; it was 8.
    max_batch: int = knob(4, ge=1, description="decoding sequences above which a step does not speculate")
    # engine/spec/state.py: "adaptive" prices rows by measured step times under the cap, stops losing streams.
    draft_policy: Literal["adaptive", "rule", "cost"] = knob("adaptive", description="draft policy: adaptive|rule|cost")
    # method suffix (vLLM's names and defaults; engine/spec/suffix.py).
    suffix_decoding_max_tree_depth: int = knob(24, ge=3, le=256, description="suffix: the tries' depth, which "
                                                "bounds the match length plus the drafts")
    suffix_decoding_max_cached_requests: int = knob(10000, ge=0, description="suffix: recent requests whose "
                                                     "outputs the global trie holds (0: none; also bounded in nodes)")
    suffix_decoding_max_spec_factor: float = knob(1.0, gt=0, le=64, description="suffix: drafts at most this "
                                                   "times the match length")
    suffix_decoding_min_token_prob: float = knob(0.1, ge=0, le=1, description="suffix: drafts only tokens whose "
                                                  "estimated probability (from the counts) is at least this")

    def check(self) -> None:
        method = SPEC_METHOD_ALIASES.get((self.method or ("draft_model" if self.model else "ngram")).strip().lower())
        if method is None:
            raise ValueError(f"SpeculativeConfig.method: unknown speculative method {self.method!r}: expected one "
                             f"of {sorted(SPEC_METHOD_ALIASES)}")
        object.__setattr__(self, "method", method)
        if self.method == "draft_model" and not self.model:
            raise ValueError("method draft_model needs `model`: the draft model's path")
        if self.method != "draft_model" and self.model:
            raise ValueError(f"`model` is the draft model of method draft_model, not of {self.method}")
        stray = sorted(f for f, info in self.fields().items()  # (a dump of a config repeats defaults)
                       if f.startswith("suffix_decoding_") and getattr(self, f) != info.default)
        if stray and self.method != "suffix":
            raise ValueError(f"{stray[0]} is a field of method suffix, not of {self.method}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")


@dataclass(kw_only=True)
class EngineConfig(Settings):
    """The engine's knobs, checked once at construction (`LLM(...)`, flags, YAML, the engine link):
    a plain dataclass, so the engine path imports no pydantic (tokenpath.knobs says why)."""

    model: str = DEFAULT_CHAT_MODEL
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", description="auto: bf16/fp16/fp32 safetensors run on the native CPU kernels on their own values "
                            "(float32 activations); on torch, bfloat16 on CPUs with BF16 (a float32 checkpoint "
                            "included, as vLLM downcasts it), else float32; float16 on CUDA without bf16")
    device: str = knob("auto", description="torch device; auto: CUDA when present, else CPU")
    # auto: GGUF weights run on the native CPU kernels in their own blocks, and bf16/fp16/fp32
    # safetensors on their own values (torch when the kernels are not built or the CPU lacks AVX2,
    # or when --dtype asks for a 16-bit type other than the file's); none: torch float path; q8_0:
    # every matrix Q8_0 on the native kernels, any checkpoint (quantized at load); q4_k: every
    # matrix Q4_K (Q5_0 where a row is not whole 256-weight super-blocks), the embedding and head
    # Q8_0 (engine/kernels/model.py). The default comes from TOKENPATH_QUANTIZATION when set, so CI
    # can run the whole suite on one path.
    quantization: Literal["auto", "none", "q8_0", "q4_k"] = knob(
        factory=lambda: os.environ.get("TOKENPATH_QUANTIZATION", "auto"),
        description="auto: native kernels on GGUF blocks and bf16/fp16/fp32 safetensors; none: torch float; "
                    "q8_0: every matrix Q8_0; q4_k: Q4_K (Q5_0 where rows are not whole 256-blocks; "
                    "embedding and head Q8_0), quantized at load "
                    "(default: $TOKENPATH_QUANTIZATION, else auto)")
    block_size: int = knob(16, ge=1, le=256, description="tokens per KV cache block")
    # What the KV cache stores (vLLM's --kv-cache-dtype). auto: float16 on the native CPU kernels
    # (half the memory per token; converted in registers, needs F16C, else float32), the model's
    # dtype on the torch path. fp8_e4m3 (alias fp8) and fp8_e5m2: one byte per value, native
    # kernels only (csrc/kv_fp8.h: no per-tensor scale, vLLM's default k_scale = v_scale = 1).
    # kv_cache_memory stays a byte budget, so float16 holds twice float32's tokens and fp8 twice
    # float16's. q8_0: llama.cpp's cache type (blocks of 32 int8 with a half scale, 34 bytes).
    # Bytes per token: 2 * layers * kv_heads * head_dim * (4, 2, 1, 34/32).
    # The default comes from TOKENPATH_KV_CACHE_DTYPE when set (as --quantization's), so CI can run
    # the prefix-cache, speculative and window tests on an fp8 pool unchanged.
    kv_cache_dtype: Literal["auto", "float32", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "q8_0"] = knob(
        factory=lambda: os.environ.get("TOKENPATH_KV_CACHE_DTYPE", "auto"),
        description="KV cache storage; auto: float16 on the native CPU kernels, the model dtype on torch; "
                    "float32: 4 bytes per value; float16: 2; fp8_e4m3 (alias fp8: 3 mantissa bits, max 448) "
                    "and fp8_e5m2 (2 mantissa bits, max 57344): 1 byte, native kernels only, no scaling; "
                    "q8_0: llama.cpp's blocks of 32 int8 with a half scale, 34/32 bytes, native kernels only, "
                    "head_dim a multiple of 32; bytes per token = 2 * layers * kv_heads * head_dim * that "
                    "(default: $TOKENPATH_KV_CACHE_DTYPE, else auto)")
    # The byte budget. 512 MiB holds 23k tokens of SmolLM2-135M in float16 (11.6k on the float32
    # torch path). The block pool's pages become resident as blocks are first used, and the free
    # list hands out the least recently freed block (prefix-cache eviction order), so a long-running
    # server touches the whole budget: this is its steady-state KV memory, not just a cap.
    kv_cache_memory: str | int = knob("512MiB", description="the KV cache's byte budget, e.g. 512MiB or 2GiB")
    # The memory of this many blocks of every layer (a model whose window layers keep only their
    # window gets more, smaller pages from it: engine/kv_groups.py).
    num_kv_blocks: int | None = knob(None, ge=1, description="KV cache blocks (overrides --kv-cache-memory)")
    max_num_batched_tokens: int = knob(1024, ge=1, description="most tokens one engine step computes")
    # Most prompt tokens one sequence may prefill per step (vLLM's name); 0: up to the budget.
    # A cap lets short prompts and decodes share steps with a long prefill instead of waiting
    # behind all of it.
    long_prefill_token_threshold: int = knob(
        0, ge=0, description="most prompt tokens one request prefills per step (0: no cap)")
    max_num_seqs: int = knob(64, ge=1, description="most requests running at once")
    max_model_len: int | None = knob(
        None, ge=1, description="longest prompt + completion (default: the model's context, capped at 8192)")
    enable_prefix_caching: bool = knob(True, description="reuse the KV blocks of prompts seen before")
    # vLLM's name. False (default): sliding-window layers keep only their window's KV blocks
    # (engine/kv_groups.py); True: every layer's blocks for the whole context (the baseline).
    disable_hybrid_kv_cache_manager: bool = knob(
        False, description="keep every layer's KV blocks for the whole context (sliding-window layers too)")
    # llama.cpp's --warmup (on by default there too): the first forward pass pays one-time costs,
    # which would otherwise land on the first request's TTFT (EngineCore._warm_up).
    warmup: bool = knob(True, description="run one short request through the engine before it serves, so the "
                         "first user's time to first token does not pay the engine's one-time set-up")
    seed: int = knob(0, description="seed of the engine's sampling generator")
    # A Jinja chat template file (vLLM's --chat-template): replaces the model's own, or gives a
    # model without one (a base model such as gemma-3-270m) /v1/chat/completions.
    chat_template: str | None = knob(
        None, description="Jinja chat template FILE replacing the model's own (needed for chat on a base model)")
    # LoRA adapters (vLLM's flags): how many distinct adapters one step may hold (an LRU of
    # resident slots), the largest rank accepted, and how many parsed adapters stay cached in
    # memory beyond those (default: max_loras), so a returning adapter skips the disk.
    max_loras: int = knob(4, ge=1, description="most LoRA adapters resident at once (one step may mix them)")
    max_lora_rank: int = knob(64, ge=1, le=256, description="largest LoRA rank accepted")
    max_cpu_loras: int | None = knob(
        None, ge=1, description="parsed LoRA adapters kept in memory (default: --max-loras)")
    # The native CPU kernels' knobs (engine/kernels/), each defaulting to its environment variable
    # (TOKENPATH_KERNELS_ISA, TOKENPATH_KERNELS_FINE, TOKENPATH_KERNELS_EXACT) as before they were
    # flags. The masks have a bit per matmul (1 qkv, 2 o, 4 gate_up, 8 down, 16 head): "fine"
    # activations are int8 plus residual bytes (~15 bits; all five by default:
    # engine/kernels/precision.py says why), "exact" ones stay float (GGUF layouts, slowest). None:
    # the kernels' default.
    kernels_isa: Literal["auto", "avx2", "avx512"] = knob(
        factory=lambda: kernel_isa_from_env(),
        description="native kernel set: auto (AVX-512 VNNI where the CPU and build have it, else AVX2), avx2 or "
                    "avx512 (default: $TOKENPATH_KERNELS_ISA, else auto)")
    kernels_fine: int | None = knob(
        factory=lambda: env_kernels_fine(), ge=0, le=KERNEL_MASK_ALL,
        description="bit mask of native matmuls (1 qkv, 2 o, 4 gate_up, 8 down, 16 head) whose int8 activations "
                    "carry residual bytes, ~15 bits (default: $TOKENPATH_KERNELS_FINE, else 31: all)")
    kernels_prompt_fine: int | None = knob(
        factory=lambda: env_kernels_prompt_fine(), ge=0, le=KERNEL_MASK_ALL,
        description="bit mask (as --kernels-fine) of the matmuls whose prompt rows carry residual bytes too; "
                    "the rest of a prompt runs llama.cpp's int8 activations, for a faster prefill "
                    "(default: $TOKENPATH_KERNELS_PROMPT_FINE, else 1: qkv)")
    kernels_bf16: int | None = knob(
        factory=lambda: env_kernels_bf16(), ge=0, le=KERNEL_MASK_ALL,
        description="bit mask (as --kernels-fine) of the matmuls whose bf16 weights multiply bf16 activations on "
                    "AMX tiles or AVX512_BF16's VDPBF16PS, every row, as vLLM and transformers compute a bf16 "
                    "checkpoint; the rest take float32 activations (default: $TOKENPATH_KERNELS_BF16, else 31: all, "
                    "on CPUs with AMX-BF16 or AVX512_BF16; none elsewhere); with AMX, where any bit is set, prompt "
                    "rows' attention runs on the tiles too")
    kernels_exact: int | None = knob(
        factory=lambda: env_kernels_exact(), ge=0, le=KERNEL_MASK_ALL,
        description="bit mask of native matmuls (as --kernels-fine) that keep float activations, slowest "
                    "(default: $TOKENPATH_KERNELS_EXACT, else 0)")

    # vLLM's --speculative-config: a JSON object (or, from YAML and `LLM(...)`, a mapping).
    speculative_config: SpeculativeConfig | None = knob(
        None, description='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                          '"prompt_lookup_max": 3, "prompt_lookup_min": 1}\' (off when not given)')

    def check(self) -> None:
        try:
            parse_bytes(self.kv_cache_memory)
        except ValueError as exc:
            raise ValueError(f"EngineConfig.kv_cache_memory: {exc}") from None

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)


# EngineConfig fields with no flag of their own: `--model` (repeatable: one engine per model)
# and `--served-model-name` (router aliases) feed them.
ENGINE_NOT_FLAGS = frozenset({"model", "served_model_name"})


def engine_flag_names() -> tuple[str, ...]:
    """The EngineConfig fields that `serve` and `engine` take as flags of the same name."""
    return tuple(name for name in EngineConfig.fields() if name not in ENGINE_NOT_FLAGS)


@dataclass(frozen=True)
class Flag:
    """How a field's flag differs from the plain one `add_model_flags` makes, given in the field's
    `Annotated[...]`: another name (`models` is `--model`), a metavar, and for a list how its values
    gather: `append` (`--x a --x b`), `extend` (`--x a b`, or repeated) or `csv` (`--x a,b`, or repeated)."""

    name: str | None = None
    metavar: str | None = None
    gather: Literal["append", "extend", "csv"] = "extend"


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def model_fields(model: type) -> dict[str, typing.Any]:
    """A settings class's fields by name: a pydantic model's `FieldInfo`s (the server's settings) or
    a `Settings` dataclass's `KnobInfo`s (the engine's), which have the attributes read here."""
    return model.fields() if issubclass(model, Settings) else model.model_fields  # type: ignore[attr-defined]


def default_text(field: KnobInfo | typing.Any) -> str | None:  # noqa: ANN401 - or a pydantic FieldInfo
    """A field's default as `--help` shows it, or None: no default worth showing (None, an empty
    list), or a description that already says what the default is (one read from a variable)."""
    if "default" in (field.description or "").lower():
        return None
    value = field.get_default(call_default_factory=True)
    if value is None or value == [] or value == {} or hasattr(value, "model_dump") or isinstance(value, Settings):
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def add_model_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, model: type,
                    names: typing.Iterable[str]) -> None:
    """One flag per field (`max_num_seqs` -> `--max-num-seqs`), typed and described by the field,
    its help ending with the field's default (`default_text`): declared once, on the field.
    Every default is None, so a flag not given leaves the `--config` file's value or the field's
    default in place (`server.config.build_config`); a bool is `--x` / `--no-x`."""
    from argparse import BooleanOptionalAction

    for name in names:
        field = model_fields(model)[name]
        flag = next((m for m in field.metadata if isinstance(m, Flag)), Flag())
        shown = default_text(field)
        help_text = (field.description or "") + (f" (default: {shown})" if shown is not None else "")
        kwargs: dict[str, typing.Any] = {"dest": name, "default": None, "help": help_text.replace("%", "%%")}
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) is Literal:
            kwargs["choices"] = list(typing.get_args(ann))
        elif ann is bool:
            kwargs["action"] = BooleanOptionalAction
        elif ann in (int, float) or (isinstance(ann, types.UnionType) and args in ([int], [float])):
            kwargs["type"] = args[0] if args else ann
        elif typing.get_origin(ann) is list:
            kwargs["action"] = "append" if flag.gather == "append" else "extend"
            if flag.gather == "extend":
                kwargs["nargs"] = "+"
            elif flag.gather == "csv":
                kwargs["type"] = _csv
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
        elif "FILE" in (field.description or ""):
            kwargs["metavar"] = "FILE"
        elif "bit mask" in (field.description or ""):
            kwargs["metavar"] = "MASK"
        parser.add_argument("--" + (flag.name or name).replace("_", "-"), **kwargs)


def model_argv(config: Settings, names: typing.Iterable[str]) -> list[str]:
    """The flags `add_model_flags` made that give `config`'s values where they are not the
    defaults: what another process (a local engine) must be started with to get the same config."""
    defaults = type(config)()
    argv: list[str] = []
    for name in names:
        value = getattr(config, name)
        if value is None or value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, Settings):  # a nested config (--speculative-config): its JSON
            argv += [flag, json.dumps(value.as_dict())]
        else:
            argv += [flag, str(value)]
    return argv


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str


# Every TOKENPATH_* environment variable the package reads (tests/test_config_registry.py checks
# it against the source), shown by `tokenpath --help`.
ENV_VARS = (
    EnvVar("TOKENPATH_DATA_DIR", "keys, audit log and caches (as --data-dir; default: XDG data home)"),
    EnvVar("TOKENPATH_DATABASE_URL", "Postgres URL for keys and audit (as --database-url; default: SQLite)"),
    EnvVar("TOKENPATH_REDIS_URL", "shared rate limits in Redis (as --redis-url)"),
    EnvVar("TOKENPATH_THINKING_SIGNING_KEY", "the key that signs /v1/messages thinking blocks (as "
           "--thinking-signing-key; default: a random key kept in the data dir)"),
    EnvVar("TOKENPATH_API_KEY", "a static API key (as --api-key; also the default of `trace --api-key`)"),
    EnvVar("TOKENPATH_POLICY", "the gateway's default tenant policy"),
    EnvVar("TOKENPATH_AUDIT_TEXT", "1: keep prompt and completion text in the audit log and request logs"),
    EnvVar("TOKENPATH_GRAMMAR_WARMUP", "0: the default of --grammar-warmup is off (the test suite's servers)"),
    EnvVar("TOKENPATH_QUANTIZATION", "the default of --quantization (auto, none, q8_0, q4_k)"),
    EnvVar("TOKENPATH_KV_CACHE_DTYPE", "the default of --kv-cache-dtype (auto, float32, float16, fp8, fp8_e4m3, "
           "fp8_e5m2, q8_0)"),
    EnvVar("TOKENPATH_NUM_THREADS", "torch CPU threads per engine (default: cores split among local engines)"),
    EnvVar("TOKENPATH_KERNELS_ISA", "native kernel ISA: auto, avx2 or avx512 (within what the CPU has)"),
    EnvVar("TOKENPATH_KERNELS_FINE", "bit mask: matmuls with int8 activations plus residual bytes"),
    EnvVar("TOKENPATH_KERNELS_PROMPT_FINE", "bit mask: matmuls whose prompt rows take residual bytes too"),
    EnvVar("TOKENPATH_KERNELS_BF16", "bit mask: matmuls whose bf16 weights take bf16 activations (AMX)"),
    EnvVar("TOKENPATH_KERNELS_EXACT", "bit mask: matmuls that keep float activations"),
    EnvVar("TOKENPATH_NO_KERNELS", "1: no native kernels (at install: skip the build; at run: torch path)"),
    EnvVar("TOKENPATH_BENCH_API_KEY", "the default key of `tokenpath bench`"),
    EnvVar("TOKENPATH_ENGINE_SECRET", "set by the gateway: the engine link's per-launch secret"),
    EnvVar("TOKENPATH_PARENT_PID", "set by the gateway: an engine process dies with this parent"),
    EnvVar("TOKENPATH_ENGINE_NICE", "set by the gateway: the nice increment of an engine process"),
)


# The variables a gateway sets for the engine processes it starts (replica.processes), read back
# by the engine (server.engine_process).
ENGINE_SECRET_ENV = "TOKENPATH_ENGINE_SECRET"
PARENT_PID_ENV = "TOKENPATH_PARENT_PID"
ENGINE_NICE_ENV = "TOKENPATH_ENGINE_NICE"
NUM_THREADS_ENV = "TOKENPATH_NUM_THREADS"

_TRUE = ("1", "true", "yes", "on")


def _env(name: str) -> str | None:
    """The variable's value, stripped; None when unset or blank (blank means unset everywhere)."""
    value = os.environ.get(name, "").strip()
    return value or None


def env_api_key() -> str | None:
    """TOKENPATH_API_KEY: a static key for `serve --api-key` and the admin key of `trace --url`."""
    return _env("TOKENPATH_API_KEY")


def env_bench_api_key() -> str | None:
    """TOKENPATH_BENCH_API_KEY: the default key of `tokenpath bench`."""
    return _env("TOKENPATH_BENCH_API_KEY")


def env_database_url() -> str | None:
    """TOKENPATH_DATABASE_URL: the store when `--database-url` is not given."""
    return _env("TOKENPATH_DATABASE_URL")


def env_thinking_signing_key() -> str | None:
    """TOKENPATH_THINKING_SIGNING_KEY: signs thinking blocks when `--thinking-signing-key` is not given."""
    return _env("TOKENPATH_THINKING_SIGNING_KEY")


def env_redis_url() -> str | None:
    """TOKENPATH_REDIS_URL: shared rate limits when `--redis-url` is not given."""
    return _env("TOKENPATH_REDIS_URL")


def env_policy() -> str | None:
    """TOKENPATH_POLICY: the gateway's default tenant policy."""
    return _env("TOKENPATH_POLICY")


def env_audit_text() -> bool:
    """TOKENPATH_AUDIT_TEXT (1, true, yes or on): keep prompt and completion text in the audit log
    and request logs. One reading for the gateway and the log records alike."""
    return (_env("TOKENPATH_AUDIT_TEXT") or "").lower() in _TRUE


def env_grammar_warmup() -> bool:
    """TOKENPATH_GRAMMAR_WARMUP (0 turns it off): the default of `serve --grammar-warmup`."""
    return (_env("TOKENPATH_GRAMMAR_WARMUP") or "1").lower() in _TRUE


def env_num_threads() -> int | None:
    """TOKENPATH_NUM_THREADS: torch CPU threads of this engine; None: unset."""
    value = _env(NUM_THREADS_ENV)
    if value is None:
        return None
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"{NUM_THREADS_ENV}={value!r}: expected a number of threads") from None


def env_no_kernels() -> bool:
    """TOKENPATH_NO_KERNELS=1: run the torch path, not the native kernels (at install: skip the build)."""
    return _env("TOKENPATH_NO_KERNELS") == "1"


def env_kernels_fine() -> int | None:
    """TOKENPATH_KERNELS_FINE as a mask (`kernel_mask_from_env`); None: unset."""
    return kernel_mask_from_env("TOKENPATH_KERNELS_FINE")


def env_kernels_prompt_fine() -> int | None:
    """TOKENPATH_KERNELS_PROMPT_FINE as a mask (`kernel_mask_from_env`); None: unset."""
    return kernel_mask_from_env("TOKENPATH_KERNELS_PROMPT_FINE")


def env_kernels_bf16() -> int | None:
    """TOKENPATH_KERNELS_BF16 as a mask (`kernel_mask_from_env`); None: unset."""
    return kernel_mask_from_env("TOKENPATH_KERNELS_BF16")


def env_kernels_exact() -> int | None:
    """TOKENPATH_KERNELS_EXACT as a mask (`kernel_mask_from_env`); None: unset."""
    return kernel_mask_from_env("TOKENPATH_KERNELS_EXACT")


@dataclass(frozen=True)
class EngineLaunch:
    """What a gateway tells an engine process it starts, through the environment (never argv, where
    other users could read the secret): the link's secret, the parent to die with, the nice increment."""

    secret: str
    parent_pid: int | None
    nice: int

    def env(self) -> dict[str, str]:
        """The variables to set in the child's environment."""
        env = {ENGINE_SECRET_ENV: self.secret, ENGINE_NICE_ENV: str(self.nice)}
        if self.parent_pid is not None:
            env[PARENT_PID_ENV] = str(self.parent_pid)
        return env

    @classmethod
    def from_env(cls) -> EngineLaunch:
        """This engine process's launch, as its gateway set it (an empty secret: none was set)."""
        parent = _env(PARENT_PID_ENV)
        return cls(secret=os.environ.get(ENGINE_SECRET_ENV, ""), parent_pid=int(parent) if parent else None,
                   nice=int(_env(ENGINE_NICE_ENV) or 0))


def env_help() -> str:
    """The `ENV_VARS` table, for `--help`."""
    width = max(len(v.name) for v in ENV_VARS)
    return "environment variables:\n" + "\n".join(f"  {v.name:<{width}}  {v.help}" for v in ENV_VARS)


def resolve_data_dir(explicit: str | None = None) -> Path:
    """`--data-dir`, else `TOKENPATH_DATA_DIR`, else a per-user default (XDG data home)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    path = Path(explicit or os.environ.get("TOKENPATH_DATA_DIR") or Path(base) / "tokenpath")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)  # keys and the audit log live here: owner only
    _private_dir(path)
    return path


def _private_dir(path: Path) -> None:
    """The data dir must not be writable by others (they could replace the store or plant links).
    A shared sticky folder (mode 1777: /tmp, /var/tmp) is refused, never tightened: closing it would
    break every other user of it. Any other folder of ours that is group- or world-writable (a
    k8s emptyDir is 0777) is tightened to 0700; one owned by someone else is refused."""
    st = path.stat()
    if not st.st_mode & 0o022:
        return
    mode = stat.S_IMODE(st.st_mode)
    if st.st_mode & stat.S_ISVTX:
        raise ValueError(f"the data dir {path} is a shared folder (mode {mode:o}, writable by every user); keys "
                         "and the audit log need a private one: give a path inside it, e.g. "
                         f"{path / 'tokenpath'} (created 0700), or chmod 700 {path} if it is yours alone")
    if st.st_uid != os.geteuid():
        raise ValueError(f"the data dir {path} is writable by others (mode {mode:o}) and owned by another user "
                         f"(uid {st.st_uid}); use a private folder")
    os.chmod(path, 0o700)


def data_subdir(name: str) -> Path:
    """A folder inside the data dir, made 0700 like it (tokenizer caches, engine logs)."""
    path = resolve_data_dir() / name
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def version() -> str:
    """The installed distribution's version (pyproject.toml): `--version`, the banner, bug reports."""
    from importlib import metadata

    try:
        return metadata.version("tokenpath")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"
