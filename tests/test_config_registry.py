"""Configuration is declared once: every engine knob is an `EngineConfig` field whose flags
(`serve`, `engine`, a routing file's `engine:` block) are generated from it, and every
`TOKENPATH_*` variable the package reads is in `tokenpath.config.ENV_VARS`, shown by `--help`."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from pydantic import ValidationError

from tokenpath.cli import build_parser
from tokenpath.config import (
    ENV_VARS,
    EngineConfig,
    SpeculativeConfig,
    default_text,
    engine_flag_names,
    model_argv,
)
from tokenpath.server.config import ServerConfig, build_config
from tokenpath.server.routing_config import ReplicaSpec

ROOT = Path(__file__).resolve().parents[1]
ENV_RE = re.compile(r"TOKENPATH_[A-Z0-9_]+")


def read_in_source() -> set[str]:
    """Every TOKENPATH_* name the package (and its build) mentions, the registry's own lines aside."""
    files = [*(ROOT / "src" / "tokenpath").rglob("*.py"), ROOT / "setup.py"]
    return {m for p in files for line in p.read_text().splitlines() if "EnvVar(" not in line
            for m in ENV_RE.findall(line)}


def test_every_environment_variable_is_registered_and_every_registered_one_is_read():
    registered = {v.name for v in ENV_VARS}
    assert len(registered) == len(ENV_VARS), "a variable registered twice"
    used = read_in_source()
    assert used - registered == set(), "read in src but missing from tokenpath.config.ENV_VARS"
    assert registered - used == set(), "registered but read nowhere"


@pytest.mark.parametrize("argv", [[], ["serve"], ["engine"]])
def test_help_lists_every_environment_variable(argv):
    parser = build_parser()
    if argv:
        parser = parser._subparsers._group_actions[0].choices[argv[0]]  # the subcommand's own parser
    text = parser.format_help()
    assert all(v.name in text for v in ENV_VARS), [v.name for v in ENV_VARS if v.name not in text]


def non_default(name: str):
    """A valid value of an EngineConfig field other than its default."""
    field = EngineConfig.fields()[name]
    default = EngineConfig().__getattribute__(name)
    if get_origin(field.annotation) is Literal:
        return next(c for c in get_args(field.annotation) if c != default)
    if field.annotation is bool:
        return not default
    special = {"kv_cache_memory": "1GiB", "device": "cpu", "chat_template": str(ROOT / "README.md"),
               "speculative_config": SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)}
    if name in special:
        return special[name]
    return (default or 1) + 3


def test_every_engine_field_has_a_described_flag_on_serve_and_engine():
    names = engine_flag_names()
    assert set(names) == set(EngineConfig.fields()) - {"model", "served_model_name"}
    for name in names:
        assert EngineConfig.fields()[name].description, f"{name}: no description (its --help text)"
    for command in ("serve", "engine"):
        help_text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        for name in names:
            assert f"--{name.replace('_', '-')}" in help_text, (command, name)


@pytest.mark.parametrize("name", engine_flag_names())
def test_each_engine_flag_reaches_its_field_from_either_command(name):
    """Generated flags, parsed back: the value given is the value configured."""
    value = non_default(name)
    config = EngineConfig(**{name: value})
    argv = model_argv(config, [name])
    assert argv, name
    for command in ("serve", "engine"):
        got = build_config(build_parser().parse_args([command, *argv])).engine
        assert getattr(got, name) == value, (command, argv)


def test_a_whole_config_round_trips_through_the_flags_a_local_engine_gets():
    config = EngineConfig(**{name: non_default(name) for name in engine_flag_names()})
    argv = model_argv(config, engine_flag_names())
    got = build_config(build_parser().parse_args(["engine", *argv])).engine
    assert got.as_dict(exclude={"model"}) == config.as_dict(exclude={"model"})
    assert model_argv(EngineConfig(), engine_flag_names()) == []


def test_a_routing_files_engine_block_is_checked_and_becomes_the_same_flags():
    spec = ReplicaSpec(local=2, engine={"num_kv_blocks": 64, "enable_prefix_caching": False},
                       engine_args=["--max-num-seqs", "4"])
    assert spec.engine_argv == ["--num-kv-blocks", "64", "--no-enable-prefix-caching", "--max-num-seqs", "4"]
    with pytest.raises(ValidationError, match="num_kv_block"):
        ReplicaSpec(local=1, engine={"num_kv_block": 64})  # a typo: refused at load, not by a dead engine
    with pytest.raises(ValidationError):
        ReplicaSpec(local=1, engine={"max_num_seqs": 0})


def names_read_outside_config() -> list[str]:
    """Every place in src/ other than tokenpath/config.py where code names a TOKENPATH_* variable:
    a string constant that is exactly a variable's name (what os.environ.get, getenv, environ[...]
    or a helper taking the name would be given). Prose may mention the variables (docstrings,
    comments, help text): it reads nothing."""
    config = ROOT / "src" / "tokenpath" / "config.py"
    found = []
    for path in (ROOT / "src" / "tokenpath").rglob("*.py"):
        if path == config:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_RE.fullmatch(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    return found


def test_config_py_is_the_only_reader_of_tokenpath_variables():
    assert names_read_outside_config() == [], "read these through a function of tokenpath.config"


def flag_helps(command: str) -> dict[str, str]:
    parser = build_parser()._subparsers._group_actions[0].choices[command]
    return {a.dest: a.help or "" for a in parser._actions}


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_help_shows_each_settings_default_once_from_its_field(command):
    """Every ServerConfig / ApiSettings / EngineConfig flag is made from its field: described, and
    its default shown once, the field's own (never retyped in the description)."""
    helps = flag_helps(command)
    settings = {**ServerConfig.model_fields, **EngineConfig.fields()}
    flagged = [name for name in settings if name in helps]
    assert {"host", "port", "models", "insecure", "ssl_certfile", "max_num_seqs"} <= set(flagged)
    if command == "serve":
        assert {"redis_url", "stall_timeout", "allowed_hosts", "causes", "lora_modules"} <= set(flagged)
    for name in flagged:
        text = helps[name]
        assert settings[name].description and text.startswith(settings[name].description), name
        assert text.count("default") <= 1, (name, text)
        shown = default_text(settings[name])
        if shown is not None:
            assert text.endswith(f"(default: {shown})"), (name, text)
    assert "(default: 127.0.0.1)" in helps["host"] and "(default: 30)" in helps["shutdown_timeout"]


def test_serve_settings_flags_reach_their_fields():
    args = build_parser().parse_args([
        "serve", "--host", "0.0.0.0", "--port", "0", "--model", "a", "--model", "b", "--insecure",
        "--allowed-hosts", "x.test,y.test", "--allowed-hosts", "z.test", "--lora-modules", "p=/a", "q=/b",
        "--stall-timeout", "7", "--no-causes", "--metrics-public", "--reasoning-parser", "none",
        "--stream-max-unsent", "2MiB", "--limits-fail-open"])
    config = build_config(args)
    assert (config.host, config.port, config.models, config.insecure) == ("0.0.0.0", 0, ["a", "b"], True)
    assert config.allowed_hosts == ["x.test", "y.test", "z.test"]
    assert config.lora_modules == ["p=/a", "q=/b"]
    assert (config.stall_timeout, config.causes, config.metrics_public) == (7.0, False, True)
    assert (config.reasoning_parser, config.stream_max_unsent, config.limits_fail_open) == ("none", "2MiB", True)
    untouched = build_config(build_parser().parse_args(["serve"]))
    assert untouched.model_dump() == ServerConfig().model_dump()
