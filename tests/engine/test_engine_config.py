"""The engine's configuration is a plain dataclass checked by tokenpath.knobs, so the engine path
imports no pydantic (issue 42's peak RSS: pydantic and its first model were ~16 MiB of the offline
engine's 186). Validated once, at the edge where it is built (`LLM(...)`, flags, YAML, the engine
link), each bad value an error naming its field."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import pytest

from tokenpath.config import EngineConfig, SpeculativeConfig
from tokenpath.protocol.link import LinkInfo, Welcome
from tokenpath.protocol.wire import FrameError, decode, frame
from tokenpath.server.config import ServerConfig

ENGINE_PATH = r"""
import json, sys
import msgpack
from tokenpath import LLM
import tokenpath.engine.core, tokenpath.engine.async_engine, tokenpath.engine.llm
from tokenpath.config import EngineConfig
from tokenpath.protocol.link import LinkInfo, Welcome
from tokenpath.protocol.wire import decode, frame

cfg = EngineConfig(model="m", max_num_seqs=3, speculative_config='{"num_speculative_tokens": 2}')
msg = Welcome(1.0, LinkInfo("m", engine=cfg))
assert decode(msgpack.unpackb(frame(msg)[4:], raw=False, strict_map_key=False)) == msg
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("pydantic", "pydantic_core"))))
"""


def test_the_engine_path_imports_no_pydantic():
    done = subprocess.run([sys.executable, "-c", ENGINE_PATH], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("bad, field", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 257}, "block_size"),
    ({"max_num_seqs": "4"}, "max_num_seqs"),
    ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
    ({"dtype": "float64"}, "dtype"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
    ({"speculative_config": '{"num_speculative_tokens": 2, "lookahead": 1}'}, "lookahead"),
    ({"speculative_config": "{not json"}, "speculative_config"),
    ({"speculative_config": {"method": "ngram"}}, "num_speculative_tokens"),
])
def test_a_bad_value_is_an_error_naming_its_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**bad)


def test_values_are_taken_as_pydantic_took_them():
    cfg = EngineConfig(max_num_seqs=4.0, kv_cache_memory=2**20, speculative_config={"num_speculative_tokens": 2,
                                                                                     "suffix_decoding_max_spec_factor": 1})
    assert cfg.max_num_seqs == 4 and type(cfg.max_num_seqs) is int and cfg.kv_cache_bytes == 2**20
    assert cfg.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig(speculative_config="").speculative_config is None
    assert EngineConfig(speculative_config=cfg.speculative_config).speculative_config is cfg.speculative_config
    assert EngineConfig(**cfg.as_dict()) == cfg
    assert cfg.replace(max_num_seqs=8).max_num_seqs == 8
    with pytest.raises(ValueError, match="max_num_seqs"):
        cfg.replace(max_num_seqs=0)  # a copy is checked too
    assert cfg.as_dict(exclude_defaults=True) == {"max_num_seqs": 4, "kv_cache_memory": 2**20,
                                                  "speculative_config": cfg.speculative_config.as_dict()}


def test_the_server_config_takes_the_engine_block_through_the_same_checks():
    server = ServerConfig.model_validate({"engine": {"max_num_seqs": 2, "speculative_config": {
        "num_speculative_tokens": 3}}})
    assert server.engine == EngineConfig(max_num_seqs=2, speculative_config={"num_speculative_tokens": 3})
    assert ServerConfig.model_validate(server.model_dump()).engine == server.engine
    assert json.loads(server.model_dump_json())["engine"]["speculative_config"]["num_speculative_tokens"] == 3
    with pytest.raises(ValueError, match="max_num_seq"):
        ServerConfig.model_validate({"engine": {"max_num_seq": 2}})
    with pytest.raises(ValueError, match="block_size"):
        ServerConfig.model_validate({"engine": {"block_size": 0}})


def test_a_malformed_engine_config_on_the_link_is_a_frame_error():
    body = msgpack.unpackb(frame(Welcome(1.0, LinkInfo("m", engine=EngineConfig(model="m"))))[4:], raw=False,
                           strict_map_key=False)
    body["info"]["engine"]["max_num_seqs"] = -1
    with pytest.raises(FrameError, match="max_num_seqs"):
        decode(body)
