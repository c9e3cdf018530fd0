"""A test that needs what the machine lacks fails the run, unless the run allows that capability
to be missing by name (tests/capabilities.py). Checked on a tiny generated suite run by a real
pytest in a subprocess, with the suite's own conftest hooks; and on the suite itself, which
must not skip on a capability any other way."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import pytest

from tests.capabilities import missing


@pytest.mark.requires("postgres")
def test_marked():
    pass


def test_found_missing_at_run_time(request):
    missing(request.config, "redis", "the server did not answer")


def test_needs_nothing():
    pass
'''


def run_suite(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_addoption, pytest_configure, "
                                          "pytest_runtest_setup  # noqa: F401\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_tiny.py").write_text(SUITE)
    base = {k: v for k, v in os.environ.items()
            if k not in ("TOKENPATH_TEST_POSTGRES_URL", "TOKENPATH_TEST_REDIS_URL", "TOKENPATH_TEST_ALLOW_MISSING")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), base.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path), *args],
                          cwd=tmp_path, env={**base, **env}, capture_output=True, text=True, timeout=300)


def counts(out: subprocess.CompletedProcess[str]) -> dict[str, int]:
    last = out.stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}


def test_a_missing_capability_fails_the_run_and_says_how_to_allow_it(tmp_path):
    out = run_suite(tmp_path)
    assert out.returncode == 1, out.stdout
    got = counts(out)
    assert got.get("passed") == 1 and got.get("skipped") is None, out.stdout
    assert got.get("failed", 0) + got.get("error", 0) + got.get("errors", 0) == 2, out.stdout
    assert "missing capability 'postgres'" in out.stdout and "missing capability 'redis'" in out.stdout
    assert "TOKENPATH_TEST_ALLOW_MISSING=postgres" in out.stdout  # how to opt out


@pytest.mark.parametrize("how", ["env", "option"])
def test_a_run_that_allows_them_by_name_skips_and_says_so(tmp_path, how):
    if how == "env":
        out = run_suite(tmp_path, TOKENPATH_TEST_ALLOW_MISSING="postgres, redis")
    else:
        out = run_suite(tmp_path, "--allow-missing=postgres", "--allow-missing", "redis")
    assert out.returncode == 0, out.stdout
    assert counts(out) == {"passed": 1, "skipped": 2}, out.stdout
    assert out.stdout.count("allowed by --allow-missing") == 2, out.stdout


def test_allowing_one_does_not_allow_another(tmp_path):
    out = run_suite(tmp_path, TOKENPATH_TEST_ALLOW_MISSING="postgres")
    assert out.returncode == 1 and counts(out).get("skipped") == 1, out.stdout
    assert "missing capability 'redis'" in out.stdout


def test_a_present_capability_runs_the_test(tmp_path):
    out = run_suite(tmp_path, "-k", "marked", TOKENPATH_TEST_POSTGRES_URL="postgresql://127.0.0.1:1/x")
    assert out.returncode == 0 and counts(out) == {"passed": 1}, out.stdout


def test_an_unknown_name_is_a_usage_error_not_a_silent_allow(tmp_path):
    out = run_suite(tmp_path, TOKENPATH_TEST_ALLOW_MISSING="reddis")
    assert out.returncode == 4 and "reddis" in out.stderr, (out.stdout, out.stderr)


# Skips that remain: facts of the hardware or platform no install provides, and a case a
# parameter does not apply to. Anything else the machine may lack is a capability
# (tests/capabilities.py), so that its absence fails the run.
ALLOWED_SKIPS = {
    ("tests/engine/test_quantized_quality.py", "no AVX-512 VNNI on this CPU"),
    ("tests/reliability/test_gateway_heap.py", "glibc malloc only"),
    ("tests/engine/test_tokenizer_json.py", "glibc's malloc_trim and /proc"),
    ("tests/replica/test_inprocess_liveness.py", "no per-thread schedstat"),
    ("tests/api/test_tool_cut.py", "required replies are calls only"),
}
SKIP_RE = re.compile(r"pytest\.(?:skip\(|importorskip\(|mark\.skipif\()")


def test_the_suite_skips_on_no_capability_except_the_listed_facts():
    found = set()
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name in ("capabilities.py", "test_capabilities.py"):
            continue
        text = path.read_text()
        for m in SKIP_RE.finditer(text):
            window = text[m.start():m.start() + 240]
            rel = str(path.relative_to(ROOT))
            match = next(((f, r) for f, r in ALLOWED_SKIPS if f == rel and r in window), None)
            assert match is not None, f"{rel}: {window[:120]!r}: use pytest.mark.requires(...) (tests/capabilities.py)"
            found.add(match)
    assert found == ALLOWED_SKIPS, ALLOWED_SKIPS - found  # the list keeps no stale entry
