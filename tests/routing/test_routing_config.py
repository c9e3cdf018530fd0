import pytest
from pydantic import ValidationError

from tokenpath.config import EngineConfig
from tokenpath.server.routing_config import RoutingConfig, engine_flags


def test_config_validates_replicas_and_policy(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text(
        "deployments:\n"
        "  - name: smollm2-135m-instruct\n"
        "    aliases: [gpt-4o-mini]\n"
        "    policy: session_affinity\n"
        "    replicas:\n"
        "      - local: 2\n"
        "        engine_args: ['--max-num-seqs', '4']\n"
        "      - url: http://127.0.0.1:9\n"
        "    admission: {max_queue: 8}\n"
    )
    cfg = RoutingConfig.from_yaml(path)
    spec = cfg.deployments[0]
    assert spec.replicas[0].local == 2 and spec.replicas[1].url and spec.aliases == ["gpt-4o-mini"]
    bad = [
        {"name": "m", "replicas": [{"url": "http://x", "local": 1}]},
        {"name": "m", "replicas": [{}]},
        {"name": "m", "replicas": []},
        {"name": "m", "policy": "random", "replicas": [{"local": 1}]},
        {"name": "m", "replicas": [{"local": 1}], "admission": {"max_queue_len": 3}},
        {"name": "m", "task": "embedding", "replicas": [{"url": "http://x"}]},  # encoders: local only
        {"name": "m", "replicas": [{"local": 1, "kv_events": "tcp://127.0.0.1:5557"}]},  # (the link has them)
        {"name": "m", "replicas": [{"url": "http://x", "kv_events": "http://x:5557"}]},  # not a ZMQ endpoint
        {"name": "m", "replicas": [{"url": "http://x", "kv_events_replay": "tcp://x:5558"}]},  # no live feed
    ]
    ok = {"name": "m", "replicas": [{"url": "http://x", "kv_events": "tcp://x:5557", "kv_events_replay": "tcp://x:5558"}]}
    assert RoutingConfig.model_validate({"deployments": [ok]}).deployments[0].replicas[0].kv_events == "tcp://x:5557"
    for d in bad:
        with pytest.raises(ValidationError):
            RoutingConfig.model_validate({"deployments": [d]})


def test_engine_flags_carry_only_changed_settings():
    assert engine_flags(EngineConfig()) == []
    flags = engine_flags(EngineConfig(num_kv_blocks=64, max_num_seqs=4, enable_prefix_caching=False))
    assert flags == ["--num-kv-blocks", "64", "--max-num-seqs", "4", "--no-enable-prefix-caching"]
    assert engine_flags(EngineConfig(kv_cache_dtype="float16")) == ["--kv-cache-dtype", "float16"]


def test_load_on_demand_in_a_routing_file_is_refused_naming_the_field():
    """Issue 38's `load: on_demand` is not honoured for routing files yet: a clear start-up error
    naming the deployment and the field, never a model silently loaded at start."""
    base = {"name": "m", "replicas": [{"url": "http://x"}]}
    assert RoutingConfig.model_validate({"deployments": [{**base, "load": "at_start"}]}).deployments[0].load == "at_start"
    with pytest.raises(ValidationError, match=r"'m': `load: on_demand` is not supported in routing files.*--models-dir"):
        RoutingConfig.model_validate({"deployments": [{**base, "load": "on_demand"}]})
    with pytest.raises(ValidationError, match="load"):
        RoutingConfig.model_validate({"deployments": [{**base, "load": "lazily"}]})


async def test_serve_refuses_a_routing_file_with_on_demand_before_starting_anything(tmp_path):
    from tokenpath.errors import ModelLoadError
    from tokenpath.server.config import ServerConfig
    from tokenpath.server.routing_config import serve_router

    path = tmp_path / "routing.yaml"
    path.write_text("deployments:\n  - name: m\n    load: on_demand\n    replicas: [{local: 1}]\n")
    with pytest.raises(ModelLoadError, match=r"--routing .*routing\.yaml: deployments\.0: .*'m': `load: on_demand`"):
        await serve_router(ServerConfig(data_dir=str(tmp_path)), routing_file=str(path))
