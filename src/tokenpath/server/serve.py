"""`tokenpath serve` run: the gateway's start (configuration, guard, tracing, models), uvicorn with
a drain deadline, and the start-up banner. Imported only when `serve` runs, so `tokenpath engine`
(an engine process) loads none of uvicorn, the gateway or the telemetry exporters.

Shutdown (SIGTERM or Ctrl-C): stop accepting, let in-flight requests finish for up to
`--shutdown-timeout` seconds, then abort the rest (finish_reason `abort`), stop the engines and
exit 0. The signal is not re-raised after a clean drain, so the exit status stays 0.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from tokenpath.addresses import is_loopback
from tokenpath.config import env_database_url, resolve_data_dir
from tokenpath.errors import EngineDeadError, ModelLoadError, TokenpathError
from tokenpath.gateway.base import OpenGuard, RequestGuard
from tokenpath.routing.replicas import DEFAULT_POLICY
from tokenpath.server.config import ServerConfig, build_config
from tokenpath.telemetry.otel import setup_tracing, tracing_provider
from tokenpath.telemetry.otel_metrics import setup_metrics
from tokenpath.telemetry.request_log import configure_logging, log_event

log = logging.getLogger("tokenpath.api")


def run_serve(args: argparse.Namespace) -> int:
    from tokenpath.server.memory import limit_arenas

    limit_arenas()  # before any worker thread exists (see tokenpath.server.memory)
    configure_logging(args.log_format, args.log_level)
    # Replica state polls (remote replicas, several a second) are not news: httpx logs each at INFO.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = build_config(args)
    except (ValueError, OSError) as exc:
        print(f"tokenpath: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "ray", None) and importlib.util.find_spec("ray") is None:
        print("tokenpath: --ray needs Ray: pip install 'tokenpath[ray]'", file=sys.stderr)
        return 2
    if args.gateway:
        from tokenpath.gateway import open_gateway

        try:
            guard = open_gateway(resolve_data_dir(config.data_dir), config.database_url, static_keys=args.api_keys,
                                 redis_url=config.redis_url, limits_fail_open=config.limits_fail_open,
                                 redis_timeout=config.redis_timeout)
        except (ValueError, RuntimeError) as exc:  # a malformed --redis-url, or no redis package
            print(f"tokenpath: invalid configuration: {exc}", file=sys.stderr)
            return 2
    else:
        guard = OpenGuard()
    if not is_loopback(config.host) and not guard.auth_enabled and not config.insecure:
        print(f"tokenpath: refusing to bind {config.host}: no API keys exist, so anyone who can reach it could "
              "use it. Create a key (`tokenpath keys create`), bind 127.0.0.1, or pass --insecure.",
              file=sys.stderr)
        return 2
    if args.otlp_endpoint and args.gateway:  # engine processes started by this one export there too
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint
    try:
        tracer_provider = setup_tracing(args.otlp_endpoint, service_name="tokenpath" if args.gateway
                                        else "tokenpath-engine")
        # The GenAI metrics go where the traces go (the engine processes record none: see otel_metrics).
        meter_provider = setup_metrics(args.otlp_endpoint, service_name="tokenpath" if args.gateway
                                       else "tokenpath-engine")
    except ValueError as exc:
        print(f"tokenpath: invalid tracing configuration: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(_serve(config, guard, args))
    except ModelLoadError as exc:
        print(f"tokenpath: cannot load model: {exc}", file=sys.stderr)
        return 1
    except EngineDeadError as exc:  # a replica (an engine process, a Ray actor) that never came up
        print(f"tokenpath: cannot start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C during start-up
        return 130
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flush the spans still batched
        if meter_provider is not None:
            meter_provider.shutdown()  # export the last readings


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it, and uvicorn's own
    `loop="auto"` picks it; here the loop is ours, so it is chosen here), else asyncio's. Measured
    in front of vLLM on a loaded machine, one interleaved run each: ~1.1 ms less TTFT p50 through
    the gateway, ~1.2 ms through a bare uvicorn+httpx pass-through, and less CPU per request and
    per idle second (benchmarks/results/vllm_behind_gateway-loaded-ab.md)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Server(uvicorn.Server):
    """uvicorn's server with a drain deadline: on a signal, stop accepting at once, and abort
    whatever is still generating after `shutdown_timeout` so connections can close."""

    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float, banner) -> None:  # noqa: ANN001
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.banner = banner
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.in_flight_at_signal = 0
        self.aborted = 0

    async def startup(self, sockets=None) -> None:  # noqa: ANN001
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            self.banner(port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: a clean drain must exit 0, not die of the re-raised signal.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if self._loop is not None and not self._draining:
            self._draining = True
            self.in_flight_at_signal = len(self.state.inflight)
            self._loop.call_soon_threadsafe(self._loop.call_later, self.shutdown_timeout, self._abort_all)

    def _abort_all(self) -> None:
        n = self.state.abort_all("shutdown")
        self.aborted += n
        if n:
            log.warning("shutdown timeout: aborting %d in-flight request(s)", n)


async def _load(config: ServerConfig, args: argparse.Namespace):  # noqa: ANN202
    """In-process deployments, or (with --replicas/--routing) the routing area's process/URL replicas."""
    if config.models_dir is not None and args.routing is None:
        return await _load_catalog(config, args)
    if args.replicas <= 1 and args.routing is None and args.routing_policy is None and args.ray is None \
            and args.embedding_replicas <= 1:
        from tokenpath.routing.models import ModelRouter
        from tokenpath.server.deployments import load_deployments

        deployments, closers = await load_deployments(config)
        return ModelRouter(deployments, config.aliases), closers
    from tokenpath.server.routing_config import serve_router

    return await serve_router(config, replicas=args.replicas, routing_file=args.routing,
                              policy=args.routing_policy or DEFAULT_POLICY, ray_address=args.ray,
                              embedding_replicas=args.embedding_replicas)


async def _load_catalog(config: ServerConfig, args: argparse.Namespace):  # noqa: ANN202
    """`--models-dir`: models loaded on demand (server.catalog); only the `--model`s given load now."""
    from tokenpath.routing.models import ModelRouter
    from tokenpath.server.catalog import open_catalog

    log_dir = resolve_data_dir(config.data_dir) / "logs" / "engines"
    try:
        catalog = await open_catalog(config, list(args.models or []), args.replicas, args.embedding_replicas, log_dir,
                                     ray_address=args.ray)
        router = ModelRouter([], config.aliases, catalog=catalog)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    catalog.start()
    return router, [catalog.close]


async def _serve(config: ServerConfig, guard: RequestGuard, args: argparse.Namespace) -> int:
    from tokenpath.api.app import create_app
    from tokenpath.server.lora_modules import register_lora_modules  # imports the API: only `serve` needs it

    router, closers = await _load(config, args)
    _add_served_names(router, args.served_model_names)
    try:
        await register_lora_modules(router, config.lora_modules)
    except TokenpathError as exc:
        await _together(closers)()
        raise ModelLoadError(f"--lora-modules: {exc.message}") from None
    deployments = list(router.deployments.values())
    stoppers = [_together(closers)]  # every replica at once: each engine's exit waits on no other
    if hasattr(guard, "aclose"):
        stoppers.append(guard.aclose)  # then the store, once nothing can finish a request any more
    app = create_app(router, guard, config, on_shutdown=stoppers)

    def banner(port: int) -> None:
        print(startup_banner(config, router, guard, args, deployments, port), flush=True)
        log_event(log, "startup", "serving", models=[d.name for d in deployments], host=config.host, port=port,
                  replicas=sum(len(d.replicas) for d in deployments),
                  tracing=tracing_provider() is not None)

    from tokenpath.api.limits import header_timeout_protocol

    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", lifespan="on",
                               # (abort_all fires at shutdown_timeout; a stream needs a moment after it)
                               timeout_graceful_shutdown=config.shutdown_timeout + 1, access_log=False,
                               http=header_timeout_protocol(config.header_timeout),
                               timeout_keep_alive=config.timeout_keep_alive,
                               log_config=None,  # keep our handler and format
                               **_tls_options(config))
    server = _Server(uv_config, app.state.tokenpath, config.shutdown_timeout, banner)
    from tokenpath.server.memory import trim_periodically

    trimmer = asyncio.create_task(trim_periodically())
    try:
        await server.serve()
    finally:
        trimmer.cancel()
    drained = max(0, server.in_flight_at_signal - server.aborted)
    print(f"tokenpath: stopped: drained {drained} in-flight request(s), aborted {server.aborted}", flush=True)
    return 0


def _together(closers: list) -> Callable[[], Awaitable[None]]:
    """One shutdown step that stops every replica concurrently (engine processes, Ray actors, URL
    clients): stopped one after another, each frozen engine added its whole stop timeout."""

    async def close_all() -> None:
        results = await asyncio.gather(*(c() for c in closers), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.error("error while stopping a replica: %r", r)

    return close_all


def _tls_options(config: ServerConfig) -> dict:
    """uvicorn's TLS arguments: HTTPS when a certificate is set, client certificates required when
    a CA bundle is."""
    if not config.ssl_certfile:
        return {}
    import ssl

    opts: dict = {"ssl_keyfile": config.ssl_keyfile, "ssl_certfile": config.ssl_certfile}
    if config.ssl_ca_certs:
        opts |= {"ssl_ca_certs": config.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return opts


def _add_served_names(router, names: list[str]) -> None:  # noqa: ANN001
    """`--served-model-name`: more names for the first chat model (vLLM's flag), as router aliases."""
    if not names:
        return
    chat = next((d.name for d in router.deployments.values() if d.task != "embedding"), None)
    if chat is None:
        raise SystemExit("tokenpath: --served-model-name needs a chat model to name")
    for name in names:
        if name != chat and name not in router.deployments:
            router.aliases[name] = chat


def startup_banner(config: ServerConfig, router, guard: RequestGuard, args: argparse.Namespace,  # noqa: ANN001
                   deployments: list, port: int) -> str:
    """What an operator needs at a glance: version, models and the ids clients send, endpoints,
    where the data lives and whether keys are required. The last line is what tests wait for."""
    from tokenpath.config import version

    lines = [f"tokenpath {version()}"]
    for d in deployments:
        names = [a for a, target in router.aliases.items() if target == d.name]
        also = f"; also as {', '.join(names)}" if names else ""
        lines.append(f"  model: {d.name} ({d.task}, {len(d.replicas) or 1} replica(s){also})")
    for name, ref in router.adapters.items():
        lines.append(f"  lora adapter: {name} (on {ref.base}, {ref.path})")
    if router.catalog is not None:
        ids = router.catalog.ids()
        lines.append(f"  catalog: {len(ids)} model(s) on demand ({config.models_dir}): {', '.join(ids)}")
    lines.append("  endpoints: POST /v1/chat/completions /v1/completions /v1/messages /v1/embeddings /reset_prefix_cache; "
                 "GET /v1/models /health /metrics")
    data = str(resolve_data_dir(config.data_dir)) if args.gateway else "none (bare engine)"
    store = " (keys and audit in PostgreSQL)" if config.database_url or env_database_url() else ""
    lines.append(f"  data dir: {data}{store}")
    if guard.auth_enabled:
        how = [f"{len(args.api_keys)} --api-key key(s)"] if args.api_keys else []
        how.append("stored keys (`tokenpath keys list`)")
        lines.append(f"  auth: on ({' + '.join(how)}); /metrics "
                     + ("needs an admin key" if config.metrics_require_key else
                        "is open" + (" (tenant series too)" if config.metrics_public else
                                     " (tenant series for admin keys)")))
    else:
        lines.append("  auth: off (no keys exist; loopback only) - `tokenpath keys create` or --api-key turns it on")
    lines.append("  stop: Ctrl-C or SIGTERM (in-flight requests get --shutdown-timeout seconds)")
    if config.ssl_certfile:
        lines.append("  tls: on" + (" (client certificates required)" if config.ssl_ca_certs else ""))
    lines.append(f"tokenpath: listening on {config.scheme}://{config.host}:{port}/v1  "
                 "(health: /health, metrics: /metrics)")
    return "\n".join(lines)
