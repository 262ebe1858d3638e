"""The batched engine (docs/design.md §5): the scheduler (scheduler.py: `Engine`, `engine_run`,
`engine_generate`), what it asks of a proposer (base.py: `Proposer`), one module per proposer (head.py,
tree.py, draft_model.py, block.py), `engine_proposer` (proposers.py) and `round_cost` (timing.py)."""

from inference_eval.engine.block import PagedBlockProposer
from inference_eval.engine.base import ChainProposer, Proposer, Request, Result, Tree
from inference_eval.engine.draft_model import PagedDraftModelProposer
from inference_eval.engine.head import PagedHeadProposer, frequent_ids
from inference_eval.engine.proposers import engine_proposer
from inference_eval.engine.scheduler import Engine, HostSyncError, engine_generate, engine_run, forbid_host_reads
from inference_eval.engine.timing import round_cost
from inference_eval.engine.tree import PagedTreeProposer

__all__ = ["ChainProposer", "Engine", "HostSyncError", "PagedBlockProposer", "PagedDraftModelProposer", "PagedHeadProposer",
           "PagedTreeProposer", "Proposer", "Request", "Result", "Tree", "engine_generate", "engine_proposer",
           "engine_run", "forbid_host_reads", "frequent_ids", "round_cost"]
