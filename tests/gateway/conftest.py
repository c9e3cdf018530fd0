"""Fixtures: one real store per test, on SQLite (a file in tmp_path) and, when
TOKENPATH_TEST_POSTGRES_URL is set (`make test` sets it), on a real PostgreSQL server, in a schema
of its own that is dropped afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from redis_fixtures import drop_namespace, require_redis
from tests.capabilities import require

from tokenpath.gateway.store import GatewayStore

POSTGRES_URL = os.environ.get("TOKENPATH_TEST_POSTGRES_URL")


class Clock:
    """A settable wall clock for windows and day boundaries."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock(1_796_000_000.0)  # 2026-11-30T...; tests move it explicitly


@pytest.fixture(params=["sqlite", "postgres"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where a store lives; several GatewayStore objects on it act like several gateway processes."""
    if request.param == "sqlite":
        yield str(tmp_path / "gateway.sqlite3")
        return
    require(request.config, "postgres")  # `make test` starts it (scripts/postgres.sh says why it could not)
    assert POSTGRES_URL is not None
    import psycopg

    schema = f"tp_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in POSTGRES_URL else "?"
    yield f"{POSTGRES_URL}{sep}options={quote(f'-csearch_path={schema}')}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def store(store_location: str) -> Iterator[GatewayStore]:
    s = GatewayStore(store_location)
    yield s
    s.close()


@pytest.fixture
async def make_limits(request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., object]]:
    """RedisLimits on the test Redis server (a required capability), in a namespace of this test's own
    (dropped afterwards); each call is another gateway's backend, with its own connection pool."""
    url = require_redis(request.config)
    from tokenpath.gateway.redis_limits import RedisLimits

    namespace = f"tptest-{uuid.uuid4().hex[:10]}"
    made: list[RedisLimits] = []

    def make(**kw: object) -> RedisLimits:  # url=: another route to the same server (a proxy)
        made.append(RedisLimits(str(kw.pop("url", url)), namespace=namespace, **kw))
        return made[-1]

    yield make
    for limits in made:
        await limits.aclose()
    await drop_namespace(url, namespace)
