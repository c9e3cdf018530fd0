"""`tokenpath diagnose` names thrash: catalog models evicting each other under a budget that fits
one, reloaded soon after. The catalog is the real one (routing.catalog) with its injected loader
building a bare Deployment of a stated footprint (a real model's load takes ~15 s on this machine;
the catalog's own bookkeeping is what writes the causes). The requests' audit rows go through a
real SQLite store and `tokenpath diagnose` reads them back from it, as it does offline."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest

from tokenpath.gateway.base import AuditRecord
from tokenpath.gateway.store import GatewayStore, resolve_store_location
from tokenpath.routing.catalog import CatalogConfig, CatalogEntry, Loaded, ModelCatalog
from tokenpath.routing.models import Deployment
from tokenpath.server import trace_cli
from tokenpath.telemetry.causes import derive
from tokenpath.telemetry.stages import stage_ms
from tokenpath.telemetry.timeline import Timeline

MIB = 1024 * 1024


async def _load(entry: CatalogEntry) -> Loaded:
    await asyncio.sleep(0.05)

    async def close() -> None:
        return None

    return Loaded(Deployment(entry.id, entry.task), close, 60 * MIB)


async def _serve(cat: ModelCatalog, model: str, store: GatewayStore) -> dict:
    """One request through the catalog, its audit row written as the API writes it."""
    t = Timeline(uuid.uuid4().hex[:12])
    t.stamp("body_read")
    _, release = await cat.acquire(model, t)
    t.stamp("admitted")
    await asyncio.sleep(0.01)
    t.stamp("finished")
    release()
    timing = {"stages_ms": stage_ms(t), "causes": [c.as_dict() for c in derive(t)]}
    store.write_audit(AuditRecord(request_id=t.request_id, time=time.time(), tenant="t", key_prefix=None,
                                  model=model, endpoint="/v1/chat/completions", status=200,
                                  timing=json.dumps(timing)))
    return t.attrs.get("model_load") or {}


def _diagnose(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    parser = argparse.ArgumentParser()
    trace_cli.register(parser.add_subparsers())
    args = parser.parse_args(["diagnose", "--json", "--data-dir", str(data_dir)])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


async def test_diagnose_names_models_evicting_each_other(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENPATH_DATABASE_URL", raising=False)
    store = GatewayStore(resolve_store_location(tmp_path))
    entries = [CatalogEntry(m, f"/models/{m}.gguf", "chat", size_hint=60 * MIB) for m in ("a", "b", "c")]
    cat = ModelCatalog(entries, _load, CatalogConfig(memory_bytes=100 * MIB))
    whys = [await _serve(cat, m, store) for m in ("a", "b", "a", "b", "a", "c")]
    store.close()
    assert [w["cause"] for w in whys] == ["cold", "cold", "evicted", "evicted", "evicted", "cold"]
    assert whys[2]["evicted_for"] == "b" and whys[2]["memory_bytes"] == 60 * MIB and whys[2]["load"] == 2

    report = _diagnose(tmp_path, capsys)
    found = {f["kind"]: f for f in report["findings"]}
    thrash = found["model_thrash"]
    ev = thrash["evidence"]
    assert ev["loads"] == 6 and ev["reloads"] == 3 and ev["models"] == ["a", "b"]
    assert {(e["model"], e["evicted_for"], e["times"]) for e in ev["evicted_by"]} == {("a", "b", 2), ("b", "a", 1)}
    assert ev["load_seconds"] >= 6 * 0.04 and "b evicted a x2" in thrash["figure"]
    assert "--models-memory 120MiB" in thrash["lever"] and "now 100 MiB" in thrash["lever"]
    assert "pin" in thrash["lever"] and "(a:" in thrash["lever"]


async def test_reloads_after_idle_unloads_point_at_the_keep_alive(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENPATH_DATABASE_URL", raising=False)
    store = GatewayStore(resolve_store_location(tmp_path))
    cat = ModelCatalog([CatalogEntry("a", "/models/a.gguf", "chat")], _load,
                       CatalogConfig(keep_alive_s=0.0, reap_interval_s=0.02))
    cat.start()
    whys = []
    for _ in range(4):
        whys.append(await _serve(cat, "a", store))
        for _ in range(500):  # the reaper unloads it (generous: a loaded machine)
            if cat.state("a") == "unloaded":
                break
            await asyncio.sleep(0.02)
    await cat.close()
    store.close()
    assert [w["cause"] for w in whys] == ["cold"] + ["idle_unloaded"] * 3
    thrash = {f["kind"]: f for f in _diagnose(tmp_path, capsys)["findings"]}["model_thrash"]
    assert thrash["evidence"]["idle_reloads"] == 3 and "--keep-alive" in thrash["lever"]
    assert "--models-memory" not in thrash["lever"]
