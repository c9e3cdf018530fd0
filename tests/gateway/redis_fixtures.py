"""Real Redis servers for the shared-limits tests: the one `.ci/run` starts (TOKENPATH_TEST_REDIS_URL,
via scripts/redis.sh) and private ones a test can stop and start again on the same port."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
from tests.capabilities import require

REDIS_URL = os.environ.get("TOKENPATH_TEST_REDIS_URL")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "redis.sh"


def require_redis(config: pytest.Config) -> str:
    """The test Redis URL; without one (or the redis package) the test fails, unless the run
    allows `redis` to be missing (tests/capabilities.py)."""
    require(config, "redis")
    assert REDIS_URL is not None  # what the capability checked
    return REDIS_URL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A redis-server of its own (scripts/redis.sh in a private dir), stoppable and restartable on the
    same port, so an outage can be caused without touching the shared test server."""

    def __init__(self, tmp: Path) -> None:
        self.env = {**os.environ, "TOKENPATH_REDIS_DIR": str(tmp / "redis"),
                    "TOKENPATH_REDIS_PORT": str(free_port())}
        self.url = f"redis://127.0.0.1:{self.env['TOKENPATH_REDIS_PORT']}/0"

    def start(self) -> str:
        out = subprocess.run(["bash", str(SCRIPT), "start"], env=self.env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == self.url
        return self.url

    def stop(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=self.env, capture_output=True, timeout=60, check=True)


async def drop_namespace(url: str, namespace: str) -> None:
    """Delete every key a test wrote under its namespace."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{namespace}:*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
