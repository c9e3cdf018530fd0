"""The suite's one rule about the machine: a test that needs something the machine lacks fails,
unless the run allows it to be missing by name (tests/capabilities.py)."""

from __future__ import annotations

import pytest

from tests import capabilities


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--allow-missing", action="append", metavar="NAME[,NAME]",
                     help="capabilities (tests/capabilities.py: redis, postgres, chromium, kernels, ... or all) "
                     f"whose tests skip instead of fail when missing; also ${capabilities.ALLOW_ENV}")


def pytest_configure(config: pytest.Config) -> None:
    capabilities.configure(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    capabilities.setup(item)
