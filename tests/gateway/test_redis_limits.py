"""Rate limits and quotas kept in a real Redis (`RedisLimits`) through the real guard; keys in a
real SQLite store. Gateways here are separate `Gateway` objects with their own Redis connection
pools, as separate processes would have (tests/gateway/test_redis_shared_limits.py runs real
`tokenpath serve` processes)."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from redis_fixtures import PrivateRedis, free_port

from tokenpath.errors import InvalidRequestError, RateLimitError, ServiceUnavailableError
from tokenpath.gateway import Gateway, GatewayStore, Limits
from tokenpath.gateway.admin import create_key, set_tenant
from tokenpath.gateway.limiter import DAY_S, day_of


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def store(tmp_path: Path):
    s = GatewayStore(tmp_path / "gateway.sqlite3")
    yield s
    s.close()


async def _try(gw: Gateway, principal, tokens: int):
    try:
        return await gw.reserve(principal, "m", tokens)
    except RateLimitError as exc:
        return exc


async def test_tpm_exact_under_50_concurrent_requests_from_two_gateways(store, clock, make_limits):
    secret, _ = create_key(store, "acme", limits=Limits(tpm=1000), now=clock())
    gateways = [Gateway(store, clock=clock, limits=make_limits()) for _ in range(2)]
    principal = await gateways[0].authenticate(bearer(secret))
    sizes = [30 + 7 * (i % 9) for i in range(50)]  # 30..86 tokens, 2,650 in all
    results = await asyncio.gather(*(_try(gateways[i % 2], principal, n) for i, n in enumerate(sizes)))
    admitted = [r.tokens for r in results if not isinstance(r, RateLimitError)]
    refused = [r for r in results if isinstance(r, RateLimitError)]
    assert sum(admitted) <= 1000 and refused
    # Exact, not merely safe: whatever was refused did not fit in what was left.
    assert all(n > 1000 - sum(admitted) for n, r in zip(sizes, results, strict=True) if isinstance(r, RateLimitError))
    for exc in refused:
        assert exc.headers["x-ratelimit-limit-tokens"] == "1000"
        assert int(exc.headers["Retry-After"]) >= 1
    # The windows are in Redis, not in the SQL store.
    assert store.db.transaction().__enter__().q("SELECT COUNT(*) FROM admissions")[0][0] == 0


async def test_rpm_exact_across_two_gateways_and_the_window_slides(store, clock, make_limits):
    secret, _ = create_key(store, "acme", limits=Limits(rpm=10), now=clock())
    gateways = [Gateway(store, clock=clock, limits=make_limits()) for _ in range(2)]
    p = await gateways[0].authenticate(bearer(secret))
    results = await asyncio.gather(*(_try(gateways[i % 2], p, 1) for i in range(30)))
    assert sum(not isinstance(r, RateLimitError) for r in results) == 10
    clock.advance(59.9)
    assert isinstance(await _try(gateways[0], p, 1), RateLimitError)
    clock.advance(0.2)  # every admission is now more than 60 s old
    results = await asyncio.gather(*(_try(gateways[i % 2], p, 1) for i in range(12)))
    assert sum(not isinstance(r, RateLimitError) for r in results) == 10


async def test_reconcile_returns_unused_tokens_to_the_window(store, clock, make_limits):
    secret, _ = create_key(store, "acme", limits=Limits(tpm=100), now=clock())
    gw = Gateway(store, clock=clock, limits=make_limits())
    p = await gw.authenticate(bearer(secret))
    first = await gw.reserve(p, "m", 80)
    assert first.headers["x-ratelimit-remaining-tokens"] == "20"
    with pytest.raises(RateLimitError):
        await gw.reserve(p, "m", 30)
    await gw.reconcile(first, 10)
    await gw.reconcile(first, 10)  # idempotent
    second = await gw.reserve(p, "m", 90)
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimitError):
        await gw.reserve(p, "m", 1)


async def test_rpm_retry_after_and_tenant_limits_span_keys(store, clock, make_limits):
    set_tenant(store, "acme", limits=Limits(rpm=3, tpm=500), now=clock())
    loose, _ = create_key(store, "acme", now=clock())
    tight, _ = create_key(store, "acme", limits=Limits(tpm=100, rpm=2), now=clock())
    gw = Gateway(store, clock=clock, limits=make_limits())
    p_loose, p_tight = await gw.authenticate(bearer(loose)), await gw.authenticate(bearer(tight))
    with pytest.raises(InvalidRequestError):  # over the key's 100 TPM: can never fit, so a 400
        await gw.reserve(p_tight, "m", 150)
    await gw.reserve(p_tight, "m", 10)
    clock.advance(20)
    await gw.reserve(p_tight, "m", 10)
    clock.advance(10)
    with pytest.raises(RateLimitError) as err:  # the key's own 2 RPM
        await gw.reserve(p_tight, "m", 10)
    assert err.value.retry_after == pytest.approx(30)  # its first admission leaves the window then
    assert "key " in err.value.message
    await gw.reserve(p_loose, "m", 10)
    with pytest.raises(RateLimitError) as err:  # the tenant's 3 RPM, shared by both keys
        await gw.reserve(p_loose, "m", 10)
    assert "tenant 'acme'" in err.value.message


async def test_daily_quota_resets_at_midnight_and_late_reconcile_credits_yesterday(store, clock, make_limits):
    clock.now = (day_of(clock.now) + 1) * DAY_S - 10  # 23:59:50 UTC
    secret, _ = create_key(store, "acme", limits=Limits(daily_tokens=100), now=clock())
    gw = Gateway(store, clock=clock, limits=make_limits())
    p = await gw.authenticate(bearer(secret))
    late = await gw.reserve(p, "m", 70)
    assert late.headers["x-ratelimit-remaining-tokens-day"] == "30"
    with pytest.raises(RateLimitError) as err:
        await gw.reserve(p, "m", 40)
    assert err.value.retry_after == pytest.approx(10)
    clock.advance(11)
    fresh = await gw.reserve(p, "m", 90)
    assert fresh.headers["x-ratelimit-remaining-tokens-day"] == "10"
    await gw.reconcile(late, 0)
    with pytest.raises(RateLimitError):
        await gw.reserve(p, "m", 20)


async def test_same_decisions_headers_and_retry_after_as_the_sql_store(tmp_path, clock, make_limits):
    """One rule in two languages (Python for SQL, Lua in Redis): a random walk through both agrees."""
    sql_store, redis_store = GatewayStore(tmp_path / "a.sqlite3"), GatewayStore(tmp_path / "b.sqlite3")
    try:
        gws, principals = [], []
        for s, limits in ((sql_store, None), (redis_store, make_limits())):
            set_tenant(s, "acme", limits=Limits(rpm=7, tpm=900, daily_tokens=2500), now=clock())
            a, _ = create_key(s, "acme", limits=Limits(tpm=400), now=clock())
            b, _ = create_key(s, "acme", limits=Limits(rpm=4), now=clock())
            gw = Gateway(s, clock=clock, limits=limits)
            gws.append(gw)
            principals.append([await gw.authenticate(bearer(a)), await gw.authenticate(bearer(b))])
        rng = random.Random(13)
        held: list[list] = [[], []]
        outcomes = 0
        adjusted: dict[str, int] = {}
        for _ in range(160):
            action, who, n = rng.random(), rng.randrange(2), rng.randint(1, 450)
            if action < 0.2:
                clock.advance(rng.uniform(0, 25))
                continue
            if action < 0.35 and held[0]:
                i = rng.randrange(len(held[0]))
                used = rng.randint(0, held[0][i].tokens)
                for side in (0, 1):
                    await gws[side].reconcile(held[side].pop(i), used)
                continue
            got = []
            for side in (0, 1):
                mask = principals[side][who].key_prefix or "\0"
                try:
                    r = await gws[side].reserve(principals[side][who], "m", n)
                    held[side].append(r)
                    got.append(("ok", r.headers))
                except RateLimitError as exc:
                    got.append(("429", exc.headers, round(exc.retry_after, 3), exc.message.replace(mask, "KEY")))
                except InvalidRequestError as exc:
                    got.append(("400", exc.message.replace(mask, "KEY")))
            assert got[0] == got[1]
            outcomes += got[0][0] == "429"
            if got[0][0] == "ok" and rng.random() < 0.7:  # tokenized: the estimate becomes exact
                exact = max(1, round(n * rng.uniform(0.3, 2.0)))
                after = [await _adjust(gws[side], held[side][-1], exact, principals[side][who].key_prefix)
                         for side in (0, 1)]
                assert after[0] == after[1]
                kind = ("grow " if exact > n else "shrink ") + after[0][0]
                adjusted[kind] = adjusted.get(kind, 0) + 1
                if after[0][0] != "ok":  # refused: the admission is gone on both sides
                    held[0].pop(), held[1].pop()
        assert outcomes >= 5, "the walk should hit the limits"
        assert {"grow ok", "grow 429", "shrink ok"} <= set(adjusted), adjusted
    finally:
        sql_store.close()
        redis_store.close()


async def _adjust(gw: Gateway, reservation, tokens: int, key_prefix: str | None):
    """An adjust's outcome in comparable form (the key's prefix differs between the two stores)."""
    mask = key_prefix or "\0"
    try:
        await gw.adjust(reservation, tokens)
        return ("ok", reservation.headers, reservation.tokens)
    except RateLimitError as exc:
        return ("429", exc.headers, round(exc.retry_after, 3), exc.message.replace(mask, "KEY"), reservation.reconciled)
    except InvalidRequestError as exc:
        return ("400", exc.message.replace(mask, "KEY"), reservation.reconciled)


@pytest.mark.requires("redis")
async def test_unreachable_redis_fails_closed_with_503_and_a_log_line(store, clock, caplog):
    from tokenpath.gateway.redis_limits import RedisLimits

    secret, _ = create_key(store, "acme", limits=Limits(rpm=5), now=clock())
    limits = RedisLimits(f"redis://:hunter2@127.0.0.1:{free_port()}/0", timeout_s=0.5)  # nothing listens there
    gw = Gateway(store, clock=clock, limits=limits)
    p = await gw.authenticate(bearer(secret))
    with caplog.at_level(logging.ERROR, logger="tokenpath.gateway"):
        with pytest.raises(ServiceUnavailableError) as err:
            await asyncio.wait_for(gw.reserve(p, "m", 10), 5)
        with pytest.raises(ServiceUnavailableError):
            await asyncio.wait_for(gw.reserve(p, "m", 10), 5)
    body = err.value.to_body()["error"]
    assert err.value.status_code == 503 and body["code"] == "rate_limits_unavailable"
    assert "Redis at redis://127.0.0.1:" in body["message"] and "hunter2" not in body["message"]
    lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lines) == 1 and "fail closed" in lines[0] and "hunter2" not in caplog.text  # one line per outage
    await limits.aclose()


@pytest.mark.requires("redis")
async def test_fail_open_admits_without_limits_and_says_so(store, clock, caplog):
    from tokenpath.gateway.redis_limits import RedisLimits

    secret, _ = create_key(store, "acme", limits=Limits(rpm=1), now=clock())
    limits = RedisLimits(f"redis://127.0.0.1:{free_port()}/0", fail_open=True, timeout_s=0.5)
    gw = Gateway(store, clock=clock, limits=limits)
    p = await gw.authenticate(bearer(secret))
    with caplog.at_level(logging.ERROR, logger="tokenpath.gateway"):
        for _ in range(3):  # over the 1 RPM: no limits while Redis is away, as configured
            r = await gw.reserve(p, "m", 10)
            await gw.reconcile(r, 5)  # nothing to give back: must not raise
    assert "WITHOUT rate limits" in caplog.text
    await limits.aclose()


@pytest.mark.requires("redis")
async def test_service_resumes_when_redis_comes_back(store, clock, tmp_path, caplog):
    from tokenpath.gateway.redis_limits import RedisLimits

    server = PrivateRedis(tmp_path)
    url = server.start()
    limits = RedisLimits(url, timeout_s=0.5)
    try:
        secret, _ = create_key(store, "acme", limits=Limits(rpm=100), now=clock())
        gw = Gateway(store, clock=clock, limits=limits)
        p = await gw.authenticate(bearer(secret))
        await gw.reserve(p, "m", 10)
        server.stop()
        with pytest.raises(ServiceUnavailableError):
            await asyncio.wait_for(gw.reserve(p, "m", 10), 5)
        server.start()  # same port, empty (no persistence): the same client object reconnects
        with caplog.at_level(logging.WARNING, logger="tokenpath.gateway"):
            r = await asyncio.wait_for(gw.reserve(p, "m", 10), 5)
        assert r.headers["x-ratelimit-remaining-requests"] == "99"
        assert "reachable again" in caplog.text
    finally:
        await limits.aclose()
        server.stop()


async def test_a_resent_reconcile_gives_back_once(store, clock, make_limits):
    """The client resends a command after a dropped connection: the script must not apply it twice."""
    secret, _ = create_key(store, "acme", limits=Limits(tpm=1000, daily_tokens=1000), now=clock())
    limits = make_limits()
    gw = Gateway(store, clock=clock, limits=limits)
    p = await gw.authenticate(bearer(secret))
    r = await gw.reserve(p, "m", 600)
    for _ in range(2):  # as a resend would: straight to the backend, past the guard's own flag
        await limits.reconcile(r.admission_id, p.key_prefix, p.tenant, r.day, 600, 100)
    after = await gw.reserve(p, "m", 10)
    assert after.headers["x-ratelimit-remaining-tokens"] == str(1000 - 100 - 10)
    assert after.headers["x-ratelimit-remaining-tokens-day"] == str(1000 - 100 - 10)


async def _slow_proxy(upstream: str, delay_s: float) -> asyncio.Server:
    """A loopback TCP proxy to Redis that holds each new connection `delay_s` before passing any
    byte: a Redis (or a gateway's event loop) as slow to answer as on a heavily loaded host."""
    parts = urlsplit(upstream)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delay_s)
        up_reader, up_writer = await asyncio.open_connection(parts.hostname, parts.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.requires("redis")
async def test_a_slow_redis_on_a_loaded_host_is_not_an_outage(store, clock, make_limits, caplog):
    """Under load, opening a burst of connections took over the old 1 s bound and the limits failed
    closed with Redis healthy. A Redis 1.5 s slow to answer is within the default bound: admitted,
    exactly counted, no 503 and no outage logged."""
    from redis_fixtures import REDIS_URL

    proxy = await _slow_proxy(REDIS_URL, 1.5)
    port = proxy.sockets[0].getsockname()[1]
    try:
        secret, _ = create_key(store, "acme", limits=Limits(rpm=3), now=clock())
        gw = Gateway(store, clock=clock, limits=make_limits(url=f"redis://127.0.0.1:{port}/0"))
        p = await gw.authenticate(bearer(secret))
        results = await asyncio.gather(*(_try(gw, p, 1) for _ in range(5)))
        assert sum(not isinstance(r, RateLimitError) for r in results) == 3, results
        assert "unreachable" not in caplog.text
    finally:
        proxy.close()
