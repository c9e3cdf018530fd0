"""The Ray replica kind's configuration, without a cluster: it validates like the other kinds, and
importing tokenpath (the actor class included) never needs the optional `ray` package."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tokenpath.server.routing_config import RoutingConfig


def test_a_deployment_can_ask_for_ray_replicas_and_only_one_kind_per_entry():
    cfg = RoutingConfig.model_validate({"deployments": [{
        "name": "m", "replicas": [{"ray": {"num_replicas": 2, "num_cpus": 2, "resources": {"big": 1}}}]}]})
    assert cfg.deployments[0].replicas[0].ray == {"num_replicas": 2, "num_cpus": 2, "resources": {"big": 1}}
    with pytest.raises(ValidationError, match="exactly one of"):
        RoutingConfig.model_validate({"deployments": [{
            "name": "m", "replicas": [{"url": "http://127.0.0.1:1", "ray": {"num_replicas": 1}}]}]})


def test_the_actor_module_imports_without_ray():
    code = ("import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
            "import tokenpath.replica.ray_actor, tokenpath.replica.ray_replica, tokenpath.cli\n"
            "from tokenpath.replica.ray_replica import RayReplicaConfig, connect\n"
            "try:\n    connect('auto')\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'tokenpath[ray]'" in out.stdout
