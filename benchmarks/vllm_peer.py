"""vLLM's CPU build as a backend: started on loopback with what a gateway in front of it reads.

One launcher for everything that runs a real vLLM behind tokenpath: benchmarks/vllm_behind_gateway.py
and the peers tier (tests/peers/, `make test-peers`). The venv is scripts/vllm_venv.sh's
(benchmarks/.venv-vllm, or $TOKENPATH_VLLM_VENV); the model is the bf16 SmolLM2 safetensors of
benchmarks/make_smollm2_hf.py. vLLM runs with its per-request metrics (the backend's own
engine_queue/prefill), prompt-token details (cached tokens) and ZMQ KV events with a replay
endpoint (the precise prefix index), and a routing file puts it behind `tokenpath serve` as a
`url:` replica.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.procs import free_port, stop_group, wait_healthy  # noqa: E402

NAME = "smollm2-135m-instruct"
MODEL_DIR = ROOT / ".cache" / "peers" / "smollm2-135m-bfloat16"


def venv() -> Path:
    return Path(os.environ.get("TOKENPATH_VLLM_VENV", ROOT / "benchmarks" / ".venv-vllm"))


def model_dir(path: Path = MODEL_DIR) -> Path:
    """The bf16 safetensors both engines serve, made from the packaged GGUF when missing."""
    if not (path / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_smollm2_hf.py"), "--out", str(path)],
                       check=True)
    return path


def start_group(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A server in a process group of its own (its children are stopped with it)."""
    with open(log, "w") as f:
        return subprocess.Popen(argv, env=env or dict(os.environ), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)


@dataclass
class Vllm:
    """A running vLLM: its HTTP port and its KV-event endpoints (live PUB, replay ROUTER)."""

    proc: subprocess.Popen
    port: int
    live: int
    replay: int
    log: Path
    ready_s: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def routes(self, path: Path, max_num_seqs: int = 32) -> Path:
        """A routing file whose one deployment is this vLLM, with its KV events."""
        path.write_text(f"deployments:\n  - name: {NAME}\n    replicas:\n      - url: {self.url}\n"
                        f"        max_num_seqs: {max_num_seqs}\n        kv_events: tcp://127.0.0.1:{self.live}\n"
                        f"        kv_events_replay: tcp://127.0.0.1:{self.replay}\n")
        return path

    def stop(self) -> None:
        stop_group(self.proc)


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """`argv` run on the CPUs `cpus` (taskset's list, e.g. "0" or "0,1"), or as is for None. vLLM's
    CPU worker binds its OpenMP threads within the affinity it starts with."""
    return argv if cpus is None else ["taskset", "-c", cpus, *argv]


def start_vllm(out: Path, model: Path | None = None, timeout: float = 1200, cpus: str | None = None) -> Vllm:
    """Start vLLM and wait until /health answers (a minute quiet; several under load). `cpus`:
    pinned there (its API server and engine alike), else on every core."""
    exe = venv() / "bin" / "vllm"
    if not exe.exists():
        raise RuntimeError(f"{exe} is missing: run scripts/vllm_venv.sh")
    port, live, replay = free_port(), free_port(), free_port()
    kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{live}",
                     "replay_endpoint": f"tcp://*:{replay}"})
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    log = out / "vllm.log"
    t0 = time.monotonic()
    proc = start_group(pinned([str(exe), "serve", str(model or model_dir()), "--served-model-name", NAME, "--host",
                               "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096",
                               "--enable-per-request-metrics", "--enable-prompt-tokens-details", "--kv-events-config",
                               kv], cpus), log, env)
    try:
        wait_healthy(port, proc, log, timeout)
    except BaseException:
        stop_group(proc)
        raise
    return Vllm(proc, port, live, replay, log, round(time.monotonic() - t0, 1))


def start_gateway(vllm: Vllm, out: Path, tag: str, *flags: str, cpus: str | None = None,
                  module: str = "tokenpath.cli", env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """`tokenpath serve` whose only replica is `vllm` (JSON logs: one `tokenpath.request` line each).
    `cpus`: pinned there; `module`: what runs it (`benchmarks.ttft_path_hooks`: with its windows
    timed), with `env` added to the environment."""
    routes = vllm.routes(out / f"routes-{tag}.yaml")
    port = free_port()
    log = out / f"gateway-{tag}.log"
    proc = start_group(pinned([sys.executable, "-m", module, "serve", "--model", NAME, "--routing", str(routes),
                               "--port", str(port), "--host", "127.0.0.1", "--log-format", "json",
                               "--data-dir", str(out / f"data-{tag}"), *flags], cpus), log,
                       dict(os.environ, **env) if env else None)
    try:
        wait_healthy(port, proc, log, 300)
    except BaseException:
        stop_group(proc)
        raise
    return proc, port


def request_lines(log: Path) -> list[dict]:
    """The gateway's `tokenpath.request` log records, in order."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if '"tokenpath.request"' in line:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows
