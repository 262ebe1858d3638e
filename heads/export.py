"""Export of a trained head. Native format now (config.json + model.safetensors, no frozen target
weights); engine formats (vLLM / SGLang) build on it — see ../shared/reference/export_formats.md.

Every export is reloaded and compared with the live head on fixed inputs before it is reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from heads.checkpoint import load_native, save_native
from heads.mtp import MTPHead


@torch.no_grad()
def probe_logits(head: MTPHead, seed: int = 0, length: int = 8) -> torch.Tensor:
    """Head logits on a fixed random (state, token) sequence — a fingerprint of the function."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, length, head.args.hidden_size, generator=gen).to(head.dtype)
    tokens = torch.randint(0, head.args.vocab_size, (1, length), generator=gen)
    out = head(hidden, tokens, torch.arange(length).expand(1, length))
    return head.logits(out)


def export_native(head: MTPHead, out_dir: str | Path, fingerprint: dict[str, Any] | None = None) -> Path:
    """Write the native checkpoint and prove the round trip: the reloaded head's logits must equal
    the live head's bit for bit."""
    out = save_native(head, out_dir, fingerprint)
    reloaded = load_native(out, head.tied, head.args)
    if not torch.equal(probe_logits(head), probe_logits(reloaded)):
        raise RuntimeError(f"{out}: reloaded head gives different logits than the exported one")
    return out
