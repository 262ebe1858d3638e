"""Optimizers and learning-rate schedules of the training module (docs/design.md §4).

`auto` (the default, `resolve_optimizer`): `muon` for the head types where it was measured to accept more
at the demo's budget (docs/RESULTS.md §8, "Muon at the demo's budget"), `adamw` for the others — and `adamw`
under DeepSpeed ZeRO, whose optimizer holds flattened partitions of the tensors, not the matrices Muon
orthogonalises (an explicit `muon` there is refused, train/module.py).

`adamw`: AdamW over every trainable tensor, weight decay on matrices only.

`muon`: Muon (Jordan et al., 2024; the Moonlight scaling of Liu et al., 2025, "Muon is Scalable for
LLM Training") on the head's hidden matrices, AdamW on everything else (norm weights, biases, and a
head's own vocabulary projection — EAGLE-3's `lm_head` — which Muon's authors keep on AdamW like
embeddings). One optimizer object holds both groups, so Lightning's automatic optimisation, the
scheduler, checkpoints and resume treat it as any other. A Muon step on a matrix W with gradient G:

    B ← μ B + (1 − μ) G;   U ← (1 − μ) G + μ B  (Nesterov)
    O ← NewtonSchulz5(U)                        (≈ the orthogonal polar factor of U)
    W ← (1 − lr·λ) W − lr · 0.2 · √max(rows, cols) · O

the 0.2·√max(A, B) factor matching AdamW's update RMS, so one lr serves both groups. Under FSDP2 a matrix
and its gradient are sharded by rows (DTensors): the momentum is kept per shard, the update U is gathered
whole for the Newton–Schulz iteration and each rank applies its own rows — the same step as one process
(tests/test_multiprocess.py). Over several ranks (`divide_ns`: FSDP2's shards, or DDP's identical gradients) the
iteration is divided: each rank orthogonalises its share of the matrices (`ns_owners`, balanced by FLOPs) and one
all-gather of the results gives every rank every O — bit for bit what one process computes, at 1/world of its
cost (≈ 73 TFLOP per step for an 8B-shaped head on every rank otherwise; tests/test_gpu_correct_scale.py). That is
`torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`, except that the Newton–Schulz iteration runs in a
chosen dtype (`ns_dtype`, `default_ns_dtype`): torch's fixes bfloat16, which a CPU without bf16 instructions runs
~170× slower than float32 (tests/README.md). tests/test_optim.py checks both groups against torch's own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

OPTIMIZERS = ("adamw", "muon")
SETTINGS = ("auto", *OPTIMIZERS)  # train.module.optimizer
# the head types `auto` trains with Muon: measured at the demo's budget on two seeds (docs/RESULTS.md §8); eagle3
# and draft_lm were measured there too and do not gain (§8, "Muon on `eagle3` and `draft_lm`"); dflash and dspark as
# part of the peer's recipes that conf/head/dflash.yaml and conf/head/dspark.yaml train with (§10)
MUON_HEAD_TYPES = ("mtp", "dflash", "dspark")
SCHEDULES = ("cosine", "linear")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # the quintic of Keller Jordan's Muon (torch's default too)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> torch.Tensor:
    """The quintic Newton–Schulz iteration of Muon: ≈ U Vᵀ for G = U S Vᵀ (singular values near 1)."""
    if g.ndim != 2 or len(coefficients) != 3:
        raise ValueError("Newton-Schulz needs a 2-D matrix and 3 coefficients")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm ≤ 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> int:
    """Multiply-add FLOPs of `newton_schulz` on a matrix of `shape`: per step X Xᵀ (2·m²·n), the quadratic in the
    Gram matrix (2·m³) and its product with X (2·m²·n), m the shorter side."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)


def ns_owners(shapes: list[tuple[int, ...]], world: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the rank with the fewest FLOPs so far
    (ties: the lowest rank) — the same answer on every rank, from the shapes alone."""
    load = [0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += ns_flops(shapes[i])
    return owners


def _whole(update: torch.Tensor) -> torch.Tensor:
    return update.full_tensor() if isinstance(update, DTensor) else update


def _in_placements(o: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """O in the update's own form: a DTensor's local shard of it (no communication: every rank holds O whole)."""
    if not isinstance(like, DTensor):
        return o
    return distribute_tensor(o.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def orthogonalise(updates: list[torch.Tensor], steps: int, dtype: torch.dtype,
                  group: "torch.distributed.ProcessGroup | None" = None) -> list[torch.Tensor]:
    """Newton–Schulz of every update, each whole (a sharded one, FSDP2's DTensor, gathered first). With `group`
    (several ranks holding the same updates): rank r computes only the matrices `ns_owners` gives it, then one
    all-gather of a flat buffer per rank hands every rank every O."""
    import torch.distributed as dist

    wholes = [_whole(u) for u in updates]
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return [_in_placements(newton_schulz(w, steps, dtype=dtype), u) for w, u in zip(wholes, updates)]
    rank = dist.get_rank(group)
    owners = ns_owners([tuple(w.shape) for w in wholes], world)
    sizes = [sum(w.numel() for w, o in zip(wholes, owners) if o == r) for r in range(world)]
    out_dtype = wholes[0].dtype
    mine = [newton_schulz(w, steps, dtype=dtype).to(out_dtype).reshape(-1)
            for w, o in zip(wholes, owners) if o == rank]
    buf = torch.zeros(max(sizes), dtype=out_dtype, device=wholes[0].device)  # padded to the largest share
    if mine:
        torch.cat(mine, out=buf[:sizes[rank]])
    gathered = torch.empty(world * buf.numel(), dtype=out_dtype, device=buf.device)
    dist.all_gather_into_tensor(gathered, buf, group=group)
    gathered = gathered.view(world, -1)  # [world, largest share]
    offsets = [0] * world
    result = []
    for w, o, u in zip(wholes, owners, updates):
        flat = gathered[o, offsets[o]:offsets[o] + w.numel()]
        offsets[o] += w.numel()
        result.append(_in_placements(flat.view(w.shape), u))
    return result


def ns_group(params: list[torch.Tensor]) -> "torch.distributed.ProcessGroup | None":
    """The ranks that divide the Newton–Schulz work of `params`: a sharded matrix's own mesh (FSDP2), else every
    rank of the default group (DDP: every rank holds the same averaged gradient); None in one process."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    sharded = [p for p in params if isinstance(p, DTensor)]
    if sharded:
        mesh = sharded[0].device_mesh
        return mesh.get_group() if mesh.ndim == 1 else mesh.get_group(0)
    return dist.group.WORLD


def resolve_optimizer(setting: str, head_type: str, on_deepspeed: bool) -> str:
    """`train.module.optimizer` as trained: `auto` is `muon` for MUON_HEAD_TYPES unless DeepSpeed runs the
    optimizer (ZeRO partitions flattened tensors), `adamw` otherwise; an explicit choice stays as it is."""
    if setting not in SETTINGS:
        raise ValueError(f"train.module.optimizer={setting!r}: expected one of {SETTINGS}")
    if setting != "auto":
        return setting
    return "muon" if head_type in MUON_HEAD_TYPES and not on_deepspeed else "adamw"


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups with `muon: True` (2-D tensors only), AdamW on the others (module docstring)."""

    def __init__(self, groups: Iterable[dict[str, Any]], lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, ns_dtype: torch.dtype = torch.float32,
                 divide_ns: bool = False) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps, "momentum": momentum,
                    "nesterov": nesterov, "ns_steps": ns_steps, "muon": False}
        super().__init__(list(groups), defaults)
        self.ns_dtype = ns_dtype
        # several ranks with the same updates (DDP's averaged gradients, FSDP2's shards): divide Newton–Schulz
        self.divide_ns = divide_ns
        for group in self.param_groups:
            if group["muon"]:
                bad = [tuple(p.shape) for p in group["params"] if p.ndim != 2]
                if bad:
                    raise ValueError(f"Muon updates matrices only; this group holds tensors of shapes {bad}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # (parameter, update, group): orthogonalised together
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["muon"]:
                    muon.append((p, self._muon_update(p.grad, self.state[p], group), group))
                else:
                    self._adamw(p, p.grad, self.state[p], group)
        by_steps: dict[int, list[int]] = {}
        for i, (_, _, group) in enumerate(muon):
            by_steps.setdefault(group["ns_steps"], []).append(i)
        for steps, idx in by_steps.items():
            params = [muon[i][0] for i in idx]
            group_ = ns_group(params) if self.divide_ns else None
            for i, o in zip(idx, orthogonalise([muon[i][1] for i in idx], steps, self.ns_dtype, group_)):
                p, _, group = muon[i]
                lr = group["lr"]
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(o.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
        return loss

    @staticmethod
    def _muon_update(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        """The momentum step of Muon: the buffer B and the (Nesterov) update U that Newton–Schulz orthogonalises."""
        mu = group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - mu)
        return grad.lerp(buf, mu) if group["nesterov"] else buf

    def _adamw(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        (b1, b2), lr = group["betas"], group["lr"]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = float(state["step"])
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))


def parameter_groups(head: torch.nn.Module, optimizer: str, weight_decay: float,
                     muon_weight_decay: float = 0.1) -> list[dict[str, Any]]:
    """The head's trainable tensors in optimizer groups: AdamW decays matrices only (`weight_decay`);
    Muon takes the matrices except vocabulary-sized ones (`lm_head`, `embed_tokens`), which stay on AdamW
    with the vectors, and decays them by `muon_weight_decay` (speculators' 0.1)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"train.module.optimizer={optimizer!r}: expected one of {OPTIMIZERS}")
    named = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    vectors = [p for _, p in named if p.ndim < 2]
    if optimizer == "adamw":
        return [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": vectors, "weight_decay": 0.0}]
    vocab = [p for n, p in named if p.ndim >= 2 and n.split(".")[-2:-1] in (["lm_head"], ["embed_tokens"])]
    matrices = [p for n, p in named if p.ndim == 2 and not any(p is q for q in vocab)]
    groups = [{"params": matrices, "muon": True, "weight_decay": muon_weight_decay},
              {"params": vocab, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def split_deep_groups(head: torch.nn.Module, groups: list[dict[str, Any]], deep_lr: float) -> list[dict[str, Any]]:
    """Each group split into its tensors outside the modules of depth ≥ 2 and those inside, which get `deep_lr`."""
    deep = {id(p) for m in head.depth_modules()[1:] for p in m.parameters()}
    out = []
    for g in groups:
        rest = [p for p in g["params"] if id(p) not in deep]
        inside = [p for p in g["params"] if id(p) in deep]
        out += [{**g, "params": rest}] if rest else []
        out += [{**g, "params": inside, "lr": deep_lr}] if inside else []
    return out


# `train.module.ns_dtype`: the Newton–Schulz iteration's dtype (None: `default_ns_dtype`)
NS_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def default_ns_dtype(on_cuda: bool) -> torch.dtype:
    """The Newton–Schulz iteration's dtype: bfloat16 (as torch's Muon) where the device multiplies it natively — a GPU,
    or a CPU with AVX-512-BF16 / AMX, where the demo's 1-module training steps ran at 1.04 step/s against 0.91 with
    the iteration in float32 (2 EPYC cores, docs/RESULTS.md "The demo in under 20 minutes") — else float32 (a CPU
    without bf16 instructions runs bf16 products ~170× slower)."""
    from inference_eval.model import cpu_has_fast_bf16

    return torch.bfloat16 if on_cuda or cpu_has_fast_bf16() else torch.float32


def build_optimizer(head: torch.nn.Module, optimizer: str, lr: float, weight_decay: float,
                    betas: tuple[float, float], momentum: float = 0.95, muon_weight_decay: float = 0.1,
                    ns_dtype: torch.dtype | None = None, deep_lr_scale: float = 1.0,
                    divide_ns: bool = False) -> torch.optim.Optimizer:
    """`train.module.optimizer`: adamw | muon (module docstring). `ns_dtype` None: `default_ns_dtype`.
    `deep_lr_scale`: the peak lr of the per-depth modules of depth ≥ 2 (`head.depth_modules()[1:]`) is `deep_lr_scale × lr`, each group split in two (the schedule scales both).
    `divide_ns`: over several ranks, each orthogonalises its share of Muon's matrices (`orthogonalise`)."""
    groups = parameter_groups(head, optimizer, weight_decay, muon_weight_decay)
    if deep_lr_scale != 1.0:
        groups = split_deep_groups(head, groups, lr * deep_lr_scale)
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))
    if ns_dtype is None:
        ns_dtype = default_ns_dtype(any(p.is_cuda for g in groups for p in g["params"]))
    return MuonAdamW(groups, lr=lr, weight_decay=weight_decay, betas=tuple(betas), momentum=momentum,
                     ns_dtype=ns_dtype, divide_ns=divide_ns)


def lr_multiplier(step: int, total: int, warmup: int, schedule: str, min_lr_ratio: float) -> float:
    """lr / peak lr at `step` of `total`: linear warm-up over `warmup` steps, then `cosine` or `linear`
    decay to `min_lr_ratio` at the last step (`linear` with 0: the decay-to-zero of speculators)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"train.module.schedule={schedule!r}: expected one of {SCHEDULES}")
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * shape
