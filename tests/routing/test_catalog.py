"""The catalog's bookkeeping (routing.catalog): one shared load, the budget and its evictions, the
back-off after a failed load, and the Timeline facts a waiting request gets. The loader is the
catalog's injected dependency; here it builds a bare Deployment with a stated footprint, so the
budget arithmetic is exact (the real loader runs in tests/api/test_model_catalog.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenpath.errors import ConflictError, DeadlineExceededError, NotFoundError, ServiceUnavailableError
from tokenpath.routing.catalog import CatalogConfig, CatalogEntry, Loaded, ModelCatalog
from tokenpath.routing.models import Deployment, ModelRouter
from tokenpath.telemetry.causes import derive
from tokenpath.telemetry.timeline import Timeline

MIB = 1024 * 1024


class Loads:
    """A loader that records its calls: a model of `sizes[id]` MiB, after `delay` seconds; the
    ids in `broken` fail."""

    def __init__(self, sizes: dict[str, int], delay: float = 0.05, broken: set[str] | None = None) -> None:
        self.sizes, self.delay, self.broken = sizes, delay, broken or set()
        self.calls: list[str] = []
        self.closed: list[str] = []

    async def __call__(self, entry: CatalogEntry) -> Loaded:
        self.calls.append(entry.id)
        await asyncio.sleep(self.delay)
        if entry.id in self.broken:
            raise RuntimeError(f"{entry.source}: bad tensor data")

        async def close() -> None:
            self.closed.append(entry.id)

        return Loaded(Deployment(entry.id, entry.task), close, self.sizes[entry.id] * MIB)


def catalog(loads: Loads, **config: object) -> ModelCatalog:
    entries = [CatalogEntry(i, f"/models/{i}.gguf", "chat", size_hint=loads.sizes[i] * MIB) for i in loads.sizes]
    return ModelCatalog(entries, loads, CatalogConfig(**config))  # type: ignore[arg-type]


def test_duplicate_ids_are_refused_naming_both_sources():
    with pytest.raises(ValueError, match=r"'a'.*/x/a\.gguf and /y/a"):
        ModelCatalog([CatalogEntry("a", "/x/a.gguf", "chat"), CatalogEntry("a", "/y/a", "chat")], Loads({}))


async def test_concurrent_first_requests_share_one_load_and_wait_in_model_load():
    loads = Loads({"a": 10})
    cat = catalog(loads)
    router = ModelRouter([], catalog=cat)
    timelines = [Timeline(f"r{i}") for i in range(5)]
    got = await asyncio.gather(*(router.acquire("a", "chat", t) for t in timelines))
    assert loads.calls == ["a"] and {d.name for d, _ in got} == {"a"} and "a" in router.deployments
    for t in timelines:
        assert t.durations().get("model_load") is not None and t.attrs["model_load"]["cause"] == "cold"
    assert cat.state("a") == "loaded" and cat.describe("a")["loads"] == 1
    for _, release in got:
        assert release is not None
        release()
    with pytest.raises(NotFoundError, match="'/etc/passwd'"):  # never a load from a path
        await router.acquire("/etc/passwd", "chat")


async def test_budget_evicts_the_lru_idle_model_and_the_cause_names_it():
    loads = Loads({"a": 60, "b": 60, "c": 60})
    cat = catalog(loads, memory_bytes=130 * MIB)
    _, rel_a = await cat.acquire("a")
    _, rel_b = await cat.acquire("b")
    rel_a()
    rel_b()
    await cat.acquire("b")  # b is now the more recently used (and held)
    t = Timeline("r")
    await cat.acquire("c", t)
    assert loads.closed == ["a"] and cat.state("a") == "unloaded" and cat.used_bytes() == 120 * MIB
    t2 = Timeline("r2")
    with pytest.raises(ServiceUnavailableError) as busy:  # b held, c held: nothing to evict
        await cat.acquire("a", t2)
    assert busy.value.code == "model_memory_exhausted" and "Retry-After" in busy.value.headers
    assert cat.state("a") == "unloaded"  # (not failed: nothing was wrong with it)


async def test_an_evicted_model_says_who_evicted_it():
    loads = Loads({"a": 60, "b": 60})
    cat = catalog(loads, max_loaded=1)
    (_, rel) = await cat.acquire("a")
    rel()
    (_, rel) = await cat.acquire("b")
    rel()
    t = Timeline("r")
    t.stamp("body_read")
    await cat.acquire("a", t)
    t.stamp("finished")
    why = t.attrs["model_load"]
    assert why["cause"] == "evicted" and why["evicted_for"] == "b" and why["evicted_ago_s"] >= 0
    causes = {c.kind: c for c in derive(t)}
    assert causes["model_load"].detail["evicted_for"] == "b"


async def test_a_model_larger_than_the_budget_is_refused_with_both_sizes():
    loads = Loads({"big": 300, "small": 10})
    cat = catalog(loads, memory_bytes=100 * MIB)
    with pytest.raises(ServiceUnavailableError, match=r"'big' needs 300 MiB.*budget of 100 MiB"):
        await cat.acquire("big")
    assert loads.calls == [] and cat.state("big") == "failed"
    await cat.acquire("small")  # the others keep serving
    assert cat.state("small") == "loaded"


async def test_a_failed_load_backs_off_then_tries_again():
    loads = Loads({"a": 10}, broken={"a"})
    cat = catalog(loads, backoff_s=0.3)
    for _ in range(2):
        with pytest.raises(ServiceUnavailableError, match="'a' failed to load: .*bad tensor data") as exc:
            await cat.acquire("a")
        assert exc.value.headers["Retry-After"] == "1"
    assert loads.calls == ["a"]  # the second was refused inside the back-off, without a load
    await asyncio.sleep(0.4)
    loads.broken.clear()
    await cat.acquire("a")
    assert loads.calls == ["a", "a"] and cat.state("a") == "loaded"


async def test_unload_of_a_busy_model_is_a_409_unless_forced_and_idle_ones_are_reaped():
    loads = Loads({"a": 10, "b": 10})
    cat = catalog(loads, keep_alive_s=-1, reap_interval_s=0.05)
    stopped: list[str] = []
    _, release = await cat.acquire("a", stop=stopped.append)
    with pytest.raises(ConflictError, match="1 request"):
        await cat.unload("a")
    assert await cat.unload("a", force=True) == "unloaded" and stopped == ["model_unloaded"]
    release()
    cat.start()
    _, release = await cat.acquire("b", keep_alive_s=0.1)  # Ollama's per-request keep_alive
    await asyncio.sleep(0.4)
    assert cat.state("b") == "loaded"  # held: never unloaded while a request runs
    release()
    for _ in range(100):
        if cat.state("b") == "unloaded":
            break
        await asyncio.sleep(0.05)
    assert cat.state("b") == "unloaded" and loads.closed == ["a", "b"]
    await cat.close()


async def test_a_load_measured_larger_than_its_estimate_still_keeps_the_budget():
    loads = Loads({"a": 60, "b": 60})
    entries = [CatalogEntry("a", "/m/a.gguf", "chat", size_hint=60 * MIB),
               CatalogEntry("b", "/m/b.gguf", "chat", size_hint=10 * MIB)]  # (its disk size: a fraction)
    cat = ModelCatalog(entries, loads, CatalogConfig(memory_bytes=100 * MIB))
    (_, rel) = await cat.acquire("a")
    rel()
    await cat.acquire("b")  # 60 + 10 fits; measured 60 + 60 does not: a goes
    assert cat.state("a") == "unloaded" and cat.used_bytes() == 60 * MIB


async def test_a_request_waits_for_a_load_under_its_deadline_and_the_load_goes_on():
    loads = Loads({"a": 10}, delay=0.5)
    cat = catalog(loads)
    t = Timeline("r")
    t.stamp("body_read")
    with pytest.raises(DeadlineExceededError, match="while model 'a' was loading"):
        await cat.acquire("a", t, deadline=time.monotonic() + 0.05)
    t.stamp("finished")
    assert "model_load" in t.durations()  # it ended in the stage it waited in
    await cat.acquire("a")  # the load it started goes on: this one joins it
    assert loads.calls == ["a"] and cat.state("a") == "loaded"


async def test_unloading_closes_the_deployments_flow_through_its_public_close():
    """The catalog stops an unloaded model's flow controller with `Deployment.close_flow`, which
    never builds a flow just to close it."""
    loads = Loads({"a": 10})
    cat = catalog(loads)
    dep, release = await cat.acquire("a")
    release()
    closed: list[str] = []
    close_flow = dep.close_flow

    async def spy() -> None:
        closed.append(dep.name)
        await close_flow()

    dep.close_flow = spy  # type: ignore[method-assign]
    await cat.unload("a")
    assert closed == ["a"] and loads.closed == ["a"]
    bare = Deployment("b", "chat")
    await bare.close_flow()
    assert bare._flow is None  # (nothing was built)
    flow = bare.flow
    await bare.close_flow()
    assert bare.flow is flow


async def test_an_unload_waits_for_a_finishing_request_to_let_go_then_frees():
    """A request whose reply was sent releases the model and then still holds its deployment while
    its end runs (the audit write): an unload arriving then must free it once that lets go, not
    free nothing (CI: 327 MiB before a load, 440 after its unload). `free` records whether the
    deployment was still alive each time it ran; the unload returns only after it was gone."""
    import weakref

    alive: list[bool] = []
    refs: list[weakref.ref[Deployment]] = []

    async def load(entry: CatalogEntry) -> Loaded:
        dep = Deployment(entry.id, entry.task)
        refs.append(weakref.ref(dep))

        async def close() -> None:
            pass

        async def free() -> None:
            import gc

            gc.collect()
            alive.append(refs[-1]() is not None)

        return Loaded(dep, close, MIB, free)

    cat = ModelCatalog([CatalogEntry("a", "/models/a.gguf", "chat")], load, CatalogConfig())
    held, release = await cat.acquire("a")
    release()  # (the reply was sent; the request's end goes on, holding `held`)

    async def finishing(dep: Deployment) -> None:
        await asyncio.sleep(0.3)
        del dep

    ending = asyncio.create_task(finishing(held))
    del held
    started = time.monotonic()
    await cat.unload("a")
    assert refs[-1]() is None, "the unload returned with the deployment still alive"
    # Held at the first collection, gone at the last: the wait ended because the holder let go (the
    # last `free` ran in the wait loop, which stops at LATE_HOLDER_WAIT_S with the deployment alive).
    # No upper bound on the time: each poll runs a full gc.collect, which on a loaded 2-core host
    # in a suite's big heap took 4.7 s of polls in all (CI, 2026-12-06).
    assert alive[0] and not alive[-1], alive
    assert time.monotonic() - started > 0.25
    await ending
