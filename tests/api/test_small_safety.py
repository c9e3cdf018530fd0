"""Issue 23, item 6: a stop list past the cap names the cap; the data dir and its tokenizer cache
are private (0700); a shared 1777 folder given as the data dir is refused with a clear message."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.api.conftest import TOKENPATH
from tests.api.sim_server import SimServer
from tests.simulated_replica import SimulatedReplica

from tokenpath.config import resolve_data_dir
from tokenpath.engine import tokenizer


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    srv = SimServer(SimulatedReplica("r0"))
    yield srv.start()
    srv.stop()


def test_a_thousand_stop_strings_is_a_400_naming_the_cap(url: str):
    """(`stop` is one field of both generation bodies, checked by the same `check_caps`.)"""
    body = {"model": "sim", "max_tokens": 2, "prompt": "x", "stop": [f"s{i}" for i in range(1000)]}
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stop" and "1000" in err["message"] and "limit of 16" in err["message"], err
    assert "valid string" not in err["message"]


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_tokenizer_cache_is_made_0700(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask_022: None):
    monkeypatch.setenv("TOKENPATH_DATA_DIR", str(tmp_path / "data"))
    cache = tokenizer._cache_dir()  # where a GGUF's tokenizer is saved (save_pretrained makes 0755 folders)
    assert cache == tmp_path / "data" / "tokenizers"
    assert _mode(cache.parent) == 0o700 and _mode(cache) == 0o700


def test_a_world_writable_data_dir_of_ours_is_tightened(tmp_path: Path):
    d = tmp_path / "emptydir"
    d.mkdir()
    d.chmod(0o777)  # what a k8s emptyDir looks like
    assert resolve_data_dir(str(d)) == d and _mode(d) == 0o700


def test_a_shared_1777_folder_is_refused_with_a_clear_message(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ValueError, match="shared folder"):
        resolve_data_dir(str(shared))
    out = subprocess.run([TOKENPATH, "serve", "--port", "0", "--data-dir", str(shared)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "shared folder (mode 1777" in out.stderr and str(shared / "tokenpath") in out.stderr
    assert _mode(shared) == 0o1777  # not tightened: other users of a shared folder keep it
