"""The training loss of the block drafters (heads/dflash.py: dflash, dspark) — docs/design.md §4.

A batch's rows draw random anchors (`BlockLossConfig.anchors` per row, among the positions a ≥ 1 whose first draft's
token t_{a+1} is trained on), and `block_unroll` runs every anchor's block at once. Draft i (1..D) of the block at a
predicts t_{a+i} against the target's distribution at a+i-1, p = softmax(W_lm N_f(H_{a+i-1})); per row

    KL(p ‖ q_i),   TV = 1 − Σ_v min(p_v, q_v)  (1 − the row's acceptance probability under rejection sampling),
    BCE(σ(c_i), 1 − TV)                          (DSpark's confidence head, against the detached acceptance)

weighted per position: DFlash's decay w_i = exp(−(i−1)/γ), or D-PACE's w_i = Σ_{j≥i} Π_{l≤j} s_l with the smoothed
confidences s_l = (1−α)·exp(−CE_l) + α of the block's trained rows (no gradient through the weights). The loss is
Σ_rows w · (w_kl·KL + w_tv·TV + w_conf·BCE) / (trained rows). CE = KL + the teacher's entropy: the same gradient.

The [rows × V] logits exist one chunk of rows at a time, recomputed in backward (activation checkpointing), so peak
memory does not grow with the anchors.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from heads.dflash import block_unroll
from inference_eval.speculative import chain_tau

WEIGHTS = ("decay", "dpace")


@dataclass(frozen=True)
class BlockLossConfig:
    anchors: int = 64  # blocks per batch row (fewer where the row has fewer trainable positions)
    gamma: float = 4.0  # DFlash's position decay exp(-(i-1)/γ)
    weights: str = "decay"  # decay | dpace
    dpace_alpha: float = 0.5  # D-PACE's smoothing of the per-position confidence
    w_kl: float | str = "auto"  # auto: 1 for dflash, 0.1 for dspark (DSpark's 0.1·CE + 0.9·TV)
    w_tv: float | str = "auto"  # auto: 0 for dflash, 0.9 for dspark
    # cross-entropy against the target's top-1 token (hard labels: the loss of speculators' DFlash recipe); where it is
    # > 0, D-PACE's confidences read this CE instead of the soft one
    w_ce: float = 0.0
    w_conf: float = 1.0  # the confidence head's BCE (a head with one)

    def __post_init__(self) -> None:
        if self.anchors < 1:
            raise ValueError(f"train.module.block.anchors={self.anchors}: expected ≥ 1 block per row")
        if not self.gamma > 0:
            raise ValueError(f"train.module.block.gamma={self.gamma!r}: expected a positive decay length")
        if self.weights not in WEIGHTS:
            raise ValueError(f"train.module.block.weights={self.weights!r}: expected one of {WEIGHTS}")
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"train.module.block.dpace_alpha={self.dpace_alpha!r}: expected a number in [0, 1]")
        for key in ("w_kl", "w_tv"):
            v = getattr(self, key)
            if v != "auto" and not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"train.module.block.{key}={v!r}: expected auto or a weight ≥ 0")
        if not (isinstance(self.w_ce, (int, float)) and self.w_ce >= 0):
            raise ValueError(f"train.module.block.w_ce={self.w_ce!r}: expected a weight ≥ 0 (0: off)")

    def term_weights(self, head) -> tuple[float, float]:
        """(w_kl, w_tv) for `head`, `auto` resolved by its kind."""
        spark = head.kind == "dspark"
        w_kl = (0.1 if spark else 1.0) if self.w_kl == "auto" else float(self.w_kl)
        w_tv = (0.9 if spark else 0.0) if self.w_tv == "auto" else float(self.w_tv)
        return w_kl, w_tv


def row_seeds(ids: torch.Tensor, salt: int) -> list[int]:
    """One seed per batch row [B, T] from its tokens and `salt` (the run's seed and step): a row draws the same anchors
    whichever rank or batch it lands in, so N processes train what one process does."""
    rows = ids.to(torch.int64).cpu().numpy()
    return [zlib.crc32(r.tobytes(), salt & 0xFFFFFFFF) for r in rows]


def select_anchors(trainable: torch.Tensor, count: int, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct anchors per row among the columns where `trainable` [B, T] holds, drawn uniformly from
    each row's seed, ascending: (anchors [B, n] long, valid [B, n] bool; unused slots point at column 1)."""
    b, t = trainable.shape
    picks, n = [], 0
    for row, seed in zip(trainable.cpu(), seeds):
        cols = row.nonzero().flatten()
        gen = torch.Generator().manual_seed(seed)
        chosen = cols[torch.randperm(cols.numel(), generator=gen)[:count]].sort().values
        picks.append(chosen)
        n = max(n, chosen.numel())
    n = max(n, 1)
    anchors = torch.ones(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    for i, c in enumerate(picks):
        anchors[i, : c.numel()], valid[i, : c.numel()] = c, True
    return anchors.to(trainable.device), valid.to(trainable.device)


def row_terms(head, h: torch.Tensor, prev: torch.Tensor, teacher: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per block row: (KL [N], soft CE [N], TV [N] — float32 —, the draft's top-1 == the teacher's [N] bool, confidence
    logits [N] or None, the hard-label CE [N]: −log q(the teacher's top-1 in the head's vocabulary)) for row states
    `h` [N, H] after tokens `prev` [N] against target states `teacher` [N, H]."""
    acc = torch.promote_types(h.dtype, torch.float32)  # softmax arithmetic in fp32 (float64 stays float64)
    logits = head.row_logits(h, prev).to(acc)
    full = head.tied.teacher_logits(teacher).to(acc)
    ids = head.draft_ids
    t = full if ids is None else full[:, ids]  # a reduced vocabulary: the teacher renormalised over its rows
    lp_t, lp_s = t.log_softmax(-1), logits.log_softmax(-1)
    p_t = lp_t.exp()
    ce = -(p_t * lp_s).sum(-1)
    kl = ce + (p_t * lp_t).sum(-1)
    tv = 1.0 - torch.minimum(p_t, lp_s.exp()).sum(-1)
    agree = head.to_target_ids(logits.argmax(-1)) == full.argmax(-1)
    hard = -lp_s.gather(-1, t.argmax(-1, keepdim=True)).squeeze(-1)
    return kl, ce, tv, agree, head.confidence(h, prev), hard


def chunked_row_terms(head, h: torch.Tensor, prev: torch.Tensor, teacher: torch.Tensor, chunk: int):
    """`row_terms` a chunk of rows at a time, each chunk recomputed in backward (no [N, V] tensor is kept)."""
    parts = []
    for a in range(0, h.shape[0], chunk):
        args = (h[a:a + chunk], prev[a:a + chunk], teacher[a:a + chunk])
        fn = lambda hh, pp, tt: row_terms(head, hh, pp, tt)  # noqa: E731
        parts.append(checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args))
    kl, ce, tv, agree, hard = (torch.cat([p[i] for p in parts]) for i in (0, 1, 2, 3, 5))
    conf = torch.cat([p[4] for p in parts]) if parts and parts[0][4] is not None else None
    return kl, ce, tv, agree, conf, hard


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [M, D] from per-row CE [M, D] of M blocks (mask: the trained rows): the expected
    number of further accepted tokens each position's draft leads to, Σ_{j≥i} Π_{l≤j} s_l."""
    with torch.no_grad():
        s = torch.where(mask, (1.0 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(s, dim=-1) * mask
        return torch.flip(torch.cumsum(torch.flip(prefix, dims=[-1]), dim=-1), dims=[-1]) * mask


def block_terms(head, batch: dict[str, torch.Tensor], cfg: BlockLossConfig, salt: int = 0,
                loss_on: str = "assistant", chunk: int = 512, anchors: tuple | None = None) -> dict[str, torch.Tensor]:
    """The loss and metrics of a batch for a block head: `loss`, per draft position d (1..D) `kl_d{d}`, `tv_d{d}`,
    `acc_d{d}`, `agree_count_d{d}`, `n_count_d{d}` (the same keys as the chain heads', so held-out scores and
    validation read them alike), `sim_tau`, `tokens`, `n_tokens`. Anchors are drawn per row from its tokens and `salt`;
    `anchors`: (anchors, valid) to use instead (tests)."""
    hidden = batch["hidden"]
    ids, valid, loss_mask = batch["input_ids"], batch["valid"], batch["loss_mask"]
    segments, positions = batch.get("segments"), batch.get("positions")
    b, t = ids.shape
    trained = valid if loss_on == "all" else valid & loss_mask  # the tokens a draft may be trained on
    # an anchor a needs a context (a ≥ 1) and its first draft's token t_{a+1} trained on, in its own sample
    first = torch.zeros_like(trained)
    first[:, 1:t - 1] = trained[:, 2:]
    if segments is not None:
        first[:, 1:t - 1] &= segments[:, 2:] == segments[:, 1:t - 1]
    a, a_valid = anchors if anchors is not None else select_anchors(first, cfg.anchors, row_seeds(ids, salt))
    aux = batch["aux_hidden"].to(head.dtype)
    h = block_unroll(head, aux, ids, a, positions, segments)  # [B, n, R, H]
    depth, first_row = head.max_depth, head.first_row
    w_kl, w_tv = cfg.term_weights(head)
    seg_a = segments.gather(1, a) if segments is not None else None
    rows_h, rows_prev, rows_teacher, masks = [], [], [], []
    for i in range(1, depth + 1):
        tok = (a + i).clamp(max=t - 1)  # t_{a+i}, the draft's token
        m = a_valid & (a + i < t) & trained.gather(1, tok)
        if seg_a is not None:
            m &= segments.gather(1, tok) == seg_a
        masks.append(m)
        rows_h.append(h[:, :, first_row + i - 1])
        before = (a + i - 1).clamp(max=t - 1)  # the draft's teacher position (rows past the end are masked)
        rows_prev.append(ids.gather(1, before))
        rows_teacher.append(hidden.gather(1, before[..., None].expand(-1, -1, hidden.shape[-1])))
    mask = torch.stack(masks, dim=-1)  # [B, n, D]
    sel = mask.flatten()
    kl, ce, tv, agree, conf, hard = chunked_row_terms(
        head, torch.stack(rows_h, dim=2).flatten(0, 2)[sel], torch.stack(rows_prev, dim=-1).flatten()[sel],
        torch.stack(rows_teacher, dim=2).flatten(0, 2)[sel].to(head.dtype), chunk)
    pos = torch.arange(1, depth + 1, device=ids.device).expand_as(mask)[mask]  # each trained row's draft position
    if cfg.weights == "dpace":
        ce_full = torch.zeros(mask.shape, dtype=ce.dtype, device=ce.device)
        ce_full[mask] = (hard if cfg.w_ce > 0 else ce).detach()
        w = dpace_weights(ce_full.flatten(0, 1), mask.flatten(0, 1), cfg.dpace_alpha).view(mask.shape)[mask]
    else:
        w = torch.exp(-(pos - 1).to(kl.dtype) / cfg.gamma)
    per_row = w_kl * kl + w_tv * tv + cfg.w_ce * hard
    if conf is not None:
        per_row = per_row + cfg.w_conf * F.binary_cross_entropy_with_logits(conf.to(tv.dtype), (1.0 - tv).detach(),
                                                                          reduction="none")
    n_rows = mask.sum()
    out: dict[str, torch.Tensor] = {"tokens": valid.sum(), "loss": (w.to(per_row.dtype) * per_row).sum() / n_rows.clamp(min=1)}
    accs = []
    for d in range(1, depth + 1):
        at = pos == d
        n = at.sum()
        n_safe = n.clamp(min=1)
        acc = agree[at].sum().float() / n_safe
        accs.append(acc)
        out.update({f"kl_d{d}": kl[at].sum() / n_safe, f"tv_d{d}": tv[at].sum() / n_safe, f"acc_d{d}": acc,
                    f"agree_count_d{d}": agree[at].sum().detach(), f"n_count_d{d}": n})
        if conf is not None:
            out[f"conf_d{d}"] = torch.sigmoid(conf[at].float()).sum() / n_safe
    out["n_tokens"] = out["n_count_d1"]
    out["sim_tau"] = torch.as_tensor(chain_tau(accs))
    return out

