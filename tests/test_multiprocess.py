"""Training launched the standard way on several real processes (issue 29): `torchrun --nproc-per-node 2
-m scripts.train …` on this CPU (gloo), for the DDP and FSDP presets. Each run is checked against one
process computing the same global batches by hand — the mean of the two ranks' losses, one clipped
AdamW step on its gradient, the module's own schedule — step by step: every rank's loss, the saved head.
Lightning runs both strategies on CPU (FSDP with `device_id=None`); nothing is mocked."""

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
from omegaconf import OmegaConf
from safetensors.torch import load_file

from experiments.stages import run_precompute
from tests.conftest import ROOT, compose_config

STEPS = 10


class RecordLosses(L.Callback):
    """Per rank: the loss of every optimizer step and the rows of its batch, written at the end."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.steps, self.sharding, self.vals = out_dir, [], {}, []

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        params = list(pl_module.head.parameters())
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        self.sharding = {"dtensors": sum(isinstance(p, DTensor) for p in params), "params": len(params),
                         "local_numel": local, "numel": sum(p.numel() for p in params)}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rows = [ids[valid].tolist() for ids, valid in zip(batch["input_ids"], batch["valid"])]
        self.steps.append({"step": trainer.global_step, "loss": float(outputs["loss"]), "rows": rows})

    def on_validation_end(self, trainer, pl_module) -> None:
        sampler = trainer.val_dataloaders.batch_sampler
        self.vals.append({"step": trainer.global_step, "loss": float(trainer.callback_metrics["val/loss"]),
                          "real": sampler.real_batches, "batches": len(sampler)})

    def on_train_end(self, trainer, pl_module) -> None:
        out = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
        out.write_text(json.dumps({"world_size": trainer.world_size, "steps": self.steps, "sharding": self.sharding,
                                   "vals": self.vals}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(module: str, overrides: list[str], nproc: int = 2, timeout: int = 600,
             extra: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", *(extra or []), "-m", module, *overrides]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{_first_failure(proc.stdout + proc.stderr)}\n{proc.stderr[-3000:]}"
    return proc


def _first_failure(text: str, width: int = 4000) -> str:
    """The output from its first sign of a failing rank (a traceback, a C++ abort's message): torchrun's
    summary at the end names only the signal, and a tail cut to a few thousand characters loses the cause."""
    marks = [i for i in (text.find(m) for m in ("Traceback", "terminate called", "what():", "Aborted", "ERROR"))
             if i >= 0]
    start = max(0, min(marks) - 500) if marks else max(0, len(text) - width)
    return "[first failure]\n" + text[start:start + width]


class DeepSpeedStrategy:  # stands for Lightning's (which refuses a CPU accelerator) where the module asks
    pass                    # which strategy runs it: `optimizer: auto` is AdamW under DeepSpeed


def _reference(cfg, store_dir: Path, init_dir: Path, steps: int, deepspeed: bool = False):
    """One process, the same global batches: rank r's batch of step s is TokenBudgetBatches(…, 2, r)'s
    s-th; loss = mean over ranks of compute_loss (each normalised by its own tokens, as each rank's is),
    then the module's own optimizer (the one it resolves under DeepSpeed when `deepspeed`), schedule and
    Lightning's clipping. Returns the losses, the final state, and val_loss(step): the whole held-out
    split's per-token loss after that step."""
    from artifacts.checkpoint import load_native
    from inference_eval.model import tied_target
    from train.data import FeatureDataModule
    from train.module import DraftHeadModule

    L.seed_everything(int(cfg.seed))  # as run_training seeds each rank (a block head's anchors read the seed)
    tied, args, _ = tied_target(cfg.target.path)
    head = load_native(init_dir, tied, args)
    module = DraftHeadModule(head, **OmegaConf.to_container(cfg.train.module, resolve=True))
    dm = FeatureDataModule(cfg.store_dir, None, **OmegaConf.to_container(cfg.train.data, resolve=True))
    dm.setup("fit")

    class _Trainer:
        estimated_stepping_batches = steps
        global_step, world_size = 0, 1
        strategy = DeepSpeedStrategy() if deepspeed else None

    module.trainer = _Trainer()  # the schedule's horizon is all configure_optimizers reads (and deep_from_step the step)
    opt_cfg = module.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    def batches(rank: int):
        loader = dm._loader(dm.train_idx, shuffle=True, num_replicas=2, rank=rank)
        for epoch in range(steps):  # Lightning's set_epoch at every epoch start
            loader.batch_sampler.set_epoch(epoch)
            yield from loader

    ranks = [batches(r) for r in range(2)]
    losses, states = [], []
    params = [p for p in head.parameters() if p.requires_grad]
    for step in range(steps):
        module.trainer.global_step = step
        if step and step == module.deep_start_step():  # 0: every depth from the first step, no copy
            module.start_deeper_modules(opt)
        outs = [module.compute_loss(next(it))["loss"] for it in ranks]
        opt.zero_grad()
        (sum(outs) / 2).backward()
        if module.clip_scope() == "module":  # each per-depth module by its own norm
            module._clip_each_module(opt, float(cfg.trainer.gradient_clip_val), "norm")
        else:
            torch.nn.utils.clip_grad_norm_(params, float(cfg.trainer.gradient_clip_val))
        opt.step()
        sched.step()
        losses.append(tuple(float(o.detach()) for o in outs))
        states.append({k: v.detach().clone() for k, v in head.state_dict().items()})

    def val_loss(step: int) -> float:
        """The held-out split's per-token loss after `step` steps, one process, every batch."""
        head.load_state_dict(states[step - 1])
        total = n = 0.0
        module.eval()  # as Lightning's validation loop runs it (a block head's held-out anchors are fixed)
        with torch.no_grad():
            for b in dm._loader(dm.val_idx, shuffle=False):
                out = module.compute_loss(b)
                total += float(out["loss"]) * float(out["n_tokens"])
                n += float(out["n_tokens"])
        module.train()
        return total / n

    return losses, states[-1], val_loss


def _overrides(base: list[str], preset: str, record: Path, steps: int) -> list[str]:
    out = [*base, f"trainer={preset}", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
           f"trainer.max_steps={steps}", "trainer.max_epochs=-1", "train.data.batch_tokens=256",
           # a constant LR: a run configured for fewer steps then has the same schedule (resume below)
           "train.module.warmup_steps=0", "train.module.min_lr_ratio=1.0", "train.data.val_fraction=0.25",
           # Muon's iteration in float32: bf16 (`auto` on a CPU with bf16 instructions) rounds the ranks' last-bit
           # differences in the averaged gradients apart, and the comparison is to 1e-5
           "train.module.ns_dtype=float32",
           "+trainer.callbacks=[{_target_: tests.test_multiprocess.RecordLosses, out_dir: " + str(record) + "}]"]
    return [*out, "trainer.strategy=ddp"] if preset == "ddp" else out


def _engine_val_steps(run_dir: Path) -> list[int]:
    """Steps at which engine validation logged τ (the csv logger's metrics.csv, written by rank 0)."""
    import csv

    steps = set()
    for f in run_dir.rglob("metrics.csv"):
        for row in csv.DictReader(f.open()):
            if row.get("engine_val/tau"):
                steps.add(int(row["step"]))
    return sorted(steps)


def _ranks(record: Path) -> list[dict]:
    return [json.loads((record / f"rank{r}.json").read_text()) for r in range(2)]


# a small block drafter: one draft layer, blocks of 4, 8 anchors per row
DFLASH = ["head=dflash", "head.num_layers=1", "head.block_size=4", "train.module.block.anchors=8"]


@pytest.mark.parametrize("preset, head", [("ddp", ["head=mtp3", "train.module.deep_from_step=3"]), ("8xh100_fsdp", []),
                                          ("8xh100_fsdp", ["head=eagle3", "head.draft_vocab_size=64",
                                                           "train.module.depth=2"]),
                                          ("8xh100_fsdp", ["head.num_modules=2", "train.module.depth=2",
                                                           "train.module.deep_from_step=3"]),
                                          ("ddp", DFLASH), ("8xh100_fsdp", DFLASH)],
                         ids=["ddp-mtp3", "fsdp", "fsdp-eagle3-depth2", "fsdp-deep-from-step-3", "ddp-dflash",
                              "fsdp-dflash"])
def test_torchrun_two_processes_train_like_one(preset, head, tiny_overrides, tmp_path):
    """10 optimizer steps on 2 processes: every rank's loss at every step and the saved head equal one
    process computing the same global batches; engine validation at step 5 (rank 0 scores a whole copy
    gathered from the shards, the other rank waits) finishes — a deadlock fails on the timeout; a run
    stopped at step 4 and resumed from its checkpoint continues the same curve to step 10. The EAGLE-3
    case trains depth 2 (the training-time test through the sharded layer) and its own lm_head. The DDP case trains
    the default head (`mtp3`: 3 modules, each clipped by its own norm, depths 2–3 joining at step 3), and a `dflash`
    block head (its anchors drawn from each row's tokens, so one process draws what the two ranks drew). One trains a
    2-module head whose depth 2 joins at step 3 (`deep_from_step`: before it, each rank runs depth 2 at weight 0
    where one process skips it; at it, module 2 becomes a copy of module 1), resumed at step 4 after the copy."""
    full, part, resumed = (tmp_path / n for n in ("full", "part", "resumed"))
    for d in (full, part, resumed):
        d.mkdir()
    common = [*tiny_overrides, *head, "train.engine_validation.every_n_steps=5", "train.engine_validation.prompts=1",
              "train.engine_validation.conversations=1", "train.engine_validation.max_new_tokens=4"]
    cfg = compose_config(_overrides(common, preset, full, STEPS))
    run_precompute(cfg)
    proc = torchrun("scripts.train", _overrides(common, preset, full, STEPS), timeout=600)
    ranks = _ranks(full)
    assert [r["world_size"] for r in ranks] == [2, 2], proc.stdout[-2000:]
    # optimizer=auto: Muon for mtp and dflash (under FSDP2: each matrix's update gathered whole), AdamW for eagle3
    adamw = "head=eagle3" in head
    assert f"train.module.optimizer=auto: {'adamw' if adamw else 'muon'}" in proc.stdout + proc.stderr
    # the new store's sha256 checked once for both ranks (rank 0 hashed, rank 1 found its stamp)
    assert (proc.stdout + proc.stderr).count(" verified in ") == 1
    assert [len(r["steps"]) for r in ranks] == [STEPS, STEPS]
    sharding = ranks[0]["sharding"]
    if preset == "ddp":
        assert sharding["dtensors"] == 0 and sharding["local_numel"] == sharding["numel"]
    else:  # every parameter a shard: each rank holds about half of the head
        assert sharding["dtensors"] == sharding["params"] > 0, sharding
        assert sharding["local_numel"] <= sharding["numel"] // 2 + sharding["params"], sharding
    # engine validation ran at step 5 and at the end, on rank 0, and the run went on
    assert _engine_val_steps(Path(cfg.run_dir)) == [5, STEPS]
    ref_losses, ref_state, ref_val = _reference(cfg, Path(cfg.store_dir), Path(cfg.train.untrained_dir), STEPS)
    assert len({round(a, 6) for a, _ in ref_losses}) == STEPS  # the curve moves: the comparison is not vacuous
    # validation is sharded (each rank its batches, padding run but not counted) and reduced: both ranks
    # report the whole split's per-token loss, which one process computes over every batch
    vals = [r["vals"] for r in ranks]
    assert vals[0] and [v["step"] for v in vals[0]] == [v["step"] for v in vals[1]]
    # 3 held-out batches: rank 0 scores 2, rank 1 scores 1 and runs its first again, uncounted
    assert [(v[0]["real"], v[0]["batches"]) for v in vals] == [(2, 2), (1, 2)], vals
    for v0, v1 in zip(*vals):
        assert v0["loss"] == pytest.approx(v1["loss"], rel=1e-9)
        assert v0["loss"] == pytest.approx(ref_val(v0["step"]), rel=1e-5), v0
    for s in range(STEPS):
        for r in range(2):
            assert ranks[r]["steps"][s]["loss"] == pytest.approx(ref_losses[s][r], rel=1e-5, abs=1e-6), (s, r)
    saved = load_file(Path(cfg.head_dir) / "model.safetensors")
    assert saved.keys() == ref_state.keys()
    for k, v in ref_state.items():
        torch.testing.assert_close(saved[k], v, atol=1e-5, rtol=1e-4, msg=k)

    # stop at step 4, resume from last.ckpt to step 10: the same losses as the uninterrupted run
    split = [f"run_dir={tmp_path / 'run_part'}", f"store_dir={cfg.store_dir}", "train.engine_validation.enabled=false"]
    torchrun("scripts.train", [*_overrides(common, preset, part, 4), *split])
    torchrun("scripts.train", [*_overrides(common, preset, resumed, STEPS), *split, "train.resume=last"])
    first, rest = _ranks(part), _ranks(resumed)
    for r in range(2):
        losses = [s["loss"] for s in first[r]["steps"]] + [s["loss"] for s in rest[r]["steps"]]
        assert losses == pytest.approx([ref_losses[s][r] for s in range(STEPS)], rel=1e-5, abs=1e-6), r
    resumed_head = load_file(tmp_path / "run_part" / "head" / "model.safetensors")
    for k, v in ref_state.items():
        torch.testing.assert_close(resumed_head[k], v, atol=1e-5, rtol=1e-4, msg=k)


def test_torchrun_precompute_two_ranks_equal_one(tiny_overrides, tiny_target, tmp_path):
    """`torchrun --nproc-per-node 2 -m scripts.precompute`: each rank takes RANK / WORLD_SIZE from the
    launcher, the last to finish merges; the merged store holds the single-process store's samples
    (ids, masks; states up to batched-matmul rounding)."""
    from data.store import FeatureStore
    from tests.numerics import assert_same_states

    settings = [*tiny_overrides, "precompute.shard_tokens=300"]
    ref_dir, _ = run_precompute(compose_config([*settings, f"store_dir={tmp_path / 'single'}"]))
    store_dir = tmp_path / "ranked"
    torchrun("scripts.precompute", [*settings, f"store_dir={store_dir}"], timeout=300)
    store, ref = FeatureStore(store_dir), FeatureStore(ref_dir)
    assert store.manifest["complete"] and store.manifest["ranks"]["world_size"] == 2
    assert {s["file"].split("/shards/")[0] for s in store.manifest["shards"]} == {"ranks/rank-00000", "ranks/rank-00001"}

    def by_id(st):
        ids = [sid for shard in st.manifest["shards"] for sid in shard["sample_ids"]]
        return {sid: st[i] for i, sid in enumerate(ids)}

    got, want = by_id(store), by_id(ref)
    assert sorted(got) == sorted(want) and len(got) == len(ref)
    for sid, sample in got.items():
        assert torch.equal(sample["input_ids"], want[sid]["input_ids"])
        assert torch.equal(sample["loss_mask"], want[sid]["loss_mask"])
        assert_same_states(sample["hidden"], want[sid]["hidden"], tiny_target)


def test_torchrun_two_nodes_train_like_one(tiny_overrides, tmp_path):
    """Two "nodes" of one process each on localhost (`torchrun --nnodes 2 --node-rank 0|1`,
    `trainer.num_nodes=2`): global ranks 0 and 1 train the same steps as one process on the same
    global batches, and node 0's rank 0 saves that head."""
    record = tmp_path / "ranks"
    record.mkdir()
    overrides = [*_overrides(tiny_overrides, "ddp", record, STEPS), "trainer.devices=1", "trainer.num_nodes=2",
                 "train.engine_validation.enabled=false"]
    cfg = compose_config(overrides)
    run_precompute(cfg)
    port = _free_port()
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                               "-m", "scripts.train", *overrides],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    ranks = _ranks(record)
    assert [r["world_size"] for r in ranks] == [2, 2]
    ref_losses, ref_state, ref_val = _reference(cfg, Path(cfg.store_dir), Path(cfg.train.untrained_dir), STEPS)
    for s in range(STEPS):
        for r in range(2):
            assert ranks[r]["steps"][s]["loss"] == pytest.approx(ref_losses[s][r], rel=1e-5, abs=1e-6), (s, r)
    saved = load_file(Path(cfg.head_dir) / "model.safetensors")
    for k, v in ref_state.items():
        torch.testing.assert_close(saved[k], v, atol=1e-5, rtol=1e-4, msg=k)


# ---- DeepSpeed ZeRO-2/3: the preset's config through deepspeed.initialize --------------------------------
RESUME_AT = 4  # the DeepSpeed job saves its checkpoint after this step; a second job resumes from it
VAL_AT = 5  # and runs the product's in-loop engine validation after this one


class _StubTrainer:
    """What EngineValidation reads of Lightning's Trainer, for a loop that Lightning does not run (DeepSpeed on
    CPU): the step, the ranks, the data module; no logger (the figures come back from `run`)."""

    logger = None

    def __init__(self, rank: int, world_size: int, dm, root: str) -> None:
        self.global_rank, self.world_size, self.is_global_zero = rank, world_size, rank == 0
        self.datamodule, self.default_root_dir, self.global_step = dm, root, 0


def deepspeed_job(overrides: list[str], steps: int, out_dir: str, resume: str | None = None) -> None:
    """One rank of a torchrun job (`python -m tests.test_multiprocess deepspeed …`): the preset's
    DeepSpeed config (fp32 here: this CPU has no fast bf16) through `deepspeed.initialize` — Lightning's
    DeepSpeedStrategy refuses a CPU accelerator — on the module's own optimizer and loss, this rank's
    batches as Lightning would give them. As Lightning's DeepSpeed strategy does: the engine's own
    (collective) `save_checkpoint` after step RESUME_AT, and the product's in-loop engine validation
    (train/validation.py EngineValidation: every rank gathers the head, rank 0 scores it while the other waits
    on the validation's own barrier) after step VAL_AT; at the end the save path of train/run.py
    (`whole_head_state`). `resume`: a checkpoint directory: load it (`load_checkpoint`) and run the steps
    after RESUME_AT on the same batches."""
    import deepspeed
    from hydra.utils import instantiate

    from artifacts.checkpoint import load_native
    from inference_eval.model import tied_target
    from train.data import FeatureDataModule
    from train.module import DraftHeadModule
    from experiments.stages import validation_settings
    from tests.test_strategies import _Loss
    from train.strategies import whole_head_state
    from train.validation import EngineValidation

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a 90 s JIT build, not needed on gloo
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    cfg = compose_config(overrides)
    L.seed_everything(int(cfg.seed))  # as run_training seeds each rank (a block head's anchors read the seed)
    preset = instantiate(cfg.trainer.strategy).config
    tied, args, _ = tied_target(cfg.target.path)
    head = load_native(cfg.train.untrained_dir, tied, args)
    module = DraftHeadModule(head, **OmegaConf.to_container(cfg.train.module, resolve=True))

    class _Trainer:
        estimated_stepping_batches = steps
        global_step = 0  # set at each step: the block drafters draw their anchors from it, as under Lightning
        strategy = DeepSpeedStrategy()

    module.trainer = _Trainer()
    module.setup("fit")  # the checks Lightning's DeepSpeed strategy would run
    opt = module.configure_optimizers()["optimizer"]
    config = {**preset, "gradient_clipping": float(cfg.trainer.gradient_clip_val), "gradient_accumulation_steps": 1}
    # the tiny head's tensors are all below the preset's persistence threshold (kept whole): partition all
    if config["zero_optimization"]["stage"] == 3:
        config["zero_optimization"] = {**config["zero_optimization"], "stage3_param_persistence_threshold": 0}
    engine, ds_opt, _, _ = deepspeed.initialize(model=_Loss(module), optimizer=opt, config=config,
                                                model_parameters=[p for p in head.parameters() if p.requires_grad],
                                                dist_init_required=False)
    dm = FeatureDataModule(cfg.store_dir, None, **OmegaConf.to_container(cfg.train.data, resolve=True))
    dm.setup("fit")
    loader = dm._loader(dm.train_idx, shuffle=True, num_replicas=2, rank=rank)
    trainer = _StubTrainer(rank, 2, dm, out_dir)
    validation = EngineValidation(validation_settings(cfg, cfg.target.path))
    validation.setup(trainer, module, "fit")  # the waiting ranks' gloo group (its timeout: wait_timeout_s)

    def batches():
        for epoch in range(steps):
            loader.batch_sampler.set_epoch(epoch)
            yield from loader

    first = 0
    if resume is not None:
        path, client = engine.load_checkpoint(resume, tag=f"step{RESUME_AT}")
        assert path is not None, f"no DeepSpeed checkpoint under {resume}"
        first = int(client["global_step"])
    losses, validated = [], []
    for step, b in zip(range(steps), batches()):
        if step < first:  # the batches before the checkpoint: drawn, not trained (the sampler's order)
            continue
        module.trainer.global_step = step
        loss = engine(b)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        trainer.global_step = step + 1
        if trainer.global_step == RESUME_AT and resume is None:
            engine.save_checkpoint(str(Path(out_dir) / "ckpt"), tag=f"step{RESUME_AT}",
                                   client_state={"global_step": RESUME_AT})
        if trainer.global_step == VAL_AT and resume is None:
            validated.append(validation.run(trainer, module))  # a deadlock: the barrier's timeout fails the job

    class _Rank:
        is_global_zero = rank == 0

    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in head.parameters() if p.requires_grad)
    state = whole_head_state(_Rank(), head)  # None when the head is whole on every rank (ZeRO-2): save it as is
    if state is None and rank == 0:
        state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    record = {"losses": losses, "first_step": first, "stage": engine.zero_optimization_stage(),
              "partitioned": partitioned, "optimizer": type(ds_opt).__name__, "optimizer_kind": type(opt).__name__,
              "validated": validated}
    name = "resumed" if resume is not None else "full"
    Path(out_dir, f"{name}-rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(Path(out_dir) / f"{name}-head.safetensors"))
    # every rank leaves together and tears its groups down (the validation's gloo group too): a rank that
    # exits while the other still saves can abort in a C++ destructor ("terminate called without an active
    # exception", seen once in `make test`), and torchrun then fails the job
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("preset, head", [("8xh100", ["head=mtp3"]), ("8xh100_zero3", []),
                                          ("8xh100_zero3", ["head=eagle3", "head.draft_vocab_size=64",
                                                            "train.module.depth=2"]),
                                          ("8xh100", DFLASH), ("8xh100_zero3", DFLASH)],
                         ids=["zero2-mtp3", "zero3-mtp", "zero3-eagle3-depth2", "zero2-dflash", "zero3-dflash"])
def test_torchrun_deepspeed_two_processes_train_like_one(preset, head, tiny_overrides, tmp_path):
    """ZeRO-2 and ZeRO-3 on 2 processes (the preset's DeepSpeed config through deepspeed.initialize, as
    Lightning's strategy would build it; Lightning itself refuses a CPU accelerator): under ZeRO-3 every
    parameter partitioned; 10 steps whose losses equal one process on the same global batches, and the
    head gathered for the save (every rank together) equal to that process's head. EAGLE-3 uses its own
    lm_head outside a module call: the KL must still see the whole matrix. In-loop engine validation after
    step 5 finishes on the gathered head (a deadlock fails on the barrier's 120 s timeout) and agrees with the
    training forward (strict, float32); a job resumed from DeepSpeed's own checkpoint of step 4 continues the
    same curve to the same head. ZeRO-2 trains the default head (`mtp3`), whose `auto` settings are DeepSpeed's:
    AdamW, every depth from the first step, the whole gradient clipped (DeepSpeed's own clipping); both stages also
    train a `dflash` block head (its context projection and norms called as modules, so ZeRO-3 gathers them)."""
    out = tmp_path / "deepspeed"
    out.mkdir()
    overrides = [*_overrides([*tiny_overrides, *head], preset, out, STEPS), "trainer.accelerator=cpu",
                 "train.engine_validation.prompts=1", "train.engine_validation.conversations=1",
                 "train.engine_validation.max_new_tokens=4", "train.engine_validation.wait_timeout_s=120",
                 f"run_dir={tmp_path / 'run'}"]
    cfg = compose_config(overrides)
    run_precompute(cfg)
    from artifacts.checkpoint import save_native
    from train.data import FeatureDataModule
    from tests.helpers import init_head_of

    dm = FeatureDataModule(cfg.store_dir, None, **OmegaConf.to_container(cfg.train.data, resolve=True))
    dm.setup("fit")  # the EAGLE-3 draft vocabulary comes from the training split, as in run_training
    save_native(init_head_of(cfg, Path(cfg.target.path), dm), cfg.train.untrained_dir)
    torchrun("tests.test_multiprocess", ["deepspeed", json.dumps(overrides), str(STEPS), str(out)], timeout=600)
    ranks = [json.loads((out / f"full-rank{r}.json").read_text()) for r in range(2)]
    stage = 3 if preset == "8xh100_zero3" else 2
    assert all(r["stage"] == stage and r["partitioned"] == (stage == 3) for r in ranks), ranks
    ref_losses, ref_state, _ = _reference(cfg, Path(cfg.store_dir), Path(cfg.train.untrained_dir), STEPS,
                                          deepspeed=True)
    assert all(r["optimizer_kind"] == "AdamW" for r in ranks), ranks  # optimizer=auto under DeepSpeed
    assert len({round(a, 6) for a, _ in ref_losses}) == STEPS  # the curve moves: the comparison is not vacuous
    for r in range(2):
        assert ranks[r]["losses"] == pytest.approx([a[r] for a in ref_losses], rel=1e-5, abs=1e-6), r
    saved = load_file(out / "full-head.safetensors")
    assert saved.keys() == ref_state.keys()
    for k, v in ref_state.items():
        torch.testing.assert_close(saved[k], v, atol=1e-5, rtol=1e-4, msg=k)
    # validation: rank 0 scored the gathered head (τ ≥ 1, the engine's top-1 = the training forward's), rank 1 waited
    (val0,), (val1,) = ranks[0]["validated"], ranks[1]["validated"]
    assert val1 is None and val0["step"] == VAL_AT and val0["engine_val/tau"] >= 1.0, val0
    assert val0["engine_val/acc_d1"] == pytest.approx(val0["engine_val/train_acc_d1"], abs=1e-6), val0

    # resume from DeepSpeed's checkpoint of step 4 (partitioned optimizer state under ZeRO-3) to step 10
    torchrun("tests.test_multiprocess", ["deepspeed", json.dumps(overrides), str(STEPS), str(out), str(out / "ckpt")],
             timeout=600)
    rest = [json.loads((out / f"resumed-rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        assert rest[r]["first_step"] == RESUME_AT
        assert rest[r]["losses"] == pytest.approx([a[r] for a in ref_losses[RESUME_AT:]], rel=1e-5, abs=1e-6), r
    resumed = load_file(out / "resumed-head.safetensors")
    for k, v in ref_state.items():
        torch.testing.assert_close(resumed[k], v, atol=1e-5, rtol=1e-4, msg=k)


if __name__ == "__main__" and sys.argv[1:2] == ["deepspeed"]:
    deepspeed_job(json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
