"""What every entry point shares (scripts/__init__.py): the CPU thread policy and run directories that
do not collide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from scripts.runtime import apply_threads, resolve_threads
from tests.conftest import ROOT


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
