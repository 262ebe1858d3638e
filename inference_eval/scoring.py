"""Teacher-forced scoring in the engine: the head's states along a known token sequence, computed the
way the engine's draft path computes them, and the simulated τ built on their top-1 agreement.

For each scored row i of a sequence the target recomputes H (and the aux layers a head reads); the engine's own
proposer (`PagedHeadProposer`, on a one-sequence paged cache) runs the head over the target's states for depth 1,
then its draft chain from row i with the true tokens forced for depths 2..D — what the draft loop computes once the
target has accepted up to row i. Depth d's state at row i estimates H_{i+d}; its logits predict t_{i+d+1}.
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
from inference_eval.engine.head import PagedHeadProposer
from inference_eval.paged import BlockAllocator, BlockTable
from inference_eval.speculative import chain_tau, full_vocab_logits


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


def one_sequence(prop, dev: torch.device, length: int, k: int, block_size: int = 16) -> BlockTable:
    """Attach proposer `prop` to a one-sequence paged cache of `length` slots on `dev`; its block table."""
    blocks = -(-length // block_size)
    prop.attach(SimpleNamespace(device=dev, num_blocks=blocks, block_size=block_size, k=k, static=None))  # eager passes
    table = BlockTable(block_size, dev)
    table.extend(BlockAllocator(blocks).allocate(blocks))
    return table


@torch.no_grad()
def chain_states(head, x: torch.Tensor, ids: torch.Tensor, depth: int, rows: list[int]) -> dict[int, list[torch.Tensor]]:
    """{d: a chain head's depth-d state [S] at each row of `rows`} along tokens `ids` [T] from what it reads of the
    target (`x` [1, T, ·], head.target_input of its states), through the engine's proposer: depth 1 over every row,
    then each row's chain with the true tokens forced (rows in descending order: row i's chain writes slots
    i + 1.., which only rows > i read)."""
    t = ids.shape[0]
    prop = PagedHeadProposer(head)
    table = one_sequence(prop, x.device, t + depth + 2, depth)
    s1 = prop._refresh([SimpleNamespace(table=table)], x[:, : t - 1], [ids[1:t].tolist()], [0])  # [T-1, S]
    states: dict[int, list[torch.Tensor]] = {d: [] for d in range(1, depth + 1)}
    states[1] = [s1[i] for i in rows]
    deeper: dict[int, list[torch.Tensor]] = {}
    for i in sorted(rows, reverse=True) if depth > 1 else []:
        forced = ids[i + 2: i + depth + 1].tolist()
        forced += [0] * (depth - 1 - len(forced))  # past the end: scored out, as in the unroll
        deeper[i] = prop.chain([SimpleNamespace(table=table, m=i + 1)], s1[i][None, None], depth,
                               lambda j, _: forced[j - 1: j])
    for d in range(2, depth + 1):
        states[d] = [deeper[i][d - 1][0, 0] for i in rows]
    return states


@torch.no_grad()
def teacher_forced_states(target, head, ids: torch.Tensor, depth: int, rows: list[int]
                          ) -> tuple[dict[int, list[torch.Tensor]], torch.Tensor]:
    """({d: the head's depth-d state at each row of `rows`}, the target's states H [1, T, H] in float32),
    on the target's device."""
    ids = ids.to(target.device)
    out = target(ids[None], logits="none", capture_layers=head.capture_layers)
    hidden = out.hidden.float()
    aux = torch.cat(out.aux, dim=-1).float() if head.capture_layers else None
    if hasattr(head, "teacher_forced_states"):  # a draft LM (heads/draft_lm.py): tokens only, its own forward
        return head.teacher_forced_states(ids, depth, rows), hidden
    if not head.chain:  # medusa: every depth straight from the target state
        return {d: list(head(hidden[:, rows], depth=d)[0]) for d in range(1, depth + 1)}, hidden
    return chain_states(head, head.target_input(hidden, aux), ids, depth, rows), hidden


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
    prop = PagedBlockProposer(head)
    table = one_sequence(prop, dev, t + rows_per_block, k, block_size)
    prop.write_context([SimpleNamespace(table=table)], target_state(head, out.hidden, out.aux), [(0, t)], [0])
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
    return chain_tau(accs), accs
