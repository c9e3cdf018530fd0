"""Adapter affinity in the default picker: holders first (`lora_hit`), a hot adapter spread to a
second replica instead of pinned (`lora_spread`), a cold one to a replica with a free slot
(`lora_cold`); the adapter's block hashes are its own, so a base-model prefix is no hit."""

from __future__ import annotations

from tokenpath.engine.block_hash import block_hashes, lora_root
from tokenpath.protocol import GenerateRequest, ReplicaState, Submission
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.sampling_params import SamplingParams
from tokenpath.routing.replicas import PrefixAwarePicker, RoundRobinPicker
from tokenpath.telemetry.timeline import Timeline

SQL = LoraRef("sql", "/adapters/sql")


def req(tokens, lora=None, rid="r"):
    return Submission(GenerateRequest(rid, list(tokens), SamplingParams(), lora=lora), Timeline(rid))


def st(name, running=0, loras=(), running_loras=(), hashes=(), max_loras=2):
    return ReplicaState(name, running=running, max_num_seqs=8, loras=frozenset(loras),
                        running_loras=tuple(running_loras), prefix_hashes=set(hashes), max_loras=max_loras)


def test_holder_preferred():
    pick = PrefixAwarePicker().pick(req([1, 2, 3], SQL), [st("a"), st("b", running=2, loras=["sql"])])
    assert (pick.name, pick.reason) == ("b", "lora_hit")


def test_hot_adapter_spreads_instead_of_pinning():
    busy = st("a", running=6, loras=["sql"], running_loras=["sql"])
    pick = PrefixAwarePicker().pick(req([1, 2, 3], SQL), [busy, st("b", running=1)])
    assert (pick.name, pick.reason) == ("b", "lora_spread")
    # Once both hold it, the less loaded holder serves it.
    pick = PrefixAwarePicker().pick(req([1, 2, 3], SQL), [busy, st("b", running=1, loras=["sql"])])
    assert (pick.name, pick.reason) == ("b", "lora_hit")


def test_cold_adapter_goes_where_a_slot_is_free():
    full = st("a", running=1, loras=["x", "y"], running_loras=["x", "y"])
    pick = PrefixAwarePicker().pick(req([1, 2, 3], SQL), [full, st("b", running=3, loras=["z"], running_loras=["z"])])
    assert (pick.name, pick.reason) == ("b", "lora_cold")


def test_adapter_prefixes_are_its_own():
    tokens = list(range(100, 100 + 64))
    base_hashes = block_hashes(tokens, 16)
    sql_hashes = block_hashes(tokens, 16, root=lora_root(SQL.name, SQL.path))
    assert not set(base_hashes) & set(sql_hashes)
    states = [st("a", hashes=base_hashes, loras=["sql"]), st("b", hashes=sql_hashes, loras=["sql"])]
    pick = PrefixAwarePicker().pick(req(tokens, SQL), states)
    assert (pick.name, pick.matched_blocks, pick.reason) == ("b", 4, "lora_hit")
    assert PrefixAwarePicker().pick(req(tokens), states).name == "a"  # the base model's prefix is on a


def test_base_requests_unchanged_and_round_robin_ignores_adapters():
    pick = PrefixAwarePicker().pick(req([1, 2]), [st("a"), st("b")])
    assert not pick.reason.startswith("lora")
    rr = RoundRobinPicker()
    assert [rr.pick(req([1], SQL), [st("a", loras=["sql"]), st("b")]).name for _ in range(2)] == ["a", "b"]
