"""Wall-clock timers for the phases of an RL step (rollout, reward, old/ref log-prob, actor update,
weight sync, ...)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["Timers"]


class Timers:
    """Accumulate wall seconds per named phase.

    Usage::

        timers = Timers()
        with timers("rollout"):
            ...
        with timers("actor_update"):
            ...
        metrics.update({f"time/{k}": v for k, v in timers.pop().items()})

    Entering the same name twice accumulates; different names may nest (an outer phase includes the
    inner one's time). Re-entering a name that is still running raises.

    Args:
        cuda_sync: call ``torch.cuda.synchronize()`` at the start and end of each phase (when CUDA is
            available) so asynchronous kernels are charged to the phase that launched them.
        clock: seconds clock (default ``time.perf_counter``; injectable for tests).
    """

    def __init__(self, cuda_sync: bool = False, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._cuda_sync = cuda_sync
        self._totals: dict[str, float] = {}
        self._running: set[str] = set()

    def _sync(self) -> None:
        if self._cuda_sync:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"timer name must be a non-empty string, got {name!r}")
        if name in self._running:
            raise RuntimeError(f"timer {name!r} is already running; phases of the same name cannot nest")
        self._running.add(name)
        self._sync()
        start = self._clock()
        try:
            yield
        finally:
            self._sync()
            self._totals[name] = self._totals.get(name, 0.0) + (self._clock() - start)
            self._running.discard(name)

    def elapsed(self) -> dict[str, float]:
        """Accumulated seconds per finished phase so far, without resetting."""
        return dict(self._totals)

    def pop(self) -> dict[str, float]:
        """Return accumulated seconds per phase (insertion order) and reset the totals.

        Phases still running keep running; their time is counted when they end.
        """
        out, self._totals = self._totals, {}
        return out
