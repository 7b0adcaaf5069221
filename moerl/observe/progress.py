"""Periodic one-line progress reports that stay readable in non-tty logs (no carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """Print ``desc: done/total (pct) | rate unit/s | elapsed | eta`` at most every ``interval_s``.

    One full line per report (never ``\\r``), so a redirected log reads like::

        rollout: 96/256 (37.5%) | 12.3 samples/s | elapsed 00:07 | eta 00:13

    A final line is printed by :meth:`close` (or when leaving a ``with`` block).

    Args:
        total: number of units expected (> 0), or None when unknown (no percentage or ETA).
        desc: label at the start of the line.
        interval_s: minimum seconds between two reports (>= 0; 0 reports on every update).
        unit: unit name used in the rate.
        file: stream to print to (default ``sys.stdout`` at print time).
        clock: seconds clock (default ``time.monotonic``; injectable for tests).

    Raises:
        ValueError: total <= 0 or interval_s < 0.
    """

    def __init__(
        self,
        total: Optional[int],
        desc: str,
        *,
        interval_s: float = 10.0,
        unit: str = "it",
        file: Optional[TextIO] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total is not None and total <= 0:
            raise ValueError(f"total must be > 0 or None (unknown), got {total}")
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0 seconds, got {interval_s}")
        self.total, self.desc, self.unit = total, desc, unit
        self.interval_s = interval_s
        self.n = 0
        self._file = file
        self._clock = clock
        self._start = clock()
        self._last_print = self._start
        self._closed = False

    def update(self, n: int = 1) -> None:
        """Add ``n`` finished units; print a line if ``interval_s`` passed since the last one."""
        if n < 0:
            raise ValueError(f"update(n) needs n >= 0, got {n}")
        self.n += n
        now = self._clock()
        if now - self._last_print >= self.interval_s:
            self._print(now)

    def format(self, now: Optional[float] = None) -> str:
        """The current progress line (without newline)."""
        now = self._clock() if now is None else now
        elapsed = max(now - self._start, 0.0)
        rate = self.n / elapsed if elapsed > 0 else 0.0
        parts = []
        if self.total is not None:
            parts.append(f"{self.desc}: {self.n}/{self.total} ({100.0 * self.n / self.total:.1f}%)")
        else:
            parts.append(f"{self.desc}: {self.n}")
        parts.append(f"{rate:.3g} {self.unit}/s")
        parts.append(f"elapsed {tqdm.format_interval(elapsed)}")
        if self.total is not None:
            if rate > 0:
                eta = tqdm.format_interval(max(self.total - self.n, 0) / rate)
            else:
                eta = "?"
            parts.append(f"eta {eta}")
        return " | ".join(parts)

    def _print(self, now: float) -> None:
        self._last_print = now
        print(self.format(now), file=self._file if self._file is not None else sys.stdout, flush=True)

    def close(self) -> None:
        """Print the final line (once)."""
        if not self._closed:
            self._closed = True
            self._print(self._clock())

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
