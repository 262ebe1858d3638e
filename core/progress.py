"""Progress of long steps, seen in a terminal and in a log file alike.

`Progress` drives a tqdm bar when the bar is wanted (`progress: true`) and stderr is a terminal, and
logs a line every `every_s` seconds whatever stdout and stderr are — done/total, the rate and the ETA,
plus the step's own figures (loss, accepted tokens) — so a run whose output goes to a file (nohup,
a scheduler's log, hydra's `<stage>.log`) shows steady progress too. `every_s` comes from the config's
`progress_log_s` (`log_interval(cfg.progress_log_s)`); null turns the lines off, 0 logs every update (tests).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from tqdm.auto import tqdm

log = logging.getLogger("spechead.progress")
DEFAULT_EVERY_S = 30.0


def log_interval(value: float | int | str | None = DEFAULT_EVERY_S) -> float | None:
    """The `progress_log_s` setting checked: seconds between progress lines (None: no lines)."""
    if value is None:
        return None
    value = float(value)
    if value < 0:
        raise ValueError(f"progress_log_s={value}: expected null (no progress lines) or seconds ≥ 0")
    return value


def duration(seconds: float) -> str:
    seconds = int(round(max(seconds, 0)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def amount(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 or float(x).is_integer() else f"{x:.3g}"


class Progress:
    """`with Progress(total, "precompute", "tok", bar=cfg.progress, every_s=log_interval(cfg.progress_log_s)) as p:
    p.update(n, loss=0.5)`. `total` may be None (no percentage or ETA). The closing line gives the
    count, the time taken and the rate."""

    def __init__(self, total: float | None, desc: str, unit: str = "it", bar: bool = True,
                 every_s: float | None = DEFAULT_EVERY_S, unit_scale: bool = False, logger: logging.Logger = log,
                 clock=time.monotonic) -> None:
        self.total, self.desc, self.unit, self.every_s, self.log, self.clock = total, desc, unit, every_s, logger, clock
        self.done = 0.0
        self.fields: dict[str, Any] = {}
        self.t0 = self.last = clock()
        self.lines = 0
        self.closed = False
        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                        disable=not (bar and (_is_terminal(sys.stderr) or "notebook" in tqdm.__module__)))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)

    def set(self, **fields: Any) -> None:
        """Figures shown beside the count (on the bar and in the next line)."""
        self.fields.update(fields)
        if fields:
            self.bar.set_postfix({k: _fmt(v) for k, v in self.fields.items()}, refresh=False)

    def update(self, n: float = 1, **fields: Any) -> None:
        self.done += n
        self.set(**fields)
        self.bar.update(n)
        now = self.clock()
        if self.every_s is not None and now - self.last >= self.every_s:
            self.last = now
            self.log.info(self.line(now))
            self.lines += 1

    def line(self, now: float | None = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}: {amount(self.done)}"
                 + (f"/{amount(self.total)} {self.unit} ({100 * self.done / self.total:.0f}%)" if self.total
                    else f" {self.unit}")]
        parts.append(f"{amount(rate)} {self.unit}/s")
        parts += [f"{k}={_fmt(v)}" for k, v in self.fields.items()]
        parts.append(f"elapsed {duration(elapsed)}")
        if self.total and rate > 0 and self.done < self.total:
            parts.append(f"ETA {duration((self.total - self.done) / rate)}")
        return " ".join(parts)

    def close(self, failed: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.bar.close()
        if self.every_s is not None:
            elapsed = self.clock() - self.t0
            self.log.info("%s: %s after %s (%s %s, %s %s/s)%s", self.desc, "stopped" if failed else "done",
                          duration(elapsed), amount(self.done), self.unit,
                          amount(self.done / elapsed if elapsed > 0 else 0.0), self.unit,
                          "".join(f" {k}={_fmt(v)}" for k, v in self.fields.items()))


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
