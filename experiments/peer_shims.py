"""Run the peer trainer speculators 0.9.0 (vllm-project) on CPU: `speculators train` behind CPU shims.

    .venv-speculators/bin/python -m experiments.peer_shims <speculators train args...>

`make speculators-env` builds `.venv-speculators` (CPU torch 2.13, speculators==0.9.0, transformers 5.19).
This module patches, from our side and in this process only, the few places where speculators' single-
process train path assumes an accelerator; nothing inside site-packages is edited. Then it hands the
arguments to speculators' own console-script entry point (`speculators = speculators.__main__:app`, a
typer app; `train` forwards everything to `TrainConfig.resolve` and `speculators.train.cli.main`), as
`speculators train <args>` would.

The shims (each a no-op where an accelerator is there):
- `torch.accelerator.synchronize` / `torch.cuda.synchronize`: no-ops (the trainer's step timer calls them
  unconditionally; on a CPU-only torch they raise "Cannot access accelerator device").
- the trainer's device: `Trainer` moves the model and every batch to `get_local_rank()` (the int 0, i.e.
  cuda:0) and autocasts on `"cuda"` when no accelerator is found; here both become `"cpu"`.
- `get_current_device()` (checkpoint loading on resume) answers `"cpu"` instead of `"cuda:0"`.
- the DataLoader is built with `pin_memory=False` (pinning needs an accelerator).
- Muon's Newton–Schulz iteration (`torch.optim._muon._zeropower_via_newtonschulz`, which speculators' `muon`
  optimizer uses) runs in float32 instead of torch's fixed bfloat16: a CPU without bf16 instructions runs
  the bf16 matmuls ~170x slower (a 3-step smoke run spent 26 s of its 31 s steps there). The same iteration,
  same coefficients; only the dtype differs (our train/optim.py `ns_dtype` does the same on CPU).
  `PEER_SHIMS_MUON_NS_DTYPE=bfloat16` keeps torch's.
- CPU defaults, added only when the flag is absent: `--num-workers 0` (its default, 12 spawned workers,
  would compete with training for 2 cores), `--draft-attn-impl sdpa` (flex attention wants a GPU
  compiler), `--loss-implementation eager` (the fused loss is a Triton kernel),
  `--hidden-states-dtype float32` (bf16 autocast is ~170x slower on a CPU without bf16 instructions;
  CPU autocast then warns that float32 is not an autocast dtype and runs in float32).

What `speculators train` consumes (read in speculators/train/data.py, dataloader.py, cli.py and
hs_connectors/transfer.py; experiments/peer_data.py writes it from one of our feature stores):

    <data_path>/                 a `datasets.Dataset.save_to_disk` directory, one row per conversation:
        input_ids  int64 [T]       token ids (the verifier's tokenisation, chat template applied)
        loss_mask  int64 [T]       1 where token t is an assistant token (ours: the same convention)
        seq_len    int64           T (the multipack sampler packs rows by it)
    <data_path>/hidden_states/hs_<row>.safetensors   (FileTransfer, `--hidden-states-backend file`)
        token_ids      int64 [T]        must equal the row's input_ids (else the row is skipped)
        hidden_states  [T, K+1, H]      the K aux states in `--target-layer-ids` order, then the last
                                        layer's output before the final norm (the verifier norm and
                                        lm_head are applied by the trainer to make the teacher logits)
    <data_path>/token_freq.pt    {token id: count} over the loss tokens: with --draft-vocab-size N the
                                 trainer picks the N most frequent (ties by lower id; the same rule as
                                 our Eagle3Head.set_draft_vocab) and caches d2t-N.npy / t2d-N.npy there.

Layer ids: speculators' id i is vLLM's capture point, the hidden state entering decoder layer i (id L
is the last layer's output) — the same convention as our store's `aux_layers`, so the store's ids are
passed unchanged as `--target-layer-ids`. The rows are split in order: the first
int(rows · --train-data-ratio) train, the rest validate. When every cached hidden-states file is present
the trainer never talks to a vLLM server (`--on-missing raise` makes that explicit); without them its
`generate` mode asks a running vLLM (`--vllm-endpoint`) for the states of each row.

speculators' EAGLE-3 defaults differ from the original EAGLE-3 and from ours: norm_before_residual,
norm_before_fc and norm_output are on (EAGLE-3.1), the draft lm_head stays frozen at the verifier's
rows, the optimizer is Muon at lr 1e-3 with a linear decay, 3 training-time-test steps, and every draft
layer uses sliding-window attention (window 2048) unless `--full-attention-indices 0` is given.
artifacts/formats/speculators.py reads the checkpoints it writes (`<save_path>/<epoch>/`).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from train.optim import newton_schulz

CPU_DEFAULTS: dict[str, str] = {
    "--num-workers": "0",
    "--draft-attn-impl": "sdpa",
    "--loss-implementation": "eager",
    "--hidden-states-dtype": "float32",
}


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def with_cpu_defaults(argv: list[str]) -> list[str]:
    """argv plus each CPU default whose flag it does not set (a `--config` YAML is not looked into)."""
    out = list(argv)
    for flag, value in CPU_DEFAULTS.items():
        if not _has_flag(out, flag):
            out.append(f"{flag}={value}")
    return out


def apply_cpu_shims() -> list[str]:
    """Install the shims; returns what was patched (for the log)."""
    import torch

    applied: list[str] = []
    if torch.accelerator.is_available():
        return applied  # a real accelerator: speculators runs as it is

    def _no_sync(*_a: Any, **_k: Any) -> None:
        return None

    torch.accelerator.synchronize = _no_sync  # type: ignore[assignment]
    torch.cuda.synchronize = _no_sync  # type: ignore[assignment]
    applied.append("torch.accelerator.synchronize / torch.cuda.synchronize: no-ops")

    import speculators.train.checkpointer as spec_ckpt
    import speculators.train.dataloader as spec_dl
    import speculators.train.trainer as spec_trainer
    import speculators.utils.util as spec_util

    def _cpu_device() -> str:
        return "cpu"

    spec_util.get_current_device = _cpu_device
    spec_ckpt.get_current_device = _cpu_device
    applied.append("get_current_device -> 'cpu' (checkpoint loading)")

    # the trainer's own binding of get_local_rank: model.to(...) and batch .to(...) go to "cpu", not 0 (cuda:0)
    spec_trainer.get_local_rank = _cpu_device
    orig_init = spec_trainer.Trainer.__init__

    def _init(self, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        self.device_type = "cpu"  # autocast device (only read in the train / val loops)

    spec_trainer.Trainer.__init__ = _init  # type: ignore[method-assign]
    applied.append("Trainer: device 'cpu' (model, batches) and autocast on 'cpu'")

    base_loader = spec_dl.DataLoader

    class _UnpinnedLoader(base_loader):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["pin_memory"] = False
            super().__init__(*args, **kwargs)

    spec_dl.DataLoader = _UnpinnedLoader
    applied.append("DataLoader(pin_memory=False)")

    ns_dtype = os.environ.get("PEER_SHIMS_MUON_NS_DTYPE", "float32")
    if ns_dtype != "bfloat16":
        import torch.optim._muon as muon

        dtype = getattr(torch, ns_dtype)

        def _newton_schulz(grad, ns_coefficients, ns_steps, eps):  # torch's signature, our iteration
            if ns_steps >= 100:
                raise ValueError("Number of steps must be less than 100 for computational efficiency")
            return newton_schulz(grad, ns_steps, eps, dtype, tuple(ns_coefficients))

        muon._zeropower_via_newtonschulz = _newton_schulz
        applied.append(f"Muon Newton-Schulz in {ns_dtype} (torch's: bfloat16)")
    return applied


def speculators_app():
    """speculators' console-script entry point (`speculators = speculators.__main__:app`), found through the
    installed package's entry points."""
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="console_scripts") if e.name == "speculators"]
    if not eps:
        raise RuntimeError("no `speculators` console script is installed here: run this with "
                           ".venv-speculators/bin/python (make speculators-env)")
    return eps[0].load()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":  # accept `... peer_shims train <args>` too
        argv = argv[1:]
    applied = apply_cpu_shims()
    args = with_cpu_defaults(argv) if applied else argv
    for line in applied:
        print(f"[peer_shims] {line}", file=sys.stderr)
    print(f"[peer_shims] speculators train {' '.join(args)}", file=sys.stderr)
    app = speculators_app()
    app(args=["train", *args], prog_name="speculators", standalone_mode=True)


if __name__ == "__main__":
    main()
