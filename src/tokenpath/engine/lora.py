"""LoRA adapters in the PEFT format: reading and checking one, and the engine's two LRUs of them.

An adapter is a directory with `adapter_config.json` (peft_type LORA, `r`, `lora_alpha`,
`target_modules`) and `adapter_model.safetensors` (`...layers.N.self_attn.q_proj.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]). Targets: q/k/v/o and gate/up/down projections, the
matrices every decoder family here has. Everything a bad adapter can get wrong is refused with a
400 naming the file and the problem, before anything that is being served changes: a missing
path, a directory that is not PEFT, a rank over `max_lora_rank`, a module this model lacks, a
shape of another base model.

Two LRUs (vLLM's): `max_cpu_loras` parsed adapters kept in memory (`cpu`), of which up to
`max_loras` are resident (`resident`: in the compute form the runner reads; the native kernels'
pointer tables), the adapters one step may mix. Reading from disk runs on a worker thread, off
the step loop: a request whose adapter is loading waits in the queue while others run.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokenpath.engine.model_config import ModelConfig
from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.lora import LoraRef

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tokenpath.engine.lora")

# The order the native kernels number them in (csrc/forward.cpp kLoraTargets).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoraError(InvalidRequestError):
    """An adapter that cannot run on this model: the client's (or operator's) input, a 400."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message, param="lora_path", code=code)


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target matrix of this model."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (h, nq), "k_proj": (h, nkv), "v_proj": (h, nkv), "o_proj": (nq, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoraWeights:
    """One parsed adapter: per layer, target -> (A [r, in], B [out, r]) float32, contiguous."""

    name: str
    path: str
    rank: int
    scaling: float
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    load_seconds: float = 0.0
    native: NativeTable | None = field(default=None, repr=False)  # built while resident

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


@dataclass
class NativeTable:
    """An adapter as the native kernels read it: [layers][7][A, B^T] pointers into `keep`."""

    ptrs: np.ndarray  # uint64
    keep: list[np.ndarray]


def _config(path: Path, max_rank: int) -> dict:
    if not path.exists():
        raise LoraError(f"LoRA adapter path '{path}' does not exist", "lora_path_not_found")
    if not path.is_dir():
        raise LoraError(f"LoRA adapter path '{path}' is not a directory (expected a PEFT adapter directory with "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})", "lora_not_peft")
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights.is_file():
        missing = CONFIG_FILE if not cfg_file.is_file() else WEIGHTS_FILE
        raise LoraError(f"'{path}' is not a PEFT LoRA adapter: {missing} is missing", "lora_not_peft")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"{cfg_file}: not valid JSON ({exc})", "lora_not_peft") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "")).upper() != "LORA":
        kind = cfg.get("peft_type") if isinstance(cfg, dict) else None
        raise LoraError(f"{cfg_file}: peft_type is {kind!r}, not 'LORA'", "lora_not_peft")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"{cfg_file}: rank r must be a positive integer, got {r!r}", "lora_not_peft")
    if r > max_rank:
        raise LoraError(f"LoRA adapter '{path}' has rank {r}, over this server's --max-lora-rank {max_rank}",
                        "lora_rank_too_large")
    unsupported = [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save") if cfg.get(k)]
    unsupported += [k for k in ("use_dora",) if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']}")
    if unsupported:
        raise LoraError(f"{cfg_file}: {', '.join(unsupported)} not supported (plain LoRA on "
                        f"{', '.join(LORA_TARGETS)} only)", "lora_unsupported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(LORA_TARGETS))
        if lacking:
            raise LoraError(f"LoRA adapter '{path}' targets {', '.join(lacking)}, which this model lacks "
                            f"(supported: {', '.join(LORA_TARGETS)})", "lora_unsupported_modules")
    return cfg


def check_adapter(path: str | Path, model: ModelConfig | None, max_rank: int) -> None:
    """Refuse (LoraError) what `read_adapter` would; with no model config (a URL replica), the
    checks that need none."""
    if model is None:
        _config(Path(path), max_rank)
        return
    read_adapter("check", path, model, max_rank)


def read_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoraWeights:
    """Parse and check one PEFT adapter against this model (LoraError if it cannot run here)."""
    if model.num_experts:  # the torch path applies no deltas inside experts: refuse, never ignore
        raise LoraError(f"LoRA adapter '{path}': this model is a mixture of experts ({model.num_experts} experts), "
                        "and LoRA adapters on mixture-of-experts models are not supported yet", "lora_unsupported")
    import torch  # (an adapter's load only: a GGUF engine without adapters never imports it)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    started = time.perf_counter()
    path = Path(path)
    cfg = _config(path, max_rank)
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError, ValueError) as exc:
        raise LoraError(f"{path / WEIGHTS_FILE}: unreadable ({exc})", "lora_not_peft") from None
    shapes = target_shapes(model)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"LoRA adapter '{path}' has weights for '{key}', a module this model lacks "
                            f"(supported: {', '.join(LORA_TARGETS)})", "lora_unsupported_modules")
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in shapes:
            raise LoraError(f"LoRA adapter '{path}' targets {target}, which this model lacks "
                            f"(supported: {', '.join(LORA_TARGETS)})", "lora_unsupported_modules")
        if layer >= model.num_layers:
            raise LoraError(f"LoRA adapter '{path}' has layer {layer}, but this model has {model.num_layers} "
                            "layers: it was made for another base model", "lora_base_mismatch")
        parts.setdefault((layer, target), {})[ab] = t
    if not parts:
        raise LoraError(f"LoRA adapter '{path}': {WEIGHTS_FILE} holds no LoRA weights", "lora_not_peft")
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(model.num_layers)]
    for (layer, target), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter '{path}': layer {layer} {target} has lora_{''.join(ab)} only",
                            "lora_not_peft")
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[target]
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (n_out, r):
            raise LoraError(
                f"LoRA adapter '{path}': layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}, but "
                f"this model needs A ({r}, {n_in}) and B ({n_out}, {r}): it was made for another base model",
                "lora_base_mismatch")
        layers[layer][target] = (a.to(torch.float32).contiguous(), b.to(torch.float32).contiguous())
    return LoraWeights(name=name, path=str(path), rank=r, scaling=scaling, layers=layers,
                       load_seconds=time.perf_counter() - started)


def native_table(w: LoraWeights) -> NativeTable:
    """The pointer table the native kernels read: A as is, B transposed ([r, out]), both in IEEE
    half precision (csrc/lora_delta.h says why; the torch path keeps its float32 tensors)."""
    keep: list[np.ndarray] = []
    ptrs: np.ndarray = np.zeros(len(w.layers) * len(LORA_TARGETS) * 2, dtype=np.uint64)
    for li, layer in enumerate(w.layers):
        for ti, target in enumerate(LORA_TARGETS):
            ab = layer.get(target)
            if ab is None:
                continue
            import torch  # (torch's conversion: F16C, several times numpy's astype on this CPU)

            a = ab[0].to(torch.float16).contiguous().numpy()
            bt = ab[1].to(torch.float16).t().contiguous().numpy()
            keep += [a, bt]
            base = (li * len(LORA_TARGETS) + ti) * 2
            ptrs[base], ptrs[base + 1] = a.ctypes.data, bt.ctypes.data
    return NativeTable(ptrs=ptrs, keep=keep)


def lora_key(ref: LoraRef) -> str:
    """One adapter's identity in the engine: its name and path (a name reloaded from another
    path is another adapter)."""
    return f"{ref.name}\0{ref.path}"


@dataclass
class LoadRecord:
    """How one adapter became ready: read from disk (`cold`) or found in the CPU LRU."""

    started: float  # monotonic
    ended: float
    cold: bool


class LoraManager:
    """The engine's adapters: loads off the step loop, the CPU LRU and the resident slots.

    Called from the step thread (`ready`, `activate`, `get`, `take_failures`); the worker thread
    only fills `cpu` and `failed` under the lock, then calls `wake` so the loop schedules again."""

    def __init__(self, model: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 native: bool, wake: Callable[[], None] | None = None) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu = max(max_cpu_loras or max_loras, max_loras)
        self.native = native
        self.wake = wake or (lambda: None)
        self.cpu: OrderedDict[str, LoraWeights] = OrderedDict()
        self.resident: OrderedDict[str, LoraWeights] = OrderedDict()
        self.loading: dict[str, float] = {}  # key -> monotonic start
        # Loaded for a waiting request and not yet activated: never trimmed from the CPU LRU
        # before that request had its turn (else two loads could evict each other forever).
        self.wanted: set[str] = set()
        self.failed: dict[str, LoraError] = {}
        self.records: dict[str, LoadRecord] = {}  # the last load of each key (for the waiting requests' traces)
        self.loads = 0  # cold loads done
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- loading
    def ready(self, ref: LoraRef) -> bool:
        """Whether `ref` is in memory; if not, and not loading or failed, start loading it."""
        key = lora_key(ref)
        with self._lock:
            if key in self.cpu:
                return True
            self.wanted.add(key)
            if key in self.loading or key in self.failed:
                return False
            self.loading[key] = time.monotonic()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenpath-lora")
        self._pool.submit(self._load, key, ref)
        return False

    def _load(self, key: str, ref: LoraRef) -> None:
        try:
            w = read_adapter(ref.name, ref.path, self.model, self.max_rank)
        except LoraError as exc:
            with self._lock:
                self.failed[key] = exc
                self.loading.pop(key, None)
        except Exception as exc:  # an unexpected reader failure is still this adapter's problem only
            log.exception("loading LoRA adapter %s failed", ref.name)
            with self._lock:
                self.failed[key] = LoraError(f"LoRA adapter '{ref.name}' failed to load: {exc}", "lora_load_failed")
                self.loading.pop(key, None)
        else:
            with self._lock:
                started = self.loading.pop(key, time.monotonic())
                self.cpu[key] = w
                self.records[key] = LoadRecord(started, time.monotonic(), cold=True)
                self.loads += 1
                self._trim_cpu()
            log.info("LoRA adapter %s loaded from %s in %.1f ms (rank %d, %.1f MiB)", ref.name, ref.path,
                     w.load_seconds * 1e3, w.rank, w.nbytes / 2**20)
        self.wake()

    def take_failures(self) -> dict[str, LoraError]:
        """Adapters that failed to load since the last call (their waiting requests fail)."""
        with self._lock:
            out, self.failed = self.failed, {}
            self.wanted -= set(out)
        return out

    # ---------------------------------------------------------------- slots
    def activate(self, ref: LoraRef, in_use: set[str]) -> bool:
        """Make `ref` resident for the steps to come, as the scheduler admits a request using it;
        False (and a load started) if it is not in memory. Evicts the least recently used resident
        adapter that no running request uses (`in_use`: their keys)."""
        key = lora_key(ref)
        w = self.resident.get(key)
        if w is not None:
            self.resident.move_to_end(key)
            return True
        with self._lock:
            w = self.cpu.get(key)
            if w is not None:
                self.cpu.move_to_end(key)
                self.wanted.discard(key)
        if w is None:
            self.ready(ref)
            return False
        if self.native and w.native is None:
            w.native = native_table(w)
        self.resident[key] = w
        for old in list(self.resident):
            if len(self.resident) <= self.max_loras:
                break
            if old not in in_use and old != key:
                self.resident.pop(old).native = None
        with self._lock:
            self._trim_cpu()
        return True

    def _trim_cpu(self) -> None:
        """Evict least recently used adapters beyond `max_cpu`, never a resident or wanted one (so
        the LRU may run over its size while every adapter in it is in use or awaited)."""
        for old in list(self.cpu):
            if len(self.cpu) <= self.max_cpu:
                break
            if old not in self.resident and old not in self.wanted:
                del self.cpu[old]

    def get(self, ref: LoraRef) -> LoraWeights:
        return self.resident[lora_key(ref)]

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w.name for w in list(self.resident.values())))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def base_model_config(model: str) -> ModelConfig | None:
    """The hyperparameters of a model by name or path (metadata only, no weights), for checking
    adapters in a gateway whose engines run elsewhere; None when they cannot be read here."""
    from tokenpath.engine.loader import resolve_model_path
    from tokenpath.engine.loader_gguf import read_gguf
    from tokenpath.engine.loader_hf import read_hf_config

    try:
        path = resolve_model_path(model)
        return read_gguf(path)[0] if path.is_file() else read_hf_config(path)
    except Exception:  # (a remote-only model, a Ray cluster's own path): the engines check shapes
        log.info("the base model %s cannot be read here: LoRA adapters are checked by the engines", model)
        return None
