"""Rate limits and quotas through the real guard and store (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from tokenpath.errors import InvalidRequestError, RateLimitError
from tokenpath.gateway import Gateway, GatewayStore, Limits
from tokenpath.gateway.admin import create_key, set_tenant
from tokenpath.gateway.limiter import DAY_S, day_of, format_duration


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def _try_reserve(gw: Gateway, principal, tokens: int):
    try:
        return await gw.reserve(principal, "m", tokens)
    except RateLimitError as exc:
        return exc


async def test_tpm_exact_under_50_concurrent_requests_from_two_gateways(store_location, clock):
    """Two gateway instances (separate connections, as two processes would have) share one store."""
    stores = [GatewayStore(store_location), GatewayStore(store_location)]
    try:
        secret, _ = create_key(stores[0], "acme", limits=Limits(tpm=1000), now=clock())
        gateways = [Gateway(s, clock=clock) for s in stores]
        principal = await gateways[0].authenticate(bearer(secret))
        sizes = [30 + 7 * (i % 9) for i in range(50)]  # 30..86 tokens, 2,650 in all
        results = await asyncio.gather(
            *(_try_reserve(gateways[i % 2], principal, n) for i, n in enumerate(sizes))
        )
        admitted = [r.tokens for r in results if not isinstance(r, RateLimitError)]
        refused = [r for r in results if isinstance(r, RateLimitError)]
        assert sum(admitted) <= 1000
        assert refused, "2,650 tokens asked against 1,000: some must be refused"
        # Exact, not merely safe: whatever was refused did not fit in what was left.
        assert all(n > 1000 - sum(admitted) for n, r in zip(sizes, results, strict=True) if isinstance(r, RateLimitError))
        for exc in refused:
            assert exc.headers["x-ratelimit-limit-tokens"] == "1000"
            assert int(exc.headers["Retry-After"]) >= 1
    finally:
        for s in stores:
            s.close()


async def test_reconcile_returns_unused_tokens_to_the_window(store, clock):
    secret, _ = create_key(store, "acme", limits=Limits(tpm=100), now=clock())
    gw = Gateway(store, clock=clock)
    p = await gw.authenticate(bearer(secret))
    first = await gw.reserve(p, "m", 80)
    assert first.headers["x-ratelimit-remaining-tokens"] == "20"
    with pytest.raises(RateLimitError):
        await gw.reserve(p, "m", 30)
    await gw.reconcile(first, 10)
    await gw.reconcile(first, 10)  # idempotent: the API may call it from more than one path
    second = await gw.reserve(p, "m", 90)
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimitError):
        await gw.reserve(p, "m", 1)


async def test_rpm_limit_sliding_window_and_retry_after(store, clock):
    secret, _ = create_key(store, "acme", limits=Limits(rpm=2), now=clock())
    gw = Gateway(store, clock=clock)
    p = await gw.authenticate(bearer(secret))
    r1 = await gw.reserve(p, "m", 1)
    assert (r1.headers["x-ratelimit-limit-requests"], r1.headers["x-ratelimit-remaining-requests"]) == ("2", "1")
    clock.advance(20)
    await gw.reserve(p, "m", 1)
    clock.advance(10)
    with pytest.raises(RateLimitError) as err:
        await gw.reserve(p, "m", 1)
    # The first admission (30 s ago) leaves the 60 s window in 30 s.
    assert err.value.retry_after == pytest.approx(30)
    assert err.value.headers["Retry-After"] == "30"
    assert err.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.value.status_code == 429
    clock.advance(30.5)
    await gw.reserve(p, "m", 1)  # one slot came back, not two: the window slides
    with pytest.raises(RateLimitError):
        await gw.reserve(p, "m", 1)


async def test_tenant_limit_spans_its_keys_and_keys_tighten_tenant_defaults(store, clock):
    set_tenant(store, "acme", limits=Limits(rpm=3, tpm=500), now=clock())
    loose, _ = create_key(store, "acme", now=clock())
    tight, _ = create_key(store, "acme", limits=Limits(tpm=100, rpm=50), now=clock())
    gw = Gateway(store, clock=clock)
    p_loose, p_tight = await gw.authenticate(bearer(loose)), await gw.authenticate(bearer(tight))
    assert p_loose.key_limits == Limits(rpm=3, tpm=500)  # inherited
    assert p_tight.key_limits == Limits(rpm=3, tpm=100)  # tightened, never loosened past the tenant
    with pytest.raises(InvalidRequestError):  # 150 > the key's 100 TPM: can never fit, so not a 429
        await gw.reserve(p_tight, "m", 150)
    await gw.reserve(p_loose, "m", 10)
    await gw.reserve(p_tight, "m", 10)
    await gw.reserve(p_loose, "m", 10)
    with pytest.raises(RateLimitError) as err:  # the tenant's 3 RPM is shared by both keys
        await gw.reserve(p_tight, "m", 10)
    assert "tenant 'acme'" in err.value.message


async def test_daily_quota_resets_at_the_day_boundary(store, clock):
    clock.now = (day_of(clock.now) + 1) * DAY_S - 10  # 23:59:50 UTC
    secret, _ = create_key(store, "acme", limits=Limits(daily_tokens=100), now=clock())
    gw = Gateway(store, clock=clock)
    p = await gw.authenticate(bearer(secret))
    late = await gw.reserve(p, "m", 70)
    assert late.headers["x-ratelimit-remaining-tokens-day"] == "30"
    with pytest.raises(RateLimitError) as err:
        await gw.reserve(p, "m", 40)
    assert err.value.retry_after == pytest.approx(10)
    clock.advance(11)  # 00:00:01 the next day
    fresh = await gw.reserve(p, "m", 90)
    assert fresh.headers["x-ratelimit-remaining-tokens-day"] == "10"
    # Reconciling yesterday's request after midnight credits yesterday, not today.
    await gw.reconcile(late, 0)
    with pytest.raises(RateLimitError):
        await gw.reserve(p, "m", 20)


async def test_no_limits_no_headers_and_anonymous_has_no_limits(store, clock):
    gw = Gateway(store, clock=clock)
    anon = await gw.authenticate({})
    assert (await gw.reserve(anon, "m", 10**9)).headers == {}
    secret, _ = create_key(store, "acme", now=clock())
    p = await gw.authenticate(bearer(secret))
    assert (await gw.reserve(p, "m", 10**6)).headers == {}


def test_format_duration():
    assert [format_duration(s) for s in (0.25, 1, 12.34, 59.99, 60, 360, 3723)] == [
        "250ms", "1s", "12s", "59s", "1m0s", "6m0s", "1h2m3s"]


_WORKER = r"""
import asyncio, json, os, sys, time
from tokenpath.errors import RateLimitError
from tokenpath.gateway import Gateway, GatewayStore

location, secret, go_file, sizes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

async def main():
    gw = Gateway(GatewayStore(location))
    p = await gw.authenticate({"Authorization": "Bearer " + secret})
    while not os.path.exists(go_file):  # start together with the other processes
        await asyncio.sleep(0.005)

    async def one(n):
        try:
            await gw.reserve(p, "m", n)
            return [n, True]
        except RateLimitError:
            return [n, False]

    print(json.dumps(await asyncio.gather(*(one(n) for n in sizes))))

asyncio.run(main())
"""


def test_tpm_exact_across_gateway_processes(store_location, tmp_path, clock):
    """Three OS processes, each its own gateway and connection, race for one key's 1,000 TPM."""
    admin = GatewayStore(store_location)
    try:
        secret, _ = create_key(admin, "acme", limits=Limits(tpm=1000), now=clock())
    finally:
        admin.close()
    go = tmp_path / "go"
    sizes = [[40 + 3 * ((i + 7 * w) % 11) for i in range(20)] for w in range(3)]  # 60 requests, ~3,000 tokens
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, store_location, secret, str(go), json.dumps(s)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in sizes]
    time.sleep(1.0)  # let them connect; correctness does not depend on it, only how hard they race
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results += json.loads(out)
    admitted = sum(n for n, ok in results if ok)
    refused = [n for n, ok in results if not ok]
    assert admitted <= 1000 and refused
    assert all(n > 1000 - admitted for n in refused)


async def test_reservations_are_written_on_the_loop_unless_the_store_is_busy(store_location, clock):
    """`reserve` and `adjust` run before every request with a stored key: on the event loop where
    the store can write at once (SQLite: `write_nowait`, no thread hop), else off it. A store whose
    write lock another writer holds (another gateway process here; the audit writer's thread
    alike) is not waited for on the loop: nothing is written there, and the reservation goes off
    the loop, where it waits its turn and is decided the same way. PostgreSQL always goes off it."""
    import sqlite3

    from tokenpath.gateway.limits_backend import StoreLimits

    store = GatewayStore(store_location)
    try:
        secret, record = create_key(store, "acme", limits=Limits(tpm=1000), now=clock())
        p = await Gateway(store, clock=clock).authenticate(bearer(secret))
        key, tenant = p.key_limits or Limits(), p.tenant_limits or Limits()
        sqlite = store.db.kind == "sqlite"
        first = store.reserve_nowait(record.prefix, "acme", key, tenant, 600, clock())
        assert (first is not None and first.verdict.allowed and first.admission_id is not None) is sqlite
        if not sqlite:
            return
        assert store.adjust_nowait(first.admission_id, record.prefix, "acme", key, tenant, first.day, 600, 500,
                                   clock()).allowed
        refused = store.reserve_nowait(record.prefix, "acme", key, tenant, 600, clock())  # 500 + 600 > 1000
        assert refused is not None and not refused.verdict.allowed and refused.admission_id is None
        other = sqlite3.connect(store_location, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the store
        try:
            assert store.reserve_nowait(record.prefix, "acme", key, tenant, 100, clock()) is None
            limits = StoreLimits(store)
            waiting = asyncio.create_task(limits.reserve(record.prefix, "acme", key, tenant, 100, clock()))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # off the loop, waiting its turn (the loop itself is free)
        finally:
            other.execute("COMMIT")
            other.close()
        admitted = await waiting
        assert admitted.verdict.allowed and admitted.admission_id is not None
        (used,) = store.db.read_nowait("SELECT COALESCE(SUM(tokens), 0) FROM admissions") or [(None,)]
        assert used == (500 + 100,)
    finally:
        store.close()


async def test_reconcile_is_written_on_the_loop_unless_the_store_is_busy(store_location, clock):
    """Every request with a stored key reconciles its reservation once the reply is out: on the event
    loop where SQLite can write at once (`reconcile_nowait`, as `reserve_nowait`), else off it,
    waiting its turn behind another writer; the day's count ends the same either way."""
    import sqlite3

    from tokenpath.gateway.limits_backend import StoreLimits

    store = GatewayStore(store_location)
    try:
        secret, record = create_key(store, "acme", limits=Limits(tpm=1000), now=clock())
        p = await Gateway(store, clock=clock).authenticate(bearer(secret))
        key, tenant = p.key_limits or Limits(), p.tenant_limits or Limits()
        if store.db.kind != "sqlite":  # (PostgreSQL is never written on the loop)
            assert not store.reconcile_nowait(1, record.prefix, "acme", 0, 0, 0)
            return
        a = store.reserve_nowait(record.prefix, "acme", key, tenant, 600, clock())
        b = store.reserve_nowait(record.prefix, "acme", key, tenant, 300, clock())
        assert a is not None and b is not None and a.admission_id is not None and b.admission_id is not None
        assert store.reconcile_nowait(a.admission_id, record.prefix, "acme", a.day, 600, 250)
        other = sqlite3.connect(store_location, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the store
        try:
            assert not store.reconcile_nowait(b.admission_id, record.prefix, "acme", b.day, 300, 100)
            waiting = asyncio.create_task(StoreLimits(store).reconcile(b.admission_id, record.prefix, "acme",
                                                                       b.day, 300, 100))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # off the loop, waiting its turn (the loop itself is free)
        finally:
            other.execute("COMMIT")
            other.close()
        await waiting
        used = store.db.read_nowait("SELECT tokens FROM admissions ORDER BY id")
        assert used == [(250,), (100,)]
        day = store.db.read_nowait("SELECT tokens FROM daily_usage WHERE scope = ?", (f"key:{record.prefix}",))
        assert day == [(350,)]
    finally:
        store.close()
