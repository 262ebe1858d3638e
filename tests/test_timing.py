"""The timing discipline (core/timing.py) on a fake clock: pairs in alternation, the ratio pair by pair,
its median and spread, and the verdict they support."""

import pytest

from core.timing import SPREAD_BOUND, Load, Paired, measure_pairs, runnable_others, thread_settings, warn_if_unstable


pytestmark = pytest.mark.unit


class Machine:
    """A fake clock whose speed changes: work of `cost` seconds takes cost × slowdown(now)."""

    def __init__(self, slowdown):
        self.now, self.slowdown, self.log = 0.0, slowdown, []

    def clock(self) -> float:
        return self.now

    def side(self, name: str, cost: float):
        def run():
            self.log.append(name)
            self.now += cost * self.slowdown(self.now, name)
        return run


def step_at(t_step: float, factor: float, only: str | None = None):
    """The machine gets `factor` times slower from `t_step` on (for side `only`, or for both)."""
    return lambda now, name: factor if now >= t_step and (only is None or name == only) else 1.0


def test_pairs_alternate_and_the_paired_median_survives_a_load_step():
    # ours takes 1 s, the baseline 2 s: the true speedup is 2. The machine turns 3x slower mid-run.
    m = Machine(step_at(20.0, 3.0))
    t = measure_pairs({"hf": m.side("hf", 2.0), "ours": m.side("ours", 1.0)}, pairs=9, warmup=1, clock=m.clock)
    assert m.log[:2] == ["hf", "ours"]  # the warm-up
    assert m.log[2:8] == ["hf", "ours", "ours", "hf", "hf", "ours"]  # A B, B A, A B
    p = t.ratio("hf", "ours")
    assert p.median == pytest.approx(2.0)
    assert len(p.ratios) == 9 and sum(abs(r - 2.0) < 1e-9 for r in p.ratios) >= 8  # only the pair the step splits

    # unpaired, as a bench that times one side then the other would: the step lands in one side's block
    m = Machine(step_at(20.0, 3.0))
    a = measure_pairs({"hf": m.side("hf", 2.0)}, pairs=9, warmup=0, clock=m.clock).seconds["hf"]
    b = measure_pairs({"ours": m.side("ours", 1.0)}, pairs=9, warmup=0, clock=m.clock).seconds["ours"]
    unpaired = sum(a) / sum(b)
    assert unpaired < 1.0  # the load, not the code: the baseline ran before the step, ours after


def test_a_spike_in_one_side_moves_the_mean_not_the_paired_median():
    hit = {"n": 0}

    def slowdown(now, name):  # one run of `ours` is preempted for 5x its time
        if name == "ours":
            hit["n"] += 1
            return 5.0 if hit["n"] == 4 else 1.0
        return 1.0

    m = Machine(slowdown)
    t = measure_pairs({"hf": m.side("hf", 1.5), "ours": m.side("ours", 1.0)}, pairs=7, warmup=1, clock=m.clock)
    p = t.ratio("hf", "ours")
    assert p.median == pytest.approx(1.5)
    assert sum(t.seconds["hf"]) / sum(t.seconds["ours"]) < 1.2  # the pooled ratio moved
    assert p.lo == pytest.approx(0.3) and not p.stable()  # and the spread shows it


def test_a_side_can_time_itself():
    m = Machine(lambda now, name: 1.0)
    t = measure_pairs({"a": lambda: 4.0, "b": m.side("b", 2.0)}, pairs=3, warmup=0, clock=m.clock)
    assert t.seconds["a"] == [4.0, 4.0, 4.0] and t.seconds["b"] == [2.0, 2.0, 2.0]
    assert t.ratio("a", "b").median == 2.0


def test_three_sides_rotate():
    m = Machine(lambda now, name: 1.0)
    measure_pairs({n: m.side(n, 1.0) for n in "abc"}, pairs=3, warmup=0, clock=m.clock)
    assert "".join(m.log) == "abcbcacab"


@pytest.mark.parametrize("ratios, verdict", [
    ((1.21, 1.18, 1.25, 1.19), "faster"),          # every pair faster
    ((0.91, 0.97, 0.95), "not faster"),            # none faster
    ((1.17, 0.99, 1.05, 0.93), "within noise"),    # the demo's probe 1.17x, its timed pass 0.99x
    ((1.4,), "within noise"),                      # one pair: no spread to judge by
])
def test_verdict_from_recorded_pairs(ratios, verdict):
    assert Paired(ratios).verdict() == verdict


def test_spread_text_and_stability():
    p = Paired((1.0, 1.1, 1.3))
    assert p.median == 1.1 and p.lo == 1.0 and p.hi == 1.3
    assert p.spread == pytest.approx(0.3 / 1.1)
    assert p.stable() is (0.3 / 1.1 <= SPREAD_BOUND)
    assert p.text() == "1.10 [1.00–1.30] over 3 pairs"
    assert p.kv("speedup") == "speedup=1.100 speedup_min=1.000 speedup_max=1.300"
    assert Paired.of([2.0, 3.0], [1.0, 1.0]).ratios == (2.0, 3.0)
    with pytest.raises(ValueError, match="no pairs"):
        Paired(())
    with pytest.raises(ValueError, match="2 numerators for 1"):
        Paired.of([1.0, 2.0], [1.0])
    line = warn_if_unstable("speedup_vs_hf", Paired((1.0, 9.6)), Load([3, 3]), threads=2)
    assert line.startswith("UNSTABLE speedup_vs_hf at 2 thread(s): pairs spread") and "busy" in line
    assert warn_if_unstable("x", Paired((1.0, 1.02)), Load([0]), threads=1) is None
    import os

    busy = Load([os.cpu_count()] * 3)  # tight pairs, but every core taken by other work
    line = warn_if_unstable("x", Paired((4.0, 4.1)), busy, threads=2)
    assert line and "busy" in line and "1-thread figure" in line and "spread" not in line


def test_load_and_thread_settings():
    assert runnable_others() >= 0
    load = Load()
    load.sample()
    assert len(load.samples) == 1 and "other runnable threads" in load.text()
    assert Load([5, 6]).busy(threads=1) is (5.5 > max(0, (__import__("os").cpu_count() or 1) - 1))
    import torch

    assert thread_settings("all,1") == list(dict.fromkeys([torch.get_num_threads(), 1]))
    assert thread_settings("2") == [2]
    with pytest.raises(ValueError, match="--threads 'x'"):
        thread_settings("x")
