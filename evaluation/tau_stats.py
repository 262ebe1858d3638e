"""How sure a τ is: its standard error over prompts, and the paired difference of two heads.

τ = Σ emitted / Σ passes over a prompt set. The draft rounds of one prompt are not independent (an easy
continuation is easy for every round), so the standard error treats each prompt as one draw: the ratio
estimator's linearisation z_i = (e_i − τ·s_i) / S, with e_i the tokens prompt i emitted, s_i its target
passes and S = Σ s_i, gives Var(τ) ≈ n / (n − 1) · Σ z_i².

Two heads decoding the same prompts greedily emit the same tokens (speculation is lossless), so their
difference is far less noisy than either τ: ∆τ's standard error comes from d_i = z_i(a) − z_i(b), prompt by
prompt. `python -m evaluation.tau_stats A.json[:label] B.json[:label]` prints it for two evaluation reports
(evaluation/evaluate.py writes `per_prompt` and `tau_se` into each head's entry).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Sequence


def _check(per_prompt: Sequence[Sequence[int]], what: str) -> tuple[list[int], list[int]]:
    passes = [int(p[0]) for p in per_prompt]
    emitted = [int(p[1]) for p in per_prompt]
    if any(s < 0 for s in passes) or any(e < s for e, s in zip(emitted, passes)):
        raise ValueError(f"{what}: per_prompt rows are [target passes, tokens emitted], emitted ≥ passes ≥ 0")
    if sum(passes) == 0:
        raise ValueError(f"{what}: no target pass in any prompt")
    return passes, emitted


def _linearised(per_prompt: Sequence[Sequence[int]], what: str) -> tuple[float, list[float]]:
    passes, emitted = _check(per_prompt, what)
    total = sum(passes)
    tau = sum(emitted) / total
    return tau, [(e - tau * s) / total for s, e in zip(passes, emitted)]


def tau_standard_error(per_prompt: Sequence[Sequence[int]]) -> float | None:
    """τ's standard error with prompts as the unit of sampling; None below two prompts.
    `per_prompt`: [target passes, tokens emitted] of each prompt."""
    if len(per_prompt) < 2:
        return None
    _, z = _linearised(per_prompt, "tau_standard_error")
    n = len(z)
    return math.sqrt(n / (n - 1) * sum(x * x for x in z))


def paired_tau_difference(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[float, float | None]:
    """(τ_a − τ_b, its standard error) for two heads run on the same prompts in the same order."""
    if len(a) != len(b):
        raise ValueError(f"paired_tau_difference: {len(a)} prompts against {len(b)}: the two runs must decode the "
                         "same prompt set")
    tau_a, za = _linearised(a, "paired_tau_difference (a)")
    tau_b, zb = _linearised(b, "paired_tau_difference (b)")
    n = len(a)
    if n < 2:
        return tau_a - tau_b, None
    return tau_a - tau_b, math.sqrt(n / (n - 1) * sum((x - y) ** 2 for x, y in zip(za, zb)))


def _entry(spec: str) -> tuple[str, dict]:
    """`report.json[:label]` → (its label, the head's entry); the label may be left out when the report has one head."""
    path, _, label = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    report = json.loads(Path(path).read_text())
    results = report.get("results") or {}
    if not label:
        if len(results) != 1:
            raise SystemExit(f"{path}: {len(results)} heads ({', '.join(results)}): name one as {path}:<label>")
        label = next(iter(results))
    if label not in results:
        raise SystemExit(f"{path}: no head {label!r} (it has {', '.join(results)})")
    entry = results[label]
    if not entry.get("per_prompt"):
        raise SystemExit(f"{path}: head {label!r} has no per_prompt counts (a report written before they were "
                         "recorded, or by the vLLM evaluator): evaluate it again")
    return f"{path}:{label}", {**entry, "prompt_set": (report.get("dataset"), report.get("turn"), report.get("prompts"),
                                                       report.get("max_new_tokens"))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="τ_a − τ_b of two evaluation reports, paired prompt by prompt")
    ap.add_argument("a", help="report.json[:label]")
    ap.add_argument("b", help="report.json[:label]")
    args = ap.parse_args(argv)
    (name_a, a), (name_b, b) = _entry(args.a), _entry(args.b)
    if a["prompt_set"] != b["prompt_set"]:
        raise SystemExit(f"{name_a} and {name_b} were evaluated on different prompt sets "
                         f"({a['prompt_set']} against {b['prompt_set']}): nothing to pair")
    diff, se = paired_tau_difference(a["per_prompt"], b["per_prompt"])
    se_a, se_b = tau_standard_error(a["per_prompt"]), tau_standard_error(b["per_prompt"])
    def f(x: float | None) -> str:
        return "nan" if x is None else f"{x:.4f}"

    print(f"a={name_a} tau_a={a['tau']:.4f}±{f(se_a)} b={name_b} tau_b={b['tau']:.4f}±{f(se_b)} "
          f"prompts={len(a['per_prompt'])} delta_tau={diff:+.4f} paired_se={f(se)}")


if __name__ == "__main__":
    main()
