"""Export a feature store's training split in the format speculators' `train` reads (experiments/peer_shims.py).

    .venv/bin/python -m experiments.peer_data --store runs/<name>/features --out runs/<name>/peer_data \
        [--heldout runs/<name>/heldout.json | --split-seed 0 --val-fraction 0.05] [--train-samples N]

Both trainers then see the same conversations, token ids, loss masks, hidden states and split:

- the split is train/data.py's: `split_order(sample ids, split_seed)`, the first
  min(max(1, round(n · val_fraction)), n − 1) held out, the rest trained on in store order (and
  `--train-samples N` keeps the first N of those, as `train.data.train_samples` does). With `--heldout`
  the split_seed and val_fraction come from the `<run_dir>/heldout.json` our training wrote, and the held-out
  ids are checked against it.
- the rows of the `datasets` directory are the training conversations (store order) followed by the
  held-out ones (split order); speculators splits rows in order at int(rows · ratio), and the ratio written
  to `peer_data.json` (`train_data_ratio`, pass it as `--train-data-ratio`) puts the boundary exactly
  after the training rows. So the peer trains on our training split and validates on our held-out split.
- the hidden states are the store's own (no target run): `hs_<row>.safetensors` holds `token_ids` and
  `hidden_states` [T, K+1, H] = the store's K aux states (the inputs of target layers `aux_layers`, the
  convention speculators and vLLM use for `--target-layer-ids`), then the store's `hidden` (the last
  layer's output before the final norm; speculators applies the verifier's norm and lm_head to it for the
  teacher logits, as our training does).
- `token_freq.pt` counts the loss tokens of the training rows only, as train/run.py does for our
  EAGLE-3 draft vocabulary; speculators' rule (most frequent, ties by lower id) is the same.

The store must hold aux layers (precompute with `head=eagle3` or `precompute.aux_layers=[...]`; for the peer's
DFlash / DSpark, the store of our `head=dflash`, which captures the block head's `target_layers`: the same export,
speculators' DFlash reads the K aux states as its context and the last one for its teacher).
`peer_data.json` records the store, the split digest, the counts, the layer ids and the verifier
directory (`data.sources.target_config`), and `command` is the peer training command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from data.store import FeatureStore
from train.data import heldout_ids_digest, split_order


def split_indices(store: FeatureStore, split_seed: int, val_fraction: float,
                  train_samples: int | None = None) -> tuple[list[int], list[int]]:
    """(train indices in store order, held-out indices in split order), exactly as FeatureDataModule.setup."""
    n = len(store)
    order = split_order(store.sample_ids(), split_seed)
    n_val = min(max(1, round(n * val_fraction)), n - 1) if val_fraction > 0 and n > 1 else 0
    val_idx, train_idx = order[:n_val], sorted(order[n_val:])
    if train_samples is not None:
        if int(train_samples) < 1:
            raise ValueError(f"--train-samples {train_samples}: at least 1")
        train_idx = train_idx[: int(train_samples)]
    return train_idx, val_idx


def boundary_ratio(n_train: int, n_rows: int) -> float:
    """A ratio r with int(n_rows · r) == n_train (speculators' ArrowDataset split)."""
    r = (n_train + 0.5) / n_rows
    if int(n_rows * r) != n_train or not 0.0 < r < 1.0:
        raise ValueError(f"no train_data_ratio splits {n_rows} rows after row {n_train}")
    return r


def hidden_states_rows(sample: dict[str, torch.Tensor], num_aux: int) -> torch.Tensor:
    """[T, K+1, H]: the K aux states (ascending layer ids), then the last layer's pre-norm output."""
    hidden = sample["hidden"]
    t, h = hidden.shape
    aux = sample["aux_hidden"].reshape(t, num_aux, h).to(hidden.dtype)
    return torch.cat([aux, hidden.unsqueeze(1)], dim=1).contiguous()


def export(store_dir: str | Path, out: str | Path, split_seed: int = 0, val_fraction: float = 0.05,
           train_samples: int | None = None, heldout: str | Path | None = None, verifier: str | None = None,
           dtype: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write the store's training and held-out rows in speculators' format under `out` (hidden states per row,
    the dataset, token frequencies of the training split, peer_data.json); returns peer_data.json's content."""
    cast = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype is not None and dtype not in cast:  # before anything under `out` is touched
        raise ValueError(f"--dtype {dtype}: choose one of {sorted(cast)}")
    store = FeatureStore(store_dir, verify="header")
    if not store.aux_layers:
        raise ValueError(f"{store_dir}: the store holds no aux layers (manifest captured.aux_layers); speculators' "
                         "EAGLE-3 reads them: precompute with head=eagle3 (or precompute.aux_layers=[...])")
    train_idx, val_idx, split_seed, val_fraction = _split(store, store_dir, heldout, split_seed, val_fraction,
                                                          train_samples)
    ids = store.sample_ids()
    val_ids = [ids[i] for i in val_idx]

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty (--overwrite replaces it)")
        import shutil
        shutil.rmtree(out)
    rows = train_idx + val_idx
    columns = _write_rows(store, rows, out, cast.get(dtype))

    counts = store.token_counts(_vocab_size(verifier), train_idx)
    torch.save({int(t): int(c) for t, c in enumerate(counts.tolist()) if c}, out / "token_freq.pt")

    ratio = boundary_ratio(len(train_idx), len(rows))
    info = {
        "store": str(Path(store_dir).resolve()), "split_seed": split_seed, "val_fraction": val_fraction,
        "train_samples": len(train_idx), "heldout_samples": len(val_idx), "rows": len(rows),
        "train_tokens": sum(columns["seq_len"][: len(train_idx)]),
        "train_data_ratio": ratio, "heldout_sha256": heldout_ids_digest(val_ids),
        "train_ids": [ids[i] for i in train_idx], "heldout_ids": val_ids,
        "target_layer_ids": list(store.aux_layers), "hidden_size": store.hidden_size,
        "hidden_dtype": dtype or str(store.hidden_dtype).removeprefix("torch."),
        "verifier": verifier, "target_fingerprint": store.manifest.get("target_fingerprint"),
    }
    info["command"] = peer_command(out, info)
    (out / "peer_data.json").write_text(json.dumps(info, indent=1))
    return info


def _split(store: FeatureStore, store_dir, heldout, split_seed: int, val_fraction: float,
           train_samples: int | None) -> tuple[list[int], list[int], int, float]:
    """(training rows, held-out rows, split_seed, val_fraction): our split of the store, as recorded in a
    run's heldout.json when given (which must then match the store)."""
    recorded = None
    if heldout is not None:
        recorded = json.loads(Path(heldout).read_text())
        split_seed, val_fraction = int(recorded["split_seed"]), float(recorded["val_fraction"])
        if recorded.get("store_samples") is not None and int(recorded["store_samples"]) != len(store):
            raise ValueError(f"{heldout}: store_samples {recorded['store_samples']} but {store_dir} holds {len(store)}")
    train_idx, val_idx = split_indices(store, split_seed, val_fraction, train_samples)
    val_ids = [store.sample_ids()[i] for i in val_idx]
    if recorded is not None and recorded.get("heldout_ids") is not None and list(recorded["heldout_ids"]) != val_ids:
        raise ValueError(f"{heldout}: its held-out ids differ from the split recomputed on {store_dir} "
                         f"(split_seed={split_seed}, val_fraction={val_fraction})")
    if not val_idx:
        raise ValueError("the split holds out no conversation; speculators needs a validation split "
                         "(--val-fraction > 0 and a store of at least 2 samples)")

    return train_idx, val_idx, split_seed, val_fraction


def _write_rows(store: FeatureStore, rows: list[int], out: Path, dtype: torch.dtype | None) -> dict[str, list]:
    """One `hidden_states/hs_<row>.safetensors` per row (token ids and the aux states, `dtype` if given)
    and the dataset's columns, saved with `datasets` in `out`."""
    from datasets import Dataset
    from safetensors.torch import save_file

    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True)
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    num_aux = len(store.aux_layers)
    for row, i in enumerate(rows):
        s = store[i]
        input_ids = s["input_ids"].long()
        hs = hidden_states_rows(s, num_aux)
        if dtype is not None:
            hs = hs.to(dtype)
        save_file({"token_ids": input_ids.contiguous(), "hidden_states": hs}, str(hs_dir / f"hs_{row}.safetensors"))
        columns["input_ids"].append(input_ids.tolist())
        columns["loss_mask"].append(s["loss_mask"].long().tolist())
        columns["seq_len"].append(int(input_ids.shape[0]))
    ds = Dataset.from_dict(columns)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    return columns


def _vocab_size(verifier: str | None) -> int:
    if verifier is None:
        raise ValueError("the target's vocab size is needed for token_freq.pt: pass --verifier <target dir>")
    return int(json.loads((Path(verifier) / "config.json").read_text())["vocab_size"])


def peer_command(out: Path, info: dict[str, Any], save_path: str | None = None, epochs: int = 2,
                 draft_vocab_size: int | None = 8192, total_seq_len: int = 1024, speculator_type: str = "eagle3",
                 block: dict[str, int] | None = None) -> str:
    """The shimmed `speculators train` command for this export (full-size defaults: 2 epochs, V_d 8192, 1024).

    `speculator_type` "dflash" / "dspark": the peer's block drafters, shaped as ours by `block` {num_layers,
    block_size, mask_token_id} (`block_peer_shape`); `draft_vocab_size` None: the target's whole vocabulary (no
    --draft-vocab-size). Every draft layer attends to the whole context (`--full-attention-indices` names them all:
    speculators' default is a 2048-token sliding window on every layer), as ours does."""
    layers = [0]
    shape: list[str] = []
    if speculator_type in ("dflash", "dspark"):
        if not block:
            raise ValueError(f"--speculator-type {speculator_type}: pass block={{num_layers, block_size, mask_token_id}}")
        layers = list(range(int(block["num_layers"])))
        shape = ["--num-layers", str(len(layers)), "--block-size", str(int(block["block_size"])),
                 "--mask-token-id", str(int(block["mask_token_id"]))]
    elif speculator_type != "eagle3":
        raise ValueError(f"--speculator-type {speculator_type}: peer_command knows eagle3, dflash and dspark")
    args = [".venv-speculators/bin/python", "-m", "experiments.peer_shims",
            "--speculator-type", speculator_type, "--verifier-name-or-path", str(info["verifier"]),
            "--data-path", str(out), "--save-path", save_path or str(out.parent / "peer_ckpt"),
            "--target-layer-ids", *[str(i) for i in info["target_layer_ids"]],
            "--train-data-ratio", repr(info["train_data_ratio"]), *shape,
            *(["--draft-vocab-size", str(draft_vocab_size)] if draft_vocab_size else []), "--epochs", str(epochs),
            "--total-seq-len", str(total_seq_len), "--full-attention-indices", *[str(i) for i in layers],
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
            "--hidden-states-dtype", "float32", "--on-missing", "raise"]
    return " ".join(shlex.quote(a) for a in args)


def block_peer_shape(head_cfg: dict[str, Any], vocab_size: int) -> dict[str, int]:
    """{num_layers, block_size, mask_token_id} of one of our block heads' configs (conf/head/dflash_net.yaml), for the
    peer's command: the same draft depth, block and mask token (ours defaults to the target's last id)."""
    mask = head_cfg.get("mask_token_id")
    return {"num_layers": int(head_cfg.get("num_layers", 3)), "block_size": int(head_cfg.get("block_size", 8)),
            "mask_token_id": vocab_size - 1 if mask is None else int(mask)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True, help="feature store directory (manifest.json), with aux layers")
    p.add_argument("--out", required=True, help="output directory (the peer's --data-path)")
    p.add_argument("--heldout", default=None, help="<run_dir>/heldout.json of our training run: its split")
    p.add_argument("--split-seed", type=int, default=0, help="train.data.split_seed (without --heldout)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="train.data.val_fraction (without --heldout)")
    p.add_argument("--train-samples", type=int, default=None, help="the first N training conversations only")
    p.add_argument("--verifier", default=None,
                   help="the target's HF directory (default: the configured target, data.sources.target_config)")
    p.add_argument("--target", default=None, help="hydra target= group for the default --verifier (e.g. smollm2)")
    p.add_argument("--dtype", default=None, help="hidden-states dtype of the files (default: the store's)")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    verifier = a.verifier
    if verifier is None:
        verifier = str(default_verifier(a.target))
    info = export(a.store, a.out, a.split_seed, a.val_fraction, a.train_samples, a.heldout, verifier, a.dtype,
                  a.overwrite)
    print(f"peer_data rows={info['rows']} train={info['train_samples']} heldout={info['heldout_samples']} "
          f"train_tokens={info['train_tokens']} layers={info['target_layer_ids']} out={a.out}")
    print(info["command"])


def default_verifier(target: str | None) -> Path:
    """The configured target's checkpoint dir (the converted SmolLM2 by default)."""
    from hydra import compose, initialize_config_dir

    from data.sources import target_config
    from inference_eval.targets import register_target_resolvers

    conf = Path(__file__).resolve().parents[1] / "conf"
    register_target_resolvers()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=[f"target={target}"] if target else [])
    return target_config(cfg.target).dir


if __name__ == "__main__":
    main(sys.argv[1:])
