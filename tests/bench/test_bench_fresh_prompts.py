"""`tokenpath bench` must not fool its user on repeated runs (issue 14): fresh prompts per run by
default (seed printed and saved), the prefix-cache hit rate of every run in the JSON, a warning when
a workload without shared prefixes mostly hits the cache, `--reset-cache`, and `--input-len-mode`.
Against the loopback stub server, whose toy prefix cache reports `cached_tokens` like a real one."""

import json

from stub_server import StubServer

from tokenpath.bench.tokens import ApproxTokens
from tokenpath.bench.workload import LengthDist, Workload, WorkloadConfig
from tokenpath.cli import main

ARGS = ["bench", "--tokenizer", "approx", "--no-progress", "--concurrency", "2", "--num-requests", "6",
        "--input-len", "12", "--output-len", "3"]


def _run(url, tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    assert main([*ARGS, "--base-url", url, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def _prompts(bodies):
    return {b["messages"][-1]["content"] for b in bodies}


def test_two_default_runs_send_different_prompts_and_report_their_hit_rates(tmp_path, capsys):
    with StubServer() as srv:
        first = _run(srv.url, tmp_path, "a")
        sent_first = _prompts(srv.state.bodies)
        srv.state.bodies.clear()
        second = _run(srv.url, tmp_path, "b")
        sent_second = _prompts(srv.state.bodies)
    assert sent_first.isdisjoint(sent_second)  # main: identical (request i = f(seed 0, i))
    assert first["meta"]["seed"] != second["meta"]["seed"]
    assert first["meta"]["workload"]["seed"] == first["meta"]["seed"]
    for doc in (first, second):
        (run,) = doc["runs"]
        assert run["summary"]["prefix_cache_hit_rate"] == 0.0 and run["warnings"] == []
        assert all(r["cached_tokens"] == 0 for r in run["records"])
    err = capsys.readouterr().err
    assert f"prompt seed: {first['meta']['seed']} (fresh; --seed" in err


def test_a_repeated_seed_is_reproducible_and_its_cache_hits_are_flagged(tmp_path, capsys):
    with StubServer() as srv:
        _run(srv.url, tmp_path, "a", "--seed", "7")
        sent_first = _prompts(srv.state.bodies)
        srv.state.bodies.clear()
        again = _run(srv.url, tmp_path, "b", "--seed", "7")
        assert _prompts(srv.state.bodies) == sent_first
        (run,) = again["runs"]
        assert run["summary"]["prefix_cache_hit_rate"] == 1.0
        assert run["warnings"] and "prefix-cache hits" in run["warnings"][0]
        assert "warning" in capsys.readouterr().err
        cold = _run(srv.url, tmp_path, "c", "--seed", "7", "--reset-cache")
        assert srv.state.resets == 1
        assert cold["runs"][0]["summary"]["prefix_cache_hit_rate"] == 0.0


def test_load_points_of_one_sweep_get_their_own_prompts(tmp_path):
    with StubServer() as srv:
        doc = _run(srv.url, tmp_path, "s", "--concurrency", "1,2")
    assert [r["summary"]["prefix_cache_hit_rate"] for r in doc["runs"]] == [0.0, 0.0]


class _Overhead(ApproxTokens):
    def chat_overhead(self, with_system: bool) -> int:
        return 5


def test_input_len_mode_user_counts_user_text_only():
    def spec(mode):
        cfg = WorkloadConfig(input_len=LengthDist.parse(20), seed=1, input_len_mode=mode)
        return Workload(cfg, _Overhead()).spec(0)

    template, user = spec("template"), spec("user")
    assert len(template.user_text.split()) == 15 and template.input_len == 20  # template tokens included
    assert len(user.user_text.split()) == 20 and user.input_len == 25  # aiperf's ISL: user text only
