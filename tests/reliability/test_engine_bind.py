"""`tokenpath engine` binds loopback unless told otherwise (issue 10, defect 5).

Engine ports skip keys, limits and audit, so an engine run by hand must not listen on a public
address by accident: any non-loopback `--host` is refused before the model loads, even with the
per-launch secret set, unless `--insecure` says so. (A connection without the secret is refused
by the engine link itself: tests/replica/test_engine_link.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOKENPATH = str(Path(sys.executable).parent / "tokenpath")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_public_bind_is_refused_without_insecure(host):
    env = {**os.environ, "TOKENPATH_ENGINE_SECRET": "s3cret-for-this-test"}
    out = subprocess.run([TOKENPATH, "engine", "--host", host, "--port", "0"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"refusing to bind {host}" in out.stderr and "--insecure" in out.stderr
