"""Server settings: where to listen, which models to serve, and the caps that keep a client
mistake from becoming an outage. Loadable from a YAML file (`--config`); flags override it."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from tokenpath.config import DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL, EngineConfig, parse_bytes


class Caps(BaseModel):
    """Upper bounds on request fields; beyond them a request is a 400, not a resource problem."""

    model_config = ConfigDict(extra="forbid")

    max_n: int = Field(8, ge=1, le=16)
    max_tokens: int = Field(4096, ge=1)
    max_stop: int = Field(16, ge=0, le=16)
    max_messages: int = Field(256, ge=1)
    max_prompts: int = Field(32, ge=1)  # prompts in one /v1/completions request
    max_embedding_inputs: int = Field(2048, ge=1)  # inputs in one /v1/embeddings request (OpenAI's limit)
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    # Tokens one request may cost at most: its prompt tokens plus n x max_tokens for every prompt.
    # Without it, 32 prompts x n=8 x 4096 tokens is a million tokens in one call.
    max_request_tokens: int = Field(65536, ge=1)


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    models: list[str] = Field(default_factory=lambda: [DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL])
    aliases: dict[str, str] = Field(default_factory=dict)
    max_body_size: str | int = "4MiB"
    shutdown_timeout: float = Field(30.0, ge=0)
    caps: Caps = Field(default_factory=Caps)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    data_dir: str | None = None
    database_url: str | None = None
    redis_url: str | None = None  # rate limits shared through Redis (keys and audit stay in the database)
    limits_fail_open: bool = False  # Redis unreachable: admit without limits instead of 503
    insecure: bool = False
    metrics_public: bool = False  # /metrics without a key even when auth is on (it names tenants)
    # Slow clients (slowloris): a connection must finish its request headers, and then its body,
    # within these many seconds, or it is closed (headers) or answered 408 (body).
    header_timeout: float = Field(10.0, gt=0)
    body_timeout: float = Field(10.0, gt=0)

    @property
    def max_body_bytes(self) -> int:
        return parse_bytes(self.max_body_size)

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
