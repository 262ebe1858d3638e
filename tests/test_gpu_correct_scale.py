"""What a GPU run costs and how it is divided, checked on a CPU: the tied tensors' dtype per precision, the per-rank
memory table of docs/scale.md against the function that sizes it, FSDP2's mixed-precision policy and which units
stay gathered, Muon's Newton–Schulz divided among ranks (2 processes == 1, bit for bit), the GPU recipe of the
presets, and bench/gpu_check.py's scale / paths parts at tiny shapes (so the GPU check cannot rot)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT, compose_config


def _tiny_head(tiny_target, cfg=None):
    from heads.registry import build_head
    from inference_eval.model import tied_target

    tied, args, parts = tied_target(tiny_target)
    head = build_head(cfg or {"type": "mtp"}, args, tied)
    head.reset_parameters(0, parts.first_input_norm)
    return head


# ---- tied tensors and the memory table -----------------------------------------------------------------------
@pytest.mark.unit
def test_gpu_correct_tied_tensors_train_in_the_compute_dtype(tiny_target):
    """bf16 on a GPU under bf16 precision, fp32 under 32-true and on the CPU; online training's tensors (the loaded
    target's own) are left alone."""
    from train.memory import tied_dtype
    from train.run import place_tied

    assert tied_dtype("bf16-mixed", "cuda:0") == torch.bfloat16
    assert tied_dtype("bf16-true", "cuda") == torch.bfloat16
    assert tied_dtype("16-mixed", "cuda") == torch.float16
    assert tied_dtype("32-true", "cuda") == torch.float32
    assert tied_dtype("bf16-mixed", "cpu") == torch.float32

    def trainer(precision, device):
        return SimpleNamespace(precision=precision, strategy=SimpleNamespace(root_device=torch.device(device)))

    head = _tiny_head(tiny_target)
    params = {n: p.dtype for n, p in head.named_parameters()}
    assert place_tied(head, trainer("bf16-mixed", "cpu")) == torch.float32
    assert head.tied.embed.dtype == torch.float32
    assert place_tied(head, trainer("bf16-mixed", "meta"), shared_with_target=True) == torch.float32
    assert head.tied.lm_head.dtype == torch.float32
    # "meta" stands for the GPU: any device that is not the CPU
    assert place_tied(head, trainer("bf16-mixed", "meta")) == torch.bfloat16
    assert {b.dtype for b in head.tied.buffers()} == {torch.bfloat16}
    assert {n: p.dtype for n, p in head.named_parameters()} == params  # the trained tensors stay fp32


@pytest.mark.unit
def test_gpu_correct_memory_table_is_the_sizing_functions_output():
    """docs/scale.md's per-rank memory rows are `python -m train.memory`'s lines, and the sizing moves with what it
    sizes: fp32 tied tensors double their 4.2 GB at 70B, sharding divides the optimizer states by the ranks."""
    from train.memory import LLAMA_70B, TABLE_HEADER, rank_memory, table_rows

    doc = (ROOT / "docs" / "scale.md").read_text()
    assert TABLE_HEADER in doc
    for row in table_rows():
        assert row in doc, f"docs/scale.md lacks (run python -m train.memory):\n{row}"
    bf16 = rank_memory(LLAMA_70B, {"type": "mtp"}, "8xh100_fsdp", 8, 16384, 1)
    fp32 = rank_memory(LLAMA_70B, {"type": "mtp"}, "8xh100_fsdp", 8, 16384, 1, precision="32-true")
    assert bf16["tied"] == pytest.approx(2 * 128256 * 8192 * 2 / 1e9, rel=1e-3)  # 4.2 GB
    assert fp32["tied"] == pytest.approx(2 * bf16["tied"], rel=1e-3)
    assert bf16["params_b"] == pytest.approx(0.99, abs=0.01)
    ddp = rank_memory(LLAMA_70B, {"type": "mtp"}, "ddp", 8, 16384, 1)
    assert ddp["optimizer"] == pytest.approx(8 * bf16["optimizer"], rel=1e-9)
    adamw = rank_memory(LLAMA_70B, {"type": "mtp"}, "ddp", 8, 16384, 1, optimizer="adamw")
    assert adamw["optimizer"] == pytest.approx(8 * bf16["params_b"], rel=1e-6)  # two fp32 moments per parameter


# ---- FSDP2 ---------------------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("precision, mixed, expected", [("bf16-mixed", True, torch.bfloat16),
                                                        ("32-true", True, None), ("bf16-mixed", False, None)])
def test_gpu_correct_fsdp_units_policy_and_resharding(tiny_target, precision, mixed, expected):
    """bf16 gathers with fp32 reduction under bf16 precision; a layer reused at every depth (mtp, one module) stays
    gathered through the step, a module per depth (mtp3) reshards after its forward as the preset says."""
    from train.module import DraftHeadModule
    from train.strategies import fsdp_unit_settings, unroll_calls

    strategy = SimpleNamespace(reshard_after_forward=True, mixed_precision=mixed,
                               precision_plugin=SimpleNamespace(precision=precision))
    one = DraftHeadModule(_tiny_head(tiny_target), depth=3)
    three = DraftHeadModule(_tiny_head(tiny_target, {"type": "mtp", "num_modules": 3}), depth=3)
    assert unroll_calls(one.head, one.head.decoder(1), 3) == 3
    assert [unroll_calls(three.head, three.head.decoder(d), 3) for d in (1, 2, 3)] == [1, 1, 1]
    for module, layer_reshard in ((one, False), (three, True)):
        settings = fsdp_unit_settings(module, strategy, 3)
        assert settings[-1][0] is module and settings[-1][1]["reshard_after_forward"] is True
        layers = settings[:-1]
        assert layers and all(getattr(m, "fsdp_unit", False) for m, _ in layers)
        assert {kw["reshard_after_forward"] for _, kw in layers} == {layer_reshard}
        for _, kw in settings:
            policy = kw.get("mp_policy")
            if expected is None:
                assert policy is None
            else:
                assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    depth1 = fsdp_unit_settings(DraftHeadModule(_tiny_head(tiny_target), depth=1), strategy, 1)
    assert all(kw["reshard_after_forward"] for _, kw in depth1)


def _torchrun(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={port}", *args]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_gpu_correct_fsdp_bf16_policy_trains_on_two_processes(tiny_overrides, tmp_path):
    """The FSDP2 preset under bf16-mixed on 2 CPU processes (gloo): the policy is applied (bf16 gathers, fp32 shards
    and reduction), the loss falls over 8 steps, and both ranks see the same loss — the bf16 path trains."""
    from experiments.stages import run_precompute

    record = tmp_path / "record"
    record.mkdir()
    overrides = [*tiny_overrides, "trainer=8xh100_fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
                 "trainer.precision=bf16-mixed", "trainer.max_steps=8", "trainer.max_epochs=-1",
                 "train.data.batch_tokens=256", "train.module.lr=3e-3", "train.module.warmup_steps=0",
                 "train.module.depth=2", "train.engine_validation.enabled=false",
                 "+trainer.callbacks=[{_target_: tests.test_multiprocess.RecordLosses, out_dir: " + str(record) + "}]"]
    run_precompute(compose_config(overrides))
    _torchrun(["-m", "scripts.train", *overrides])
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["sharding"]["dtensors"] == ranks[0]["sharding"]["params"] > 0
    losses = [[s["loss"] for s in r["steps"]] for r in ranks]
    assert len(losses[0]) == 8 and all(math.isfinite(x) for x in losses[0] + losses[1])
    assert sum(losses[0][-3:]) + sum(losses[1][-3:]) < sum(losses[0][:3]) + sum(losses[1][:3])


# ---- Muon divided among ranks -----------------------------------------------------------------------------
@pytest.mark.unit
def test_gpu_correct_newton_schulz_owners_balance_the_flops():
    from train.optim import ns_flops, ns_owners

    shapes = [(512, 1792), (512, 512), (128, 512), (128, 512), (512, 512), (1792, 512), (1792, 512), (512, 1792)]
    owners = ns_owners(shapes, 2)
    assert owners == ns_owners(list(shapes), 2) and set(owners) == {0, 1}
    load = [sum(ns_flops(s) for s, o in zip(shapes, owners) if o == r) for r in range(2)]
    assert max(load) / sum(load) < 0.6  # about half each, where every-rank-computes-everything is 1.0
    assert ns_owners(shapes, 1) == [0] * len(shapes)
    assert ns_flops((4, 8), steps=1) == 4 * 16 * 8 + 2 * 64


def _muon_steps(params, divide: bool, steps: int = 3):
    from train.optim import MuonAdamW

    opt = MuonAdamW([{"params": params, "muon": True, "weight_decay": 0.1}], lr=2e-2, divide_ns=divide)
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        grads = [torch.randn(tuple(p.shape), generator=g) for p in params]
        for p, grad in zip(params, grads):
            if hasattr(p, "device_mesh"):  # a DTensor: this rank's rows of the same gradient
                from torch.distributed.tensor import distribute_tensor

                grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = grad
        opt.step()


SHAPES = [(24, 40), (40, 24), (16, 16), (8, 32), (32, 8)]


def _start_params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _muon_worker(out: str) -> None:
    """torchrun worker: plain tensors (DDP) and row-sharded DTensors (FSDP2), Newton–Schulz divided over the ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    plain = [torch.nn.Parameter(t) for t in _start_params()]
    _muon_steps(plain, divide=True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)) for t in _start_params()]
    _muon_steps(sharded, divide=True)
    result = {"plain": [p.detach() for p in plain], "sharded": [p.detach().full_tensor() for p in sharded]}
    torch.save(result, Path(out) / f"rank{dist.get_rank()}.pt")
    from scripts.runtime import close_process_group

    close_process_group()  # both ranks leave together: one tearing gloo down alone can abort the other at exit


def test_gpu_correct_muon_divided_among_ranks_equals_one_process(tmp_path):
    """Each of 2 processes orthogonalises its share of the matrices, one all-gather hands out the rest: after 3 steps
    every rank's matrices equal one process's bit for bit (fp32), plain (DDP) and row-sharded (FSDP2) alike."""
    _torchrun(["-m", "tests.test_gpu_correct_scale", "muon", str(tmp_path)])
    one = [torch.nn.Parameter(t) for t in _start_params()]
    _muon_steps(one, divide=False)
    start = _start_params()
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for kind in ("plain", "sharded"):
            for a, b, s in zip(got[kind], one, start):
                torch.testing.assert_close(a, b.detach(), atol=0, rtol=0)
                assert (a - s).abs().max() > 1e-3  # it moved


# ---- the GPU recipe ---------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("preset", ["gpu", "ddp", "8xh100", "8xh100_fsdp", "8xh100_zero3"])
def test_gpu_correct_gpu_presets_train_16k_tokens_with_the_sqrt_lr(preset):
    """Every GPU preset trains ≥ 16k tokens per rank with lr = 1e-3 × sqrt(tokens / 512); the CPU preset keeps
    the measured 512 and 1e-3."""
    cfg = compose_config([f"trainer={preset}", "progress=false"])
    tokens, lr = cfg.train.data.batch_tokens, cfg.train.module.lr
    assert tokens >= 16384
    assert lr == pytest.approx(1e-3 * math.sqrt(tokens / 512), rel=1e-3)
    cpu = compose_config(["trainer=cpu", "progress=false"])
    assert (cpu.train.data.batch_tokens, cpu.train.module.lr) == (512, 1e-3)


# ---- bench/gpu_check.py ----------------------------------------------------------------------------------
@pytest.mark.unit
def test_gpu_correct_gpu_check_arithmetic():
    from bench.gpu_scale import TINY, attention_memory_gb, mfu, train_flops_per_token
    from train.memory import LLAMA_70B, meta_head

    assert mfu(1e9, 989e3) == pytest.approx(1.0)
    # depth 3, 8 × 2,048 rows at 70B: K and V 2 × 8 × 8 × 2,048 × 128 × 2 B × 3, mask 2,048 × 6,144, lse 8 × 64 × 2,048 × 4
    expected = (2 * 8 * 8 * 2048 * 128 * 2 * 3 + 2048 * 3 * 2048 + 8 * 64 * 2048 * 4) / 1e9
    assert attention_memory_gb(LLAMA_70B, 8, 2048, 3) == pytest.approx(expected)
    head = meta_head(TINY, {"type": "mtp", "num_modules": 3})
    n = sum(p.numel() for p in head.parameters())
    assert train_flops_per_token(TINY, head, 3) == pytest.approx(3 * (6 * n / 3 + 6 * TINY.vocab * TINY.hidden))


def test_gpu_correct_gpu_check_scale_runs_on_cpu(tmp_path):
    """`--part scale --quick --device cpu`: every head × optimizer × batch shape trains, the SDPA kernel is named
    (not the math fallback), and one JSON lands in $OUT."""
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--part", "scale", "--quick", "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((tmp_path / "gpu_check_scale.json").read_text())
    assert out["ok"] and not out["errors"]
    assert len(out["train"]) == 2 * 2 * 3
    for key, v in out["train"].items():
        assert v["tok_s"] > 0 and 0 < v["optimizer_share"] < 1 and not v["math_fallback"], key
        assert any("flash_attention" in k for k in v["sdpa"]), (key, v["sdpa"])
    assert out["attention_memory_gb"]["llama3-70b"]["packed16k"] > out["attention_memory_gb"]["llama3-70b"]["16x1024"]
    assert out["store_s_per_shard"] > 0 and out["precompute"]["tok_s"] > 0
    assert "gpu_check_scale ok=True" in proc.stdout


def test_gpu_correct_gpu_check_paths_dry_run(tmp_path):
    """`--part paths --dry-run`: one torchrun command per preset at world size 1, 30 steps, validation every 10."""
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--part", "paths", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "torch.distributed.run" in line]
    assert [line.split()[0] for line in lines] == ["8xh100_fsdp", "ddp", "8xh100", "8xh100_zero3"]
    for line in lines:
        assert all(x in line for x in ("--nproc-per-node=1", "trainer.devices=1", "trainer.max_steps=30",
                                       "train.engine_validation.every_n_steps=10"))


if __name__ == "__main__":  # torchrun workers of the tests above
    if sys.argv[1] == "muon":
        _muon_worker(sys.argv[2])
