"""The suite's rules about the machine and its tiers: a test that needs something the machine
lacks fails, unless the run allows it to be missing by name (tests/capabilities.py); `--fast`
runs the fast tier only (tests/tiers.py)."""

from __future__ import annotations

import pytest

from tests import capabilities, tiers
from tests.tiers import _fast_tier_guard  # noqa: F401  (the --fast guard: an autouse fixture)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--allow-missing", action="append", metavar="NAME[,NAME]",
                     help="capabilities (tests/capabilities.py: redis, postgres, chromium, kernels, ... or all) "
                     f"whose tests skip instead of fail when missing; also ${capabilities.ALLOW_ENV}")
    tiers.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    capabilities.configure(config)
    tiers.configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.classify(config, items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    capabilities.setup(item)
