"""The fast tier (`make test-fast`, `pytest --fast`: tests/tiers.py) leaves out what starts a
server or loads a real model, `make test` runs everything, and a test the classification gets
wrong fails the fast run instead of slowing it quietly. Checked on a tiny generated suite run by
a real pytest in a subprocess, with the suite's own conftest hooks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiers

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def server():
    """Named as tests/api/conftest.py's real server fixture: what it stands for is what counts."""
    return "a server"


@pytest.fixture
def client(server):
    return server


def test_plain():
    pass


def test_uses_a_server_through_another_fixture(client):
    pass


@pytest.mark.slow
def test_marked_slow():
    pass


@pytest.mark.requires("redis")
def test_needs_redis():
    pass


def test_starts_serve_in_its_body():
    # Misclassified: the guard stops it before the process starts.
    subprocess.run([sys.executable, "-c", "pass", "serve"], check=True)


def test_runs_a_harmless_command():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


def run_suite(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_addoption, pytest_configure, "
                                          "pytest_collection_modifyitems, pytest_runtest_setup, "
                                          "_fast_tier_guard  # noqa: F401\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: outside the fast tier\n")
    (tmp_path / "test_tiny.py").write_text(SUITE)
    peers = tmp_path / "tests" / "peers"  # (the peers tier: tests/peers/ under the root)
    peers.mkdir(parents=True, exist_ok=True)
    (peers / "test_peer.py").write_text("def test_against_a_real_peer():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "TOKENPATH_TEST_REDIS_URL"}
    env["TOKENPATH_TEST_ALLOW_MISSING"] = "redis"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), str(tmp_path), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def outcomes(out: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return dict(re.findall(r"::(test_\w+) (PASSED|FAILED|SKIPPED|ERROR)", out.stdout))


@pytest.mark.slow  # (a nested pytest run: ~10 s on 2 busy cores)
def test_the_fast_tier_runs_only_what_starts_nothing_and_refuses_a_misclassified_test(tmp_path):
    out = run_suite(tmp_path, "--fast")
    assert outcomes(out) == {"test_plain": "PASSED", "test_runs_a_harmless_command": "PASSED",
                             "test_starts_serve_in_its_body": "FAILED"}, out.stdout
    assert "4 deselected" in out.stdout, out.stdout
    assert "a test of the fast tier starts" in out.stdout and "mark it slow" in out.stdout, out.stdout


@pytest.mark.slow
def test_a_full_run_runs_every_tier_and_guards_nothing(tmp_path):
    out = run_suite(tmp_path)
    assert outcomes(out) == {"test_plain": "PASSED", "test_uses_a_server_through_another_fixture": "PASSED",
                             "test_marked_slow": "PASSED", "test_needs_redis": "SKIPPED",
                             "test_starts_serve_in_its_body": "PASSED", "test_runs_a_harmless_command": "PASSED"}, \
        out.stdout
    assert "1 deselected" in out.stdout, out.stdout  # the peers tier runs only when asked for


@pytest.mark.slow
def test_the_peers_tier_runs_alone_and_only_when_asked_for(tmp_path):
    out = run_suite(tmp_path, "--peers")
    assert outcomes(out) == {"test_against_a_real_peer": "PASSED"}, out.stdout
    assert "6 deselected" in out.stdout, out.stdout


def test_marks_come_from_fixtures_modules_and_capabilities():
    assert tiers.tier_marks("tests/x.py", ["tmp_path"], []) == set()
    assert tiers.tier_marks("tests/x.py", ["tmp_path", "server"], []) == {"slow"}
    assert tiers.tier_marks("tests/x.py", ["smol_llm"], ["redis"]) == {"slow", "services"}
    assert tiers.tier_marks("tests/x.py", [], ["postgres"]) == {"services"}
    assert tiers.tier_marks("tests/x.py", [], ["kernels"]) == set()  # the kernels are not a service
    assert tiers.tier_marks("tests/x.py", [], [], "postgres-3") == {"services"}  # a case against a service
    assert tiers.tier_marks("tests/x.py", [], [], "sqlite-3") == set()
    assert tiers.tier_marks("tests/x.py", ["store", "make_limits"], []) == {"services"}  # requires Redis when run
    for module in tiers.SLOW_MODULES:
        assert (ROOT / module).is_file(), f"tests/tiers.py SLOW_MODULES names {module}, which is gone"
        assert tiers.tier_marks(module, [], []) == {"slow"}


def test_the_guard_knows_a_server_from_a_cli_call():
    assert tiers.slow_command(["/venv/bin/tokenpath", "serve", "--port", "0"])
    assert tiers.slow_command([sys.executable, "-m", "tests.replica.ray_cluster", "--node", "{}"])
    assert tiers.slow_command(["redis-server", "--port", "0"])
    assert tiers.slow_command([sys.executable, "-m", "tokenpath.cli", "engine", "--listen-fd", "12"])
    assert not tiers.slow_command(["/venv/bin/tokenpath", "--version"])
    assert not tiers.slow_command(["/venv/bin/tokenpath", "keys", "create", "--ray-free-name"])
