"""A stalled replica is never picked, whatever its prefix score (issue 23: requests went to a frozen
engine with `routing_reason: prefix_hit`). Real link replicas (not connected: their state is set
as a link leaves it), the real pool, flow controller and prefix-aware picker."""

from __future__ import annotations

import time

from tokenpath.admission.controller import FlowController
from tokenpath.engine.block_hash import block_hashes
from tokenpath.protocol import EngineState, GenerateRequest, SamplingParams, Submission
from tokenpath.replica.link_client import EngineLinkReplica
from tokenpath.replica.liveness import LivenessConfig
from tokenpath.replica.pool import ReplicaPool
from tokenpath.routing.replicas import PrefixAwarePicker
from tokenpath.telemetry.timeline import Timeline


def linked(name: str) -> EngineLinkReplica:
    rep = EngineLinkReplica(name, secret="unused", max_num_seqs=8, liveness=LivenessConfig(stall_after_s=2.0))
    rep._down_reason = None
    rep.liveness.active = True
    rep._state = EngineState(block_size=16, num_blocks=1000)
    return rep


def request(rid: str, ids: list[int]) -> Submission[GenerateRequest]:
    return Submission(GenerateRequest(rid, ids, SamplingParams(max_tokens=4)), Timeline(rid))


async def test_prefix_hit_on_a_stalled_replica_goes_elsewhere():
    warm, cold = linked("engine-0"), linked("engine-1")
    picker = PrefixAwarePicker()
    flow = FlowController("m", ReplicaPool([warm, cold]), picker)
    prompt = list(range(100, 100 + 256))
    picker.index.add("engine-0", block_hashes(prompt, 16))
    first = await flow.acquire(request("a", prompt))
    assert (first.pick.name, first.pick.reason) == ("engine-0", "prefix_predicted")
    flow.release(first, ok=True)
    warm.liveness.heard_at = time.monotonic() - 2.5  # silent past the bound: stalled
    assert not warm.state().healthy and "stalled" in (warm.state().detail or "")
    second = await flow.acquire(request("b", prompt))
    assert second.pick.name == "engine-1"
    flow.release(second, ok=True)
    warm.liveness.heard(time.monotonic())  # heard again: recovered, the prefix counts again
    third = await flow.acquire(request("c", prompt))
    assert (third.pick.name, third.pick.reason) == ("engine-0", "prefix_predicted")
    flow.release(third, ok=True)
