"""Fault-suite fixtures: real `tokenpath serve` processes on free loopback ports.

The server helpers are the API suite's (`tests/api/conftest.py`): started as a user starts them,
stopped with SIGTERM, and a clean exit asserted."""

from __future__ import annotations

import pytest

from tests.api.conftest import Server


@pytest.fixture(scope="module")
def gateway(server: Server) -> Server:
    """The default in-process `tokenpath serve` (chat + embeddings): the session's (tests/conftest.py),
    which the API tests use too. The fault suite's nasty inputs and grammar bombs only send it
    requests, so they need no server of their own; that it still answers after them all is checked
    by its clean exit (SIGTERM -> 0) at the end of the session."""
    return server
