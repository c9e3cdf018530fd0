"""`tokenpath serve` settings, one config for the whole server: where to listen, which models to
serve, the engine's knobs, and (from `ApiSettings`) the caps that keep a client mistake from
becoming an outage. Loadable from a YAML file (`--config`); flags override it (`build_config`).

`build_config` lives here, below both commands that need it (`server.cli` for `serve`,
`server.engine_process` for `engine`), so neither imports the other.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import ConfigDict, Field, PlainSerializer, PlainValidator, field_validator, model_validator

from tokenpath.api.settings import ApiSettings, Caps  # noqa: F401 - Caps: part of this config's schema
from tokenpath.config import (
    DEFAULT_CHAT_MODEL,
    DEFAULT_EMBEDDING_MODEL,
    REDIS_TIMEOUT_S,
    EngineConfig,
    Flag,
    engine_flag_names,
    parse_bytes,
    parse_duration,
)
from tokenpath.protocol.names import MODEL, name_problem
from tokenpath.replica.liveness import FIRST_TOKEN_S, NEXT_TOKEN_S, STALL_AFTER_S, LivenessConfig

# The engine's settings are a plain dataclass checked by itself (tokenpath.knobs): pydantic hands the
# YAML mapping to its own checks and dumps it as its dict.
EngineSettings = Annotated[EngineConfig, PlainValidator(EngineConfig.coerce), PlainSerializer(lambda c: c.as_dict())]


class ServerConfig(ApiSettings):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0 picks a free one)")
    models: Annotated[list[str], Flag("model", metavar="NAME_OR_PATH", gather="append")] = Field(
        default_factory=lambda: [DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL], description="model to serve (repeatable)")
    aliases: dict[str, str] = Field(default_factory=dict)
    engine: EngineSettings = Field(default_factory=EngineConfig)
    data_dir: str | None = Field(None, description="keys, audit log and caches (default: $TOKENPATH_DATA_DIR or XDG)")
    database_url: str | None = Field(
        None, description="Postgres URL for keys/audit instead of SQLite in the data dir (default: "
        "$TOKENPATH_DATABASE_URL)")
    # Rate limits shared through Redis (keys and audit stay in the database).
    redis_url: str | None = Field(
        None, description="keep rate windows, token reservations and daily quotas in this Redis, shared by every "
        "gateway pointed at it (redis://host:port/db; default: $TOKENPATH_REDIS_URL)")
    limits_fail_open: bool = Field(
        False, description="with --redis-url: admit requests without limits while Redis is unreachable; "
        "off: refuse them with 503")
    redis_timeout: float = Field(
        REDIS_TIMEOUT_S, gt=0, description="with --redis-url: seconds a limit check waits on Redis (connecting or "
        "for a reply) before Redis counts as unreachable")
    insecure: bool = Field(False, description="allow a non-loopback --host without API keys")
    # Every replica, in-process, in engine processes, on Ray or behind a URL
    # (`tokenpath.replica.liveness`): one silent this long (no state push, no output; in-process,
    # a step that has not returned) is stalled, ejected at once, and its in-flight
    # requests are retried elsewhere (no token sent yet) or ended with a clean 503.
    stall_timeout: Annotated[float, Flag(metavar="S")] = Field(
        STALL_AFTER_S, gt=0, description="a replica silent this long (an in-process engine: one step hung this "
        "long) is ejected and its requests retried or failed")
    # Per request, bounds a healthy engine never reaches: its first token within this many seconds
    # of dispatch, each next token within `token_timeout` of the last.
    first_token_timeout: Annotated[float, Flag(metavar="S")] = Field(
        FIRST_TOKEN_S, gt=0, description="a request with no first token this long after dispatch is released")
    token_timeout: Annotated[float, Flag(metavar="S")] = Field(
        NEXT_TOKEN_S, gt=0, description="a request with no next token for this long is released")
    # LoRA adapters served from the start (vLLM's --lora-modules): NAME=PATH or its JSON form.
    lora_modules: Annotated[list[str], Flag(metavar="NAME=PATH")] = Field(
        default_factory=list, description="LoRA adapters to serve (vLLM's flag): NAME=PATH, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; repeatable. Clients send NAME as `model`; '
        "POST /v1/load_lora_adapter adds more at run time")

    # Models on demand (server.catalog, routing.catalog): every GGUF file and HF directory in
    # `models_dir`, and the packaged models, load on their first request and unload when idle or
    # to make room under the budget.
    models_dir: Annotated[str | None, Flag(metavar="DIR")] = Field(
        None, description="serve every GGUF file and HF model directory in this DIR on demand (with the packaged "
        "models): each loads on its first request, under --models-memory / --max-loaded-models, and unloads after "
        "--keep-alive idle")
    models_memory: Annotated[str | int | None, Flag(metavar="SIZE")] = Field(
        None, description="with --models-dir: the memory the loaded models may use together, e.g. 16GiB (each "
        "model's footprint measured after its load); the least recently used idle model is unloaded to fit")
    max_loaded_models: Annotated[int | None, Flag(metavar="N")] = Field(None, ge=1, description="with --models-dir: at most N models loaded at once")
    keep_alive: Annotated[str, Flag(metavar="DURATION")] = Field(
        "5m", description="with --models-dir: a model idle this long is unloaded (Ollama's keep_alive: '5m', "
        "'30s', seconds; negative: never); a request's `keep_alive` field overrides it for that model")

    @field_validator("models_memory")
    @classmethod
    def _memory_size(cls, v: str | int | None) -> str | int | None:
        if v is not None:
            parse_bytes(v)
        return v

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, v: str) -> str:
        parse_duration(v)
        return v

    def liveness(self) -> LivenessConfig:
        return LivenessConfig(stall_after_s=self.stall_timeout, first_token_s=self.first_token_timeout,
                              next_token_s=self.token_timeout)

    # TLS terminated by the server itself (vLLM's --ssl-* flags): a PEM key and certificate; with
    # a CA bundle, clients must present a certificate it signed (mutual TLS).
    ssl_keyfile: str | None = Field(None, description="serve HTTPS with this PEM private key FILE")
    ssl_certfile: str | None = Field(None, description="serve HTTPS with this PEM certificate (chain) FILE")
    ssl_ca_certs: str | None = Field(
        None, description="require client certificates signed by the CAs in this FILE (mutual TLS)")

    @model_validator(mode="after")
    def _tls_pairs(self) -> ServerConfig:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs (client certificates) needs --ssl-keyfile and --ssl-certfile")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')} {path}: no such file")
        return self

    @model_validator(mode="after")
    def _alias_names(self) -> ServerConfig:
        for alias in self.aliases:  # what clients send as `model`: the same safe set the API checks
            problem = name_problem(alias, MODEL)
            if problem is not None:
                raise ValueError(f"aliases: {alias!r}: {problem}")
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServerConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings at the top level")
        return cls.model_validate(data)


def is_embedding_model(name: str) -> bool:
    """The default embedding model's name, or a directory holding a sentence-transformers BERT."""
    if name == DEFAULT_EMBEDDING_MODEL:
        return True
    path = Path(name)
    return path.is_dir() and (path / "sentence_bert_config.json").is_file()


def build_config(args: argparse.Namespace) -> ServerConfig:
    """The `--config` file (or the defaults), with every flag that was given laid over it. A bare
    `tokenpath engine` serves the default chat model alone. Flags a subcommand lacks count as not given."""
    cfg = ServerConfig.from_yaml(args.config) if args.config else ServerConfig()
    for name in getattr(args, "served_model_names", None) or ():  # checked before any model loads
        problem = name_problem(name, MODEL)
        if problem is not None:
            raise ValueError(f"--served-model-name {name!r}: {problem}")
    if not args.gateway and not args.models and not args.config:
        cfg.models = [DEFAULT_CHAT_MODEL]
    # A flag's dest is its field's name (`--model` gathers `models`), so the fields are the list of flags.
    update = {k: v for k in ServerConfig.model_fields if k != "engine" and (v := getattr(args, k, None)) is not None}
    engine = {k: v for k in engine_flag_names() if (v := getattr(args, k, None)) is not None}
    if "chat_template" in engine:  # engine processes may start elsewhere than this command's cwd
        engine["chat_template"] = str(Path(engine["chat_template"]).expanduser().resolve())
    update["engine"] = EngineConfig.coerce({**cfg.engine.as_dict(), **engine})  # (parses JSON flags)
    return ServerConfig.model_validate({**cfg.model_dump(), **update})
