"""Stage plumbing around the target: the target a stage runs as one typed object (`TargetConfig`, built once from
the config's `target` section by data/sources.py `target_config`), which backend a stage runs it with (`resolve_backend`), HF
transformers behind the engine model's forward signature for families the engine lacks (`HFTarget`), and
`load_target`, the target a stage runs as its config places it (the engine's model or HF),
and what the `auto` placements choose: `target.device=auto` (`resolve_target_device`) and `trainer=auto`
(`auto_accelerator`) — CUDA where torch sees it, the CPU only on a machine without GPUs (`cuda_visible`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from types import SimpleNamespace

import torch

from inference_eval.model import (LlamaForCausalLM, TargetOutput, auto_compute_dtype, resolve_device, target_args,
                                  target_fingerprint)

log = logging.getLogger(__name__)

TARGET_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FINGERPRINTS = ("header", "full")


@dataclass(frozen=True)
class TargetConfig:
    """The target every stage runs: its checkpoint directory (resolved: `target.path`, or the packaged `source`
    converted once), the name and compute dtype its fingerprint records, how the fingerprint hashes the weights
    (`header`: safetensors headers and sizes; `full`: also the bytes), where it runs (`device`; `device_map`: HF's
    sharding) and whether HF may run the checkpoint's own code. A target named by its Hugging Face Hub id records
    the repo id and the commit its snapshot directory holds (data/hub.py)."""

    dir: Path
    name: str
    dtype: str
    fingerprint_mode: str = "header"
    device: str = "auto"
    device_map: str | None = None
    trust_remote_code: bool = False
    hub_repo: str | None = None  # `target.path=<org/name>`: the repo id ...
    hub_commit: str | None = None  # ... and the commit `target.revision` resolved to

    def __post_init__(self) -> None:
        if self.dtype not in TARGET_DTYPES:
            raise ValueError(f"target.dtype={self.dtype!r}: expected one of {', '.join(TARGET_DTYPES)}")
        if self.fingerprint_mode not in FINGERPRINTS:
            raise ValueError(f"target.fingerprint={self.fingerprint_mode!r}: expected one of {', '.join(FINGERPRINTS)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TARGET_DTYPES[self.dtype]

    @cached_property
    def fingerprint(self) -> dict[str, Any]:
        """What stores, heads and caches made from this target record and compare (inference_eval/model.py
        `target_fingerprint`); computed once (`full` reads every weight byte). A Hub target adds where its files
        came from, `source: {hub, revision}` (the commit): provenance, which no comparison reads (core/fingerprint.py
        FINGERPRINT_IGNORED), so the same files from a local directory are the same target."""
        fingerprint = target_fingerprint(self.dir, self.name, self.dtype, self.fingerprint_mode)
        if self.hub_repo is not None:
            fingerprint["source"] = {"hub": self.hub_repo, "revision": self.hub_commit}
        return fingerprint


def resolve_backend(backend: str | None, target_dir: str | Path, stage: str) -> str:
    """`auto` → `engine` for a checkpoint of a family the engine implements (inference_eval/families),
    else `hf`; precompute and regenerate also take `vllm` (inference_eval/vllm_backend.py: vLLM in its own
    environment)."""
    backend = backend or "auto"
    choices = ("auto", "engine", "hf", "vllm") if stage in ("precompute", "regenerate") else ("auto", "engine", "hf")
    if backend not in choices:
        raise ValueError(f"{stage}.backend={backend!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
    if backend != "auto":
        return backend
    try:
        target_args(target_dir)
    except ValueError:
        return "hf"
    return "engine"


class HFTarget:
    """An HF transformers causal LM behind the engine model's forward signature, for the families
    the engine does not implement (precompute's `hf` backend): the last decoder layer's output before
    the final norm (a forward hook) and the inputs of requested layers (`hidden_states[i]`); the base
    model runs without its lm_head, so no logits are computed."""

    def __init__(self, model) -> None:
        self.hf = model.eval().requires_grad_(False)
        base = model.base_model
        self.layers = getattr(base, "layers", None) or getattr(base, "h", None)
        if self.layers is None:
            raise ValueError(f"{type(model).__name__}: no decoder layer list (base_model.layers or .h) to hook")
        # one hook for the model's lifetime, writing to thread-local storage: precompute runs batches
        # on several threads at once, and a hook sees every thread's forward
        self._local = threading.local()
        self.layers[-1].register_forward_hook(self._capture)
        cfg = model.config
        self.args = SimpleNamespace(num_hidden_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                                    max_position_embeddings=getattr(cfg, "max_position_embeddings", 1 << 30))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", trust_remote_code: bool = False,
                        device_map: str | dict | None = None) -> "HFTarget":
        """`device_map` (e.g. `auto`) shards the layers over the visible GPUs through accelerate, for a
        target too large for one; the weights then load straight onto their devices."""
        from transformers import AutoModelForCausalLM

        if device_map is not None:
            return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                            device_map=device_map))
        device = torch.device(device)
        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                        device_map=None if device.type == "cpu" else str(device)))

    @property
    def device(self) -> torch.device:
        """Where inputs go: the embedding's device (the first shard's under a device_map)."""
        return self.hf.get_input_embeddings().weight.device

    def __call__(self, input_ids: torch.Tensor, logits: str = "none", capture_layers: tuple[int, ...] = ()
                 ) -> TargetOutput:
        if logits != "none":
            raise ValueError("HFTarget computes hidden states only (logits='none')")
        out = self.hf.base_model(input_ids=input_ids, output_hidden_states=bool(capture_layers), use_cache=False)
        hidden, self._local.hidden = self._local.hidden, None
        aux = [out.hidden_states[i] for i in capture_layers]
        return TargetOutput(hidden=hidden, logits=None, aux=aux)

    def _capture(self, module, args, output) -> None:
        self._local.hidden = output[0] if isinstance(output, tuple) else output



def load_target(target: TargetConfig, backend: str, dtype: torch.dtype | None = None):
    """The target a stage runs, placed by `target.device` (`resolve_target_device`): the engine's model, or for
    the `hf` backend HF transformers, sharded over the visible GPUs when `target.device_map` is set; in `dtype`
    (default the target's compute dtype). vLLM (precompute's `vllm` backend) starts its own worker process
    (inference_eval/vllm_backend.py)."""
    if backend not in ("engine", "hf"):
        raise ValueError(f"load_target: backend {backend!r} (engine or hf; vllm runs as inference_eval/vllm_backend.py "
                         "VLLMBackend)")
    dtype = target.torch_dtype if dtype is None else dtype
    device = resolve_target_device(target.device)
    if backend == "engine":
        return LlamaForCausalLM.from_pretrained(target.dir, dtype=dtype, device=device)
    return HFTarget.from_pretrained(target.dir, dtype=dtype, device=device, trust_remote_code=target.trust_remote_code,
                                    device_map=target.device_map)


class GPUNotVisible(RuntimeError):
    """`nvidia-smi` lists GPUs that torch cannot use: an `auto` setting would quietly run on the CPU."""


def nvidia_smi_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists (`GPU 0: NVIDIA H100 80GB HBM3 (UUID: ...)`, one line each); none where
    the tool is missing or fails (a machine without an NVIDIA driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")] if out.returncode == 0 else []


def cuda_visible(setting: str, force_cpu: str, torch_sees: bool | None = None,
                 listed_gpus: Callable[[], list[str]] | None = None) -> bool:
    """Whether an `auto` setting (`setting`) runs on CUDA: True where torch sees a GPU, False on a machine
    whose `nvidia-smi` lists none. Where it lists GPUs that torch cannot see (a CPU wheel, a driver older than
    the wheel's CUDA, CUDA_VISIBLE_DEVICES hiding them) it raises GPUNotVisible instead of falling back: a GPU
    node's work on its CPU takes hours where it took minutes, and nothing else would say why. `force_cpu`: the
    setting that runs on the CPU anyway. `torch_sees` (default torch.cuda.is_available()) and `listed_gpus`
    (default `nvidia-smi -L`) are what a test injects."""
    if torch.cuda.is_available() if torch_sees is None else torch_sees:
        return True
    listed = (listed_gpus or nvidia_smi_gpus)()
    if not listed:
        return False
    raise GPUNotVisible(
        f"{setting}: `nvidia-smi -L` lists {len(listed)} GPU(s) ({listed[0]}) but torch {torch.__version__} sees none "
        f"(its CUDA build: {torch.version.cuda or 'none, a CPU wheel'}; CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Check the driver (`nvidia-smi` runs and its "
        f"'CUDA Version' is at least the wheel's), CUDA_VISIBLE_DEVICES, and that .venv holds the CUDA torch (remove "
        f".venv, then `make install TORCH=cuda`). To run on the CPU anyway: {force_cpu}")


def resolve_target_device(spec: str | torch.device | None = "auto",
                          listed_gpus: Callable[[], list[str]] | None = None) -> torch.device:
    """`target.device` as `resolve_device` places it (auto: this rank's GPU, else the CPU), except that
    `auto` refuses the CPU on a machine whose GPUs torch cannot see (`cuda_visible`)."""
    if spec is None or str(spec) == "auto":
        cuda_visible("target.device=auto", "target.device=cpu", listed_gpus=listed_gpus)
    return resolve_device(spec)


def auto_accelerator(torch_sees: bool | None = None, listed_gpus: Callable[[], list[str]] | None = None,
                     say: bool = True) -> str:
    """`trainer=auto` (the default, conf/trainer/auto.yaml: the `cpu` preset with this accelerator and the recipe of
    `on_gpu`): `gpu` where torch sees CUDA — with `precision: auto` (bf16-mixed there) and the GPU recipe that is
    the `gpu` preset — else `cpu`, the `cpu` preset itself; refused where `nvidia-smi` lists GPUs torch cannot see
    (`cuda_visible`). `say`: log the choice."""
    on_gpu = cuda_visible("trainer=auto", "trainer=cpu", torch_sees, listed_gpus)
    if say:
        log.info("trainer=auto: the %s preset (%s)", "gpu" if on_gpu else "cpu",
                 f"torch sees {torch.cuda.device_count()} CUDA device(s)" if on_gpu else "no GPU on this machine")
    return "gpu" if on_gpu else "cpu"


def on_gpu(gpu_value: Any, cpu_value: Any) -> Any:
    """`${on_gpu:A,B}` (conf/recipe/auto.yaml): A where `trainer=auto` trains on the GPU, else B — the GPU recipe's
    tokens per step and learning rate (conf/recipe/gpu.yaml) or the CPU recipe's (conf/config.yaml)."""
    return gpu_value if auto_accelerator(say=False) == "gpu" else cpu_value


def register_target_resolvers() -> None:
    """The config's resolvers of what `auto` places where: `compute_dtype` (`target.dtype: auto`,
    conf/target/smollm2.yaml: inference_eval/model.py `auto_compute_dtype`) and `auto_accelerator`
    (`trainer=auto`, conf/trainer/auto.yaml; cached, so a config resolves it, and logs the choice, once).
    Every entry point registers them before reading a config (scripts/runtime.py); code that composes the
    config itself calls this first."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("compute_dtype", auto_compute_dtype, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("auto_accelerator", auto_accelerator, replace=True, use_cache=True)
    OmegaConf.register_new_resolver("on_gpu", on_gpu, replace=True, use_cache=True)
