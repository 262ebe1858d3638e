"""What a GPU user runs first, checked on a CPU with stand-ins for the second device, the driver and the other
ranks: where in-loop validation scores a head gathered from shards (all of it where the engine runs), what the
`auto` settings choose and refuse (`make install TORCH=cuda`, `target.device=auto`, `trainer=auto`), and the
start-up check that every rank sees the run directory.

A CPU has one device, so no placement can go wrong on it: the tests put the "GPU" side on `meta`, a device with
shapes and no data, and assert that every tensor ends where the engine runs."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose_config
from heads.registry import build_head
from inference_eval.model import tied_target

META = torch.device("meta")
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0f0e0d0c-0000-0000-0000-000000000000)"


def _devices(module: torch.nn.Module) -> set[torch.device]:
    return {t.device for t in (*module.parameters(), *module.buffers())}


def _head(target: Path, kind: str = "mtp") -> torch.nn.Module:
    tied, args, parts = tied_target(target)
    head = build_head({"type": kind}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    return head


# ---- the head validation scores lives where the engine runs ------------------------------------------------
def _validation(tmp_path: Path, engine_device: torch.device, scored: list):
    """EngineValidation with the engine's target a stand-in on `engine_device` and the scoring replaced by a
    recorder of the head it is given: what the run decides up to the scoring, run as it is."""
    from train.validation import EngineValidation, EngineValidationSettings

    val = EngineValidation(EngineValidationSettings(tmp_path, plot_dir=None), target=SimpleNamespace(device=engine_device))

    def evaluate(head, samples, val_idx, step=0):
        scored.append(head)
        return {"engine_val/tau": 1.0}

    val.evaluate = evaluate
    return val


def _trainer():
    dm = SimpleNamespace(sample_with_states=lambda i: None, val_idx=[0])
    return SimpleNamespace(global_step=5, is_global_zero=True, datamodule=dm, logger=None)


@pytest.mark.unit
def test_gpu_correct_sharded_head_scored_on_the_engine_device(tiny_target, tmp_path, monkeypatch):
    """A ZeRO-3 head on rank 0 (parameters tagged as partitions; the gather a no-op in one process): its tied
    target tensors live on the rank's device (`meta` standing for cuda), the gathered state comes back on the
    CPU. The engine runs on that device: the head validation scores must be there whole — parameters and
    buffers. Before the fix, the copy kept CPU parameters beside the device's tied buffers, and validation,
    comparing the tied buffers' device alone with the engine's, scored it as it was: on a GPU a device error at
    the first validation, before the head was saved."""
    import deepspeed

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", lambda params, modifier_rank=None: contextlib.nullcontext())
    head = _head(tiny_target)
    head.tied.to(META)  # the frozen target tensors on the rank's device
    for i, p in enumerate(head.parameters()):
        p.ds_id = i  # what `whole_head_state` reads as a ZeRO-3 partitioned parameter
    scored = []
    _validation(tmp_path, META, scored).run(_trainer(), SimpleNamespace(head=head))
    assert len(scored) == 1 and scored[0] is not head  # a gathered copy, not the training head
    assert _devices(scored[0]) == {META}, {n: t.device for n, t in (*scored[0].named_parameters(),
                                                                    *scored[0].named_buffers())}
    # the training head is left as training holds it: its parameters on the CPU, its tied tensors on the device
    assert {p.device for p in head.parameters()} == {torch.device("cpu")} and _devices(head.tied) == {META}


@pytest.mark.unit
def test_gpu_correct_whole_head_copied_to_another_engine_device(tiny_target, tmp_path):
    """A whole head (DDP, one process) trained on the CPU with the engine elsewhere (`meta`): validation
    scores a copy with every parameter and buffer there, and the training head stays on the CPU; with the
    engine on the CPU too it scores the training head itself, no copy."""
    head = _head(tiny_target)
    scored = []
    _validation(tmp_path, META, scored).run(_trainer(), SimpleNamespace(head=head))
    assert scored[0] is not head and _devices(scored[0]) == {META}
    assert _devices(head) == {torch.device("cpu")}
    _validation(tmp_path, torch.device("cpu"), scored).run(_trainer(), SimpleNamespace(head=head))
    assert scored[1] is head


@pytest.mark.unit
def test_gpu_correct_on_device_looks_at_every_tensor(tiny_target):
    """`on_device`, the placement rule: a head split over two devices is copied whole to the engine's, whichever
    side the engine is on — its tied buffers alone (or its parameters alone) on the right device decide nothing."""
    from train.validation import on_device

    head = _head(tiny_target)
    head.tied.to(META)
    placed = on_device(head, META)  # parameters on the CPU, tied buffers already on the engine's device
    assert placed is not head and _devices(placed) == {META} and placed.tied is not head.tied
    assert {p.device for p in head.parameters()} == {torch.device("cpu")}  # the original is not moved
    whole = _head(tiny_target)
    assert on_device(whole, torch.device("cpu")) is whole
    params_there = _head(tiny_target).to(META)
    params_there.tied = _head(tiny_target).tied  # parameters on the engine's device, tied buffers on the CPU
    assert _devices(on_device(params_there, META)) == {META}


@pytest.mark.unit
def test_gpu_correct_whole_head_copy_lives_with_its_tied_tensors(tiny_target, monkeypatch):
    """`whole_head` of a sharded head: the copy holds the gathered values, on the device and in the dtype of the
    tied tensors it shares with the training head (which stay the training head's own, unmoved)."""
    import deepspeed

    from train.strategies import whole_head

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", lambda params, modifier_rank=None: contextlib.nullcontext())
    head = _head(tiny_target)
    with torch.no_grad():
        for i, p in enumerate(head.parameters()):
            p.add_(0.01 * (i + 1))  # values a fresh head does not have
            p.ds_id = i
    copy = whole_head(SimpleNamespace(is_global_zero=True), head)
    assert copy is not head and copy.tied is head.tied
    for (name, a), (_, b) in zip(head.state_dict().items(), copy.state_dict().items()):
        assert torch.equal(a, b), name
    embed = head.tied.embed
    head.tied.to(META)
    copy = whole_head(SimpleNamespace(is_global_zero=True), head)
    assert _devices(copy) == {META} and head.tied.embed.dtype == embed.dtype
    assert {p.device for p in head.parameters()} == {torch.device("cpu")}
    assert whole_head(SimpleNamespace(is_global_zero=False), head) is None


# ---- a GPU node whose torch sees no GPU ---------------------------------------------------------------------
@pytest.mark.unit
def test_gpu_correct_target_device_auto_refuses_the_cpu_where_gpus_are_listed():
    """`target.device=auto` where `nvidia-smi -L` lists a GPU and torch sees none: an error naming what to
    check and `target.device=cpu`, not the CPU; without listed GPUs: the CPU, as before; an explicit device is
    never second-guessed (the probe is not even run)."""
    from inference_eval.targets import GPUNotVisible, resolve_target_device

    def never():
        raise AssertionError("nvidia-smi consulted for an explicit device")

    with pytest.raises(GPUNotVisible) as err:
        resolve_target_device("auto", listed_gpus=lambda: [H100])
    for part in ("target.device=auto", "lists 1 GPU", H100, "sees none", "driver", "CUDA_VISIBLE_DEVICES",
                 "CUDA Version", "make install TORCH=cuda", "To run on the CPU anyway: target.device=cpu"):
        assert part in str(err.value), part
    assert resolve_target_device("auto", listed_gpus=lambda: []) == torch.device("cpu")
    assert resolve_target_device(None, listed_gpus=lambda: []) == torch.device("cpu")
    assert resolve_target_device("cpu", listed_gpus=never) == torch.device("cpu")


@pytest.mark.unit
def test_gpu_correct_load_target_and_validation_use_the_check(monkeypatch, tiny_target, tmp_path):
    """The stages' own paths: `load_target` (precompute, online training) and validation's engine device refuse
    `auto` on such a node (the real probe replaced by a stand-in listing a GPU)."""
    from inference_eval import targets
    from train.validation import EngineValidation, EngineValidationSettings

    monkeypatch.setattr(targets, "nvidia_smi_gpus", lambda: [H100])
    auto = targets.TargetConfig(dir=tiny_target, name="tiny", dtype="float32", device="auto")
    with pytest.raises(targets.GPUNotVisible, match="target.device=cpu"):
        targets.load_target(auto, "engine")
    with pytest.raises(targets.GPUNotVisible, match="target.device=cpu"):
        EngineValidation(EngineValidationSettings(tmp_path, device="auto")).engine_device()
    assert EngineValidation(EngineValidationSettings(tmp_path, device="cpu")).engine_device() == torch.device("cpu")
    model = targets.load_target(dataclasses.replace(auto, device="cpu"), "engine")
    assert model.device == torch.device("cpu")


@pytest.mark.unit
def test_gpu_correct_nvidia_smi_probe(tmp_path, monkeypatch):
    """`nvidia_smi_gpus` on stand-ins of the tool: the GPU lines of `nvidia-smi -L`; none where it fails (driver
    tools without a GPU) or is missing."""
    from inference_eval.targets import nvidia_smi_gpus

    def tool(body: str) -> None:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "nvidia-smi").write_text(f"#!/bin/sh\n{body}\n")
        (d / "nvidia-smi").chmod(0o755)
        monkeypatch.setenv("PATH", f"{d}:/usr/bin:/bin")

    tool(f"echo '{H100}'; echo 'GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)'; echo '  MIG 1g.10gb Device 0: (UUID: MIG-x)'")
    assert nvidia_smi_gpus() == [H100, "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"]
    tool(f"echo '{H100}'; exit 9")
    assert nvidia_smi_gpus() == []
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert nvidia_smi_gpus() == []


def _install_check(make_args: list[str], path_dir: Path | None = None) -> str:
    """The last command `make install` runs before it records the install (dry run, -n)."""
    env = {**os.environ}
    env.pop("TORCH", None)
    if path_dir is not None:
        env["PATH"] = f"{path_dir}:{env['PATH']}"
    out = subprocess.run(["make", "-n", "-B", "install", *make_args], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    checks = [line for line in out if "sees no GPU" in line and not line.startswith("#")]
    assert len(checks) == 1, out
    return checks[0]


@pytest.mark.parametrize("gpus", [0, 2])
def test_gpu_correct_make_install_cuda_fails_without_a_visible_gpu(tmp_path, gpus):
    """`make install TORCH=cuda` — and `auto` on a node whose `nvidia-smi -L` lists a GPU — ends with a check
    run here on a stand-in torch (a CUDA 12.8 build): with no GPU visible it fails naming the driver,
    CUDA_VISIBLE_DEVICES and the wheel's CUDA version against nvidia-smi's; with GPUs it passes."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho '{H100}'\n")
    (fake / "nvidia-smi").chmod(0o755)
    line = _install_check(["TORCH=cuda"])
    assert _install_check([], fake) == line  # auto on a GPU node: the same check
    stand_in = tmp_path / "site" / "torch"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(
        "__version__ = '2.13.0+cu128'\n"
        "class version:\n    cuda = '12.8'\n"
        f"class cuda:\n    is_available = staticmethod(lambda: {gpus > 0})\n"
        f"    device_count = staticmethod(lambda: {gpus})\n")
    cmd = line.replace(".venv/bin/python", sys.executable, 1)
    env = {**os.environ, "PYTHONPATH": str(stand_in.parent), "CUDA_VISIBLE_DEVICES": "7"}
    run = subprocess.run(["sh", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True)
    if gpus:
        assert run.returncode == 0, run.stderr
        return
    assert run.returncode == 1
    for part in ("TORCH=cuda: torch 2.13.0+cu128 (CUDA 12.8) sees no GPU", "the driver (nvidia-smi",
                 "CUDA_VISIBLE_DEVICES (now 7)", "wheel CUDA version 12.8", "CUDA Version nvidia-smi prints",
                 "make install TORCH=cpu"):
        assert part in run.stderr, (part, run.stderr)


# ---- trainer=auto --------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_gpu_correct_auto_accelerator_rule(caplog):
    """`auto_accelerator`: gpu where torch sees CUDA (the probe not run), cpu on a machine without GPUs, said in
    the log; refused, naming trainer=cpu, where nvidia-smi lists GPUs torch cannot see."""
    from inference_eval.targets import GPUNotVisible, auto_accelerator

    def never():
        raise AssertionError("nvidia-smi consulted while torch sees CUDA")

    with caplog.at_level(logging.INFO, logger="inference_eval.targets"):
        assert auto_accelerator(torch_sees=True, listed_gpus=never) == "gpu"
        assert auto_accelerator(torch_sees=False, listed_gpus=lambda: []) == "cpu"
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["trainer=auto: the gpu preset",
                                                                      "trainer=auto: the cpu preset"]
    with pytest.raises(GPUNotVisible, match="trainer=auto: .*To run on the CPU anyway: trainer=cpu"):
        auto_accelerator(torch_sees=False, listed_gpus=lambda: [H100])


def _resolved(cfg) -> dict:
    """The trainer as it runs, with the recipe that goes with it: tokens per step and learning rate."""
    from train.run import resolve_precision

    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    return {**trainer, "precision": resolve_precision(trainer["precision"], trainer["accelerator"]),
            "batch_tokens": cfg.train.data.batch_tokens, "lr": cfg.train.module.lr}


@pytest.mark.unit
def test_gpu_correct_default_trainer_is_cpu_here_and_gpu_with_cuda(monkeypatch, caplog):
    """The default config's trainer resolves to exactly the `cpu` preset on this machine (the config a run or a
    result cache reads is today's, its recipe too: 512 tokens a step, lr 1e-3), and, where torch sees CUDA, to
    exactly the `gpu` preset with the GPU recipe (16,384 tokens, lr 5.66e-3; a value on the command line still wins);
    on a node whose GPUs torch cannot see, reading it fails naming trainer=cpu."""
    from inference_eval import targets

    with caplog.at_level(logging.INFO, logger="inference_eval.targets"):
        default = compose_config(["progress=false"])
        here = _resolved(default)
        assert here == _resolved(compose_config(["progress=false", "trainer=cpu"]))
        assert (here["accelerator"], here["batch_tokens"], here["lr"]) == ("cpu", 512, 1e-3)
        # the result caches key the resolved config: the same sections as trainer=cpu's
        assert OmegaConf.to_container(default.train, resolve=True) == OmegaConf.to_container(
            compose_config(["progress=false", "trainer=cpu"]).train, resolve=True)
    assert caplog.messages.count("trainer=auto: the cpu preset (no GPU on this machine)") == 1  # said once
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    on_gpu = _resolved(compose_config(["progress=false"]))
    assert on_gpu == _resolved(compose_config(["progress=false", "trainer=gpu"]))
    assert (on_gpu["accelerator"], on_gpu["devices"], on_gpu["precision"]) == ("gpu", 1, "bf16-mixed")
    assert (on_gpu["batch_tokens"], on_gpu["lr"]) == (16384, 5.66e-3)
    mine = _resolved(compose_config(["progress=false", "train.data.batch_tokens=4096", "train.module.lr=2.83e-3"]))
    assert (mine["accelerator"], mine["batch_tokens"], mine["lr"]) == ("gpu", 4096, 2.83e-3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(targets, "nvidia_smi_gpus", lambda: [H100])
    with pytest.raises(Exception, match="trainer=cpu"):
        compose_config(["progress=false"]).trainer.accelerator
    assert compose_config(["progress=false", "trainer=cpu"]).trainer.accelerator == "cpu"  # forced: no probe


# ---- every rank sees the run directory ------------------------------------------------------------------------
@pytest.mark.unit
def test_gpu_correct_run_dir_seen_by_every_rank(tmp_path):
    """`run_dir_problem`, one rank's side of the start-up check, with rank 0's token injected: the directory rank
    0 wrote reads back its token (no problem); another node's local directory of the same name (no file), or
    one left by an earlier run (another token), is an error naming the directory and the rank."""
    from train.run import RUN_DIR_TOKEN, run_dir_problem

    shared, local = tmp_path / "shared", tmp_path / "node1"
    shared.mkdir()
    local.mkdir()
    (shared / RUN_DIR_TOKEN).write_text("a1b2")
    assert run_dir_problem(shared, 3, "a1b2", wait_s=0) is None
    missing = run_dir_problem(local, 3, "a1b2", wait_s=0.3)
    assert missing.startswith(f"rank 3 does not see the run directory {local.resolve()}") and "no such file" in missing
    (local / RUN_DIR_TOKEN).write_text("old-run")
    stale = run_dir_problem(local, 5, "a1b2", wait_s=0)
    assert "rank 5" in stale and str(local.resolve()) in stale and "another run" in stale
    assert "filesystem every node mounts" in stale


class _Ranks:
    """Lightning's strategy as `check_run_dir_shared` uses it, for one rank of a job: `broadcast` returns rank
    0's token (the real one on rank 0, `sent` elsewhere) and `reduce_boolean_decision` ANDs this rank's answer
    with the other ranks' (`others`)."""

    def __init__(self, rank: int, others_ok: bool, sent: str | None = None) -> None:
        self.global_rank, self.others_ok, self.sent, self.asked = rank, others_ok, sent, []

    def broadcast(self, obj, src=0):
        return obj if self.global_rank == 0 else self.sent

    def reduce_boolean_decision(self, decision, all=True):
        self.asked.append(decision)
        return decision and self.others_ok


def test_gpu_correct_run_dir_check_fails_every_rank_together(tmp_path):
    """`check_run_dir_shared`: rank 0 writes a fresh random token and removes it once every rank has read it;
    all ranks fail together — the rank that cannot read it naming itself and the directory, the others
    naming the directory — and pass together when every rank reads it."""
    from train.run import RUN_DIR_TOKEN, RunDirNotShared, check_run_dir_shared

    run_dir = tmp_path / "run"
    rank0 = _Ranks(0, others_ok=True)
    check_run_dir_shared(run_dir, rank0)
    assert rank0.asked == [True] and not (run_dir / RUN_DIR_TOKEN).exists()
    with pytest.raises(RunDirNotShared, match=rf"rank 0: another rank does not see the run directory {run_dir}"):
        check_run_dir_shared(run_dir, _Ranks(0, others_ok=False))
    (run_dir / RUN_DIR_TOKEN).write_text("token-rank0-wrote")  # as rank 0 left it while rank 2 reads
    check_run_dir_shared(run_dir, _Ranks(2, others_ok=True, sent="token-rank0-wrote"))
    elsewhere = tmp_path / "node2-local"
    elsewhere.mkdir()
    with pytest.raises(RunDirNotShared, match=rf"rank 2 does not see the run directory {elsewhere}"):
        check_run_dir_shared(elsewhere, _Ranks(2, others_ok=True, sent="token-rank0-wrote"))


def test_gpu_correct_run_dir_check_where_training_starts(tmp_path):
    """`SharedRunDir`, the callback run_training adds: on a job of several ranks it runs the check at setup,
    where the process group exists (here on one stand-in rank whose peers fail: the run stops before any step);
    one process has nothing to check."""
    from train.run import RunDirNotShared, SharedRunDir

    callback = SharedRunDir(tmp_path / "run")
    callback.setup(SimpleNamespace(world_size=1, strategy=None), None, "fit")
    assert not (tmp_path / "run").exists()
    with pytest.raises(RunDirNotShared):
        callback.setup(SimpleNamespace(world_size=2, strategy=_Ranks(0, others_ok=False)), None, "fit")
