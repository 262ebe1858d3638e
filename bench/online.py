"""Online vs offline training on the demo's data: the default target (SmolLM2-135M-Instruct)
and the demo's ShareGPT conversations, the 1-module `mtp` head (head=mtp), float32 (this CPU runs bf16 matrices
several times slower), batches of `--batch-tokens` padded tokens.

Three sides, each over the same samples, in one process, their order rotating pair by pair
(core/timing.py `measure_pairs`; `--pairs` pairs after one untimed warm-up of each):
- `offline`: `--steps` training steps (forward, backward, AdamW) over batches read from a feature store
  (train/data.py FeatureDataModule: shards read, collated) — precompute not counted;
- `online`: the same steps over the same batches with `train.data.source=online` (train/online.py): each
  batch's states computed by the target on the spot, nothing read;
- `online_prefetch`: `online` with `train.data.online.prefetch=true` (train/online.py StatesAheadLoader):
  the next batch's states computed on a thread while the head trains on this one — off by default on a
  CPU, where both share the cores; this side says what it gives here;
- `precompute`: `data.precompute.precompute` of the samples into a fresh store (the engine model,
  packed batches), what offline training pays once before its first epoch.

Figures, each the median over pairs with its min–max: `tok_s_online`, `tok_s_offline` (trained tokens
per second), `tok_s_precompute_plus_offline` = 1 / (precompute's seconds per token + offline's), the
cost of one epoch from raw conversations offline — pair by pair, so one epoch online and offline are
compared on the same load — `online_over_offline` = online's speed over offline's, and
`prefetch_over_online` = online_prefetch's over online's, pair by pair.
Peak memory: each mode's setup and `--steps` steps in a fresh process, from the samples already tokenized
(peak RSS; the online process holds the whole target, the offline one its embedding, lm_head and norm
only); `peak_mem_ratio` = online / offline. Last line:
`online tok_s_online=<x> tok_s_offline=<y> tok_s_precompute_plus_offline=<z> peak_mem_ratio=<m>
online_over_offline=… online_over_offline_min=… online_over_offline_max=… tok_s_online_prefetch=<p>
prefetch_over_online=… … tokens=<n> other_runnable=<l>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.timing import Load, Paired, measure_pairs, thread_budget, warn_if_unstable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def config(samples: int, batch_tokens: int, store_dir: Path, max_length: int = 1024):
    from hydra import compose, initialize_config_dir

    from inference_eval.targets import register_target_resolvers

    register_target_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            "head=mtp", f"data.max_samples={samples}", f"data.max_length={max_length}", "target.dtype=float32",
            "precompute.store_dtype=float32", "trainer.precision=32-true", f"train.data.batch_tokens={batch_tokens}",
            "train.data.val_fraction=0", "train.data.verify_store=header", "progress=false", "logger=csv",
            f"store_dir={store_dir}", f"run_dir={store_dir.parent / 'run'}"])


class Bench:
    """The bench's samples, target, store and one head per side. `with_target=False` (the offline memory
    process): no target in memory, the store at cfg.store_dir read as it is; `precompute=False`: no store."""

    def __init__(self, cfg, steps: int, with_target: bool = True, precompute: bool = True,
                 samples_file: Path | None = None) -> None:
        from data.precompute import tokenize_source
        from data.sources import DataConfig, target_config
        from data.store import StoreWriter
        from heads.registry import head_config, resolve_aux_layers
        from inference_eval.targets import load_target
        from train.online import OnlineSamples, TargetStates

        self.cfg, self.steps = cfg, steps
        target = dataclasses.replace(target_config(cfg.target), dtype="float32")  # both sides in float32
        self.target_dir = target.dir
        if samples_file is not None:  # a memory process: the parent's tokenized samples (parsing the ShareGPT
            # dump would set the peak RSS by itself)
            self.samples = [tuple(x) for x in json.loads(samples_file.read_text())]
        else:
            self.samples, _, _ = tokenize_source(DataConfig.of(cfg.data), self.target_dir)
        self.fingerprint = target.fingerprint
        self.store_dir = Path(cfg.store_dir)
        self.modules: dict = {}
        self.target = None
        if not with_target:
            return
        self.target = load_target(target, "engine")
        self.aux = resolve_aux_layers(cfg.precompute.get("aux_layers", "auto"), head_config(cfg.get("head") or {})[1],
                                      self.target.args.num_hidden_layers)
        self._writer = lambda root: StoreWriter(root, self.fingerprint, self.target.args.hidden_size, dtype="float32",
                                                shard_tokens=int(cfg.precompute.shard_tokens),
                                                captured={"hidden": "last_layer_pre_norm"})
        if precompute:
            self.precompute_once(self.store_dir)
        self.online_samples = OnlineSamples(self.samples, self.aux)
        self.states = TargetStates(self.target, self.aux)

    def precompute_once(self, root: Path) -> int:
        from data.precompute import precompute

        if root.exists():
            shutil.rmtree(root)
        stats = precompute(self.target, self.samples, self._writer(root), batch_tokens=8192, progress=False)
        return stats.tokens

    def module(self, name: str):
        """A fresh head and optimizer per side (the same start), built once."""
        if name not in self.modules:
            from omegaconf import OmegaConf

            from train.module import DraftHeadModule
            from train.run import init_head

            head = init_head(self.cfg, self.target_dir, None, self.target if name.startswith("online") else None)
            module = DraftHeadModule(head, **OmegaConf.to_container(self.cfg.train.module, resolve=True))
            opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
            self.modules[name] = (module, opt)
        return self.modules[name]

    def loader(self, name: str):
        from omegaconf import OmegaConf

        from train.data import FeatureDataModule
        from train.online import OnlineDataModule

        kw = OmegaConf.to_container(self.cfg.train.data, resolve=True)
        kw.pop("source", None)
        if name.startswith("online"):
            kw.pop("online", None)
            dm = OnlineDataModule(self.online_samples, self.states, **kw)
        else:
            dm = FeatureDataModule(str(self.store_dir), self.fingerprint, **kw)
        dm.setup("fit")
        loader = dm._loader(dm.train_idx, shuffle=True)
        if name == "online_prefetch":
            from functools import partial

            loader.prepare = partial(dm._prepare_ahead, torch.device("cpu"))
        return loader

    def train(self, name: str) -> tuple[int, float]:
        """`steps` steps of side `name`: (trained tokens, seconds), the loader's reads included."""
        import time

        module, opt = self.module(name)
        t0 = time.perf_counter()
        tokens = 0
        for n, batch in enumerate(self.loader(name)):
            if n == self.steps:
                break
            if name == "online":
                batch = self.states(batch)
            batch.pop("sample_index", None)
            out = module.compute_loss(batch)
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            opt.step()
            tokens += int(batch["valid"].sum())
        return tokens, time.perf_counter() - t0


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM of /proc/self/status, which starts afresh at exec (getrusage's
    ru_maxrss does not: a child started by this bench would report the parent's peak), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_processes(modes: tuple[str, ...], args, store: Path) -> dict[str, float]:
    """Peak RSS (bytes) of a fresh process per mode that sets it up and trains `steps` steps (offline: over
    `store`, without the target in memory) — the processes run side by side: each one's peak is its own."""
    procs = {mode: subprocess.Popen([sys.executable, __file__, "--mode", mode, "--samples", str(args.samples),
                                     "--max-length", str(args.max_length), "--steps", str(args.steps),
                                     "--batch-tokens", str(args.batch_tokens), "--threads", str(args.threads),
                                     "--store", str(store), "--samples-file", str(store.parent / "samples.json")],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for mode in modes}
    peaks = {}
    for mode, proc in procs.items():
        out, err = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"online: the {mode} memory process failed:\n{err[-3000:]}")
        peaks[mode] = float(json.loads(out.strip().splitlines()[-1])["peak_rss"])
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer samples, steps and pairs (under a minute)")
    ap.add_argument("--samples", type=int, help="conversations (default 48; --quick 4)")
    ap.add_argument("--max-length", type=int, help="tokens per conversation at most (default 1024; --quick 256)")
    ap.add_argument("--steps", type=int, help="training steps per side per pair (default 6; --quick 1)")
    ap.add_argument("--pairs", type=int, help="pairs (default 3; --quick 1)")
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--threads", default="all", help="intra-op threads for every side (default: torch's count)")
    ap.add_argument("--mode", choices=["offline", "online"], help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--samples-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.samples = args.samples or (4 if args.quick else 48)
    args.max_length = args.max_length or (256 if args.quick else 1024)
    args.steps = args.steps or (1 if args.quick else 6)
    pairs = args.pairs or (1 if args.quick else 3)
    logging.basicConfig(level=logging.WARNING)
    threads = torch.get_num_threads() if args.threads == "all" else int(args.threads)
    args.threads = threads
    with tempfile.TemporaryDirectory() as tmp, thread_budget(threads):
        if args.mode:  # a memory process: set up, train, report the peak
            cfg = config(args.samples, args.batch_tokens, Path(args.store), args.max_length)
            Bench(cfg, args.steps, with_target=args.mode == "online", precompute=False,
                  samples_file=Path(args.samples_file)).train(args.mode)
            print(json.dumps({"peak_rss": peak_rss()}))
            return
        cfg = config(args.samples, args.batch_tokens, Path(tmp) / "store", args.max_length)
        bench = Bench(cfg, args.steps)
        trained: dict[str, int] = {}
        pre_tokens = [0]

        def side(name: str):
            def run() -> float:
                if name == "precompute":
                    import time

                    t0 = time.perf_counter()
                    pre_tokens[0] = bench.precompute_once(Path(tmp) / "fresh")
                    return time.perf_counter() - t0
                tokens, seconds = bench.train(name)
                trained[name] = tokens
                return seconds
            return run

        load = Load()
        t = measure_pairs({n: side(n) for n in ("offline", "online", "online_prefetch", "precompute")}, pairs,
                          warmup=1, load=load,
                          on_pair=lambda i, got: print(f"pair {i + 1}/{pairs}: " + ", ".join(
                              f"{k} {v:.2f} s" for k, v in got.items()), flush=True))
        (bench.store_dir.parent / "samples.json").write_text(json.dumps(bench.samples))
        peaks = peak_processes(("offline", "online"), args, bench.store_dir)
    if not trained["online"] == trained["online_prefetch"] == trained["offline"]:
        sys.exit(f"online: the sides trained different tokens ({trained})")
    tokens = trained["offline"]
    on = [tokens / s for s in t.seconds["online"]]
    off = [tokens / s for s in t.seconds["offline"]]
    both = [1.0 / (p / pre_tokens[0] + o / tokens) for p, o in zip(t.seconds["precompute"], t.seconds["offline"])]
    ratio = t.ratio("offline", "online")  # offline's seconds / online's: online's speed over offline's
    ahead = t.ratio("online", "online_prefetch")
    pre = [tokens / s for s in t.seconds["online_prefetch"]]
    print(f"online over offline: {ratio.text(3)}; online over precompute + offline: "
          f"{Paired.of([1 / b for b in both], [1 / o for o in on]).text(3)}")
    warning = warn_if_unstable("online_over_offline", ratio, load, threads)
    if warning:
        print(warning)
    print(f"online with prefetch over online: {ahead.text(3)}")
    print(f"load while timing: {load.text()}")
    print(f"peak RSS: offline {peaks['offline'] / 2**20:.0f} MiB, online {peaks['online'] / 2**20:.0f} MiB")
    print(f"online tok_s_online={statistics.median(on):.0f} tok_s_offline={statistics.median(off):.0f} "
          f"tok_s_precompute_plus_offline={statistics.median(both):.0f} "
          f"peak_mem_ratio={peaks['online'] / peaks['offline']:.3f} {ratio.kv('online_over_offline')} "
          f"tok_s_online_prefetch={statistics.median(pre):.0f} {ahead.kv('prefetch_over_online')} "
          f"tokens={tokens} threads={threads} other_runnable={load.median:g}")

if __name__ == "__main__":
    main()
