"""`routing_prefix.py`'s shared-prefix workload over engine replicas on Ray: does prefix-aware
routing still beat round-robin when the replicas are Ray actors (`RayReplica`) instead of engine
processes? Same workload, policies, engine settings and table; the prefix-cache hit rate comes
from the actors' state instead of the processes' /metrics.

    python benchmarks/routing_prefix_ray.py --policies prefix_aware,round_robin --rounds 2

Starts a private Ray instance on loopback (2 CPUs, one per actor) and stops it at the end.
Writes benchmarks/results/routing_prefix_ray.md and .json.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import routing_prefix  # noqa: E402

from tokenpath.config import EngineConfig  # noqa: E402
from tokenpath.replica.ray_replica import RayReplicaConfig, start_ray_replicas, stop_ray_replicas  # noqa: E402


async def _ray_engines(n: int, engine_args: list[str], threads: int = 1):  # noqa: ANN202
    """Stands in for routing_common.start_engines: n engine actors with the same settings."""
    flags = dict(zip(engine_args[::2], engine_args[1::2], strict=True))
    engine = EngineConfig(num_kv_blocks=int(flags["--num-kv-blocks"]), max_num_seqs=int(flags["--max-num-seqs"]),
                          long_prefill_token_threshold=int(flags["--long-prefill-token-threshold"]))
    replicas, created = await start_ray_replicas(RayReplicaConfig(num_replicas=n, address=None,
                                                                  name_prefix="engine"), engine.model, engine)
    _ray_engines.created = created  # type: ignore[attr-defined]
    return replicas, replicas  # the "procs" are the replicas: counters come from their state


async def _counters(replicas) -> dict[str, float]:  # noqa: ANN001
    states = await asyncio.gather(*(r.handle.state.remote() for r in replicas))
    return {"prefix_cache_queries": float(sum(s.prefix_cache_queries for s in states)),
            "prefix_cache_hits": float(sum(s.prefix_cache_hits for s in states))}


async def _stop(replicas, procs) -> None:  # noqa: ANN001
    await stop_ray_replicas(replicas, getattr(_ray_engines, "created", []))


def main() -> int:
    args = routing_prefix.parse()
    if args.out == "routing_prefix":
        args.out = "routing_prefix_ray"
    # Before Ray starts: every Ray process on loopback, and the engines' thread count inherited.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ["TOKENPATH_NUM_THREADS"] = str(args.threads)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="tokenpath-bench")
    routing_prefix.start_engines = _ray_engines
    routing_prefix.engine_counters = _counters
    routing_prefix.stop_all = _stop
    try:
        code = asyncio.run(routing_prefix.main(args))
    finally:
        ray.shutdown()
    relabel(routing_prefix.RESULTS / f"{args.out}.md")
    return code


def relabel(md: Path) -> None:
    """routing_prefix.py describes its own setup: say what ran here instead."""
    text = md.read_text().replace("2 `tokenpath engine` processes", "2 engine actors on Ray (`RayReplica`)")
    md.write_text(text.replace("benchmarks/routing_prefix.py", "benchmarks/routing_prefix_ray.py"))


if __name__ == "__main__":
    sys.exit(main())
