"""One timing discipline for every ratio spechead prints (benches, the k=auto probe, the demo's speedup).

A shared machine's speed moves by several times within seconds, so a ratio of two timings is only worth
what the protocol behind it is worth. The protocol here:

- both sides run under the same thread budget (`thread_budget`), after a warm-up;
- they alternate A B, B A, A B … (`measure_pairs`): each pair runs the two sides back to back, the
  order flipping every pair so a drift in the machine's speed favours neither;
- the ratio is taken pair by pair (`Paired`), and reported as the median with its min–max;
- the load seen while measuring is recorded (`runnable_others`: other runnable threads on the machine),
  and a ratio whose pairs spread wider than `SPREAD_BOUND` says so (`Paired.stable`);
- a verdict ("faster", "not faster", "within noise") follows from the spread, not from the median alone.

The per-core figure (`--threads 1` on both sides) is the one to compare across machines and loads: two
single-threaded sides share a busy machine alike, while a multi-threaded side whose threads wait on a
preempted peer (an intra-op pool) slows far more than a side of independent workers.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

# pairs whose (max - min) / median is above this are "unstable": the figure is printed with a warning
SPREAD_BOUND = 0.25


@dataclass(frozen=True)
class Paired:
    """A ratio measured pair by pair (e.g. baseline seconds / ours seconds of the same pair)."""

    ratios: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.ratios:
            raise ValueError("Paired: no pairs measured")

    @classmethod
    def of(cls, numerators: list[float], denominators: list[float]) -> "Paired":
        if len(numerators) != len(denominators):
            raise ValueError(f"Paired.of: {len(numerators)} numerators for {len(denominators)} denominators")
        return cls(tuple(n / d for n, d in zip(numerators, denominators)))

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def lo(self) -> float:
        return min(self.ratios)

    @property
    def hi(self) -> float:
        return max(self.ratios)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0 for one pair or identical pairs."""
        return (self.hi - self.lo) / self.median

    def stable(self, bound: float = SPREAD_BOUND) -> bool:
        return len(self.ratios) >= 2 and self.spread <= bound

    def verdict(self, at: float = 1.0) -> str:
        """Against `at` (1: the two sides equal): "faster" when every pair is above it, "not faster" when
        none is, "within noise" when the pairs straddle it (or there is only one pair to judge by)."""
        if len(self.ratios) < 2:
            return "within noise"
        if self.lo > at:
            return "faster"
        if self.hi <= at:
            return "not faster"
        return "within noise"

    def text(self, digits: int = 2) -> str:
        f = f"{{:.{digits}f}}"
        return (f"{f.format(self.median)} [{f.format(self.lo)}–{f.format(self.hi)}] over {len(self.ratios)} "
                f"pair{'s' if len(self.ratios) != 1 else ''}")

    def kv(self, key: str, digits: int = 3) -> str:
        """`key=<median> key_min=<min> key_max=<max>`: the figure for a bench's last line."""
        f = f"{{:.{digits}f}}"
        return f"{key}={f.format(self.median)} {key}_min={f.format(self.lo)} {key}_max={f.format(self.hi)}"


def runnable_others() -> int:
    """Runnable threads on the machine other than this process's: /proc/stat's procs_running (which
    counts threads, this one included) minus this process's threads in state R. 0 where /proc is absent."""
    try:
        with open("/proc/stat") as f:
            running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
        mine = 0
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/stat") as f:
                mine += f.read().rsplit(")", 1)[1].split()[0] == "R"
        return max(0, running - max(mine, 1))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


@dataclass
class Load:
    """Other runnable threads sampled around the pairs (`runnable_others`), with the machine's size."""

    samples: list[int] = field(default_factory=list)

    def sample(self) -> None:
        self.samples.append(runnable_others())

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0

    def text(self) -> str:
        if not self.samples:
            return "load not sampled"
        return (f"other runnable threads median {self.median:g}, max {max(self.samples)} "
                f"({len(self.samples)} samples) on {os.cpu_count()} CPUs")

    def busy(self, threads: int) -> bool:
        """More runnable work than the cores left after our `threads`: the sides time-share a core."""
        return self.median > max(0, (os.cpu_count() or 1) - threads)


@dataclass
class Timings:
    """Seconds per side per pair (`measure_pairs`), and the load seen."""

    seconds: dict[str, list[float]]
    load: Load

    def ratio(self, num: str, den: str) -> Paired:
        """Pair by pair: seconds of `num` / seconds of `den` (with num the baseline: den's speedup)."""
        return Paired.of(self.seconds[num], self.seconds[den])


def measure_pairs(sides: dict[str, Callable[[], float | None]], pairs: int, warmup: int = 1,
                  clock: Callable[[], float] = time.perf_counter, load: Load | None = None,
                  on_pair: Callable[[int, dict[str, float]], None] | None = None) -> Timings:
    """Run every side once per pair, `pairs` times, after `warmup` untimed runs of each. The order
    rotates every pair (two sides: A B, B A, A B, …). A side returns None (timed here by `clock`) or
    its own seconds (when it times only part of its call). `on_pair(i, {side: seconds})` after each."""
    if pairs < 1:
        raise ValueError(f"measure_pairs: pairs={pairs}, expected ≥ 1")
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            sides[name]()
    load = load if load is not None else Load()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for i in range(pairs):
        order = names[i % len(names):] + names[:i % len(names)] if len(names) > 2 else (names if i % 2 == 0 else names[::-1])
        load.sample()
        got = {}
        for name in order:
            t0 = clock()
            own = sides[name]()
            got[name] = float(own) if own is not None else clock() - t0
        for name in names:
            seconds[name].append(got[name])
        if on_pair is not None:
            on_pair(i, got)
    load.sample()
    return Timings(seconds, load)


@contextlib.contextmanager
def thread_budget(threads: int | None) -> Iterator[int]:
    """torch's intra-op threads set to `threads` (None: unchanged) for the block; yields the count."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def thread_settings(spec: str) -> list[int]:
    """A bench's `--threads`: "all,1" (the default: the whole machine's figure, then the per-core one), or
    a comma list of counts; "all" is torch's count at start."""
    import torch

    out = []
    for part in str(spec).split(","):
        part = part.strip()
        if part == "all":
            out.append(torch.get_num_threads())
        elif part.isdigit() and int(part) >= 1:
            out.append(int(part))
        else:
            raise ValueError(f"--threads {spec!r}: expected a comma list of 'all' and counts ≥ 1")
    return list(dict.fromkeys(out))


def warn_if_unstable(name: str, p: Paired, load: Load, threads: int, bound: float = SPREAD_BOUND) -> str | None:
    """The line a bench prints under a figure it cannot vouch for (or None): pairs that spread more
    than `bound`, or a machine busier than the cores the sides left free (then a multi-threaded figure
    measures the load: its pairs can agree with each other and still be wrong)."""
    why = []
    if not p.stable(bound):
        why.append("one pair only" if len(p.ratios) < 2 else f"pairs spread {p.spread:.0%} > {bound:.0%}")
    if load.busy(threads):
        why.append(f"the machine was busy ({load.text()})" + (": quote the 1-thread figure" if threads > 1 else ""))
    if not why:
        return None
    return f"UNSTABLE {name} at {threads} thread(s): {'; '.join(why)} — the median is not a figure to quote"
