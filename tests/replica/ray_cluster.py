"""A Ray cluster of several nodes on this machine, every process on loopback, for the Ray tests.

    python -m tests.replica.ray_cluster --node '{"num_cpus": 1, "resources": {"engine_slot": 1}}' --node '{...}'

prints `RAY_ADDRESS 127.0.0.1:PORT` once every node has joined, and runs until SIGTERM, which stops
them all. Each `--node` is a node's arguments (`num_cpus`, `resources`...); the first is the head.

Why not two `ray start`s: Ray binds its servers to loopback only when a node's IP is exactly
127.0.0.1, and `ray start` refuses that for a second node. With `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
(single-machine mode, everything on 127.0.0.1) it aborts with "Multi-node Ray clusters are not
supported on Windows and OSX"; without it, it rewrites `--node-ip-address 127.0.0.1` (and the
head's address) to the host's own IP, and with another loopback IP (127.0.0.2) the GCS and the
raylets listen on every interface (`*:PORT`). Ray's own `ray.cluster_utils.Cluster` (its
documented way to test several nodes on one machine) starts the same raylets with IP 127.0.0.1:
separate nodes to the scheduler, each with its own resources, and nothing beyond loopback.
The head runs the dashboard (on a free loopback port), which serves Ray's state API.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import tempfile
import threading

from tests.process_logs import free_port


def private_ray_env() -> tuple[str, dict[str, str]]:
    """A private Ray temp dir and the environment every Ray process of one test shares.

    The dir is short (Ray's socket paths must fit in 107 bytes) and holds `ray/`: Ray writes
    `ray_current_cluster` under `$RAY_TMPDIR/ray/` whatever `--temp-dir` says (Cluster's
    `write_ray_address`), and a fresh machine has no `/tmp/ray`. Every process binds 127.0.0.1
    (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) and the cluster has its own auth token.
    """
    ray_tmp = tempfile.mkdtemp(prefix="tpray", dir="/tmp")
    os.makedirs(os.path.join(ray_tmp, "ray"), exist_ok=True)
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    return ray_tmp, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", action="append", type=json.loads, required=True, help="a node's arguments (JSON)")
    ap.add_argument("--temp-dir", default=None, help="Ray's session dir (short: its socket paths must fit)")
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    temp_dir = args.temp_dir or tempfile.mkdtemp(prefix="tpray")
    common = {"node_ip_address": "127.0.0.1", "temp_dir": temp_dir, "object_store_memory": 80 * 1024 * 1024,
              "dashboard_agent_listen_port": None}
    head = {**common, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port(),
            "metrics_export_port": free_port(), **args.node[0]}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for node in args.node[1:]:
            cluster.add_node(**{**common, "metrics_export_port": free_port(), **node})
        cluster.wait_for_nodes()
        print(f"RAY_ADDRESS {cluster.address}", flush=True)
        stop.wait()
    finally:
        cluster.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
