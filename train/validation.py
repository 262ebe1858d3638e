"""Validation through the engine (docs/design.md §5, §7): the numbers a run reports are the numbers the
engine that serves the head gets.

`EngineValidation` is a Lightning callback that, every `every_n_steps` optimizer steps and when
training ends, on global rank 0:

1. **teacher-forced, in the engine** — recomputes the target's states for a few held-out
   conversations with the engine's target (`inference_eval.model`), runs the current head through the
   engine's own proposer with the true tokens forced (inference_eval/scoring.py: what the draft loop
   computes once the target accepted up to row i) and scores every depth d = 1..D with the
   training loss (regression + KL) and top-1 agreement. The same rows are scored by the *training*
   forward (the unroll over the stored features). Both are logged (`engine_val/…`, `engine_val/train_…`)
   with their gap. They are one computation on two code paths: with a float32 target and store they
   agree to float rounding (tests/test_validation.py); with a bf16 target and store, states differ by
   bf16 rounding (batched vs single-sequence kernels) and the documented tolerance is
   `tolerance` (default 0.02) in top-1 agreement. A larger gap is a bug (store, engine or unroll), not
   noise: with `strict` (default: on for a float32 target) it fails the run (`EngineTrainingGap`, with
   the figures of every depth over tolerance); otherwise it is logged as a warning.
2. **speculative generation, in the engine** — greedy speculative decoding (and, with
   `temperature > 0`, sampled decoding with rejection sampling: `engine_val/tau_sampled`) of held-out prompts
   (each conversation up to its first assistant token) with k drafts: τ and α_d (a per-position plot
   goes to wandb, or to a PNG beside the run), next to the *simulated* τ = 1 + Σ_d Π_{j≤d} acc_j from
   teacher-forced agreement along the target's own greedy continuation of the same prompts.

Cost is bounded by the number of conversations/prompts, rows per conversation and new tokens. The prompts
decoded are written to `<run_dir>/engine_val/prompts.jsonl` (token ids), which `evaluate.dataset=jsonl
evaluate.prompts_path=…` reads back: the same prompts, evaluated apart from training.

`engine: vllm` (targets larger than one device): step 2 runs in real vLLM instead — rank 0 exports the
current head to `<run_dir>/engine_val/vllm/head/<format>` (the format vLLM serves it in), one vLLM process
(inference_eval/vllm_spec.py, `evaluate.vllm`'s settings: tensor_parallel_size over the node's GPUs,
gpu_memory_utilization, the environment) decodes the prompts greedily with it, and τ and α_d come from
vLLM's own counters (`engine_val/tau`, `engine_val/alpha_d`, `engine_val/vllm_accepted_d`,
`engine_val/vllm_drafts`). spechead's engine does not load the target, so step 1 keeps only what the stored
(or online) states give: the training forward's scores on the held-out rows (`engine_val/train_acc_d`,
`engine_val/train_kl_d`, `engine_val/loss` from them); no simulated τ, no lossless check (vLLM's output is
not compared with plain decoding here; evaluation does that). Every rank frees its cached device memory
before rank 0 starts vLLM; the other ranks wait on the gloo barrier below, not in a training collective.

Failures. A result that can only come from a bug raises a `ValidationBug` (an AssertionError carrying
its figures in `.figures`) out of the callback and so out of `trainer.fit`: speculative output that
differs from plain greedy output with a float32 target (`LosslessViolation`: the engine is not
lossless), and, in strict mode, an engine-vs-training gap above tolerance (`EngineTrainingGap`).
Running out of memory (torch's OOM errors, MemoryError, an allocator's "can't allocate") is not retried:
it would fail again at every interval (a target larger than the device), so it ends the run with
`ValidationOutOfMemory`, whose message names the settings that fit it (`engine: vllm` with tensor
parallelism, the target on the CPU, fewer prompts). Transient failures — OSError (a missing or unreadable
file, a full disk) — do not make any number wrong: they are logged with their traceback, reported as
`engine_val/failed = 1`, and training goes on. Any other exception is an error in the validation or engine
code (the same code that serves the head) and propagates.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from core.files import atomic_write_bytes
from core.progress import Progress
from heads.dflash import block_unroll
from heads.unroll import unroll
from inference_eval.engine import engine_generate
from inference_eval.scoring import block_states, scored_rows, select_rows, simulated_tau, teacher_forced_states
from inference_eval.speculative import GREEDY, Sampling
from inference_eval.vllm_backend import VllmSettings
from train.block_loss import row_terms
from train.losses import depth_terms
from train.strategies import whole_head

log = logging.getLogger(__name__)


class ValidationBug(AssertionError):
    """A validation result that only a bug can produce. `figures` holds the numbers of the message."""

    def __init__(self, message: str, **figures: Any) -> None:
        super().__init__(message)
        self.figures = figures


class LosslessViolation(ValidationBug):
    """Float32 speculative greedy output differs from plain greedy output."""


class EngineTrainingGap(ValidationBug):
    """Strict mode: the engine's teacher-forced top-1 agreement differs from the training forward's on
    the same rows by more than the tolerance."""


def check_engine(engine: str, temperature: float) -> None:
    """train.engine_validation.engine: spechead or vllm, and vllm decodes greedily (ValueError naming the fix)."""
    if engine not in ("spechead", "vllm"):
        raise ValueError(f"train.engine_validation.engine={engine!r}: expected spechead or vllm")
    if engine == "vllm" and temperature > 0:
        raise ValueError("train.engine_validation.engine=vllm decodes greedily: set "
                         "train.engine_validation.temperature=0 (or engine=spechead for sampled τ)")


class ValidationOutOfMemory(RuntimeError):
    """Validation ran out of memory: it would at every interval, so the run ends with the settings to change."""


def is_oom(err: BaseException) -> bool:
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    msg = str(err)
    return isinstance(err, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def is_transient(err: BaseException) -> bool:
    """Failures that leave every number right and may not recur: the file system (not out of memory:
    `is_oom`, which would recur at every interval)."""
    return isinstance(err, OSError) and not isinstance(err, ValidationBug)


def oom_advice(err: BaseException, step: int, engine: str, dtype: str, device: str) -> str:
    """What to set when validation ran out of memory."""
    if engine == "vllm":
        fix = ("raise evaluate.vllm.tensor_parallel_size (the target over more GPUs), or lower "
               "evaluate.vllm.gpu_memory_utilization if training's memory is in the way, or "
               "train.engine_validation.prompts / max_new_tokens")
    else:
        fix = ("set train.engine_validation.engine=vllm (the target sharded by vLLM over the node's GPUs: "
               "evaluate.vllm.tensor_parallel_size), or target.device=cpu (slow), or fewer "
               "train.engine_validation.prompts / conversations / max_new_tokens")
    return (f"engine validation at step {step} ran out of memory ({type(err).__name__}: {str(err)[:300]}) with "
            f"the {dtype} target on {device} ({engine}'s engine); it would again at every interval: {fix}; or "
            f"train.engine_validation.enabled=false")


@dataclass
class DepthScores:
    """Sums over scored rows at one depth (divide by n for means)."""

    reg: float = 0.0
    kl: float = 0.0
    agree: int = 0
    n: int = 0

    def add(self, other: "DepthScores") -> None:
        self.reg, self.kl, self.agree, self.n = (self.reg + other.reg, self.kl + other.kl,
                                                 self.agree + other.agree, self.n + other.n)

    @property
    def acc(self) -> float:
        return self.agree / max(self.n, 1)


def score_rows(head, preds: torch.Tensor, teacher: torch.Tensor, depth: int, normed: bool = True,
               chunk: int = 512) -> DepthScores:
    """Loss parts and agreement of head states `preds` [N, H] against the target states `teacher` [N, H]
    that they estimate (H_{i+d}), exactly as the training loss defines them."""
    if preds.shape[0] == 0:
        return DepthScores()
    reg, kl, agree = depth_terms(head, preds.to(head.dtype), teacher.to(head.dtype), depth, normed, chunk)
    return DepthScores(float(reg), float(kl), int(agree), preds.shape[0])


@torch.no_grad()
def engine_teacher_forced(target, head, ids: torch.Tensor, loss_mask: torch.Tensor, depth: int,
                          rows: list[int], normed: bool = True) -> list[DepthScores]:
    """Per-depth scores of `head` on one conversation through the engine (inference_eval/scoring.py:
    the target recomputes H and the aux layers, the head runs its cached draft path with the true
    tokens forced), with the training loss's parts."""
    if getattr(head, "block", False):  # the engine's block pass anchored after each row
        h, hidden = block_states(target, head, ids, rows)
        return block_scores(head, h, ids.to(h.device), hidden[0], loss_mask, rows, depth)
    states, hidden = teacher_forced_states(target, head, ids, depth, rows)
    scores = []
    for d in range(1, depth + 1):
        keep = scored_rows(loss_mask, rows, d)
        preds = torch.stack([states[d][j] for j in keep]) if keep else hidden.new_zeros(0, head.args.hidden_size)
        teacher = hidden[0, [rows[j] + d for j in keep]]
        scores.append(score_rows(head, preds, teacher, d, normed))
    return scores


@torch.no_grad()
def training_forward_scores(head, sample: dict[str, torch.Tensor], depth: int, rows: list[int],
                            normed: bool = True) -> list[DepthScores]:
    """The same scores from the training forward: the unroll over the stored features."""
    dev = head.tied.embed.device
    hidden = sample["hidden"][None].to(dev).float()
    aux = sample["aux_hidden"][None].to(dev).float() if "aux_hidden" in sample else None
    if getattr(head, "block", False):  # the training forward's blocks at the same anchors
        ids = sample["input_ids"].to(dev)
        h = block_unroll(head, aux.to(head.dtype), ids[None], torch.tensor([[i + 1 for i in rows]], device=dev))[0]
        return block_scores(head, h, ids, hidden[0], sample["loss_mask"], rows, depth)
    outs = unroll(head, hidden.to(head.dtype), sample["input_ids"][None].to(dev), depth,
                  aux.to(head.dtype) if aux is not None else None)
    scores = []
    for d in range(1, depth + 1):
        keep = [rows[j] for j in scored_rows(sample["loss_mask"], rows, d)]
        scores.append(score_rows(head, outs[d - 1][0, keep], hidden[0, [i + d for i in keep]], d, normed))
    return scores


def block_scores(head, h: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor, loss_mask: torch.Tensor,
                 rows: list[int], depth: int) -> list[DepthScores]:
    """Per-draft-position scores of a block head's rows `h` [len(rows), R, H], the block of row i anchored at i + 1:
    draft d (row first_row + d - 1, after the token t_{i+d}) against the target's states H_{i+d} of `hidden` [T, H]
    — train/block_loss.py's KL and agreement."""
    scores = []
    for d in range(1, depth + 1):
        keep = scored_rows(loss_mask, rows, d)
        if not keep:
            scores.append(DepthScores())
            continue
        at = torch.tensor([rows[j] + d for j in keep], device=h.device)
        kl, _, _, agree, _, _ = row_terms(head, h[keep, head.first_row + d - 1].to(head.dtype), ids[at],
                                       hidden[at].to(head.dtype))
        scores.append(DepthScores(0.0, float(kl.sum()), int(agree.sum()), len(keep)))
    return scores


def first_reply_prompt(ids: torch.Tensor, loss_mask: torch.Tensor) -> list[int] | None:
    """A conversation up to its first assistant (loss) token: a held-out prompt."""
    idx = torch.nonzero(loss_mask).flatten()
    return ids[: int(idx[0])].tolist() if idx.numel() and int(idx[0]) > 0 else None


def engine_decode(target, head, prompts: list[list[int]], k: int, max_new_tokens: int, stop_ids: set[int],
                  sampling: Sampling | list[Sampling] = GREEDY):
    """The prompts through the paged engine (inference_eval/engine/) together, as serving runs them:
    (outputs in prompt order, the engine's stats). `head` None: plain decoding."""
    return engine_generate(target, prompts, max_new_tokens, proposer=head, k=k, stop_ids=stop_ids,
                           sampling=sampling, max_batch=len(prompts))


@torch.no_grad()
def speculative_scores(target, head, prompts: list[list[int]], k: int, max_new_tokens: int,
                       stop_ids: set[int], normed: bool = True, strict: bool = True) -> dict[str, Any]:
    """Real τ / α_d of greedy speculative decoding in the paged engine (all prompts in one batch), and
    the simulated τ from teacher-forced agreement along the target's own greedy continuation.

    Speculative and plain greedy outputs must be equal token for token. In float32 (`strict`) a
    difference raises `LosslessViolation`; in bf16 the target's k+1-token verification and its 1-token
    decode round differently, so a near-tie can flip the argmax and the outputs part: those prompts are
    counted (`mismatches`) and logged, not raised."""
    conts, _ = engine_decode(target, None, prompts, 1, max_new_tokens, stop_ids)
    outs, eng = engine_decode(target, head, prompts, k, max_new_tokens, stop_ids)
    mismatches = 0
    for n, (p, out, cont) in enumerate(zip(prompts, outs, conts)):
        if out == cont:
            continue
        at = next((i for i, (a, b) in enumerate(zip(out, cont)) if a != b), min(len(out), len(cont)))
        spec_tok = out[at] if at < len(out) else None  # None: that output ended here
        plain_tok = cont[at] if at < len(cont) else None
        msg = (f"speculative output differs from plain greedy output at new token {at} of a {len(p)}-token "
               f"prompt (prompt {n} of {len(prompts)}, k={k}): speculative token {spec_tok} vs plain "
               f"{plain_tok}; {len(out)} vs {len(cont)} new tokens")
        if strict:
            raise LosslessViolation(msg + " (float32): the engine is not lossless", prompt=n,
                                    prompt_tokens=len(p), new_token=at, speculative_token=spec_tok,
                                    plain_token=plain_tok, speculative_len=len(out), plain_len=len(cont), k=k)
        log.warning("%s (%s target: a near-tie rounded differently in verification and decode)", msg,
                    target.dtype)
        mismatches += 1
    sim, accs = simulated_tau(target, head, prompts, conts, k)
    return {"tau": eng.stats.tau, "alpha": eng.stats.alpha, "sim_tau": sim, "tf_acc": accs,
            "new_tokens": sum(len(o) for o in outs), "seconds": eng.stats.seconds, "mismatches": mismatches}


@dataclass(frozen=True)
class EngineValidationSettings:
    """What `EngineValidation` does and with which target: `train.engine_validation` (conf/config.yaml)
    plus the loss weights of `train.module`, typed and fixed for the run (experiments/stages.py `validation_settings`)."""

    target_dir: Path
    target_dtype: str = "float32"
    every_n_steps: int | None = None  # None: only when training ends
    conversations: int = 4  # held-out conversations scored teacher-forced
    max_rows: int | None = 64  # rows per conversation
    depth: int = 3
    prompts: int = 4  # held-out prompts decoded speculatively
    k: int = 3
    max_new_tokens: int = 32
    tolerance: float = 0.02  # engine-vs-training top-1 gap allowed (bf16)
    normed_regression: bool = True
    w_hidden: float = 1.0
    w_kl: float = 1.0
    depth_decay: float = 0.8
    plot_dir: Path | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    strict: bool | None = None  # None: on for a float32 target
    device: str | None = "auto"  # target.device: where the engine runs (auto: rank 0's GPU, else the CPU)
    wait_timeout_s: float = 86400.0
    progress_log_s: float | None = None  # seconds between progress lines (core/progress.py); None: none
    engine: str = "spechead"  # spechead | vllm: where step 2 decodes (module docstring)
    vllm: VllmSettings | None = None  # engine=vllm: evaluate.vllm's (inference_eval/vllm_spec.py VLLMRunner)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_dir", Path(self.target_dir))
        check_engine(self.engine, self.temperature)
        if self.plot_dir is not None:
            object.__setattr__(self, "plot_dir", Path(self.plot_dir))

    @property
    def is_strict(self) -> bool:
        return str(self.target_dtype) == "float32" if self.strict is None else bool(self.strict)


def on_device(head: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The head with every parameter and buffer on `device`, where the engine scores it: the head itself when
    all of it is there, else a float32 copy there (tied target tensors included) — the head training updates
    stays where training runs it. Every tensor is looked at, not one: a copy gathered from shards
    (train/strategies.py `whole_head`) has its own parameters but the training head's tied tensors, so
    where one of them is says nothing of the others."""
    if all(t.device == device for t in (*head.parameters(), *head.buffers())):
        return head
    return copy.deepcopy(head).to(device, torch.float32)


class EngineValidation(L.Callback):
    def __init__(self, settings: EngineValidationSettings, target=None) -> None:
        """`target`: an engine model of the target already loaded (online training's), used instead of
        loading another copy."""
        self.s = settings
        self.strict = settings.is_strict  # an engine-vs-training gap above tolerance fails the run
        self._target, self._stops = target, None
        self._runner = None  # engine=vllm: the vLLM job runner, made at the first validation
        self._last_step = -1
        self.results: list[dict[str, float]] = []
        # Validation runs on global rank 0 only. The other ranks must not wait for it inside the next
        # training collective (NCCL's timeout, 30 min by default, would end the job while rank 0 decodes):
        # they wait on a barrier of a gloo group of their own whose timeout is `wait_timeout_s`.
        self._wait_group = None

    # ---- hooks --------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        import torch.distributed as dist

        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized() and self._wait_group is None:
            from datetime import timedelta

            # collective: every rank creates the group here, at the same point of the fit
            self._wait_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.s.wait_timeout_s))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.s.every_n_steps and step > 0 and step % self.s.every_n_steps == 0 and step != self._last_step:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step != self._last_step:
            self.run(trainer, pl_module)

    # ---- the work -----------------------------------------------------------------------------------
    def engine_device(self) -> torch.device:
        """Where the engine scores the head, so where all of the scored head must be: the target's device
        (spechead's engine: the target loaded, or `target.device` — auto: this rank's GPU, else the CPU), the
        CPU for engine=vllm (the head is exported from there)."""
        if self.s.engine != "spechead":
            return torch.device("cpu")
        if self._target is not None:
            return self._target.device
        from inference_eval.targets import resolve_target_device

        device = resolve_target_device(self.s.device)
        if device.type == "cuda" and device.index is None:  # `cuda`: the current GPU, as tensors name it
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _load(self):
        if self._target is None:
            from data.store import DTYPES
            from inference_eval.model import LlamaForCausalLM

            self._target = LlamaForCausalLM.from_pretrained(self.s.target_dir, dtype=DTYPES[self.s.target_dtype],
                                                            device=self.engine_device())
        return self._target

    def _stop_ids(self) -> set[int]:
        if self._stops is None:
            from transformers import AutoTokenizer

            from data.prompts import stop_token_ids

            self._stops = stop_token_ids(AutoTokenizer.from_pretrained(self.s.target_dir))
        return self._stops

    def run(self, trainer, pl_module) -> dict[str, float] | None:
        self._last_step = trainer.global_step
        try:
            # sharded (FSDP2, ZeRO-3): every rank gathers the whole head together; rank 0 scores that copy
            head = whole_head(trainer, pl_module.head)
            if self.s.engine == "vllm" and torch.cuda.is_available():
                torch.cuda.empty_cache()  # every rank: what training cached is vLLM's to use while it runs
            return self._run(trainer, pl_module, head) if trainer.is_global_zero else None
        finally:
            if self._wait_group is not None:  # the other ranks wait here, not in a training collective
                import torch.distributed as dist

                dist.barrier(group=self._wait_group)

    def _run(self, trainer, pl_module, head: torch.nn.Module) -> dict[str, float]:
        dm = trainer.datamodule
        was_training = head.training
        device = "cpu"
        try:  # loading the target can fail transiently too (a missing file)
            log.info("engine validation at step %d (%s): %d held-out conversations teacher-forced, %d prompts "
                     "decoded (k=%d, %d new tokens)", trainer.global_step, self.s.engine, self.s.conversations,
                     self.s.prompts, self.s.k, self.s.max_new_tokens)
            if self.s.engine == "spechead":
                self._load()
            device = self.engine_device()
            head = on_device(head, device)  # all of it where the engine runs (a gathered copy included)
            head.eval()
            # the data module's samples with their states (online: computed); any module with a store: its records
            samples = getattr(dm, "sample_with_states", None) or dm.store.__getitem__
            metrics = self.evaluate(head, samples, dm.val_idx, trainer.global_step)
        except Exception as err:
            if is_oom(err):
                raise ValidationOutOfMemory(oom_advice(err, trainer.global_step, self.s.engine,
                                                       self.s.target_dtype, str(device))) from err
            if not is_transient(err):  # a bug (ValidationBug: with its figures): fail the run
                log.error("engine validation at step %d: %s: %s", trainer.global_step, type(err).__name__, err)
                raise
            # a file: no number is wrong; report it loudly and go on
            log.exception("engine validation failed at step %d (transient: %s); training continues",
                          trainer.global_step, type(err).__name__)
            metrics = {"engine_val/failed": 1.0}
        finally:
            head.train(was_training)
        metrics["step"] = trainer.global_step
        self.results.append(metrics)
        if trainer.logger is not None:
            trainer.logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=trainer.global_step)
        self._plot(trainer, metrics)
        return metrics

    def evaluate(self, head, sample_with_states, val_idx: list[int], step: int = 0) -> dict[str, float]:
        """`sample_with_states(i)`: held-out sample i with its target states (train/data.py: the store's
        record, or online the target's forward over it)."""
        target = self._load() if self.s.engine == "spechead" else None
        depth = min(self.s.depth, head.max_depth or self.s.depth)
        k = min(self.s.k, head.max_depth or self.s.k)
        n_conv = len(val_idx[: self.s.conversations])
        bar = Progress(n_conv + min(self.s.prompts, len(val_idx)), "engine validation", "item", bar=False,
                       every_s=self.s.progress_log_s)
        eng, ref, prompts = self._teacher_forced(target, head, sample_with_states, val_idx, depth, bar)
        m = self._depth_metrics(eng, ref) if target is not None else self._store_metrics(ref)
        if prompts:
            self._write_prompts(prompts)
            m |= self._decoded(target, head, prompts, k) if target is not None else self._vllm_decoded(head, prompts, k, step)
            bar.update(len(prompts), stage="decoded", tau=round(m["engine_val/tau"], 3))
        bar.close()
        log.info("engine validation: %s", " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in m.items()))
        return m

    def _write_prompts(self, prompts: list[list[int]]) -> None:
        """The decoded prompts as token ids, for `evaluate.dataset=jsonl` (module docstring)."""
        if self.s.plot_dir is None:
            return
        self.s.plot_dir.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps({"input_ids": p, "category": "held-out", "id": str(i)}) + "\n"
                        for i, p in enumerate(prompts))
        atomic_write_bytes(self.s.plot_dir / "prompts.jsonl", lines.encode())

    def _store_metrics(self, ref: list[DepthScores]) -> dict[str, float]:
        """engine=vllm: the training forward's scores per depth on the held-out rows, and their loss."""
        m: dict[str, float] = {}
        for d, r in enumerate(ref):
            m[f"engine_val/train_acc_d{d + 1}"] = r.acc
            m[f"engine_val/train_kl_d{d + 1}"] = r.kl / max(r.n, 1)
        m["engine_val/loss"] = self._loss(ref)
        return m

    def _loss(self, scores: list[DepthScores]) -> float:
        """The training loss over per-depth scores: Σ_d γ^(d-1) (w_hidden·reg + w_kl·kl) / rows."""
        return sum(self.s.depth_decay ** d * (self.s.w_hidden * e.reg + self.s.w_kl * e.kl) / max(e.n, 1)
                   for d, e in enumerate(scores))

    def _vllm_decoded(self, head, prompts: list[list[int]], k: int, step: int) -> dict[str, float]:
        """τ and α_d of greedy speculative decoding of the prompts in real vLLM, from its counters."""
        from artifacts.export import vllm_export
        from inference_eval.vllm_spec import VLLMRunner, spec_figures

        work = (self.s.plot_dir or Path(".")) / "vllm"
        work.mkdir(parents=True, exist_ok=True)
        if self._runner is None:
            self._runner = VLLMRunner(self.s.vllm or VllmSettings("evaluate.vllm"), self.s.target_dir,
                                      self.s.target_dtype, self.s.max_new_tokens, len(prompts),
                                      max(len(p) for p in prompts), self._stop_ids(), work,
                                      what="train.engine_validation.engine=vllm")
        served, method = vllm_export(head, work / "head", self.s.target_dir, self._runner.version,
                                     "train.engine_validation.engine=vllm")
        res = self._runner.run([{"ids": p} for p in prompts],
                               {"method": method, "model": str(served), "num_speculative_tokens": k}, f"step {step}")
        fig = spec_figures(res["spec"], k)
        m = {"engine_val/tau": fig["tau"], "engine_val/vllm_drafts": float(fig["num_drafts"]),
             "engine_val/vllm_new_tokens": float(sum(g["new_tokens"] for g in res["groups"]))}
        m.update({f"engine_val/alpha_{d + 1}": a for d, a in enumerate(fig["alpha"])})
        m.update({f"engine_val/vllm_accepted_{d + 1}": float(a) for d, a in enumerate(fig["accepted_per_pos"])})
        return m

    def _teacher_forced(self, target, head, sample_with_states, val_idx: list[int], depth: int, bar
                        ) -> tuple[list[DepthScores], list[DepthScores], list[list[int]]]:
        """Per-depth scores of the first `conversations` held-out samples in the engine and in the
        training forward, and the prompts (each of the first `prompts` samples up to its first reply)."""
        eng = [DepthScores() for _ in range(depth)]
        ref = [DepthScores() for _ in range(depth)]
        prompts = []
        for i in val_idx[: max(self.s.conversations, self.s.prompts)]:
            sample = sample_with_states(i)
            if len(prompts) < self.s.prompts:
                p = first_reply_prompt(sample["input_ids"], sample["loss_mask"])
                if p is not None:
                    prompts.append(p)
            if i not in val_idx[: self.s.conversations]:
                continue
            rows = select_rows(sample["loss_mask"], self.s.max_rows)
            if target is not None:  # engine=vllm: the training forward's scores only
                for d, s in enumerate(engine_teacher_forced(target, head, sample["input_ids"], sample["loss_mask"],
                                                            depth, rows, self.s.normed_regression)):
                    eng[d].add(s)
            for d, s in enumerate(training_forward_scores(head, sample, depth, rows, self.s.normed_regression)):
                ref[d].add(s)
            bar.update(1, stage="teacher-forced")
        return eng, ref, prompts

    def _depth_metrics(self, eng: list[DepthScores], ref: list[DepthScores]) -> dict[str, float]:
        """engine_val/* per depth and the loss; a top-1 gap between the two paths beyond `tolerance` is
        an EngineTrainingGap (strict) or a warning."""
        m: dict[str, float] = {}
        gaps = []  # depths whose engine-vs-training top-1 gap exceeds the tolerance
        for d, (e, r) in enumerate(zip(eng, ref)):
            n = max(e.n, 1)
            m[f"engine_val/kl_d{d + 1}"] = e.kl / n
            m[f"engine_val/reg_d{d + 1}"] = e.reg / n
            m[f"engine_val/acc_d{d + 1}"] = e.acc
            m[f"engine_val/train_acc_d{d + 1}"] = r.acc
            m[f"engine_val/train_kl_d{d + 1}"] = r.kl / max(r.n, 1)
            m[f"engine_val/gap_acc_d{d + 1}"] = abs(e.acc - r.acc)
            if abs(e.acc - r.acc) > self.s.tolerance:
                gaps.append({"depth": d + 1, "engine_acc": e.acc, "train_acc": r.acc, "gap": abs(e.acc - r.acc),
                             "engine_rows": e.n, "train_rows": r.n, "engine_kl": e.kl / n,
                             "train_kl": r.kl / max(r.n, 1)})
        if gaps:
            detail = "; ".join(f"depth {g['depth']}: top-1 agreement {g['engine_acc']:.4f} in the engine vs "
                               f"{g['train_acc']:.4f} in the training forward (gap {g['gap']:.4f}, "
                               f"{g['engine_rows']}/{g['train_rows']} rows; KL {g['engine_kl']:.4g} vs "
                               f"{g['train_kl']:.4g})" for g in gaps)
            msg = (f"engine validation: engine and training forward disagree on the same rows beyond tolerance "
                   f"{self.s.tolerance:.3g} ({self.s.target_dtype} target): {detail}: a numerics bug "
                   f"(store, engine or unroll)")
            if self.strict:
                raise EngineTrainingGap(msg, tolerance=self.s.tolerance, dtype=str(self.s.target_dtype), gaps=gaps)
            log.warning("%s", msg)
        m["engine_val/loss"] = self._loss(eng)
        return m

    def _decoded(self, target, head, prompts: list[list[int]], k: int) -> dict[str, float]:
        """τ, α_d and the simulated τ of greedy speculative decoding over the prompts (lossless checked);
        with a temperature, τ and α_d of sampled decoding too."""
        spec = speculative_scores(target, head, prompts, k, self.s.max_new_tokens, self._stop_ids(), self.s.normed_regression,
                                  strict=target.dtype == torch.float32)
        m = {"engine_val/tau": spec["tau"], "engine_val/lossless_mismatch": spec["mismatches"],
             "engine_val/sim_tau": spec["sim_tau"], "engine_val/tau_gap": spec["sim_tau"] - spec["tau"]}
        m.update({f"engine_val/alpha_{d + 1}": a for d, a in enumerate(spec["alpha"])})
        if self.s.temperature > 0:  # the configured temperature too: drafts accepted by rejection sampling
            sampling = Sampling(self.s.temperature, self.s.top_p, self.s.top_k, torch.Generator().manual_seed(self.s.seed))
            total = engine_decode(target, head, prompts, k, self.s.max_new_tokens, self._stop_ids(), sampling)[1].stats
            m["engine_val/tau_sampled"] = total.tau
            m.update({f"engine_val/alpha_sampled_{d + 1}": a for d, a in enumerate(total.alpha)})
        return m

    def _plot(self, trainer, metrics: dict[str, float]) -> None:
        alphas = [metrics[f"engine_val/alpha_{d}"] for d in range(1, self.s.k + 1) if f"engine_val/alpha_{d}" in metrics]
        if not alphas:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(4, 3))
        ax.bar(range(1, len(alphas) + 1), alphas)
        ax.set(xlabel="draft position d", ylabel="α_d", ylim=(0, 1),
               title=f"step {metrics['step']}: τ={metrics['engine_val/tau']:.2f} " + (
                   f"(sim {metrics['engine_val/sim_tau']:.2f})" if "engine_val/sim_tau" in metrics else f"({self.s.engine})"))
        fig.tight_layout()
        logger = trainer.logger
        if type(logger).__name__ == "WandbLogger":
            import wandb
            logger.experiment.log({"engine_val/alpha_plot": wandb.Image(fig)}, step=trainer.global_step)
        out = self.s.plot_dir or Path(trainer.default_root_dir)
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(out / f"engine_val_alpha_step{metrics['step']}.png", dpi=80)
        plt.close(fig)
