"""`serve --api-key` static keys, ambiguous credentials, the store's file mode, and re-sizing a
reservation made on a floor before tokenizing (exact for TPM), on the real stores."""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest
from tests.capabilities import missing

from tokenpath.errors import AuthenticationError, InvalidRequestError, RateLimitError
from tokenpath.gateway import Gateway, GatewayStore
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.base import Limits


async def test_static_keys_turn_auth_on_as_admin_of_tenant_default(store, clock):
    gw = Gateway(store, clock=clock, static_keys=["k1", "k2"])
    assert gw.auth_enabled
    p = await gw.authenticate({"Authorization": "Bearer k2"})
    assert p.tenant == "default" and p.admin and p.key_prefix == "static-2" and p.key_limits is None
    for headers in ({}, {"Authorization": "Bearer k3"}, {"api-key": "k"}):
        with pytest.raises(AuthenticationError):
            await gw.authenticate(headers)
    secret, _ = create_key(store, "acme", now=clock())  # stored keys keep working beside them
    stored = await gw.authenticate({"Authorization": f"Bearer {secret}"})
    assert stored.tenant == "acme" and not stored.admin
    reservation = await gw.reserve(p, "m", 10**9)  # static keys have no limits
    assert reservation.admission_id is None


@pytest.mark.parametrize("headers", [
    [("authorization", "Bearer a"), ("authorization", "Bearer b")],
    [("api-key", "a"), ("api-key", "b")],
    [("authorization", "Bearer a"), ("api-key", "b")],
])
async def test_ambiguous_credentials_are_400(store, clock, headers):
    from starlette.datastructures import Headers

    gw = Gateway(store, clock=clock, static_keys=["a"])
    with pytest.raises(InvalidRequestError) as err:
        await gw.authenticate(Headers(raw=[(k.encode(), v.encode()) for k, v in headers]))
    assert err.value.code == "ambiguous_credentials"


@pytest.mark.parametrize("pairs", [
    [("Authorization", "Bearer k1"), ("Host", "x")],
    [("API-Key", "k1"), ("x-api-key", " k1 ")],  # the same key twice is one key
    [("X-Api-Key", "k1")],
    [("Host", "x")],
])
def test_the_credential_is_found_in_every_kind_of_headers(pairs):
    """One pass over the headers (`_credential_headers`): Starlette's (ASGI's lowercase names),
    httpx's (whose `raw` keeps the sender's case) and a plain dict give the same key."""
    import httpx
    from starlette.datastructures import Headers

    from tokenpath.gateway.gateway import credential_from

    want = None if pairs == [("Host", "x")] else "k1"
    assert credential_from(Headers(raw=[(k.lower().encode(), v.encode()) for k, v in pairs])) == want
    assert credential_from(httpx.Headers(pairs)) == want
    assert credential_from(dict(pairs)) == want


def test_sqlite_store_and_its_new_directory_are_private(tmp_path: Path):
    path = tmp_path / "fresh" / "gateway.sqlite3"
    GatewayStore(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o644)  # a store made by an older version is tightened when opened
    GatewayStore(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


async def test_adjust_grows_exactly_to_the_limit_and_no_further(store, clock):
    secret, _ = create_key(store, "acme", limits=Limits(tpm=100), now=clock())
    gw = Gateway(store, clock=clock)
    p = await gw.authenticate({"Authorization": f"Bearer {secret}"})
    a = await gw.reserve(p, "m", 10)  # the floor, before tokenizing
    await gw.adjust(a, 60)  # exact
    b = await gw.reserve(p, "m", 10)
    await gw.adjust(b, 40)  # 60 + 40 = 100: exactly the limit
    with pytest.raises(RateLimitError):  # nothing left for a third
        await gw.reserve(p, "m", 1)
    await gw.adjust(b, 20)  # shrinking gives the difference back
    d = await gw.reserve(p, "m", 5)
    with pytest.raises(RateLimitError):
        await gw.adjust(d, 25)  # 60 + 20 + 25 > 100: refused, and the admission removed
    assert d.reconciled
    e = await gw.reserve(p, "m", 20)  # 60 + 20 + 20 = 100 fits again
    assert e.admission_id is not None


def test_services_script_runs_a_private_postgres_and_removes_it(tmp_path: Path, request: pytest.FixtureRequest):
    """`make test` runs pytest under scripts/services.sh: with PostgreSQL installed (or installable
    as root with apt) the command sees TOKENPATH_TEST_POSTGRES_URL and can use it; afterwards the
    cluster is stopped and its directory gone."""
    root = Path(__file__).resolve().parents[2]
    probe = ("import os, psycopg; url = os.environ['TOKENPATH_TEST_POSTGRES_URL']; "
             "print(psycopg.connect(url).execute('select 1').fetchone()[0])")
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TOKENPATH_TEST_POSTGRES_URL"}
    have = any(Path("/usr/lib/postgresql").glob("*/bin/initdb")) or subprocess.run(
        ["sh", "-c", "command -v initdb"], capture_output=True).returncode == 0
    if not have and os.geteuid() != 0:
        missing(request.config, "postgres", "PostgreSQL is not installed and installing it needs root")
    out = subprocess.run(["bash", str(root / "scripts" / "services.sh"), sys.executable, "-c", probe],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-2000:]
    started = re.search(r"started a private cluster on \S+ \((\S+)\)", out.stderr)
    assert started and "stopped and removed" in out.stderr, out.stderr[-2000:]
    assert not Path(started.group(1)).exists()
