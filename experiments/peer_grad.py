"""One loss and one gradient, both codes: speculators 0.9's EAGLE-3 step against ours on the same weights and
batch (docs/RESULTS.md §8).

    .venv/bin/python -m experiments.peer_grad --data runs/peer_compare_100k/peer/data --out runs/peer_grad \
        [--weights runs/peer_compare_100k_ttt1/peer/ckpt/0] [--batch 0] [--seed 42]

1. **The peer's side** (a subprocess in `.venv-speculators`, behind experiments/peer_shims.py's CPU shims):
   speculators' own `train` entry point runs up to building its trainer — its model (`from_training_args`,
   its own initialisation, or `--weights`' tensors loaded over it), its vocabulary mapping, its data loader
   over the export (experiments/peer_data.py, its multipack sampler, `shift_batch`, its collate), its loss
   config — with `--ttt-steps 1`; then, instead of training, one batch of its epoch 0 goes through its forward
   (its autocast, its `compute_metrics` / `compound_loss`) and `loss.backward()`. Written: the weights
   (`save_pretrained`, the checkpoint format artifacts/formats/speculators.py reads), the batch, the sampler's rows,
   the loss, every parameter's gradient before its `clip_grad_norm_(…, 1.0)` and that total norm.
2. **Ours** (this process): the same weights read into our `Eagle3Head` (artifacts/formats/speculators.py, lm_head
   frozen as the peer's), the same conversations from the store the export came from, collated by our
   training collate, and `DraftHeadModule.compute_loss` at depth 1 with `w_hidden: 0` (KL only), backward.
   Compared: the loss, per parameter the gradient's cosine and norm ratio, the total norm (our
   `gradient_clip_val: 1.0` clips the same norm), and which positions carry loss. A second row recomputes
   ours with the peer's loss mask (`ours_peer_mask`), to separate the mask from everything else. (Left: the
   peer also trains the last row of a conversation, the teacher's distribution after its last token, which
   ours drops because its mask index runs past the row; it counts only in conversations cut while an
   assistant turn is on.)
3. **Initialisation**: the peer's fresh model's parameters (without `--weights`) against our head as
   train/run.py `init_head` builds it with the e3peer1 settings (random init, the three EAGLE-3.1 norms,
   frozen lm_head), per tensor: mean, std, min, max.

Writes `<out>/peer_grad.json` and prints the tables. Takes a few minutes on one CPU thread (two builds of the
49k-vocabulary loss, the target's tensors loaded twice).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SPEC_PYTHON = ROOT / ".venv-speculators" / "bin" / "python"


# ---- the peer's side (runs in .venv-speculators) -------------------------------------------------------
def peer_side(out: Path, weights: str | None, batch_index: int, argv: list[str]) -> None:
    """speculators' `train` up to its trainer, then one forward/backward of batch `batch_index` of epoch 0."""
    from experiments.peer_shims import apply_cpu_shims, with_cpu_defaults

    applied = apply_cpu_shims()
    argv = with_cpu_defaults(argv) if applied else argv
    import speculators.train.cli as spec_cli
    from safetensors.torch import load_file, save_file
    from speculators.train.config import TrainConfig

    base = spec_cli.Trainer

    class OneBatch(base):  # type: ignore[misc, valid-type]
        def run_training(self) -> None:  # what its train_epoch does for one step, without the optimizer step
            model = self.model
            if weights:
                state = load_file(str(Path(weights) / "model.safetensors"))
                missing, unexpected = model.load_state_dict(state, strict=False)
                trainable_missing = [k for k in missing if dict(model.named_parameters())[k].requires_grad] \
                    if missing else []
                if unexpected or trainable_missing:
                    raise RuntimeError(f"{weights}: unexpected {unexpected}, trainable missing {trainable_missing}")
            model.train()
            init_dir = out / "weights"
            model.save_pretrained(init_dir)
            sampler = self.train_loader.batch_sampler
            sampler.set_epoch(0)
            rows = list(iter(sampler))[batch_index]
            sampler.set_epoch(0)
            for i, batch in enumerate(self.train_loader):
                if i == batch_index:
                    break
            gpu = {k: v.to(self.local_rank) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with torch.autocast(self.device_type, dtype=self.config.hidden_states_dtype):
                _tokens, loss, metrics = model(**gpu, **(self.config.train_call_kwargs or {}))
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()
                     if p.requires_grad and p.grad is not None}
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the trainer's clip: its pre-clip norm
            save_file(grads, str(out / "peer_grads.safetensors"))
            tensors = {k: v.contiguous() for k, v in batch.items() if isinstance(v, torch.Tensor)}
            save_file(tensors, str(out / "peer_batch.safetensors"))
            info = {"loss": float(loss), "total_norm": float(total), "rows": [int(r) for r in rows],
                    "trainable": sorted(grads), "frozen": sorted(n for n, p in model.named_parameters()
                                                                if not p.requires_grad),
                    "metrics": {k: float(v) for k, v in metrics.items() if torch.is_tensor(v) and v.numel() == 1},
                    "train_call_kwargs": {k: (v if isinstance(v, (int, float, str)) else repr(v))
                                          for k, v in (self.config.train_call_kwargs or {}).items()},
                    "config": {"lr": self.config.lr, "optimizer": self.config.optimizer,
                               "weight_decay": self.config.weight_decay,
                               "muon_weight_decay": self.config.muon_weight_decay,
                               "hidden_states_dtype": str(self.config.hidden_states_dtype)},
                    "optimizer_groups": [
                        {"type": type(o).__name__,
                         "params": [n for g in o.param_groups for n in _names(model, g["params"])],
                         **{k: (list(v) if isinstance(v, tuple) else v) for k, v in o.param_groups[0].items()
                            if k in ("lr", "weight_decay", "betas", "momentum", "eps", "adjust_lr_fn", "nesterov")}}
                        for o in self.optimizers],
                    "shims": applied, "argv": argv}
            (out / "peer_side.json").write_text(json.dumps(info, indent=1))

    spec_cli.Trainer = OneBatch
    out.mkdir(parents=True, exist_ok=True)
    spec_cli.main(TrainConfig.resolve(argv))


def _names(model: torch.nn.Module, params: list) -> list[str]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids.get(id(p), "?") for p in params]


# ---- our side ------------------------------------------------------------------------------------------
def run_peer(data: Path, out: Path, weights: str | None, batch_index: int, seed: int,
             extra: list[str]) -> dict[str, Any]:
    from experiments.peer_data import peer_command

    info = json.loads((data / "peer_data.json").read_text())
    cmd = peer_command(data, info, str(out / "ckpt"), epochs=1).split()[3:]  # drop python -m experiments.peer_shims
    cmd += ["--ttt-steps", "1", "--max-steps", "1", "--seed", str(seed), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    args = [str(SPEC_PYTHON), "-m", "experiments.peer_grad", "--peer-side", str(out), "--batch", str(batch_index)]
    if weights:
        args += ["--weights", weights]
    subprocess.run([*args, "--", *cmd], cwd=ROOT, env=env, check=True)
    return json.loads((out / "peer_side.json").read_text())


def our_name(peer_name: str) -> str:
    return "midlayer." + peer_name[len("layers.0."):] if peer_name.startswith("layers.0.") else peer_name


def shifted_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The peer's loss mask in our indexing: ours weights row i by the mask of t_{i+2} (loss_mask[i+2]); the
    peer's `shift_batch` weights the same row by the mask of t_{i+1}. So loss_mask'[j] = loss_mask[j-1] within
    each row (padded rows: position 0 gets 0)."""
    m = batch["loss_mask"]
    out = torch.zeros_like(m)
    out[:, 1:] = m[:, :-1]
    return out & batch["valid"]


def our_grads(head, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor], dict[str, Any]]:
    from train.module import DraftHeadModule

    module = DraftHeadModule(head, depth=1, w_hidden=0.0, w_kl=1.0, depth_decay=1.0)
    head.zero_grad(set_to_none=True)
    out = module.compute_loss(batch)
    out["loss"].backward()
    grads = {n: p.grad.detach().clone() for n, p in head.named_parameters() if p.requires_grad and p.grad is not None}
    return float(out["loss"]), grads, {"n_tokens": int(out["n_tokens"]), "acc_d1": float(out["acc_d1"])}


def compare(peer: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    rows = []
    for name in sorted(peer):
        g_p = peer[name].double().flatten()
        g_o = ours.get(our_name(name))
        if g_o is None:
            rows.append({"param": name, "ours": "no gradient"})
            continue
        g_o = g_o.double().flatten()
        cos = float(torch.nn.functional.cosine_similarity(g_p, g_o, dim=0))
        rows.append({"param": name, "cos": cos, "norm_ratio": float(g_o.norm() / g_p.norm().clamp(min=1e-30)),
                     "peer_norm": float(g_p.norm()), "our_norm": float(g_o.norm())})
    rows += [{"param": our, "peer": "no gradient"} for our in sorted(ours) if our not in {our_name(n) for n in peer}]
    return rows


def total_norm(grads: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def tensor_stats(t: torch.Tensor) -> dict[str, float]:
    t = t.detach().double()
    return {"mean": float(t.mean()), "std": float(t.std()) if t.numel() > 1 else 0.0,
            "min": float(t.min()), "max": float(t.max())}


def our_batch(store, info: dict[str, Any], rows: list[int]) -> tuple[dict[str, torch.Tensor], list[str]]:
    from train.data import collate

    index = {sid: i for i, sid in enumerate(store.sample_ids())}
    ids = [info["train_ids"][r] for r in rows]
    return collate([store[index[sid]] for sid in ids]), ids


def peer_positions(pb: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the peer's batch carries: loss tokens, position ids (per document?), documents, padding."""
    doc = pb["document_ids"][0]
    pos = pb["position_ids"][0]
    real = doc >= 0
    starts = [int(pos[doc == d][0]) for d in doc[real].unique().tolist()]
    return {"tokens": int(real.sum()), "padded_to": int(doc.numel()), "documents": int(doc[real].unique().numel()),
            "loss_tokens": int(pb["loss_mask"][0][real].sum()), "first_position_per_document": starts}


def init_comparison(peer_init: Path, target_dir: str, store, info: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    """The peer's fresh parameters against our init_head's (e3peer1 settings), per tensor."""
    from safetensors.torch import load_file

    from heads.eagle3 import Eagle3Config, Eagle3Head
    from inference_eval.model import tied_target

    tied, args, parts = tied_target(target_dir)
    vd = int(json.loads((peer_init / "config.json").read_text())["draft_vocab_size"])
    head = Eagle3Head(args, Eagle3Config(aux_layers=tuple(info["target_layer_ids"]), draft_vocab_size=vd,
                                         init="random", norm_before_fc=True, norm_before_residual=True,
                                         norm_output=True, train_lm_head=False), tied)
    index = {sid: i for i, sid in enumerate(store.sample_ids())}
    head.set_draft_vocab(store.token_counts(args.vocab_size, [index[s] for s in info["train_ids"]]))
    head.reset_parameters(seed, parts.first_input_norm)  # as train/run.py init_head
    peer = load_file(str(peer_init / "model.safetensors"))
    ours = head.state_dict()
    rows = []
    for name in sorted(peer):
        if name in ("embed_tokens.weight", "d2t", "t2d") or not peer[name].is_floating_point():
            continue
        o = ours.get(our_name(name))
        rows.append({"param": name, "peer": tensor_stats(peer[name]),
                     "ours": tensor_stats(o) if o is not None else None})
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--peer-side" in argv:
        split = argv.index("--")
        p = argparse.ArgumentParser()
        p.add_argument("--peer-side", required=True)
        p.add_argument("--weights", default=None)
        p.add_argument("--batch", type=int, default=0)
        a = p.parse_args(argv[:split])
        peer_side(Path(a.peer_side), a.weights, a.batch, argv[split + 1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="the peer's export (experiments/peer_data.py; peer_data.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--weights", default=None, help="a speculators checkpoint dir to load (default: its fresh init)")
    p.add_argument("--batch", type=int, default=0, help="which batch of the peer's epoch 0")
    p.add_argument("--seed", type=int, default=42, help="the peer's --seed (its init and its sampler)")
    p.add_argument("--our-seed", type=int, default=0, help="our init_head seed for the init comparison")
    a, extra = p.parse_known_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    data, out = Path(a.data), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = json.loads((data / "peer_data.json").read_text())
    side = run_peer(data, out, a.weights, a.batch, a.seed, extra)

    from safetensors.torch import load_file

    from artifacts.formats.speculators import read_speculators_eagle3
    from data.store import FeatureStore
    from inference_eval.model import tied_target

    tied, args, _ = tied_target(info["verifier"])
    head = read_speculators_eagle3(out / "weights", tied, args).float()
    head.lm_head.weight.requires_grad_(False)  # the peer's lm_head is frozen (its `frozen` list says so)
    store = FeatureStore(info["store"], verify="header")
    batch, ids = our_batch(store, info, side["rows"])
    pb = load_file(str(out / "peer_batch.safetensors"))
    peer_grads = load_file(str(out / "peer_grads.safetensors"))

    report: dict[str, Any] = {"peer": {k: side[k] for k in ("loss", "total_norm", "rows", "trainable", "frozen",
                                                          "train_call_kwargs", "config", "optimizer_groups")},
                              "conversations": ids, "peer_batch": peer_positions(pb)}
    # the same tokens? the peer's batch is our rows concatenated, shifted by one (its shift_batch)
    lens = batch["valid"].sum(1).tolist()
    peer_toks = pb["input_ids"][0][pb["document_ids"][0] >= 0]
    ours_shift = torch.cat([batch["input_ids"][r][1:n] for r, n in enumerate(lens)])
    report["same_tokens"] = bool(torch.equal(peer_toks, ours_shift))
    report["our_batch"] = {"rows": len(ids), "tokens": int(sum(lens)), "padded": list(batch["input_ids"].shape),
                           "loss_mask_tokens": int(batch["loss_mask"].sum())}
    runs = {}
    for label, b in (("ours", batch), ("ours_peer_mask", {**batch, "loss_mask": shifted_mask(batch)})):
        loss, grads, extra_out = our_grads(head, b)
        runs[label] = {"loss": loss, "total_norm": total_norm(grads), **extra_out, "grads": compare(peer_grads, grads)}
    report["ours"] = runs
    # which rows carry loss: ours (t_{i+2} assistant) against the peer's (t_{i+1} assistant), counted on our rows
    lm = batch["loss_mask"] & batch["valid"]
    ours_rows = int(lm[:, 2:].sum())
    peer_rows = int((lm[:, 1:-1]).sum())
    both = int((lm[:, 2:] & lm[:, 1:-1]).sum())
    report["mask"] = {"ours_loss_rows": ours_rows, "peer_loss_rows": peer_rows, "both": both,
                      "peer_loss_tokens_in_its_batch": report["peer_batch"]["loss_tokens"]}
    if a.weights is None:
        report["init"] = init_comparison(out / "weights", info["verifier"], store, info, a.our_seed)
    (out / "peer_grad.json").write_text(json.dumps(report, indent=1))
    print_report(report)


def print_report(r: dict[str, Any]) -> None:
    print(f"conversations {len(r['conversations'])}, same tokens {r['same_tokens']}; peer batch {r['peer_batch']}")
    print(f"our batch {r['our_batch']}; mask {r['mask']}")
    print(f"peer: loss {r['peer']['loss']:.6f} total grad norm {r['peer']['total_norm']:.6f}")
    for label, run in r["ours"].items():
        print(f"{label}: loss {run['loss']:.6f} total grad norm {run['total_norm']:.6f} n_tokens {run['n_tokens']}")
        print("| param | cos | norm ratio (ours / peer) | peer norm |")
        for g in run["grads"]:
            if "cos" in g:
                print(f"| {g['param']} | {g['cos']:.6f} | {g['norm_ratio']:.6f} | {g['peer_norm']:.4g} |")
            else:
                print(f"| {g['param']} | {g} |")
    for row in r.get("init", []):
        p, o = row["peer"], row["ours"]
        fmt = lambda s: "–" if s is None else f"{s['mean']:.4g} ± {s['std']:.4g} [{s['min']:.3g}, {s['max']:.3g}]"  # noqa: E731
        print(f"init {row['param']}: peer {fmt(p)} | ours {fmt(o)}")


if __name__ == "__main__":
    main()
