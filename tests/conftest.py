"""The suite's rules about the machine and its tiers: a test that needs something the machine
lacks fails, unless the run allows it to be missing by name (tests/capabilities.py); `--fast`
runs the fast tier only (tests/tiers.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests import capabilities, tiers
from tests.tiers import _fast_tier_guard  # noqa: F401  (the --fast guard: an autouse fixture)

if TYPE_CHECKING:
    from tests.api.conftest import Server


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--allow-missing", action="append", metavar="NAME[,NAME]",
                     help="capabilities (tests/capabilities.py: redis, postgres, chromium, kernels, ... or all) "
                     f"whose tests skip instead of fail when missing; also ${capabilities.ALLOW_ENV}")
    tiers.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    capabilities.configure(config)
    tiers.configure(config)
    # The suite starts a few hundred servers and engine processes, most never asked for a grammar:
    # each would read the vocabulary into llguidance and start a grammar worker at start-up (~3 s of
    # CPU, `serve --grammar-warmup`, on by default). Off here (inherited by every server the tests
    # start); tests/api/test_grammar_warm.py turns it on where it is the subject.
    os.environ.setdefault("TOKENPATH_GRAMMAR_WARMUP", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.classify(config, items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    capabilities.setup(item)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default `tokenpath serve`: SmolLM2 chat + MiniLM embeddings, no flags but the port.
    One per session, for every test that only sends it requests: tests/api and the fault suite's
    `gateway` (tests/reliability/conftest.py). A test that changes a server's flags or state, or
    stops it, starts its own (`server_factory`, `running_server`)."""
    from tests.api.conftest import running_server

    with running_server(tmp_path_factory.mktemp("serve")) as srv:
        yield srv
