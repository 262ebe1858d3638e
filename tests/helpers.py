"""Checks and loops shared by the head and training tests."""

import torch


def assert_cached_steps_equal_full_forward(head, seq: int = 12, prefill: int = 5) -> None:
    """A prefill chunk then single cached steps give the same states as one full causal forward."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, seq, head.args.hidden_size, generator=g)
    tokens = torch.randint(0, head.args.vocab_size, (1, seq), generator=g)
    full = head(hidden, tokens, torch.arange(seq).expand(1, seq))
    cache = head.new_cache(1, seq + 4)
    got = [head(hidden[:, :prefill], tokens[:, :prefill], torch.arange(prefill).expand(1, prefill), cache, 0)]
    got += [head(hidden[:, i:i + 1], tokens[:, i:i + 1], torch.tensor([[i]]), cache, i) for i in range(prefill, seq)]
    torch.testing.assert_close(torch.cat(got, 1), full, atol=1e-5, rtol=1e-5)


def train_on_batch(module, batch, steps: int, lr: float = 3e-3) -> list[float]:
    """AdamW steps of `module.compute_loss` on one fixed batch; the loss before each step."""
    opt = torch.optim.AdamW(module.head.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = module.compute_loss(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"].detach()))
    return losses


class StubHead:
    """The engine-facing attributes of a plain chain head over the target's last state, for stub
    drafters that only override `__call__`, `logits` and `new_cache`."""

    layers = [None]
    kind, chain, capture_layers, separate_modules, max_depth, draft_ids = "stub", True, (), False, None, None

    def target_input(self, hidden, aux=None):
        return hidden

    def to_target_ids(self, ids):
        return ids
