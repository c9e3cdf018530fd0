"""`tokenpath serve` (the OpenAI-compatible server, gateway in front) and `tokenpath engine`
(one chat model on the engine link, launched by a gateway: `tokenpath.server.engine_process`):
their flags. What `serve` runs is `tokenpath.server.serve`, imported only then: an engine process
parses these flags and imports none of uvicorn, the gateway or the telemetry exporters.
"""

from __future__ import annotations

import argparse

from tokenpath.config import (
    DEFAULT_POLICY,
    EngineConfig,
    add_model_flags,
    engine_flag_names,
    env_api_key,
    env_help,
)
from tokenpath.server.config import ServerConfig


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API (chat, completions, embeddings)",
                           epilog=env_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _server_flags(serve)
    # Settings are ServerConfig / ApiSettings fields: each flag is made from its field (typed,
    # described and defaulted there once: tokenpath.config.add_model_flags). The hand-written
    # flags below are this command's own options, not settings a --config file holds.
    add_model_flags(serve, ServerConfig, ("data_dir", "database_url", "redis_url", "redis_timeout", "limits_fail_open"))
    serve.add_argument("--replicas", type=int, default=1,
                       help="run each chat model as N local engine processes behind the router "
                       "(default %(default)s: in-process)")
    serve.add_argument("--embedding-replicas", type=int, default=1,
                       help="run each embedding model as N local engine processes behind the router "
                       "(default %(default)s: in-process)")
    serve.add_argument("--ray", metavar="auto|local|ADDRESS",
                       help="run the chat model's --replicas as engine actors on this Ray cluster: auto attaches "
                       "to the running one, local starts a private head on loopback for this server alone "
                       "(pip install 'tokenpath[ray]'; `tokenpath status --ray ADDRESS` lists them)")
    add_model_flags(serve, ServerConfig, ("lora_modules",))
    add_model_flags(serve.add_argument_group("models on demand"), ServerConfig,
                    ("models_dir", "models_memory", "max_loaded_models", "keep_alive"))
    serve.add_argument("--routing", metavar="FILE", help="deployments, replicas (local or URLs) and policies from YAML")
    serve.add_argument("--routing-policy", default=None,
                       help=f"replica picker: round_robin, least_loaded, prefix_aware, session_affinity "
                       f"(default: {DEFAULT_POLICY})")
    serve.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                       default=[k for k in [env_api_key()] if k],
                       help="a static key clients must send (repeatable; also $TOKENPATH_API_KEY), as vLLM's: "
                            "an admin key of tenant 'default' with no limits; stored keys keep working too")
    add_model_flags(serve, ServerConfig, ("metrics_public", "metrics_require_key"))
    add_model_flags(serve.add_argument_group("browser safety"), ServerConfig,
                    ("allowed_hosts", "allowed_origins", "public_docs"))
    add_model_flags(serve.add_argument_group("replica liveness (in-process engines, engine processes, Ray actors, "
                                             "URLs)"), ServerConfig,
                    ("stall_timeout", "first_token_timeout", "token_timeout"))
    add_model_flags(serve.add_argument_group("slow streaming clients"), ServerConfig,
                    ("stream_stall_timeout", "stream_max_unsent"))
    add_model_flags(serve, ServerConfig, ("reasoning_parser", "reasoning_budget", "causes", "grammar_warmup"))
    serve.set_defaults(func=run_serve, gateway=True, exit_fast=True)
    engine = sub.add_parser("engine", help="serve one model over the engine link to a tokenpath gateway",
                            epilog=env_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _server_flags(engine)
    engine.add_argument("--listen-fd", type=int, help="serve on this inherited, already-bound socket")
    engine.add_argument("--exit-with-link", action="store_true", help="exit when the gateway's link closes")
    engine.set_defaults(func=_run_engine, gateway=False, exit_fast=True)


def _run_engine(args: argparse.Namespace) -> int:
    from tokenpath.server.engine_process import run_engine

    return run_engine(args)


def _server_flags(p: argparse.ArgumentParser) -> None:
    """The flags `serve` and `engine` share: the settings from ServerConfig's and EngineConfig's
    fields, and the two commands' common options."""
    p.add_argument("--config", metavar="FILE", help="YAML settings (ServerConfig); flags override it")
    add_model_flags(p, ServerConfig, ("host", "port", "models", "shutdown_timeout", "max_body_size", "insecure"))
    add_model_flags(p.add_argument_group("TLS"), ServerConfig, ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"))
    p.add_argument("--served-model-name", action="extend", nargs="+", dest="served_model_names", default=[],
                   metavar="NAME", help="more names clients may send for the (first) chat model, as vLLM's flag "
                   "takes them (`--served-model-name a b`, or repeated); each is its own /v1/models entry")
    t = p.add_argument_group("telemetry")
    t.add_argument("--otlp-endpoint", metavar="URL",
                   help="export traces and the GenAI metrics over OTLP/HTTP to this base URL (else the OTEL_* "
                        "variables; off by default)")
    t.add_argument("--log-format", choices=["json", "text"], default="json",
                   help="request and event logs on stdout: one JSON object per line, or text (default: %(default)s)")
    t.add_argument("--log-level", default="info", type=str.lower,
                   choices=["debug", "info", "warning", "error"], help="lowest level logged (default: %(default)s)")
    add_model_flags(p.add_argument_group("engine"), EngineConfig, engine_flag_names())


def run_serve(args: argparse.Namespace) -> int:
    from tokenpath.server.serve import run_serve as run

    return run(args)
