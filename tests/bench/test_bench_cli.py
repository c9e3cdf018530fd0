"""`tokenpath bench` end to end through the real CLI entry point, against loopback stub servers:
targets side by side, arrivals, multi-turn history, errors, and every output (JSON, markdown, PNGs)."""

import json

import pytest
from stub_server import StubServer, StubState

from tokenpath.bench.cli import load_points, normalize_url, parse_target
from tokenpath.bench.records import LoadPoint
from tokenpath.cli import build_parser, main

RECORD_FIELDS = {"index", "start", "success", "status", "error", "ttft", "itl", "e2el", "output_tokens",
                 "output_tokens_source", "prompt_tokens", "intended_input_len", "intended_output_len",
                 "server_timing", "group", "session", "turn", "tpot"}
SUMMARY_FIELDS = {"completed", "failed", "duration_s", "request_throughput", "output_throughput",
                  "total_token_throughput", "total_output_tokens", "total_prompt_tokens", "mean_prompt_tokens",
                  "mean_output_tokens", "exact_output_fraction", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms",
                  "slo", "good_requests", "goodput", "errors", "server_ms"}


def bench(*argv):
    return main(["bench", "--tokenizer", "approx", "--no-progress", *argv])


def test_two_targets_two_loads_all_outputs(tmp_path, capsys):
    with StubServer(StubState(fail={3: 429})) as a, StubServer(StubState(timing=False)) as b:
        rc = bench("--target", f"ours={a.url}", "--target", f"peer={b.url},model=other,exact=hf",
                   "--note", "peer=stub without timing", "--concurrency", "1,2", "--num-requests", "5",
                   "--input-len", "12", "--output-len", "4", "--warmup", "1", "--slo", "ttft=10s,tpot=1s",
                   "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots"),
                   "--markdown", str(tmp_path / "r.md"), "--baseline", "ours")
        peer_bodies = b.state.bodies
        ours_bodies = a.state.bodies
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == "tokenpath.bench/1"
    assert {"date", "cpu_model", "cores", "versions", "workload", "tokenizer", "bounds"} <= doc["meta"].keys()
    assert [(r["target"]["name"], r["load"]["label"]) for r in doc["runs"]] == [
        ("ours", "c=1"), ("ours", "c=2"), ("peer", "c=1"), ("peer", "c=2")]
    for run in doc["runs"]:
        assert run["summary"].keys() >= SUMMARY_FIELDS
        assert len(run["records"]) == 5
        for r in run["records"]:
            assert r.keys() >= RECORD_FIELDS
        assert run["summary"]["output_throughput"] > 0
    first = doc["runs"][0]["summary"]
    # 1 warm-up, then measured request #2 of the server's count (its 3rd body) got the 429
    assert first["errors"] == {"total": 1, "http_429": 1, "by_status": {"429": 1}}
    assert first["completed"] == 4 and first["good_requests"] == 4
    assert first["server_ms"]["decode"]["mean"] == pytest.approx(3.0)
    # every server stage is kept, the gateway's and the engine's queue too
    assert first["server_ms"]["gateway"]["mean"] == pytest.approx(0.5)
    assert first["server_ms"]["engine_queue"]["mean"] == pytest.approx(1.5)
    assert doc["runs"][2]["summary"]["server_ms"] == {}
    # same request list for both targets; each target got its own model name and length forcing
    ours_prompts = sorted(b["messages"][-1]["content"] for b in ours_bodies)  # c=2: arrival order may vary
    assert ours_prompts == sorted(b["messages"][-1]["content"] for b in peer_bodies)
    assert len(set(ours_prompts)) == 12  # per load point: one warm-up + five measured, its own prompts
    assert all(b["model"] == "other" and "generation_config" in b and "ignore_eos" not in b for b in peer_bodies)
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {
        "ttft_cdf.png", "itl_cdf.png", "throughput_vs_load.png", "stages.png"}
    md = (tmp_path / "r.md").read_text()
    assert "## Ratios" in md and "| c=2 | peer |" in md and "stub without timing" in md and "cores" in md
    assert "## Where ours loses" in md and "## Targets" in md
    out = capsys.readouterr().out
    assert "server-side stages" in out and "TTFT p99" in out
    assert "gateway mean" in out and "engine_queue p99" in out


def test_multi_turn_resends_the_growing_history(tmp_path):
    with StubServer() as srv:
        rc = bench("--base-url", srv.url, "--workload", "multi-turn", "--sessions", "2", "--turns", "3",
                   "--concurrency", "2", "--num-requests", "6", "--warmup", "0", "--output-len", "2",
                   "--input-len", "5", "--json", str(tmp_path / "m.json"))
        bodies = srv.state.bodies
    assert rc == 0
    by_len = sorted(len(b["messages"]) for b in bodies)
    assert by_len == [1, 1, 3, 3, 5, 5]
    last = max(bodies, key=lambda b: len(b["messages"]))
    assert [m["role"] for m in last["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert last["messages"][1]["content"] == " w0 w1"  # the reply the server actually gave
    recs = json.loads((tmp_path / "m.json").read_text())["runs"][0]["records"]
    assert sorted((r["session"], r["turn"]) for r in recs) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    # the server's prompt count grows with the history (the stub counts words)
    by_turn = {r["turn"]: r["prompt_tokens"] for r in recs if r["session"] == 0}
    assert by_turn[0] < by_turn[1] < by_turn[2]


def test_shared_prefix_over_completions_api(tmp_path):
    with StubServer() as srv:
        rc = bench("--target", f"s={srv.url},api=completions", "--workload", "shared-prefix", "--prefix-groups",
                   "2", "--prefix-len", "30", "--input-len", "4", "--output-len", "2", "--num-requests", "8",
                   "--warmup", "0", "--concurrency", "4", "--json", str(tmp_path / "p.json"))
        bodies = srv.state.bodies
    assert rc == 0
    assert {b["prompt"].split("\n\n")[0] for b in bodies}.__len__() == 2  # two distinct shared prefixes
    recs = json.loads((tmp_path / "p.json").read_text())["runs"][0]["records"]
    assert {r["group"] for r in recs} == {0, 1} and all(r["intended_input_len"] == 34 for r in recs)


def test_open_loop_rate_burst_and_duration_bound(tmp_path):
    with StubServer() as srv:
        rc = bench("--base-url", srv.url, "--rate", "500", "--burst", "--concurrency", "3", "--num-requests", "4",
                   "--output-len", "2", "--input-len", "3", "--json", str(tmp_path / "o.json"))
        rc2 = bench("--base-url", srv.url, "--duration", "0.3", "--concurrency", "2", "--output-len", "2",
                    "--input-len", "3", "--json", str(tmp_path / "d.json"))
    assert rc == rc2 == 0
    runs = json.loads((tmp_path / "o.json").read_text())["runs"]
    assert [r["load"]["label"] for r in runs] == ["rate=500,c=3", "burst,c=3"]
    assert all(r["summary"]["completed"] == 4 for r in runs)
    d = json.loads((tmp_path / "d.json").read_text())["runs"][0]["summary"]
    assert d["completed"] > 0 and d["failed"] == 0


def test_merge_reports_earlier_files_side_by_side(tmp_path, capsys):
    with StubServer() as srv:
        for name in ("x", "y"):
            assert bench("--target", f"{name}={srv.url}", "--num-requests", "3", "--output-len", "3",
                         "--input-len", "3", "--json", str(tmp_path / f"{name}.json")) == 0
    capsys.readouterr()
    rc = main(["bench", "--merge", str(tmp_path / "x.json"), str(tmp_path / "y.json"), "--baseline", "x",
               "--json", str(tmp_path / "xy.json"), "--markdown", str(tmp_path / "xy.md")])
    assert rc == 0
    merged = json.loads((tmp_path / "xy.json").read_text())
    x = json.loads((tmp_path / "x.json").read_text())
    assert [r["target"]["name"] for r in merged["runs"]] == ["x", "y"]
    assert merged["runs"][0]["summary"] == x["runs"][0]["summary"]
    assert len(merged["meta"]["merged_from"]) == 2
    assert "vs peer" in capsys.readouterr().out


def test_all_requests_failing_exits_nonzero():
    from stub_server import free_port

    assert bench("--base-url", f"http://127.0.0.1:{free_port()}", "--num-requests", "2", "--warmup", "0",
                 "--request-timeout", "5") == 1


@pytest.mark.parametrize("argv", [[], ["--base-url", "ftp://x"], ["--base-url", "http://a:1", "--rate", "0"],
                                  ["--base-url", "http://a:1", "--slo", "speed=1ms"],
                                  ["--target", "a=http://h:1", "--target", "a=http://h:2"],
                                  ["--target", "a=http://h:1,color=red"]])
def test_bad_arguments_exit_2(argv):
    assert bench(*argv) == 2


def test_target_and_load_parsing():
    ns = build_parser().parse_args(["bench", "--model", "dm", "--exact", "none"])
    t = parse_target("p=http://127.0.0.1:9/v1,model=m,api=completions,exact=min_tokens", ns, {"p": "note"})
    assert (t.name, t.base_url, t.model, t.api, t.exact, t.note) == (
        "p", "http://127.0.0.1:9/v1", "m", "completions", "min_tokens", "note")
    bare = parse_target("http://127.0.0.1:9", ns, {})
    assert (bare.name, bare.base_url, bare.model, bare.exact) == ("127.0.0.1:9", "http://127.0.0.1:9/v1", "dm", "none")
    assert normalize_url("http://h:1/custom/v2/") == "http://h:1/custom/v2"
    assert load_points([], [1, 8], False) == [LoadPoint(concurrency=1), LoadPoint(concurrency=8)]
    assert load_points([2.0], [], True) == [LoadPoint(rate=2.0), LoadPoint(rate=float("inf"))]
    assert load_points([], [], False) == [LoadPoint(concurrency=1)]


def test_outputs_shorter_than_asked_are_flagged(tmp_path, capsys):
    with StubServer(StubState(short_by=2, usage=False)) as srv:
        rc = bench("--target", f"early={srv.url},exact=none", "--num-requests", "3", "--warmup", "0",
                   "--input-len", "3", "--output-len", "5", "--json", str(tmp_path / "e.json"))
    assert rc == 0
    s = json.loads((tmp_path / "e.json").read_text())["runs"][0]["summary"]
    assert s["exact_output_fraction"] == 0.0 and s["mean_output_tokens"] == 3.0
    out = capsys.readouterr().out
    assert "only 0% of outputs had the asked length" in out and "counted as content chunks" in out


def test_result_files_carry_no_machine_folders(tmp_path, monkeypatch):
    """argv goes into committed result files: paths under the working directory become relative,
    other absolute ones (temporary files, the installed model) their file name."""
    from tokenpath.bench.report import machine_meta

    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / "src" / "cli.py"), "bench", "--json", str(tmp_path / "out" / "r.json"),
            "--tokenizer", "/opt/models/model.gguf", "--target", "a=http://127.0.0.1:1/v1"]
    assert machine_meta(argv)["argv"] == ["src/cli.py", "bench", "--json", "out/r.json", "--tokenizer",
                                          "model.gguf", "--target", "a=http://127.0.0.1:1/v1"]


def test_result_files_carry_no_secret(tmp_path, monkeypatch):
    """Keys given on the command line are masked in result files; `env:VAR` names are kept."""
    from tokenpath.bench.report import machine_meta

    argv = ["bench", "--target", "a=http://127.0.0.1:1/v1,key=tp-secret1,model=m", "--api-key", "tp-secret2",
            "--api-key=tp-secret3", "--target", "b=http://127.0.0.1:2/v1,key=env:B_KEY"]
    kept = machine_meta(argv)["argv"]
    assert not any("tp-secret" in a for a in kept)
    assert kept == ["bench", "--target", "a=http://127.0.0.1:1/v1,key=***,model=m", "--api-key", "***",
                    "--api-key=***", "--target", "b=http://127.0.0.1:2/v1,key=env:B_KEY"]


def test_key_from_an_unset_variable_is_an_error(monkeypatch):
    """`key=env:VAR` with VAR unset used to send no key at all, silently."""
    monkeypatch.delenv("TP_NO_SUCH_KEY", raising=False)
    ns = build_parser().parse_args(["bench"])
    with pytest.raises(ValueError, match="TP_NO_SUCH_KEY.*not set"):
        parse_target("p=http://127.0.0.1:9/v1,key=env:TP_NO_SUCH_KEY", ns, {})
    monkeypatch.setenv("TP_NO_SUCH_KEY", "tp-x")
    assert parse_target("p=http://127.0.0.1:9/v1,key=env:TP_NO_SUCH_KEY", ns, {}).api_key == "tp-x"
    assert bench("--target", "p=http://127.0.0.1:9/v1,key=env:TP_UNSET_TOO") == 2
