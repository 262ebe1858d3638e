"""Per-rank time of one Muon step (train/optim.py) with its Newton–Schulz divided among the ranks, at 1 and 2 ranks
(gloo on CPU, NCCL on GPUs): the matrices of one 8B-shaped `mtp` decoder layer (`--quick`: 1/8 of each side).

Last line: `optim_bench ranks1_step_s=<a> ranks2_step_s=<b> speedup=<a/b>`."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shapes(quick: bool) -> list[tuple[int, int]]:
    h, f, kv = 4096, 14336, 1024  # Llama-3-8B: hidden, MLP, the 8 KV heads × 128
    full = [(h, 2 * h), (h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]  # eh_proj, q, k, v, o, gate, up, down
    return [(a // 8, b // 8) for a, b in full] if quick else full


def worker(quick: bool, steps: int) -> None:
    import torch.distributed as dist

    from train.optim import MuonAdamW

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes(quick)]
    opt = MuonAdamW([{"params": params, "muon": True}], lr=1e-3, divide_ns=True)
    times = []
    for i in range(steps + 1):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(f"step_s={sum(times[1:]) / steps:.4f}", flush=True)
    dist.barrier()  # both ranks leave together: one tearing gloo down alone can abort the other at exit
    dist.destroy_process_group()


def run(ranks: int, quick: bool, steps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
           f"--master-port={port}", str(Path(__file__).resolve()), "--worker", f"--steps={steps}",
           *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return float(next(l for l in proc.stdout.splitlines() if l.startswith("step_s=")).split("=")[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="matrices 1/8 of each side (< 1 min on a CPU)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.quick, args.steps)
        return
    one, two = run(1, args.quick, args.steps), run(2, args.quick, args.steps)
    print(f"optim_bench ranks1_step_s={one:.4f} ranks2_step_s={two:.4f} speedup={one / two:.2f}")


if __name__ == "__main__":
    main()
