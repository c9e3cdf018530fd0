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


def test_load_is_at_start_or_on_demand_and_fallbacks_never_involve_an_on_demand_deployment():
    """Issue 38's `load:` field; a fallback must be there when the first choice is not, so a chain
    that starts from or names an on-demand deployment is refused naming both."""
    base = {"replicas": [{"url": "http://x"}]}
    cfg = RoutingConfig.model_validate({"deployments": [{**base, "name": "a"}, {**base, "name": "b", "load": "on_demand"}]})
    assert [d.load for d in cfg.deployments] == ["at_start", "on_demand"]
    with pytest.raises(ValidationError, match="load"):
        RoutingConfig.model_validate({"deployments": [{**base, "name": "m", "load": "lazily"}]})
    with pytest.raises(ValidationError, match=r"'a': fallbacks cannot involve 'b', loaded on demand"):
        RoutingConfig.model_validate({"deployments": [{**base, "name": "a", "fallbacks": ["b"]},
                                                      {**base, "name": "b", "load": "on_demand"}]})
    with pytest.raises(ValidationError, match=r"'b': fallbacks cannot involve 'b'"):
        RoutingConfig.model_validate({"deployments": [{**base, "name": "a"},
                                                      {**base, "name": "b", "load": "on_demand", "fallbacks": ["a"]}]})


async def test_an_on_demand_deployment_starts_nothing_until_loaded(tmp_path):
    """Its replica (here a URL nothing listens on) is not built at start: the deployment is a
    catalog entry, unloaded, and not among the router's deployments until a request loads it."""
    from tests.process_logs import free_port

    from tokenpath.server.config import ServerConfig
    from tokenpath.server.routing_config import serve_router

    path = tmp_path / "routing.yaml"
    path.write_text(f"deployments:\n  - name: later\n    load: on_demand\n"
                    f"    replicas: [{{url: 'http://127.0.0.1:{free_port()}'}}]\n")
    router, closers = await serve_router(ServerConfig(data_dir=str(tmp_path), models=[]), routing_file=str(path))
    try:
        assert router.catalog is not None and "later" not in router.deployments
        assert router.catalog.state("later") == "unloaded" and "later" in router.names()
    finally:
        for close in closers:
            await close()


async def test_models_dir_beside_a_routing_file_joins_its_catalog(tmp_path):
    """`serve --routing FILE --models-dir DIR`: the directory's models are catalog entries beside the
    file's on-demand deployments, one catalog, one budget; a directory model loads in-process on
    demand and unloads. A packaged model the file serves under its own name is left to the file; a
    file in DIR named like one of the file's deployments stops the start, naming both."""
    from tests.process_logs import free_port

    from tokenpath.engine.loader import resolve_model_path
    from tokenpath.errors import ModelLoadError
    from tokenpath.server.config import ServerConfig
    from tokenpath.server.routing_config import serve_router

    models = tmp_path / "models"
    models.mkdir()
    (models / "dirmodel.gguf").symlink_to(resolve_model_path("smollm2-135m-instruct"))
    path = tmp_path / "routing.yaml"
    url = f"http://127.0.0.1:{free_port()}"
    path.write_text(f"deployments:\n  - name: later\n    load: on_demand\n    replicas: [{{url: '{url}'}}]\n"
                    f"  - name: gemma-3-270m\n    replicas: [{{url: '{url}'}}]\n")
    config = ServerConfig(data_dir=str(tmp_path), models=[], models_dir=str(models),
                          engine=EngineConfig(kv_cache_memory="32MiB", max_model_len=512))
    router, closers = await serve_router(config, routing_file=str(path))
    try:
        catalog = router.catalog
        assert catalog is not None and {"later", "dirmodel", "smollm2-135m-instruct"} <= set(catalog.ids())
        assert "gemma-3-270m" not in catalog and "gemma-3-270m" in router.deployments  # (the file serves that name)
        assert catalog.state("dirmodel") == "unloaded" and "dirmodel" not in router.deployments
        assert await catalog.load("dirmodel") == "loaded"
        assert router.deployments["dirmodel"].task == "chat"
        assert await catalog.unload("dirmodel") == "unloaded" and "dirmodel" not in router.deployments
    finally:
        for close in closers:
            await close()
    (models / "later.gguf").symlink_to(resolve_model_path("smollm2-135m-instruct"))
    with pytest.raises(ModelLoadError, match=r"model 'later' \(.*\) has the name of a deployment"):
        await serve_router(config, routing_file=str(path))
