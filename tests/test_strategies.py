"""Trainer presets (conf/trainer/): each composes and instantiates; DDP really trains on two CPU
processes with disjoint data per rank; DeepSpeed ZeRO-2 with the 8xh100 preset's config trains the
head on CPU through DeepSpeed itself (Lightning's DeepSpeed strategy runs on CUDA only)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict
from safetensors.torch import load_file

from artifacts.checkpoint import load_native
from artifacts.export import probe_logits
from inference_eval.model import tied_target
from experiments.stages import run_precompute, run_training
from tests.conftest import ROOT, compose_config
from train.data import TokenBudgetBatches
from train.run import resolve_precision


class RecordBatches(L.Callback):
    """Writes, per rank, the samples (token ids) of every train batch with its epoch, and the head's
    final weights — the ranks of a spawned or forked DDP run are only observable through files."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.seen = out_dir, []

    def on_train_start(self, trainer, pl_module) -> None:
        ddp = trainer.strategy.model  # the DistributedDataParallel wrapper
        tied = {id(t) for t in pl_module.head.tied.buffers()}
        self.ddp = {"ignored": sorted(ddp.parameters_to_ignore),
                    "tied_buffers_synced": sum(id(b) in tied for b in ddp.modules_buffers),
                    "buffers_synced": len(ddp.modules_buffers)}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rows = [ids[valid].tolist() for ids, valid in zip(batch["input_ids"], batch["valid"])]
        self.seen.append({"epoch": trainer.current_epoch, "rows": rows})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1:  # the first step ran on the initial weights: its batch and loss
            torch.save({"batch": batch, "loss": outputs["loss"].detach()},
                       Path(self.out_dir) / f"rank{trainer.global_rank}_first.pt")

    def on_train_end(self, trainer, pl_module) -> None:
        rank = trainer.global_rank
        torch.save(pl_module.head.state_dict(), Path(self.out_dir) / f"rank{rank}.pt")
        record = {"world_size": trainer.world_size, "batches": self.seen, "ddp": getattr(self, "ddp", None)}
        (Path(self.out_dir) / f"rank{rank}.json").write_text(json.dumps(record))


# ---- presets ---------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("preset, accelerator, devices, strategy", [
    ("cpu", "cpu", 1, "SingleDeviceStrategy"),
    ("gpu", "gpu", 1, "SingleDeviceStrategy"),
    ("ddp", "auto", "auto", "DDPStrategy"),
    ("8xh100", "gpu", 8, "AtomicDeepSpeedStrategy"),
])
def test_preset_composes_and_instantiates(preset, accelerator, devices, strategy):
    cfg = compose_config([f"trainer={preset}", "progress=false"])
    assert (cfg.trainer.accelerator, cfg.trainer.devices) == (accelerator, devices)
    assert cfg.trainer.precision == ("auto" if preset == "cpu" else "bf16-mixed")
    assert cfg.trainer.gradient_clip_val == 1.0 and cfg.trainer.max_epochs == 2  # shared, from cpu.yaml
    # this machine has no GPU: the GPU presets are instantiated with the accelerator overridden
    precision = resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    trainer = instantiate(cfg.trainer, accelerator="cpu", devices=1, logger=False, precision=precision)
    assert type(trainer.strategy).__name__ == strategy and trainer.precision == precision


@pytest.mark.unit
@pytest.mark.parametrize("fast_bf16,expected", [(True, "bf16-mixed"), (False, "32-true")])
def test_cpu_precision_auto_follows_the_cpu(monkeypatch, fast_bf16, expected):
    """`auto` on CPU: bf16 autocast only where the CPU multiplies bf16 natively; explicit values stay."""
    import train.run as run

    monkeypatch.setattr(run, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert resolve_precision("auto", "cpu") == expected
    assert resolve_precision("bf16-mixed", "cpu") == "bf16-mixed" and resolve_precision("32-true", "gpu") == "32-true"
    assert resolve_precision("auto", "gpu") == "bf16-mixed"


@pytest.mark.unit
def test_ddp_preset_strategy_is_overridable():
    cfg = compose_config(["trainer=ddp", "trainer.strategy=ddp_spawn", "trainer.accelerator=cpu", "trainer.devices=2",
                          "progress=false"])
    trainer = instantiate(cfg.trainer, logger=False)
    assert trainer.strategy._start_method == "spawn" and trainer.world_size == 2
    assert trainer.strategy._get_process_group_backend() == "gloo"


@pytest.mark.unit
def test_8xh100_preset_is_zero2_with_bf16_buffers():
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision
    from lightning.pytorch.strategies import DeepSpeedStrategy

    cfg = compose_config(["trainer=8xh100", "progress=false"])
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, DeepSpeedStrategy) and isinstance(strategy.config, dict)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 200_000_000
    assert strategy.config["data_types"] == {"buffer_dtype": "bf16"}
    # the whole Trainer builds without CUDA when the accelerator is CPU (8 devices: nothing starts yet)
    trainer = instantiate(cfg.trainer, accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, DeepSpeedStrategy) and trainer.world_size == 8
    assert isinstance(trainer.strategy.precision_plugin, DeepSpeedPrecision)


@pytest.mark.unit
def test_zero3_preset_shards_the_head_and_saves_it_whole():
    from lightning.pytorch.strategies import DeepSpeedStrategy

    cfg = compose_config(["trainer=8xh100_zero3", "progress=false"])
    strategy = instantiate(cfg.trainer.strategy)
    zero = strategy.config["zero_optimization"]
    assert isinstance(strategy, DeepSpeedStrategy) and zero["stage"] == 3
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert strategy.config["data_types"] == {"buffer_dtype": "bf16"}  # inherited from 8xh100
    trainer = instantiate(cfg.trainer, accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, DeepSpeedStrategy) and trainer.world_size == 8


@pytest.mark.unit
def test_fsdp_preset_is_fsdp2_over_every_rank():
    """The preset composes to FSDP2 (Lightning's ModelParallelStrategy, pure data parallel: the mesh is
    world × 1); the layers it shards carry `fsdp_unit`. tests/test_multiprocess.py trains with it."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from train.strategies import FSDP2Strategy

    cfg = compose_config(["trainer=8xh100_fsdp", "progress=false"])
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("gpu", 8, "bf16-mixed")
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDP2Strategy) and isinstance(strategy, ModelParallelStrategy)
    assert strategy._tensor_parallel_size == 1 and strategy._save_distributed_checkpoint is False


# ---- batches per rank ------------------------------------------------------------------------------
@pytest.mark.unit
def test_token_budget_batches_shard_over_ranks():
    lengths = [5, 90, 33, 12, 64, 64, 7, 100, 3, 50, 20, 70]
    whole = list(TokenBudgetBatches(lengths, batch_tokens=128, shuffle=True, seed=3))
    for world in (2, 3):
        shards = [TokenBudgetBatches(lengths, 128, True, 3, num_replicas=world, rank=r) for r in range(world)]
        per_rank = [list(s) for s in shards]
        assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == len(whole) // world
        assert all(len(s) == len(per_rank[0]) for s in shards)
        flat = [i for batches in per_rank for b in batches for i in b]
        assert len(flat) == len(set(flat))  # no sample on two ranks
        kept = whole[:len(whole) - len(whole) % world]  # the same batches as one process, cut to a multiple
        assert sorted(map(tuple, (b for batches in per_rank for b in batches))) == sorted(map(tuple, kept))
    with pytest.raises(ValueError):
        TokenBudgetBatches(lengths, 128, True, 3, num_replicas=2, rank=2)


@pytest.mark.unit
def test_validation_batches_shard_over_ranks_without_a_cut():
    """pad_to_equal (the held-out loader): every batch on exactly one rank, none cut; each rank runs
    the same number of batches (FSDP gathers in each forward), the missing ones a repeat of its own
    first batch, and `real_batches` says how many count."""
    lengths = [5, 90, 33, 12, 64, 64, 7, 100, 3, 50, 20, 70]
    whole = list(TokenBudgetBatches(lengths, batch_tokens=128, shuffle=False, seed=0))
    for world in (2, 3, 4, len(whole) + 1):
        shards = [TokenBudgetBatches(lengths, 128, False, 0, num_replicas=world, rank=r, pad_to_equal=True)
                  for r in range(world)]
        runs = [list(s) for s in shards]
        assert len({len(r) for r in runs}) == 1 and len(runs[0]) == -(-len(whole) // world)
        counted = [b for s, r in zip(shards, runs) for b in r[:s.real_batches]]
        assert sorted(map(tuple, counted)) == sorted(map(tuple, whole)), world  # each batch once, none lost
        for s, r in zip(shards, runs):
            assert all(b == (r[0] if s.real_batches else whole[0]) for b in r[s.real_batches:])
    assert len(whole) % 4 != 0  # so world 4 pads some ranks: the case is exercised


# ---- DDP on two CPU processes ----------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_ddp_trains_on_two_cpu_processes(strategy, tiny_overrides, tiny_target, tmp_path):
    """`ddp` itself would start pytest again per rank; spawn and fork run the same DDPStrategy.
    In both, run_training runs in the parent only, and Lightning loads rank 0's final weights into
    the parent's module after fit — the head run_training saves must be those weights."""
    record_dir = tmp_path / "ranks"
    record_dir.mkdir()
    cfg = compose_config([*tiny_overrides, "trainer=ddp", f"trainer.strategy={strategy}", "trainer.accelerator=cpu",
                          "trainer.devices=2", "trainer.precision=32-true", "trainer.max_epochs=2",
                          "train.data.batch_tokens=512"])
    with open_dict(cfg):
        cfg.trainer.callbacks = [{"_target_": "tests.test_strategies.RecordBatches", "out_dir": str(record_dir)}]
    run_precompute(cfg)
    head_dir, metrics = run_training(cfg)
    assert metrics["train/loss"] > 0 and "val/loss" in metrics

    ranks = [json.loads((record_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for epoch in range(2):
        rows = [[tuple(row) for b in r["batches"] if b["epoch"] == epoch for row in b["rows"]] for r in ranks]
        n_batches = [sum(b["epoch"] == epoch for b in r["batches"]) for r in ranks]
        assert n_batches == [2, 2]  # 5 batches of 2 samples per epoch, cut to 4 for 2 ranks
        assert not set(rows[0]) & set(rows[1]), f"epoch {epoch}: a sample went to both ranks"
    # the frozen target tensors are outside DDP's broadcasts; the head's own buffers are not
    for r in ranks:
        assert r["ddp"]["ignored"] == ["head.tied.embed", "head.tied.lm_head", "head.tied.norm_weight"], r["ddp"]
        assert r["ddp"]["tied_buffers_synced"] == 0 and r["ddp"]["buffers_synced"] > 0, r["ddp"]
    epochs = [[b["rows"] for b in ranks[0]["batches"] if b["epoch"] == e] for e in range(2)]
    assert epochs[0] != epochs[1]  # each epoch has its own order: set_epoch reaches the batch sampler

    # DDP kept the replicas equal, and the parent saved exactly that head
    weights = [torch.load(record_dir / f"rank{r}.pt") for r in range(2)]
    saved = load_file(Path(head_dir) / "model.safetensors")
    assert saved.keys() == weights[0].keys()
    for k in saved:
        assert torch.equal(weights[0][k], weights[1][k]) and torch.equal(saved[k], weights[0][k]), k
    tied, args, _ = tied_target(tiny_target)
    trained, untrained = load_native(head_dir, tied, args), load_native(cfg.train.untrained_dir, tied, args)
    assert not torch.equal(probe_logits(trained), probe_logits(untrained))

    # each rank's first loss is what one process computes on that batch with the initial weights
    from train.module import DraftHeadModule

    single = DraftHeadModule(untrained, **OmegaConf.to_container(cfg.train.module, resolve=True))
    losses = []
    for r in range(2):
        first = torch.load(record_dir / f"rank{r}_first.pt")
        losses.append(float(first["loss"]))
        assert torch.allclose(single.compute_loss(first["batch"])["loss"], first["loss"], rtol=1e-6, atol=0)
    assert losses[0] != losses[1]  # two different batches, so the comparison is not trivially one number


# ---- DeepSpeed ZeRO-2 on CPU -----------------------------------------------------------------------
class _Loss(torch.nn.Module):
    """What DeepSpeed's engine wraps: batch → loss, through the LightningModule's own forward (compute_loss)."""

    def __init__(self, module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch):
        return self.module(batch)["loss"]


def deepspeed_zero2_on_cpu(overrides: list[str], out_file: str) -> None:
    """Runs in its own interpreter (DeepSpeed and torch.distributed keep process-wide state, which a
    forked DDP test would inherit). Writes what the test asserts on to `out_file`."""
    import deepspeed

    from data.store import FeatureStore
    from train.data import collate
    from train.module import DraftHeadModule
    from tests.helpers import init_head_of

    cfg = compose_config(overrides)
    result: dict = {}
    # DeepSpeed JIT-compiles a shared-memory all-reduce kernel for CPU collectives the first time it
    # sets up communication (90 s on this machine); a single rank has nothing to all-reduce.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    preset = instantiate(cfg.trainer.strategy).config
    store = FeatureStore(cfg.store_dir)
    batches = [collate([store[i] for i in range(j, j + 2)]) for j in (0, 2, 4)]
    hp = dict(cfg.train.module)

    def train(engine_config: dict | None, to_dtype: torch.dtype | None) -> tuple[list[float], dict, str]:
        head = init_head_of(cfg, Path(cfg.target.path))
        module = DraftHeadModule(head, kl_chunk_size=hp["kl_chunk_size"], normed_regression=hp["normed_regression"])
        params = [p for p in head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-3)
        losses = []
        if engine_config is None:  # the reference: plain torch, Lightning's clipping
            for b in batches:
                loss = module.compute_loss(b)["loss"]
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                losses.append(float(loss))
            return losses, head.state_dict(), ""
        engine, ds_opt, _, _ = deepspeed.initialize(model=_Loss(module), optimizer=opt, model_parameters=params,
                                                    config=engine_config, dist_init_required=False)
        for b in batches:
            if to_dtype is not None:  # what Lightning's DeepSpeedPrecision does to a batch
                b = {k: v.to(to_dtype) if v.is_floating_point() else v for k, v in b.items()}
            loss = engine(b)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        kind = f"stage{engine.zero_optimization_stage()}:{type(ds_opt).__name__}:{head.tied.embed.dtype}"
        if to_dtype is None:  # the preset's strategy saving this engine's checkpoints
            result["checkpoint"] = deepspeed_checkpoint_saves(instantiate(cfg.trainer.strategy), engine,
                                                              Path(out_file).parent / "ckpt" / "last.ckpt")
        return losses, head.state_dict(), kind

    # what Lightning adds to the preset's config for gradient_clip_val=1.0 and the precision
    common = {**preset, "gradient_clipping": 1.0, "gradient_accumulation_steps": 1}
    ref_losses, ref_state, _ = train(None, None)
    fp32_losses, fp32_state, fp32_kind = train(common, None)
    bf16_losses, bf16_state, bf16_kind = train({**common, "bf16": {"enabled": True}}, torch.bfloat16)
    init = init_head_of(cfg, Path(cfg.target.path)).state_dict()
    result.update(
        ref_losses=ref_losses, fp32_losses=fp32_losses, bf16_losses=bf16_losses, fp32_kind=fp32_kind,
        bf16_kind=bf16_kind,
        fp32_max_diff=max(float((fp32_state[k] - ref_state[k]).abs().max()) for k in ref_state),
        bf16_dtypes=sorted({str(v.dtype) for v in bf16_state.values()}),
        # mean absolute differences over all weights: bf16 vs the fp32 reference, and how far the
        # reference moved from the initial weights
        bf16_error=mean_abs_diff(bf16_state, ref_state), ref_moved=mean_abs_diff(ref_state, init),
    )
    # last: Lightning's launcher rewrites the rank variables of the environment
    try:  # Lightning's own DeepSpeed strategy, on this CPU machine
        run_training(compose_config([*overrides, "trainer.accelerator=cpu", "trainer.devices=1"]))
        result["lightning"] = "trained"
    except RuntimeError as e:
        result["lightning"] = str(e)
    Path(out_file).write_text(json.dumps(result))


def deepspeed_checkpoint_saves(strategy, engine, path: Path) -> dict:
    """Three saves of `engine` through the preset's strategy to one path, the second on a disk that fills
    after the first file: what was raised, and what stood at `path` and beside it after each."""
    import errno

    strategy.model, strategy.parallel_devices = engine, [torch.device("cpu")]  # what Lightning's setup leaves there
    real_save, seen = torch.save, []

    def step_of() -> int | None:
        _, client = engine.load_checkpoint(str(path), tag="checkpoint", load_module_only=True,
                                           load_optimizer_states=False, load_lr_scheduler_states=False)
        return client.get("step") if client else None

    def full_disk(obj, f, *args, **kwargs):
        seen.append(str(f))
        if len(seen) > 1:  # a prefix of the second file, then no space left
            Path(f).write_bytes(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    out: dict = {}
    strategy.save_checkpoint({"step": 1}, path)
    out["after_first"] = step_of()
    torch.save = full_disk
    try:
        strategy.save_checkpoint({"step": 2}, path)
        out["second_error"] = None
    except Exception as err:
        out["second_error"] = f"{type(err).__name__}: {err}"
    finally:
        torch.save = real_save
    out["files_written_in_second"] = seen
    out["after_second"] = step_of()
    out["beside"] = sorted(p.name for p in path.parent.iterdir())
    strategy.save_checkpoint({"step": 3}, path)
    out["after_third"] = step_of()
    out["final_files"] = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    return out


def mean_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    total = sum(float((a[k].double() - b[k].double()).abs().sum()) for k in b)
    return total / sum(v.numel() for v in b.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_zero2_trains_head_on_cpu(tiny_overrides, tmp_path):
    """The 8xh100 preset's ZeRO-2 config through `deepspeed.initialize` on CPU (one rank, gloo):
    in fp32 three steps equal plain AdamW with the same clipping bit for bit; with the preset's
    bf16 (weights and, via `data_types.buffer_dtype`, the tied target tensors) they stay close.
    Lightning's DeepSpeedStrategy itself refuses a CPU accelerator, which is asserted too: if a
    Lightning upgrade lifts that, the preset can be run here for real."""
    overrides = [*tiny_overrides, "trainer=8xh100", "trainer.max_epochs=1", "train.data.batch_tokens=512"]
    run_precompute(compose_config(overrides))
    out = tmp_path / "deepspeed.json"
    code = f"from tests.test_strategies import deepspeed_zero2_on_cpu as f; f({overrides!r}, {str(out)!r})"
    env = {**os.environ, "WANDB_MODE": "disabled", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "only supported on CUDA GPUs" in r["lightning"], r["lightning"]
    assert r["fp32_kind"] == "stage2:DeepSpeedZeroOptimizer:torch.float32"
    assert r["fp32_losses"] == r["ref_losses"] and r["fp32_max_diff"] == 0.0
    assert r["bf16_kind"] == "stage2:DeepSpeedZeroOptimizer:torch.bfloat16"
    assert r["bf16_dtypes"] == ["torch.bfloat16"]
    assert r["bf16_losses"] == pytest.approx(r["ref_losses"], rel=1e-2)
    assert r["ref_moved"] > 10 * r["bf16_error"] > 0, r  # trained, and along the fp32 path
    # the preset's checkpoints: a save that fails mid-way (a full disk after its first file, under the temp
    # directory) raises DiskFull naming the checkpoint, leaves the previous one whole and nothing beside it
    c = r["checkpoint"]
    assert c["after_first"] == 1 and c["after_third"] == 3, c
    assert c["second_error"].startswith("DiskFull: ") and "last.ckpt: cannot be written: the disk is full" in c[
        "second_error"], c
    assert len(c["files_written_in_second"]) == 2 and all("/.last.ckpt." in f for f in c["files_written_in_second"]), c
    assert c["after_second"] == 1 and c["beside"] == ["last.ckpt"], c
    assert any(f.startswith("checkpoint/") and f.endswith("model_states.pt") for f in c["final_files"]), c


def test_ranks_wait_for_rank0s_validation_without_a_collective_timeout(tiny_overrides, monkeypatch):
    """Rank 0 validates for longer than the process group's timeout (3 s here; 30 min with NCCL): the
    other rank must wait on the validation's own long-timeout barrier, not in the next step's
    gradient all-reduce, where it would time out and end the job."""
    import time

    from train.validation import EngineValidation

    def slow(self, head, store, val_idx, step=0):
        time.sleep(6)
        return {"engine_val/tau": 1.0}

    monkeypatch.setattr(EngineValidation, "evaluate", slow)  # fork: both ranks inherit it
    cfg = compose_config([*tiny_overrides, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
                          "trainer.precision=32-true", "trainer.max_steps=3", "trainer.max_epochs=5",
                          "train.data.batch_tokens=512", "train.engine_validation.every_n_steps=1"])
    with open_dict(cfg):
        cfg.trainer.strategy = {"_target_": "lightning.pytorch.strategies.DDPStrategy", "start_method": "fork",
                                "timeout": {"_target_": "datetime.timedelta", "seconds": 3}}
    run_precompute(cfg)
    t0 = time.perf_counter()
    head_dir, metrics = run_training(cfg)
    assert time.perf_counter() - t0 > 3 * 6  # validations at steps 1, 2, 3 (the end adds none): all waited for
    assert (Path(head_dir) / "model.safetensors").exists() and metrics["train/loss"] > 0


@pytest.mark.unit
def test_loader_workers_follow_the_device_and_the_ranks(monkeypatch):
    """train.data.num_workers=auto: no workers on CPU (the step uses the cores), on a GPU up to 4 from the
    rank's share of the node's cores; a number is taken as it is; a negative one is refused."""
    from train.data import loader_workers

    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 32)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert loader_workers("auto", on_cuda=False) == 0
    assert loader_workers("auto", on_cuda=True) == 3  # 32 cores / 8 ranks, one kept for the step
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert loader_workers("auto", on_cuda=True) == 4
    assert loader_workers(2, on_cuda=False) == 2 and loader_workers("0", on_cuda=True) == 0
    with pytest.raises(ValueError, match="num_workers=-1"):
        loader_workers(-1, on_cuda=True)
