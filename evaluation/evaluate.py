"""Acceptance evaluation (docs/design.md §7): τ and α_d of a head on a prompt set through the engine."""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from artifacts.export import load_any
from core.files import atomic_write_bytes
from core.progress import Progress
from core.timing import Paired, measure_pairs
from data.conversations import load_tokenizer
from data.prompts import load_prompts, stop_token_ids
from data.store import DTYPES, FeatureStore
from evaluation.settings import EvalConfig
from evaluation.tau_stats import tau_standard_error
from inference_eval.engine import (PagedBlockProposer, PagedHeadProposer, PagedTreeProposer, engine_proposer,
                                  engine_run, frequent_ids, round_cost)
from inference_eval.model import LlamaForCausalLM, tied_from_model, tied_target
from inference_eval.scoring import simulated_tau
from inference_eval.speculative import GREEDY, DraftModelProposer, Sampling, SpecStats
from inference_eval.targets import TargetConfig, load_target

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    label: str
    k: int
    tau: float
    alpha: list[float]
    target_passes: int
    new_tokens: int
    tokens_per_s: float
    per_category_tau: dict[str, float]
    prompts: int
    # [target passes, tokens emitted] per prompt, in prompt order, and τ's standard error over prompts
    # (evaluation/tau_stats.py): what a paired comparison of two heads on the same prompts reads
    per_prompt: list[list[int]] | None = None
    tau_se: float | None = None
    compile_s: float = 0.0  # seconds the engine's static step spent compiling (evaluate.compile), outside tokens_per_s

    def summary(self) -> str:
        a = " ".join(f"{x:.3f}" for x in self.alpha)
        se = f"±{self.tau_se:.3f}" if self.tau_se is not None else ""
        return (f"{self.label}: tau={self.tau:.3f}{se} alpha=[{a}] tok/s={self.tokens_per_s:.1f} "
                f"({self.prompts} prompts)")


def prompt_counts(stats: list[SpecStats]) -> dict[str, Any]:
    """EvalResult's per_prompt and tau_se from each prompt's own counters."""
    per_prompt = [[s.steps, s.emitted] for s in stats]
    return {"per_prompt": per_prompt, "tau_se": tau_standard_error(per_prompt) if any(p[0] for p in per_prompt)
            else None}


def evaluate_batched(target, proposer, prompts: list[dict[str, Any]], k: int, max_new_tokens: int,
                     stop_ids: set[int], batch_size: int, label: str = "head", warmup: int = 0, repeats: int = 1,
                     sampling: Sampling = GREEDY, outputs: list | None = None, progress: bool = False,
                     progress_log_s: float | None = None, compile: str = "off") -> EvalResult:
    """The evaluation of every stage and batch size, through the paged engine (inference_eval/engine/):
    every prompt queued at once, `batch_size` sequences decoded together (continuous batching; 1: one
    slot). `proposer`: None (plain decoding), a head, a draft LM, or an engine proposer (e.g. a
    PagedTreeProposer); k is the tree's depth for a tree. tokens/s = all new tokens / wall time, median
    over `repeats` passes; seconds spent compiling (`compile`) are left out of the time."""
    ids = [p["ids"] for p in prompts]
    max_len = max(map(len, ids)) + max_new_tokens + 2
    compile_s = 0.0
    if warmup:
        compile_s += run_engine(target, proposer, ids[:warmup], k, max_new_tokens, stop_ids, batch_size, sampling,
                                max_len, compile=compile)[1].compile_s
    speeds, first = [], None
    for r in range(max(repeats, 1)):
        bar = Progress(len(ids), f"evaluate {label}" + (f" ({r + 1}/{repeats})" if repeats > 1 else ""), "prompt",
                       bar=progress, every_s=progress_log_s)
        t0 = time.perf_counter()
        with bar:
            results, eng = run_engine(target, proposer, ids, k, max_new_tokens, stop_ids, batch_size, sampling,
                                      max_len, on_finish=bar.update, compile=compile)
        speeds.append(sum(len(r.tokens) for r in results) / (time.perf_counter() - t0 - eng.compile_s))
        compile_s += eng.compile_s
        first = first or (results, eng)
    results, eng = first
    by_cat: dict[str, SpecStats] = {}
    for p, r in zip(prompts, results):
        by_cat.setdefault(p.get("category", "all"), SpecStats(k=eng.k)).merge(r.stats)
        if outputs is not None:
            outputs.append(r.tokens)
    return EvalResult(label=label, k=eng.k, tau=eng.stats.tau, alpha=eng.stats.alpha, target_passes=eng.stats.steps,
                      new_tokens=sum(len(r.tokens) for r in results), tokens_per_s=statistics.median(speeds),
                      per_category_tau={c: s.tau for c, s in sorted(by_cat.items())}, prompts=len(prompts),
                      compile_s=compile_s, **prompt_counts([r.stats for r in results]))


PLAIN = "<plain decoding>"  # evaluate_paired's own side (a label no configured proposer takes)


def evaluate_paired(target, runs: dict[str, tuple[Any, int]], prompts: list[dict[str, Any]], max_new_tokens: int,
                    stop_ids: set[int], batch_size: int, sampling: Sampling = GREEDY, pairs: int = 4, warmup: int = 0,
                    repeats: int = 1, progress: bool = False, progress_log_s: float | None = None,
                    compile: str = "off") -> tuple[dict[str, tuple[EvalResult, list[list[int]], Paired]], EvalResult]:
    """Every proposer of `runs` ({label: (proposer, k)}) and plain decoding over the same prompts, timed
    by core/timing.py's discipline: the prompts are cut into `pairs` groups (each at least a batch), and
    on each group plain decoding and every proposer run back to back, the order rotating from group to
    group. A proposer's speedup is taken group by group — its tokens/s over plain decoding's on the same
    prompts, measured seconds apart — and reported as the median with its min–max (`Paired`); tokens/s
    are totals. τ, α and the outputs come from the first of `repeats` passes. Returns ({label: (result,
    outputs in prompt order, speedup)}, plain decoding's result). Seconds spent compiling (`compile`) are left out
    of every side's time."""
    ids = [p["ids"] for p in prompts]
    max_len = max(map(len, ids)) + max_new_tokens + 2
    groups = groups_of(len(ids), pairs, batch_size)
    sides = {PLAIN: (None, 1), **runs}
    compile_s = dict.fromkeys(sides, 0.0)
    if warmup:
        for name, (proposer, k) in sides.items():
            compile_s[name] += run_engine(target, proposer, ids[:warmup], k, max_new_tokens, stop_ids, batch_size,
                                          sampling, max_len, compile=compile)[1].compile_s
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[int]] = {name: [] for name in sides}
    results: dict[str, list] = {name: [None] * len(ids) for name in sides}
    stats: dict[str, SpecStats] = {}
    names, unit = list(sides), 0
    bar = Progress(len(groups) * max(repeats, 1) * len(names), "evaluate (paired passes)", "pass", bar=progress,
                   every_s=progress_log_s)
    with bar:
        for r in range(max(repeats, 1)):
            for idx in groups:
                for name in names[unit % len(names):] + names[:unit % len(names)]:
                    proposer, k = sides[name]
                    t0 = time.perf_counter()
                    done, eng = run_engine(target, proposer, [ids[i] for i in idx], k, max_new_tokens, stop_ids,
                                           batch_size, sampling, max_len, compile=compile)
                    seconds[name].append(time.perf_counter() - t0 - eng.compile_s)
                    compile_s[name] += eng.compile_s
                    tokens[name].append(sum(len(x.tokens) for x in done))
                    if r == 0:
                        for i, x in zip(idx, done):
                            results[name][i] = x
                        stats.setdefault(name, SpecStats(k=eng.k)).merge(eng.stats)
                    bar.update(1, side=name if name != PLAIN else "plain")
                unit += 1

    def result(name: str) -> EvalResult:
        by_cat: dict[str, SpecStats] = {}
        for p, x in zip(prompts, results[name]):
            by_cat.setdefault(p.get("category", "all"), SpecStats(k=stats[name].k)).merge(x.stats)
        st = stats[name]
        return EvalResult(label=name, k=st.k, tau=st.tau, alpha=st.alpha, target_passes=st.steps,
                          new_tokens=sum(len(x.tokens) for x in results[name]),
                          tokens_per_s=sum(tokens[name]) / sum(seconds[name]),
                          per_category_tau={c: v.tau for c, v in sorted(by_cat.items())}, prompts=len(prompts),
                          compile_s=compile_s[name], **prompt_counts([x.stats for x in results[name]]))

    def rate(name: str) -> list[float]:
        return [n / t for n, t in zip(tokens[name], seconds[name])]

    out = {name: (result(name), [x.tokens for x in results[name]], Paired.of(rate(name), rate(PLAIN)))
           for name in runs}
    return out, result(PLAIN)


def run_engine(target, proposer, prompts: list[list[int]], k: int, max_new_tokens: int, stop_ids: set[int],
               batch_size: int, sampling: Sampling, max_len: int, on_finish=None, compile: str = "off"):
    """The prompts through the engine (`engine_run`), sized for `max_len` tokens (the prompt set's longest);
    `compile`: its static step (inference_eval/engine/static.py; the engine's `compile_s` says how long compiling
    took, which a timed caller subtracts)."""
    return engine_run(target, prompts, max_new_tokens, proposer, k, stop_ids, sampling, on_finish=on_finish,
                      seq_len=max_len, max_batch=batch_size, compile=compile)


def plain_tokens_per_s(target, prompts: list[dict[str, Any]], max_new_tokens: int, stop_ids: set[int],
                       warmup: int = 0, repeats: int = 1, sampling: Sampling = GREEDY, batch_size: int = 1,
                       compile: str = "off") -> float:
    """Plain decoding speed in the paged engine: the median over `repeats` passes after `warmup` prompts."""
    return evaluate_batched(target, None, prompts, 1, max_new_tokens, stop_ids, batch_size, "plain", warmup,
                            repeats, sampling, compile=compile).tokens_per_s


def choose_k(settings, measure) -> tuple[Any, dict[str, Any]]:
    """`evaluate.k: auto`: measure each setting — a k, or a dict {"k": k, "draft_vocab": n} (n most
    frequent tokens; None: the whole vocabulary) — and take the one of the best median speedup over
    plain decoding. `measure(setting)` gives the setting's speedup as a `core.timing.Paired` (the
    setting and plain decoding timed pair by pair in alternation, so a drift in the machine's speed
    cancels out of each pair). Settings of one draft vocabulary run in increasing k; once a k is slower
    than the k before it by more than their spread (every pair of it below every pair of the one before),
    the larger k of that vocabulary are not probed (`skipped`; one pair has no spread: no stop). Returns the setting and the table it
    came from; `chosen_verdict` is the spread's verdict ("faster", "not faster", "within noise")."""
    settings, table, skipped, last = list(settings), [], [], {}
    best = None
    for setting in settings:
        row = dict(setting) if isinstance(setting, dict) else {"k": setting}
        vocab = row.get("draft_vocab")
        before = last.get(vocab)
        if before is not None and before.get("stop"):
            skipped.append(row)
            continue
        p = measure(setting)
        row.update(speedup=p.median, speedup_min=p.lo, speedup_max=p.hi, pairs=list(p.ratios), verdict=p.verdict())
        table.append(row)
        if (before is not None and row["k"] > before["row"]["k"] and len(p.ratios) >= 2
                and len(before["row"]["pairs"]) >= 2 and p.hi < before["row"]["speedup_min"]):
            last[vocab] = {"row": row, "stop": True}
        else:
            last[vocab] = {"row": row, "stop": False}
        if best is None or row["speedup"] > best[1]["speedup"]:
            best = (setting, row)
    setting, row = best
    return setting, {"table": table, "skipped": skipped, "chosen_k": row["k"], "chosen_draft_vocab": row.get("draft_vocab"),
                     "chosen_speedup": row["speedup"], "chosen_speedup_min": row["speedup_min"],
                     "chosen_speedup_max": row["speedup_max"], "chosen_verdict": row["verdict"],
                     "faster_than_plain": row["speedup"] > 1}


def auto_probe_labels(spec: Any, labels: list[str]) -> set[str]:
    """`evaluate.auto_probe`: the proposers k=auto measures — `all`, or a list of labels (the demo's
    `[trained]`), the others then run at the first probed one's k and draft vocabulary: a baseline such
    as the untrained head is compared like for like and costs no probe. Listed labels that are not
    configured are ignored; when none of them is, every proposer is probed."""
    if spec is None or str(spec) == "all":
        return set(labels)
    if isinstance(spec, str) or not all(isinstance(x, str) for x in spec):
        raise ValueError(f"evaluate.auto_probe={spec!r}: expected all or a list of head / draft-model labels")
    chosen = {label for label in spec if label in labels}
    if not chosen and labels:
        log.info("evaluate: k=auto probes every proposer: none of evaluate.auto_probe=%s is configured (%s)",
                 list(spec), labels)
    return chosen or set(labels)


def draft_vocab_options(ec: EvalConfig, head, vocab_size: int) -> dict[int | None, torch.Tensor | None]:
    """`evaluate.auto_draft_vocab` for k=auto: {size: ids} of the draft vocabularies to try — None is the
    whole vocabulary; a size n drafts among the n tokens most frequent as assistant tokens in the
    training store (`store_dir`; without a store only the whole vocabulary is tried). A head with a
    sub-vocabulary of its own (EAGLE-3's d2t) keeps it."""
    sizes = list(ec.auto_draft_vocab)
    options: dict[int | None, torch.Tensor | None] = {None: None} if None in sizes else {}
    smaller = sorted({n for n in sizes if n is not None and 0 < n < vocab_size})
    if not smaller or getattr(head, "draft_ids", None) is not None or not hasattr(head, "lm_head_weight"):
        return options or {None: None}
    store_dir = ec.store_dir or Path("")
    if not (store_dir / "manifest.json").is_file():
        log.info("evaluate: k=auto tries the whole vocabulary only: no training store at %s to take token "
                 "frequencies from", store_dir)
        return options or {None: None}

    counts = FeatureStore(store_dir).token_counts(vocab_size)
    for n in smaller:
        options[n] = frequent_ids(counts, n)
    return options


def check_evaluation_config(ec: EvalConfig, heads_must_exist: bool = True) -> None:
    """What can be refused before any model or data is loaded beyond what `EvalConfig` checks when it is built (the
    dataset name, the k setting, the engine, the proposer): the prompts file, what the vLLM engine cannot run, and
    every configured head or draft-model path (each error says how to fix it; `heads_must_exist=False`: the demo's
    heads are trained later)."""
    if ec.engine == "vllm":
        from evaluation.vllm_eval import check_vllm_evaluation

        check_vllm_evaluation(ec)
    prompts_path = ec.prompts.prompts_path
    if ec.prompts.dataset == "jsonl" and not prompts_path.is_file():
        raise FileNotFoundError(f"evaluate.prompts_path={prompts_path}: no such file")
    heads = ec.heads
    models = {label: spec["path"] for label, spec in ec.draft_models.items() if spec.get("path")}
    if not heads and not ec.draft_models:
        raise ValueError("evaluate: nothing to evaluate (evaluate.heads and evaluate.draft_models are empty)")
    for key, entries in (("heads", heads if heads_must_exist else {}), ("draft_models", models)):
        for label, path in entries.items():
            if not Path(path).is_dir():
                hint = (" (train it first: spechead train, or set evaluate.heads." + label + "=null)"
                        if key == "heads" else "")
                raise FileNotFoundError(f"evaluate.{key}.{label}={path}: no such directory{hint}")


@dataclass
class EvalTarget:
    """The target as the evaluation runs it: its config, model, the heads' shared tensors, tokenizer and stops."""

    config: TargetConfig
    model: Any  # LlamaForCausalLM
    tied: Any  # TiedTarget
    head_dtype: str
    device: Any
    tokenizer: Any
    stops: set[int]


def load_evaluation_target(ec: EvalConfig, tc: TargetConfig) -> EvalTarget:
    """The target in target.dtype on target.device; the heads' tied tensors (the target's own unless
    evaluate.head_dtype asks for another dtype)."""
    t_load = time.perf_counter()
    target_dir = tc.dir
    log.info("evaluate: loading the target %s (%s) from %s", tc.name, tc.dtype, target_dir)
    tokenizer = load_tokenizer(target_dir, ec.prompts.data.chat_template)  # data.chat_template's, when set
    target = load_target(tc, "engine")
    device = target.device
    head_dtype = ec.head_dtype or tc.dtype
    if head_dtype == tc.dtype:  # the heads use the target's own E / N_f / W_lm: no second copy
        tied = tied_from_model(target)
    else:  # another dtype needs its own copy of the shared tensors (2 · V · H values)
        tied, _, _ = tied_target(target_dir, DTYPES[head_dtype], device=device)
        log.info("evaluate: head_dtype=%s differs from target.dtype=%s: the heads hold their own copy of the "
                 "embedding and lm_head", head_dtype, tc.dtype)
    if ec.weight_dtype is not None and ec.weight_dtype != tc.dtype:  # after `tied`, which the heads store apart
        try:
            target.store_weights(DTYPES[ec.weight_dtype])
        except ValueError as e:
            raise ValueError(f"evaluate.weight_dtype={ec.weight_dtype} with target.dtype={tc.dtype}: {e}") from e
        log.info("evaluate: the target's linear weights stored in %s, computed in %s", ec.weight_dtype, tc.dtype)
    log.info("evaluate: target loaded in %.0fs", time.perf_counter() - t_load)
    return EvalTarget(tc, target, tied, head_dtype, device, tokenizer, stop_token_ids(tokenizer))


def load_proposers(ec: EvalConfig, et: EvalTarget) -> dict[str, Any]:
    """{label: proposer}: the configured heads (any format; a head trained for another target is refused)
    and draft-model baselines (a checkpoint, or the target's first `layers` layers)."""
    target = et.model
    proposers: dict[str, Any] = {}
    for label, path in ec.heads.items():
        proposers[label] = load_any(path, et.tied, target.args,
                                    expected_fingerprint=et.config.fingerprint).to(et.device).eval()
        if ec.weight_dtype is not None:  # the heads' weights stored as the target's (W16A32 streams half the bytes)
            try:
                proposers[label].store_weights(DTYPES[ec.weight_dtype])
            except ValueError as e:
                raise ValueError(f"evaluate.weight_dtype={ec.weight_dtype}, head {label} ({path}): {e}") from e
    for label, spec in ec.draft_models.items():
        if spec.get("path"):
            draft = LlamaForCausalLM.from_pretrained(spec["path"], dtype=et.config.torch_dtype, device=et.device)
            if ec.weight_dtype is not None:
                draft.store_weights(DTYPES[ec.weight_dtype])
            if draft.args.vocab_size != target.args.vocab_size:
                raise ValueError(f"draft model {spec['path']}: vocabulary {draft.args.vocab_size} != the target's "
                                 f"{target.args.vocab_size} (a draft model must share the tokenizer)")
        else:
            draft = target.truncated(int(spec["layers"]))
        proposers[label] = DraftModelProposer(draft, label)
    return proposers


@dataclass
class RunSettings:
    """What every proposer's run shares: the prompts, the decoding and the timing protocol."""

    prompts: list[dict[str, Any]]
    max_new: int
    batch_size: int
    sampling: Sampling
    warmup: int
    repeats: int
    tree: dict[str, int] | None
    show_bar: bool
    every_s: float | None
    compile: str = "off"  # the engine's static step (evaluate.compile)


def groups_of(n: int, parts: int, at_least: int = 1) -> list[list[int]]:
    """0..n-1 in `parts` contiguous groups of near-equal size (fewer when a group would hold fewer than
    `at_least`: a batched engine's group must fill its batch)."""
    parts = max(1, min(parts, n // max(at_least, 1) or 1, n))
    cuts = [round(i * n / parts) for i in range(parts + 1)]
    return [list(range(cuts[i], cuts[i + 1])) for i in range(parts)]


def probe_setting(ec: EvalConfig, et: EvalTarget, rs: RunSettings, label: str, prop: Any, engine_prop: Any,
                  drafts_by_head: bool, plain_warm: list) -> tuple[int, Any, dict[str, Any]]:
    """evaluate.k=auto: the fastest measured (k, draft vocabulary) on a few prompts. Each setting is timed
    in `auto_pairs` pairs beside plain decoding (core/timing.py: the probe's prompts split into groups,
    a plain pass and the setting's pass on each, the order alternating). (k, the engine proposer at
    that setting, the probe's table)."""
    target = et.model
    probe = rs.prompts[: ec.auto_prompts]
    if not plain_warm:  # warms the engine up once for every proposer
        plain_warm.append(plain_tokens_per_s(target, probe, rs.max_new, et.stops, 1, 1, rs.sampling, rs.batch_size,
                                             rs.compile))
    top = min(ec.auto_max_k, getattr(prop, "max_depth", None) or 4)
    # a draft vocabulary is a head's (PagedHeadProposer); a draft LM (draft_model, draft_lm) has its own lm_head
    vocabs = draft_vocab_options(ec, prop, target.args.vocab_size) if drafts_by_head else {None: None}
    settings = [{"k": kk, "draft_vocab": nv} for nv in vocabs for kk in range(1, top + 1)]
    groups = [[probe[i] for i in g] for g in groups_of(len(probe), ec.auto_pairs, rs.batch_size)]
    bar = Progress(len(settings), f"evaluate {label}: k=auto", "setting", bar=rs.show_bar, every_s=rs.every_s)

    def measure(setting) -> Paired:
        proposer = (PagedHeadProposer(prop, vocabs[setting["draft_vocab"]])
                    if setting["draft_vocab"] is not None else engine_prop)
        per_token: dict[str, list[float]] = {"plain": [], "spec": []}
        for i, group in enumerate(groups):
            def side(p):
                def run() -> float:  # seconds per generated token (sampled runs may differ in length)
                    t0 = time.perf_counter()
                    results, eng = run_engine(target, p, [x["ids"] for x in group], setting["k"] if p else 1,
                                              rs.max_new, et.stops, rs.batch_size, rs.sampling, max_len,
                                              compile=rs.compile)
                    seconds = time.perf_counter() - t0 - eng.compile_s
                    return seconds / max(1, sum(len(r.tokens) for r in results))
                return run
            sides = {"plain": side(None), "spec": side(proposer)}
            got = measure_pairs(dict(reversed(sides.items())) if i % 2 else sides, 1, warmup=0)
            for name in per_token:
                per_token[name] += got.seconds[name]
        p = Paired.of(per_token["plain"], per_token["spec"])
        bar.update(1, k=setting["k"], draft_vocab=setting["draft_vocab"] or "all", speedup=round(p.median, 2))
        return p

    max_len = max(len(x["ids"]) for x in probe) + rs.max_new + 2
    with bar:
        chosen, auto = choose_k(settings, measure)
    if chosen["draft_vocab"] is not None:
        engine_prop = PagedHeadProposer(prop, vocabs[chosen["draft_vocab"]])
    log.info("evaluate %s: k=auto measured on %d prompts, each setting in %d pair(s) beside plain decoding "
             "(speedup median [min–max]):\n%s%s\n→ chose k=%d, draft vocabulary %s: %.2fx plain [%.2f–%.2f], %s%s",
             label, len(probe), len(groups),
             "\n".join(f"  k={r['k']} draft_vocab={r['draft_vocab'] or 'all'}: {r['speedup']:.2f}x "
                       f"[{r['speedup_min']:.2f}–{r['speedup_max']:.2f}]" for r in auto["table"]),
             "".join(f"\n  k={r['k']} draft_vocab={r['draft_vocab'] or 'all'}: not probed (a smaller k was already "
                     "slower than the one before it beyond their spread)" for r in auto["skipped"]),
             chosen["k"], chosen["draft_vocab"] or "all", auto["chosen_speedup"], auto["chosen_speedup_min"],
             auto["chosen_speedup_max"], auto["chosen_verdict"],
             "" if auto["faster_than_plain"] else
             "; NO setting is faster than plain decoding here: speculation slows this head down")
    return chosen["k"], engine_prop, auto


def result_entry(ec: EvalConfig, et: EvalTarget, rs: RunSettings, label: str, prop: Any, res: Any,
                 outputs: list[list[int]], auto: dict | None, follows: dict | None) -> dict[str, Any]:
    """One proposer's report entry: its run, how its k was chosen, and (greedy heads) the simulated τ."""
    entry = {**asdict(res), "proposer": "draft_model" if isinstance(prop, DraftModelProposer) else prop.kind}
    if auto is not None:
        entry["k_auto"] = auto
        entry["draft_vocab"] = auto["chosen_draft_vocab"]
    if follows is not None:
        entry["k_from"] = follows["label"]
        entry["draft_vocab"] = follows["draft_vocab"]
    if isinstance(prop, DraftModelProposer):
        entry["draft_layers"] = prop.draft.args.num_hidden_layers
    else:
        entry["checkpoint"] = ec.heads[label]
        if ec.simulated_tau and rs.sampling.greedy and rs.tree is None:  # teacher-forced top-1: greedy
            # along the decoded continuations: greedy speculative output is the target's greedy output
            sim, accs = simulated_tau(et.model, prop, [p["ids"] for p in rs.prompts], outputs, res.k)
            entry["simulated_tau"] = sim
            entry["teacher_forced_acc"] = accs
            entry["simulated_minus_real_tau"] = sim - res.tau
    return entry


def plan_proposers(ec: EvalConfig, et, rs: "RunSettings", proposers: dict[str, Any], k: int
                   ) -> dict[str, tuple]:
    """{label: (proposer, engine proposer, k, k=auto table, followed leader)}: each proposer's engine form
    and setting. With k=auto the probed proposers (evaluate.auto_probe) come first, each choosing its own
    k and draft vocabulary (`probe_setting`); the others take the first probed one's setting."""
    auto_k = ec.auto
    probing = auto_probe_labels(ec.auto_probe, list(proposers)) if auto_k else set()
    leader: dict[str, Any] | None = None  # the first probed proposer's choice, which the others follow
    plain_warm: list = []
    order = [label for label in proposers if label in probing] + [label for label in proposers if label not in probing]
    plans: dict[str, tuple] = {}
    for label in order:
        prop = proposers[label]
        is_head = not isinstance(prop, DraftModelProposer)
        engine_prop = (PagedTreeProposer(prop, **rs.tree) if rs.tree is not None and is_head
                       else prop if is_head else prop.draft)
        if ec.stop_below is not None and getattr(prop, "block", False):  # the adaptive draft length
            try:
                engine_prop = PagedBlockProposer(prop, ec.stop_below)
            except ValueError as e:
                raise ValueError(f"evaluate.stop_below, evaluate.heads.{label}: {e}") from e
        auto, follows = None, None
        drafts_by_head = is_head and type(engine_proposer(engine_prop)) is PagedHeadProposer
        if auto_k and label not in probing:  # a baseline at the probed proposer's setting (like for like)
            k = min(int(leader["k"]), getattr(prop, "max_depth", None) or int(leader["k"]))
            vocab = leader["draft_vocab"] if drafts_by_head else None
            if vocab is not None:
                options = draft_vocab_options(ec, prop, et.model.args.vocab_size)
                vocab = vocab if vocab in options else None
                if vocab is not None:
                    engine_prop = PagedHeadProposer(prop, options[vocab])
            follows = {"label": leader["label"], "draft_vocab": vocab}
            log.info("evaluate %s: k=auto not probed (evaluate.auto_probe); at %s's setting: k=%d, draft "
                     "vocabulary %s", label, leader["label"], k, vocab or "all")
        elif auto_k:
            k, engine_prop, auto = probe_setting(ec, et, rs, label, prop, engine_prop, drafts_by_head, plain_warm)
            if leader is None:
                leader = {"label": label, "k": k, "draft_vocab": auto["chosen_draft_vocab"]}
        plans[label] = (prop, engine_prop, k, auto, follows)
    return plans


def add_speed(entry: dict[str, Any], speed: Paired, ec: EvalConfig, et, rs: "RunSettings", engine_prop, k: int
              ) -> None:
    """The paired speedup over plain decoding and, for greedy chains, the load-free prediction
    (`round_cost`), into a result entry."""
    entry.update(speedup=speed.median, speedup_min=speed.lo, speedup_max=speed.hi, speedup_pairs=list(speed.ratios),
                 speed_verdict=speed.verdict())
    n_predict = ec.predict_prompts
    if rs.sampling.greedy and rs.tree is None and n_predict > 0:
        entry["predicted"] = round_cost(et.model, engine_prop, k, [p["ids"] for p in rs.prompts[:n_predict]], rs.max_new,
                                        et.stops, compile=rs.compile)
        entry["predicted_speedup"] = entry["predicted"]["predicted_speedup"]
    log.info("evaluate %s: %.2fx plain decoding [%.2f–%.2f over %d paired groups]: %s%s", entry.get("label", ""),
             speed.median, speed.lo, speed.hi, len(speed.ratios), speed.verdict(),
             f"; predicted {entry['predicted_speedup']:.2f}x (τ {entry['predicted']['tau']:.3f} / a round's "
             f"cost {entry['predicted']['cost']:.3f} plain steps)" if "predicted" in entry else "")


def evaluate_plans(ec: EvalConfig, et, rs: "RunSettings", plans: dict[str, tuple], report: dict[str, Any]) -> None:
    """Every planned proposer over the prompts — with `evaluate.plain_baseline`, paired with plain
    decoding group by group (core/timing.py) — into report["results"]."""
    target = et.model
    if ec.plain_baseline:
        log.info("evaluate: %s and plain decoding over the same %d prompts in %s paired groups", list(plans),
                 len(rs.prompts), ec.speed_pairs)
        paired, plain = evaluate_paired(target, {label: (plan[1], plan[2]) for label, plan in plans.items()},
                                        rs.prompts, rs.max_new, et.stops, rs.batch_size, rs.sampling,
                                        ec.speed_pairs, rs.warmup, rs.repeats, rs.show_bar, rs.every_s, rs.compile)
        report["plain_tokens_per_s"] = plain.tokens_per_s
        report["plain_compile_s"] = plain.compile_s
    for label, (prop, engine_prop, k, auto, follows) in plans.items():
        if ec.plain_baseline:
            res, outputs, speed = paired[label]
        else:
            outputs = []
            res = evaluate_batched(target, engine_prop, rs.prompts, k, rs.max_new, et.stops, rs.batch_size, label,
                                   rs.warmup, rs.repeats, rs.sampling, outputs, progress=rs.show_bar,
                                   progress_log_s=rs.every_s, compile=rs.compile)
        res.label = label
        log.info(res.summary())
        entry = result_entry(ec, et, rs, label, prop, res, outputs, auto, follows)
        if ec.plain_baseline:
            add_speed(entry, speed, ec, et, rs, engine_prop, k)
        report["results"][label] = entry


def evaluation_stage(ec: EvalConfig, tc: TargetConfig) -> dict[str, Any]:
    """The evaluation stage: `evaluate` (or `evaluation/vllm_eval.py` with `evaluate.engine=vllm`); the report
    written and, with the wandb logger, logged."""
    if ec.engine == "vllm":  # the target and the heads served by real vLLM (evaluation/vllm_eval.py)
        from evaluation.vllm_eval import run_vllm_evaluation

        report = run_vllm_evaluation(ec, tc)
    else:
        report = evaluate(ec, tc)
    report_to_wandb(ec.logger, report, write_report(report, ec.report))
    return report


def evaluate(ec: EvalConfig, tc: TargetConfig) -> dict[str, Any]:
    """Evaluate the configured heads (native checkpoints or engine exports) and draft-model baselines
    on the configured prompts through the engine: load → choose each proposer's setting → evaluate each
    proposer → the report."""
    sampling = ec.sampling()
    torch.manual_seed(ec.seed)
    et = load_evaluation_target(ec, tc)
    log.info("evaluate: preparing %s prompts%s", ec.prompts.dataset,
             " (turn 2: the target answers turn 1 first)" if 2 in ec.prompts.turns else "")
    prompts = load_prompts(ec.prompts, et.tokenizer, et.model, et.stops)
    if not prompts:
        raise ValueError(f"evaluate: no prompts from dataset {ec.prompts.dataset!r}")
    log.info("evaluate: %d prompts; heads %s; k=%s, %d new tokens, batch %d", len(prompts), list(ec.heads),
             "auto" if ec.auto else ec.k, ec.prompts.max_new_tokens, ec.batch_size)
    tree = ec.tree
    k, max_new = (1 if ec.auto else ec.k), ec.prompts.max_new_tokens
    if tree is not None:  # a tree's draft depth plays the part of k
        k = tree["depth"]
    rs = RunSettings(prompts, max_new, ec.batch_size, sampling, ec.warmup, ec.repeats, tree, ec.show_bar, ec.every_s,
                     ec.compile)
    report: dict[str, Any] = {"target": tc.name, "target_dtype": tc.dtype, "head_dtype": et.head_dtype,
                              "weight_dtype": str(et.model.weight_dtype).removeprefix("torch."),
                              "dataset": ec.prompts.dataset, "turn": "+".join(map(str, ec.prompts.turns)),
                              "prompts": len(prompts), "k": "auto" if ec.auto else k, "max_new_tokens": max_new,
                              "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                              "batch_size": ec.batch_size, "proposer": ec.proposer, "tree": tree, "warmup": rs.warmup,
                              "repeats": rs.repeats, "stop_below": ec.stop_below, "compile": ec.compile, "results": {}}
    proposers = load_proposers(ec, et)
    evaluate_plans(ec, et, rs, plan_proposers(ec, et, rs, proposers, k), report)
    report["results"] = {label: report["results"][label] for label in proposers}  # the configured order
    return report


def report_to_wandb(logger: dict[str, Any], report: dict[str, Any], files: list[Path]) -> str | None:
    """With the wandb logger configured (`logger=wandb`), log the report as a run of its own (job type
    `evaluate`): τ, α_d, tokens/s, speedup and τ per category per head, a table of the heads, and the
    PNG plots. Offline unless the logger says otherwise (WANDB_MODE overrides, as for training).
    Returns the run's directory (None when not logged)."""
    lcfg = logger or {}
    if "WandbLogger" not in str(lcfg.get("_target_", "")):
        return None
    import wandb

    settings = {key: v for key, v in report.items() if key != "results"}
    run = wandb.init(project=lcfg.get("project"), entity=lcfg.get("entity"), name=f"{lcfg.get('name')}-evaluate",
                     dir=lcfg.get("save_dir"), mode="offline" if lcfg.get("offline", True) else "online",
                     job_type="evaluate", config=settings, reinit="finish_previous")
    try:
        metrics: dict[str, Any] = {}
        rows = []
        for label, r in report["results"].items():
            metrics[f"eval/{label}/tau"] = r["tau"]
            metrics.update({f"eval/{label}/alpha_{d + 1}": a for d, a in enumerate(r["alpha"])})
            metrics.update({f"eval/{label}/tau_{c}": t for c, t in r["per_category_tau"].items()})
            metrics[f"eval/{label}/tokens_per_s"] = r["tokens_per_s"]
            for key in ("speedup", "simulated_tau"):
                if r.get(key) is not None:
                    metrics[f"eval/{label}/{key}"] = r[key]
            rows.append([label, r.get("proposer"), r["tau"], r.get("simulated_tau"), r["tokens_per_s"], r.get("speedup")])
        metrics["eval/table"] = wandb.Table(columns=["head", "proposer", "tau", "simulated_tau", "tokens_per_s",
                                                     "speedup"], data=rows)
        metrics.update({f"eval/{f.stem}": wandb.Image(str(f)) for f in files if f.suffix == ".png"})
        run.log(metrics)
        return run.dir
    finally:
        run.finish()


def write_report(report: dict[str, Any], json_path: Path) -> list[Path]:
    """The JSON report plus a Markdown table (`.md`) and two PNG plots beside it: α_d per draft
    position and τ per category, one series per head."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(json_path, json.dumps(report, indent=2).encode())
    md = json_path.with_suffix(".md")
    atomic_write_bytes(md, report_markdown(report).encode())
    return [json_path, md, *report_plots(report, json_path)]


def _report_k(report: dict[str, Any]) -> int:
    results = report["results"]
    return report["k"] if isinstance(report["k"], int) else max((len(r["alpha"]) for r in results.values()), default=1)


def report_markdown(report: dict[str, Any]) -> str:
    """The report's Markdown: the setting, a row per head (τ, α_d, speed), τ per category."""
    results = report["results"]
    k = _report_k(report)
    lines = [f"# Acceptance on {report['dataset']} ({report['prompts']} prompts, turn {report['turn']})", "",
             f"target {report['target']} ({report['target_dtype']}), "
             + ("greedy" if not report.get("temperature") else
                f"temperature {report['temperature']} (top_p {report.get('top_p')}, top_k {report.get('top_k')}), "
                "rejection sampling")
             + (f", tree (depth {k}, topk {report['tree'].get('topk')}, {report['tree'].get('total')} nodes)"
                if report.get("tree") else f", k={report['k']}") + f", batch {report.get('batch_size', 1)}, "
             f"{report['max_new_tokens']} new tokens", "",
             "| head | proposer | τ | simulated τ | " + " | ".join(f"α{d + 1}" for d in range(k)) + " | tok/s | speedup |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in range(k)) + " | --- | --- |"]

    def opt(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "–"

    for label, r in results.items():
        se = f" ± {r['tau_se']:.3f}" if r.get("tau_se") is not None else ""
        lines.append(f"| {label} | {r.get('proposer', 'head')} | {r['tau']:.3f}{se} | {opt(r, 'simulated_tau', '.3f')} | "
                     + " | ".join(f"{a:.3f}" for a in r["alpha"])
                     + f" | {r['tokens_per_s']:.1f} | "
                     + (f"{r['speedup_unpaired']:.2f} (unpaired)" if r.get("speedup_unpaired") is not None
                        else opt(r, 'speedup', '.2f'))
                     + (f" [{r['speedup_min']:.2f}–{r['speedup_max']:.2f}] {r['speed_verdict']}"
                        if r.get("speedup_min") is not None else "") + " |")
    if report.get("plain_tokens_per_s") and report.get("engine") == "vllm":
        lines += ["", f"through vLLM ({report['results'] and next(iter(report['results'].values()))['vllm']}, tensor "
                      f"parallel {report.get('tensor_parallel_size', 1)}): τ and α from its counters; plain greedy "
                      f"decoding {report['plain_tokens_per_s']:.1f} tok/s in a process of its own, so a speedup "
                      "compares two runs one after the other (unpaired: a busy machine moves it)"]
    elif report.get("plain_tokens_per_s"):
        lines += ["", f"plain greedy decoding: {report['plain_tokens_per_s']:.1f} tok/s over its paired passes "
                      f"({report.get('repeats', 1)} pass(es) after {report.get('warmup', 0)} warm-up prompts); a speedup "
                      "is the median over the groups of prompts decoded plainly and speculatively back to back, "
                      "[min–max] and the verdict they support"]
    cats = sorted({c for r in results.values() for c in r["per_category_tau"]})
    lines += ["", "τ per category:", "", "| head | " + " | ".join(cats) + " |",
              "| --- | " + " | ".join("---" for _ in cats) + " |"]
    for label, r in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{r['per_category_tau'].get(c, float('nan')):.3f}" for c in cats) + " |")
    return "\n".join(lines) + "\n"


def report_plots(report: dict[str, Any], json_path: Path) -> list[Path]:
    """α_d per draft position and τ per category beside the JSON report (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, k = report["results"], _report_k(report)
    cats = sorted({c for r in results.values() for c in r["per_category_tau"]})
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, r in results.items():
        ax.plot(range(1, len(r["alpha"]) + 1), r["alpha"], marker="o", label=f"{label} (τ={r['tau']:.2f})")
    ax.set(xlabel="draft position d", ylabel="α_d (given d-1 accepted)", ylim=(0, 1), xticks=range(1, k + 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    alpha_png = json_path.with_name(json_path.stem + "_alpha.png")
    fig.savefig(alpha_png, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / max(len(results), 1)
    for j, (label, r) in enumerate(results.items()):
        ax.bar([i + j * width for i in range(len(cats))], [r["per_category_tau"].get(c, 0) for c in cats], width,
               label=label)
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(cats))], cats, rotation=30, fontsize=8)
    ax.set(ylabel="τ", ylim=(1, None))
    ax.legend(fontsize=8)
    fig.tight_layout()
    cat_png = json_path.with_name(json_path.stem + "_tau_by_category.png")
    fig.savefig(cat_png, dpi=100)
    plt.close(fig)
    return [alpha_png, cat_png]
