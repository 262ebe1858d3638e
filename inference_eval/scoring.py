"""Teacher-forced scoring in the engine: the head's states along a known token sequence, computed the
way the engine's draft path computes them, and the simulated τ built on their top-1 agreement.

For each scored row i of a sequence the target recomputes H (and the aux layers a head reads); the head
runs its cached draft path from row i with the true tokens forced — `refresh` over the target's states
for depth 1, then `draft_chain` for depths 2..D — which is what the draft loop computes once the target
has accepted up to row i. Depth d's state at row i estimates H_{i+d}; its logits predict t_{i+d+1}.
Training's validation scores these states with the training loss (train/validation.py); evaluation
only needs their agreement with the target (`simulated_tau`).

A block head (dflash, dspark) has no chain: `block_states` runs the engine's block proposer over the target's
states of the whole sequence, anchoring a block at row i + 1 for each scored row i (the target has accepted up to
i); its draft d predicts t_{i+d+1}, the token chain depth d at row i predicts.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from inference_eval.engine.base import target_state
from inference_eval.engine.block import PagedBlockProposer
from inference_eval.paged import BlockAllocator, BlockTable
from inference_eval.speculative import draft_chain, full_vocab_logits, refresh


def scored_rows(loss_mask: torch.Tensor, rows: list[int], d: int) -> list[int]:
    """Indices j into `rows` whose depth-d prediction is scored: t_{rows[j]+d+1} exists and is a loss token."""
    t = loss_mask.shape[0]
    return [j for j, i in enumerate(rows) if i + d + 1 < t and bool(loss_mask[i + d + 1])]


def select_rows(loss_mask: torch.Tensor, max_rows: int | None) -> list[int]:
    """Rows i (0..T-2) with a depth-1 loss token t_{i+2}, evenly thinned to at most `max_rows`."""
    rows = [i for i in range(loss_mask.shape[0] - 2) if bool(loss_mask[i + 2])]
    if max_rows is not None and len(rows) > max_rows:
        step = len(rows) / max_rows
        rows = [rows[int(j * step)] for j in range(max_rows)]
    return rows


@torch.no_grad()
def teacher_forced_states(target, head, ids: torch.Tensor, depth: int, rows: list[int]
                          ) -> tuple[dict[int, list[torch.Tensor]], torch.Tensor]:
    """({d: the head's depth-d state at each row of `rows`}, the target's states H [1, T, H] in float32),
    on the target's device."""
    t = ids.shape[0]
    ids = ids.to(target.device)
    out = target(ids[None], logits="none", capture_layers=head.capture_layers)
    hidden = out.hidden.float()
    aux = torch.cat(out.aux, dim=-1).float() if head.capture_layers else None
    if hasattr(head, "teacher_forced_states"):  # a draft LM (heads/draft_lm.py): tokens only, its own forward
        return head.teacher_forced_states(ids, depth, rows), hidden
    states: dict[int, list[torch.Tensor]] = {d: [] for d in range(1, depth + 1)}
    if not head.chain:  # medusa: every depth straight from the target state
        for d in range(1, depth + 1):
            states[d] = list(head(hidden[:, rows], depth=d)[0])
        return states, hidden
    x = head.target_input(hidden, aux)
    cache = head.new_cache(1, t + depth + 2)
    s1 = refresh(head, x[:, : t - 1], ids[None, 1:t], 0, cache, last_only=False)  # [1, T-1, H]
    states[1] = [s1[0, i] for i in rows]
    if depth > 1:
        # rows in descending order: row i's chain overwrites slots i+1.., which only rows > i read
        deeper: dict[int, list[torch.Tensor]] = {}
        for i in sorted(rows, reverse=True):
            forced = ids[i + 2: i + depth + 1].tolist()
            forced += [0] * (depth - 1 - len(forced))  # past the end: scored out, as in the unroll
            deeper[i] = draft_chain(head, s1[:, i: i + 1], depth, i + 1, cache, forced)[1]
        for d in range(2, depth + 1):
            states[d] = [deeper[i][d - 1][0, 0] for i in rows]
    return states, hidden


@torch.no_grad()
def block_states(target, head, ids: torch.Tensor, rows: list[int], block_size: int = 16
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block rows [len(rows), head.block_rows(D), H] of the engine's block pass anchored at each row i + 1,
    the target's states H [1, T, H] in float32): one target pass over `ids` [T] whose states fill the draft's
    context cache once, then the blocks in descending anchor order (a block writes its slots a.., which only
    anchors > a read as context)."""
    t, dev = ids.shape[0], target.device
    ids = ids.to(dev)
    out = target(ids[None], logits="none", capture_layers=head.capture_layers)
    k = head.max_depth
    rows_per_block = head.block_rows(k)
    blocks = -(-(t + rows_per_block) // block_size)
    prop = PagedBlockProposer(head)
    prop.attach(SimpleNamespace(device=dev, num_blocks=blocks, block_size=block_size, k=k))
    table = BlockTable(block_size, dev)
    table.extend(BlockAllocator(blocks).allocate(blocks))
    seq = SimpleNamespace(table=table)
    prop.write_context([seq], target_state(head, out.hidden, out.aux), [(0, t)], [0])
    found = {}
    for i in sorted(rows, reverse=True):
        a = i + 1
        found[i] = prop.block_hidden([SimpleNamespace(table=table, m=a, tokens=ids[: a + 1].tolist())], k)[0]
    h = torch.stack([found[i] for i in rows]) if rows else out.hidden.new_zeros(0, rows_per_block, head.args.hidden_size)
    return h, out.hidden.float()


def block_agreement(head, h: torch.Tensor, prev: torch.Tensor, teacher: torch.Tensor) -> int:
    """How many block rows `h` [N, H] (after tokens `prev` [N]) draft the target's top-1 token of `teacher` [N, H]."""
    if h.shape[0] == 0:
        return 0
    mine = PagedBlockProposer(head).draft_logits(h.to(head.dtype), prev).argmax(-1)
    return int((mine == head.tied.teacher_logits(teacher.to(head.dtype)).argmax(-1)).sum())


def agreement(head, preds: torch.Tensor, teacher: torch.Tensor, depth: int) -> int:
    """How many of the head's states `preds` [N, H] have the target's top-1 token (from `teacher`, the
    states they estimate) as their own top-1 over the target vocabulary."""
    if preds.shape[0] == 0:
        return 0
    mine = full_vocab_logits(head, preds.to(head.dtype), depth).argmax(-1)
    theirs = head.tied.teacher_logits(teacher.to(head.dtype)).argmax(-1)
    return int((mine == theirs).sum())


@torch.no_grad()
def simulated_tau(target, head, prompts: list[list[int]], continuations: list[list[int]], k: int
                  ) -> tuple[float, list[float]]:
    """τ simulated from teacher-forced agreement: the head's top-1 agreement per depth d = 1..k along
    each prompt's greedy continuation (scored rows: those predicting a continuation token), pooled,
    then 1 + Σ_d Π_{j≤d} acc_j — what τ would be if acceptance at each depth were independent."""
    agree, n = [0] * k, [0] * k
    for p, cont in zip(prompts, continuations):
        seq = torch.tensor(p + cont)
        mask = torch.zeros(seq.shape[0], dtype=torch.bool)
        mask[len(p):] = True
        rows = select_rows(mask, None)
        if getattr(head, "block", False):
            h, hidden = block_states(target, head, seq, rows)
            for d in range(1, k + 1):
                keep = scored_rows(mask, rows, d)
                at = torch.tensor([rows[j] + d for j in keep], dtype=torch.long)
                agree[d - 1] += block_agreement(head, h[keep, head.first_row + d - 1], seq.to(h.device)[at],
                                                hidden[0, at])
                n[d - 1] += len(keep)
            continue
        states, hidden = teacher_forced_states(target, head, seq, k, rows)
        for d in range(1, k + 1):
            keep = scored_rows(mask, rows, d)
            if keep:
                preds = torch.stack([states[d][j] for j in keep])
                agree[d - 1] += agreement(head, preds, hidden[0, [rows[j] + d for j in keep]], d)
                n[d - 1] += len(keep)
    accs = [a / max(c, 1) for a, c in zip(agree, n)]
    sim, survive = 1.0, 1.0
    for acc in accs:
        survive *= acc
        sim += survive
    return sim, accs
