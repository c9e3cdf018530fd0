"""`tokenpath` command line: one entry point, each area registers its own subcommands.

`serve`/`engine` live in `tokenpath.server.cli`, `keys`/`audit`/`usage` in `tokenpath.gateway.cli`,
`bench` in `tokenpath.bench.cli`, `trace` in `tokenpath.server.trace_cli`. Each module exposes `register(subparsers)`; a subcommand's
handler is stored as `func` and returns the process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tokenpath.config import env_help, version

ENGINE_MODULE = "tokenpath.server.cli"  # (`tokenpath engine`'s, with `serve`)
COMMAND_MODULES = (
    ENGINE_MODULE,
    "tokenpath.gateway.cli",
    "tokenpath.bench.cli",
    "tokenpath.replica.ray_status",
    "tokenpath.server.trace_cli",
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `only`, that command's module alone (`engine`: an engine process
    launched by a gateway imports no other command's code: measured 9 MiB of its RSS)."""
    parser = argparse.ArgumentParser(prog="tokenpath", description=__doc__.splitlines()[0], epilog=env_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tokenpath {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in (COMMAND_MODULES if only is None else (only,)):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # an area not built yet; never hide a broken import inside it
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    lean = ENGINE_MODULE if given[:1] == ["engine"] else None
    args = build_parser(lean).parse_args(argv)
    code = int(args.func(args) or 0)
    if argv is None and getattr(args, "exit_fast", False):
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """End a server process once it has shut down: atexit handlers and logs flushed, but no
    interpreter teardown. That teardown's garbage collection over a server's heap (tokenizer,
    torch, a model) took 5 s of a 7 s shutdown, past any `--shutdown-timeout` (issue 23). Only
    for the process's own entry point (`argv is None`), never for an in-process caller."""
    import atexit
    import logging
    import os
    import threading

    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None:  # what a normal exit does first: join non-daemon threads and
        shutdown_threads()  # run their exit hooks (executors finishing queued work)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
