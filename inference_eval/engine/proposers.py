"""`engine_proposer`: the proposer for a head, a draft model or a tree setting (one module per proposer beside this
one)."""

from __future__ import annotations

from inference_eval.engine.block import PagedBlockProposer
from inference_eval.engine.draft_model import PagedDraftModelProposer
from inference_eval.engine.head import PagedHeadProposer
from inference_eval.engine.tree import PagedTreeProposer
from inference_eval.speculative import DraftModelProposer


def engine_proposer(x, tree: dict | None = None):
    """A proposer for the engine: as is, a draft LM (has `lm_head`) → draft model, a head → head (or
    a tree over it when `tree` gives depth/topk/total)."""
    if hasattr(x, "attach"):
        return x
    if isinstance(x, DraftModelProposer):  # a named draft LM
        x = x.draft
    if hasattr(x, "lm_head") and hasattr(x, "model"):
        return PagedDraftModelProposer(x)
    if getattr(x, "block", False):
        if tree:
            raise ValueError(f"a draft tree needs a chain head, not the block head {x.kind}")
        return PagedBlockProposer(x)
    if tree:
        return PagedTreeProposer(x, **tree)
    return PagedHeadProposer(x)
