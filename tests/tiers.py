"""The suite's two tiers: `make test` runs everything; `make test-fast` (`pytest --fast`) runs the
fast tier, the tests that start no server and load no real model, in a few minutes.

A test is outside the fast tier when it is marked `slow` (by hand, or here: it uses a fixture that
starts a server or loads a real model, or it lives in a module listed in SLOW_MODULES) or
`services` (here: it requires a service of tests/capabilities.py). Why the guard: a list drifts,
so a `--fast` run also refuses, with a failure naming the fix, what a fast test must not do:
start `tokenpath serve`, Ray or a service, or load a packaged model's weights. A test the
classification gets wrong therefore fails the fast run instead of making it slow quietly.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

FAST_OPTION = "--fast"
PEERS_OPTION = "--peers"
# The peers tier (`make test-peers`): tokenpath against the real engines it fronts (vLLM's CPU
# build, several GB in a venv of its own: scripts/vllm_venv.sh). Its install and start-up would
# double `make test`'s time, so it runs only when asked for, and then alone.
PEERS_DIR = "tests/peers/"

# Fixtures that start a `tokenpath serve` or load a real model (by name: a module's fixtures that
# use these are found through `item.fixturenames`, which holds what a test uses transitively).
HEAVY_FIXTURES = frozenset({
    "server", "server_factory", "launch_server",  # tests/api/conftest.py
    "smol_llm", "smol_llm_fp32", "smol_loaded", "hf_smol", "_gemma3_270m_hybrid", "_gemma3_270m_flat",  # tests/engine/conftest.py
    "served",  # tests/telemetry/conftest.py and several modules: a server
    "gateway",  # tests/reliability/conftest.py: a server
})

# Fixtures that need a service at run time (they require it themselves, so no mark shows it).
SERVICE_FIXTURES = frozenset({
    "make_limits",  # tests/gateway/conftest.py: RedisLimits on the test Redis server
})

# Capabilities that are services (started by scripts/services.sh) or whole systems: their tests
# are integration tests, outside the fast tier.
SERVICE_CAPABILITIES = frozenset({"postgres", "redis", "prometheus", "chromium", "ray", "gemma3", "root", "vllm",
                                  "llamacpp"})

# Modules outside the fast tier that no fixture name gives away (measured by a `--fast` run,
# 2026-12-04, on 2 cores under load 4-6).
SLOW_MODULES = frozenset({
    # They start `tokenpath serve` (or an engine process) in the test body or a fixture of their
    # own, even if only to see it refuse its flags: the guard stopped each of them.
    "tests/api/test_shutdown.py", "tests/api/test_small_safety.py", "tests/api/test_tls.py",
    "tests/reliability/test_audit_faults.py", "tests/reliability/test_nasty_names.py",
    "tests/reliability/test_engine_stall.py", "tests/reliability/test_inprocess_stall.py",
    "tests/reliability/test_schemathesis_real_model.py", "tests/reliability/test_slow_readers.py",
    "tests/reliability/test_stall_tenants.py", "tests/reliability/test_share_preemption.py",
    "tests/replica/test_remote_constraints.py", "tests/replica/test_link_hello.py", "tests/api/test_model_catalog.py", "tests/engine/test_native_without_torch.py",
    "tests/telemetry/test_causes.py", "tests/telemetry/test_dashboard_replicas.py",
    # Over ~12 s in all: tiny checkpoints saved and run by transformers and the engine, real
    # tokenizers built, nested pytest/mypy/bench runs, engine processes bound and killed.
    "tests/engine/test_moe.py", "tests/engine/test_moe_families.py", "tests/engine/test_native_attention.py", "tests/engine/test_model_families.py",
    "tests/engine/test_sampler_safety.py", "tests/engine/test_tiny_checkpoints.py",
    "tests/engine/test_kv_cache_dtype.py", "tests/engine/test_kv_window.py", "tests/engine/test_tokenizer_cache.py",
    "tests/engine/test_quantized_engine.py", "tests/engine/test_churn.py",
    "tests/reliability/test_engine_bind.py", "tests/bench/test_bench_cli.py",
    "tests/bench/test_bench_run_peers_script.py", "tests/test_capabilities.py", "tests/test_types.py",
})

# What a fast test's subprocess must not be: a server, an engine process (`tokenpath engine`), Ray, or a
# service.
_SLOW_COMMANDS = ("serve", "engine", "ray", "tests.replica.ray_cluster", "redis-server", "postgres", "pg_ctl",
                  "prometheus", "chromium")
# The packaged models (tokenpath.engine.loader.known_models): loading their weights takes seconds.
_REAL_MODELS = ("smollm2-135m-instruct", "gemma-3-270m", "all-minilm-l6-v2")


def tier_marks(path: str, fixturenames: Iterable[str], requires: Iterable[str], param_ids: str = "") -> set[str]:
    """The tier markers (`slow`, `services`) a test gets from where it lives and what it uses
    (`fixturenames`: all it uses, directly or through other fixtures);
    `path` is its file relative to the repository root, with forward slashes; `param_ids` its
    parametrization's id (`sqlite`, `postgres-8`: a case run against a service names it there,
    as tests/gateway's store fixtures do, which require it only at run time)."""
    marks: set[str] = set()
    fixturenames = set(fixturenames)
    if path in SLOW_MODULES or HEAVY_FIXTURES.intersection(fixturenames):
        marks.add("slow")
    if SERVICE_CAPABILITIES.intersection(requires) or SERVICE_CAPABILITIES.intersection(param_ids.split("-")) \
            or SERVICE_FIXTURES.intersection(fixturenames):
        marks.add("services")
    return marks


def configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "services: needs a service or Ray (tests/capabilities.py); outside the fast tier")


def addoption(parser: pytest.Parser) -> None:
    parser.addoption(FAST_OPTION, action="store_true",
                     help="the fast tier only: no test marked slow or services (tests/tiers.py); a test that "
                     "starts a server or loads a real model fails, saying to mark it")
    parser.addoption(PEERS_OPTION, action="store_true",
                     help=f"the peers tier only ({PEERS_DIR}: behind and beside a real vLLM); without it, "
                     "that tier is deselected")


def classify(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every item with its tier; under --fast, deselect those outside the fast tier; deselect
    the peers tier unless --peers, and everything else if it is given."""
    root = Path(str(config.rootpath))
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    peers = bool(config.getoption("peers"))
    other_tier: list[pytest.Item] = []
    for item in items:
        try:
            rel = Path(str(item.path)).resolve().relative_to(root).as_posix()
        except ValueError:
            rel = str(item.path)
        if rel.startswith(PEERS_DIR) != peers:
            other_tier.append(item)
            continue
        requires = [n for mark in item.iter_markers("requires") for n in mark.args]
        callspec = getattr(item, "callspec", None)
        for name in tier_marks(rel, getattr(item, "fixturenames", ()), requires, callspec.id if callspec else ""):
            item.add_marker(name)
        fast = item.get_closest_marker("slow") is None and item.get_closest_marker("services") is None
        (keep if fast else dropped).append(item)
    if other_tier:  # (the peers tier runs alone: `--peers` selects it, and only it)
        gone = {id(item) for item in other_tier}
        items[:] = [item for item in items if id(item) not in gone]
        config.hook.pytest_deselected(items=other_tier)
    if config.getoption("fast") and dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def _refuse(what: str) -> None:
    pytest.fail(f"a test of the fast tier {what}: mark it slow (pytest.mark.slow, or add its module to "
                "tests/tiers.py SLOW_MODULES), or make it lean", pytrace=False)


def _argv(args: Any) -> list[str]:
    if isinstance(args, (str, bytes)):
        return str(args).split()
    return [str(a) for a in args] if isinstance(args, Sequence) else [str(args)]


def slow_command(argv: Sequence[str]) -> bool:
    """Whether a command line starts a server, an engine, Ray or a service."""
    words = {Path(a).name for a in argv}
    return any(word in words for word in _SLOW_COMMANDS)


def _guarded_popen(original: Callable[..., None]) -> Callable[..., None]:
    def init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        if slow_command(_argv(args)):
            _refuse(f"starts {' '.join(_argv(args))[:200]!r}")
        original(self, args, *rest, **kw)
    return init


def _guarded_load(original: Callable[..., Any]) -> Callable[..., Any]:
    def load(name_or_path: Any, *args: Any, **kw: Any) -> Any:
        if str(name_or_path).lower() in _REAL_MODELS:
            _refuse(f"loads the real model {name_or_path!r}")
        return original(name_or_path, *args, **kw)
    return load


@pytest.fixture(scope="session", autouse=True)
def _fast_tier_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under --fast: starting a server/Ray/a service, or loading a packaged model, fails the test."""
    if not request.config.getoption("fast"):
        yield
        return
    from tokenpath.engine import core, loader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _guarded_popen(subprocess.Popen.__init__))
        mp.setattr(loader, "load_model", _guarded_load(loader.load_model))
        mp.setattr(core, "load_model", _guarded_load(core.load_model))
        yield
