"""`tokenpath engine`: one model (chat, or an embedding model) served over the engine link, nothing else.

No HTTP API, no gateway, no admission queue: the gateway that launched it sends `GenerateRequest`s
and reads `RequestOutput` deltas (`tokenpath.replica.link_server`). It is meant to be started by
`tokenpath serve --replicas N` (or a routing file's `local: N`), which passes:

- `--listen-fd N`: a loopback socket the gateway already bound (no port race);
- `TOKENPATH_ENGINE_SECRET` in the environment: the per-launch secret every connection must show;
- `TOKENPATH_PARENT_PID`: the process asks the kernel for SIGKILL when that parent dies, and
  exits at once if the parent is already gone (the race between fork and prctl);
- `--exit-with-link`: exit when the gateway's link closes.

Run by hand it binds `--host` (loopback by default; any other address needs `--insecure`) and
`--port`, and still requires `TOKENPATH_ENGINE_SECRET`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys

from tokenpath.addresses import is_loopback
from tokenpath.config import DEFAULT_CHAT_MODEL, ENGINE_SECRET_ENV, EngineLaunch, env_grammar_warmup
from tokenpath.server.config import build_config
from tokenpath.server.memory import freeze_startup_heap

log = logging.getLogger("tokenpath.engine")

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when the parent that launched it dies (Linux); never outlive it."""
    if parent is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def lower_priority(nice: int) -> None:
    """Raise this process's nice value by `nice`, on every thread it has so far (Linux nice values
    are per thread; the ones started later, torch's included, inherit it). Before the model loads."""
    if not nice:
        return
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, base + nice)


def run_engine(args: argparse.Namespace) -> int:
    launch = EngineLaunch.from_env()
    die_with_parent(launch.parent_pid)
    lower_priority(launch.nice)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    secret = launch.secret
    if not secret:
        print(f"tokenpath engine: set {ENGINE_SECRET_ENV} (the gateway that links to it must send the same secret)",
              file=sys.stderr)
        return 2
    if args.listen_fd is None and not is_loopback(args.host or "127.0.0.1") and not args.insecure:
        print(f"tokenpath engine: refusing to bind {args.host}: engines bind loopback (or pass --insecure)",
              file=sys.stderr)
        return 2
    if not args.models:
        args.models = [DEFAULT_CHAT_MODEL]
    config = build_config(args)
    try:
        return asyncio.run(_serve(config, args, secret))
    except KeyboardInterrupt:
        return 130


def _socket(config, args: argparse.Namespace) -> socket.socket:  # noqa: ANN001 - ServerConfig
    if args.listen_fd is not None:
        return socket.socket(fileno=args.listen_fd)
    return socket.create_server((config.host, config.port))


async def _run_link(server, model_name: str, sock: socket.socket) -> None:  # noqa: ANN001 - a LinkServer
    """Serve until the gateway's link closes (with --exit-with-link) or SIGTERM/SIGINT."""
    await server.start(sock)
    host, port = sock.getsockname()[:2]
    print(f"tokenpath engine: serving {model_name} on the engine link at {host}:{port} (pid {os.getpid()})",
          flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.done.set)
    await server.done.wait()
    await server.close()


async def _serve_embedding(config, args: argparse.Namespace, secret: str) -> int:  # noqa: ANN001
    """An embedding model (all-MiniLM-L6-v2 or a sentence-transformers BERT directory) on the link."""
    from tokenpath.replica.embedding_link import EmbeddingLinkServer
    from tokenpath.server.deployments import load_embedding_engine

    sock = _socket(config, args)
    name, engine = await asyncio.to_thread(load_embedding_engine, config.models[0])
    freeze_startup_heap()
    server = EmbeddingLinkServer(engine, secret, name, exit_on_close=args.exit_with_link)
    await _run_link(server, name, sock)
    await engine.shutdown()
    return 0


async def _serve(config, args: argparse.Namespace, secret: str) -> int:  # noqa: ANN001 - ServerConfig
    from tokenpath.engine.async_engine import AsyncEngine
    from tokenpath.replica.link_server import LinkServer
    from tokenpath.server.config import is_embedding_model

    if is_embedding_model(config.models[0]):
        return await _serve_embedding(config, args, secret)
    sock = _socket(config, args)
    engine_cfg = config.engine.replace(model=config.models[0])
    from tokenpath.telemetry.engine_spans import setup_engine_tracing

    engine = await asyncio.to_thread(AsyncEngine, engine_cfg)
    # The vocabulary read into llguidance now, not on the first structured request: that holds the
    # GIL about a second, which would freeze this process's step (api/structured.py warms the gateway's).
    if env_grammar_warmup():  # (serve's --grammar-warmup; its environment variable reaches here)
        with contextlib.suppress(Exception):  # (if it cannot be read, the first structured request says why)
            await asyncio.to_thread(lambda: engine.core.tokenizer.grammars)
    provider = setup_engine_tracing(engine.core.step_observers)
    await engine.start()
    freeze_startup_heap()  # (a full GC walking the loaded model's objects stalled a step ~100 ms)
    server = LinkServer(engine, secret, exit_on_close=args.exit_with_link, tracer_provider=provider)
    await _run_link(server, engine.model_name, sock)
    await engine.shutdown()
    if provider is not None:
        provider.shutdown()  # flush the last spans
    return 0
