"""evaluation/tau_stats.py: τ's standard error over prompts and the paired difference of two heads, against
hand-worked values and a bootstrap over prompts; the evaluation reports' per-prompt counts add up to their τ."""

import json
import math
import random

import pytest

from evaluation.tau_stats import main, paired_tau_difference, tau_standard_error


pytestmark = pytest.mark.unit


def test_standard_error_by_hand():
    rows = [[10, 15], [10, 12], [20, 30]]  # τ = 57 / 40 = 1.425
    z = [(15 - 1.425 * 10) / 40, (12 - 1.425 * 10) / 40, (30 - 1.425 * 20) / 40]
    assert tau_standard_error(rows) == pytest.approx(math.sqrt(3 / 2 * sum(x * x for x in z)))
    assert tau_standard_error(rows) == pytest.approx(0.085924, abs=1e-6)
    assert tau_standard_error([[10, 13], [20, 26], [40, 52]]) == pytest.approx(0.0)  # every prompt at τ = 1.3
    assert tau_standard_error([[10, 13]]) is None
    with pytest.raises(ValueError, match="emitted ≥ passes"):
        tau_standard_error([[10, 9], [10, 12]])
    with pytest.raises(ValueError, match="no target pass"):
        tau_standard_error([[0, 0], [0, 0]])


def _prompts(rng: random.Random, n: int) -> list[tuple[int, float]]:
    """(rounds, this prompt's acceptance rate): prompts of unequal length and difficulty."""
    return [(rng.randint(15, 60), rng.uniform(0.1, 0.6)) for _ in range(n)]


def _decode(rng: random.Random, prompts, lift: float = 0.0) -> list[list[int]]:
    """[passes, emitted] per prompt: each pass emits 1 + Binomial(2, p) tokens."""
    out = []
    for rounds, p in prompts:
        q = min(p + lift, 0.95)
        out.append([rounds, rounds + sum(rng.random() < q for _ in range(2 * rounds))])
    return out


def _bootstrap_se(stat, rows_list, rng: random.Random, draws: int = 4000) -> float:
    n = len(rows_list[0])
    vals = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        vals.append(stat(*[[rows[i] for i in idx] for rows in rows_list]))
    mean = sum(vals) / draws
    return math.sqrt(sum((v - mean) ** 2 for v in vals) / (draws - 1))


def _tau(rows):
    return sum(e for _, e in rows) / sum(s for s, _ in rows)


def test_standard_errors_agree_with_a_bootstrap_over_prompts():
    rng = random.Random(0)
    prompts = _prompts(rng, 60)
    a, b = _decode(rng, prompts), _decode(rng, prompts, lift=0.05)
    boot = _bootstrap_se(_tau, [a], random.Random(1))
    assert tau_standard_error(a) == pytest.approx(boot, rel=0.15)
    diff, se = paired_tau_difference(b, a)
    assert diff == pytest.approx(_tau(b) - _tau(a))
    boot_diff = _bootstrap_se(lambda x, y: _tau(x) - _tau(y), [b, a], random.Random(2))
    assert se == pytest.approx(boot_diff, rel=0.15)
    # the same prompts' difficulty cancels: the paired error is well below the two errors combined
    assert se < 0.7 * math.hypot(tau_standard_error(a), tau_standard_error(b))


def test_paired_difference_edges():
    rows = [[10, 15], [10, 12], [20, 30]]
    assert paired_tau_difference(rows, rows) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same prompt set"):
        paired_tau_difference(rows, rows[:2])


def _report(path, label, rows, prompts=3, dataset="mtbench"):
    tau = _tau(rows) if rows else 1.0
    path.write_text(json.dumps({"dataset": dataset, "turn": "1", "prompts": prompts, "max_new_tokens": 64,
                                "results": {label: {"tau": tau, "per_prompt": rows}}}))
    return path


def test_the_command_compares_two_reports(tmp_path, capsys):
    a = _report(tmp_path / "a.json", "h1", [[10, 15], [10, 12], [20, 30]])
    b = _report(tmp_path / "b.json", "base", [[10, 14], [10, 12], [20, 27]])
    main([str(a), f"{b}:base"])
    line = capsys.readouterr().out.strip()
    diff, se = paired_tau_difference([[10, 15], [10, 12], [20, 30]], [[10, 14], [10, 12], [20, 27]])
    assert f"delta_tau={diff:+.4f}" in line and f"paired_se={se:.4f}" in line and "prompts=3" in line
    with pytest.raises(SystemExit, match="no head 'nope'"):
        main([str(a), f"{b}:nope"])
    other = _report(tmp_path / "c.json", "x", [[10, 14], [10, 12], [20, 27]], dataset="alpaca")
    with pytest.raises(SystemExit, match="different prompt sets"):
        main([str(a), str(other)])
    old = _report(tmp_path / "d.json", "old", [])
    with pytest.raises(SystemExit, match="no per_prompt counts"):
        main([str(a), str(old)])
