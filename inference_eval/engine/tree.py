"""EAGLE-2 dynamic draft trees from a chain head (`PagedTreeProposer`, greedy)."""

from __future__ import annotations

import torch

from inference_eval.engine.base import Request, Tree
from inference_eval.engine.head import PagedHeadProposer
from inference_eval.paged import SeqSlice


class PagedTreeProposer(PagedHeadProposer):
    """EAGLE-2's dynamic draft tree from a chain head (greedy acceptance). Level 1 holds the head's
    top-`topk` tokens after t_m; each further level expands the `topk` nodes of the previous level
    with the highest cumulative log-probability (one head pass for all of them, each attending only its
    own ancestors through a tree mask) into their top-`topk` children, up to `depth` levels; the
    `total` nodes of highest cumulative log-probability (always closed under ancestors) are verified
    by the target in one pass with a tree mask, and the longest path matching the target's argmax is
    accepted; its cache entries are moved to the contiguous positions m+1..m+a."""

    tree = True

    def __init__(self, head, depth: int = 4, topk: int = 4, total: int = 16,
                 draft_vocab: torch.Tensor | None = None) -> None:
        if not head.chain:
            raise ValueError(f"a draft tree needs a chain head, not {head.kind}")
        super().__init__(head, draft_vocab)
        self.depth, self.topk, self.total = depth, topk, total
        if min(depth, topk, total) < 1:
            raise ValueError(f"tree depth/topk/total must be ≥ 1, got {depth}/{topk}/{total}")

    def check(self, k: int) -> None:
        super().check(self.depth)

    def stats_depth(self, k: int) -> int:
        return self.depth

    def lookahead(self, k: int) -> int:
        return max(self.total + 1, self.topk * (self.depth - 1) + 1)

    def propose_tree(self, reqs: list[Request]) -> list[Tree]:
        head, kk = self.head, self.topk
        b = len(reqs)
        logp = self._logits(torch.stack([self.states[r.rid] for r in reqs])[None])[0].float().log_softmax(-1)
        top = logp.topk(kk, dim=-1)
        # per sequence: node lists (token, parent, depth, score); node ids are list indices
        tok = [top.indices[i].tolist() for i in range(b)]
        par = [[-1] * kk for _ in range(b)]
        dep = [[1] * kk for _ in range(b)]
        score = [top.values[i].tolist() for i in range(b)]
        frontier = [list(range(kk)) for _ in range(b)]  # nodes to expand at this level
        entry: list[dict[int, int]] = [{} for _ in range(b)]  # node → head-cache entry (slot m + entry)
        parent_state = [torch.stack([self.states[reqs[i].rid]] * kk) for i in range(b)]  # [K, S] per sequence
        written = 0
        for level in range(1, self.depth):
            masks = []
            for i in range(b):
                m = torch.zeros(kk, written + kk, dtype=torch.bool)
                for row, node in enumerate(frontier[i]):
                    m[row, written + row] = True
                    entry[i][node] = written + row
                    p = par[i][node]
                    while p >= 0:
                        m[row, entry[i][p]] = True
                        p = par[i][p]
                masks.append(m.to(self.engine.device))
            args = (torch.cat(parent_state)[None], [[tok[i][n] for n in frontier[i]] for i in range(b)],
                    [[reqs[i].m + level - 1] * kk for i in range(b)],
                    [SeqSlice(reqs[i].table, reqs[i].m, kk, written, masks[i]) for i in range(b)])
            # separate modules: every module that answers a deeper level writes its entries of this level too
            # (the chain's rule, draft_chain), so its nodes attend their ancestors in their own cache
            for e in head.key_writers(level + 1, self.depth):
                self._head(*args, depth=e)
            h = self._head(*args, depth=level + 1)[0].view(b, kk, -1)
            written += kk
            child = self._logits(h, depth=level + 1).float().log_softmax(-1).topk(kk, dim=-1)
            for i in range(b):
                new, states = [], {}
                for row, node in enumerate(frontier[i]):
                    for c in range(kk):
                        tok[i].append(int(child.indices[i, row, c]))
                        par[i].append(node)
                        dep[i].append(level + 1)
                        score[i].append(score[i][node] + float(child.values[i, row, c]))
                        new.append(len(tok[i]) - 1)
                        states[len(tok[i]) - 1] = h[i, row]
                frontier[i] = sorted(new, key=lambda n, s=score[i]: (-s[n], n))[:kk]
                parent_state[i] = torch.stack([states[n] for n in frontier[i]])
        trees = []
        for i in range(b):
            keep = sorted(range(len(tok[i])), key=lambda n, s=score[i], d=dep[i]: (-s[n], d[n], n))[: self.total]
            keep.sort(key=lambda n: (dep[i][n], n))  # parents before children
            index = {n: j for j, n in enumerate(keep)}
            trees.append(Tree([tok[i][n] for n in keep],
                              [index[par[i][n]] if par[i][n] >= 0 else -1 for n in keep],
                              [dep[i][n] for n in keep]))
        return trees
