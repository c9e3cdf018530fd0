"""Fault-suite fixtures: real `tokenpath serve` processes on free loopback ports.

The server helpers are the API suite's (`tests/api/conftest.py`): started as a user starts them,
stopped with SIGTERM, and a clean exit asserted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.conftest import Server, running_server


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default in-process `tokenpath serve` (chat + embeddings)."""
    with running_server(tmp_path_factory.mktemp("reliability")) as srv:
        yield srv
