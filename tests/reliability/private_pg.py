"""A private PostgreSQL cluster for one test that stops and restarts it (never the shared one of
`scripts/services.sh`, which other tests use at the same time). Made as scripts/postgres.sh makes
its cluster: initdb in a fresh directory (as the `postgres` user when root), 127.0.0.1 only, a free
port, the Unix socket inside the directory, fsync off."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
from pathlib import Path


def _bindir() -> str | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(f"{d}/initdb", os.X_OK) and os.access(f"{d}/pg_ctl", os.X_OK):
            return d
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateCluster:
    def __init__(self, root: Path) -> None:
        bindir = _bindir()
        if bindir is None:
            raise RuntimeError("no PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql")
        self.bin, self.dir, self.port = bindir, root, _free_port()
        self._as_owner: list[str] = []
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)
        if os.getuid() == 0:  # initdb and postgres refuse to run as root
            if subprocess.run(["id", "postgres"], capture_output=True).returncode != 0:
                raise RuntimeError("running as root, and there is no 'postgres' user to own the cluster")
            shutil.chown(root, "postgres", "postgres")
            self._as_owner = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(root / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-locale")
        self.start()
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "tp")
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/tp"

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run([*self._as_owner, f"{self.bin}/{tool}", *args], capture_output=True, text=True,
                             timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed: {out.stderr[-2000:]}")

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "server.log"), "-w", "-t", "60",
                  "start", "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-w", "-t", "60", "-m", "immediate", "stop")

    def destroy(self) -> None:
        with contextlib.suppress(RuntimeError):  # already stopped
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
