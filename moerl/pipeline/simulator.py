"""Discrete-event simulator of a pipeline :class:`~moerl.pipeline.schedules.Schedule`.

Each rank executes its action list in order; an action starts when the rank is free and every input it
depends on has finished on its producing rank (plus a fixed ``comm`` latency when producer and consumer are
on different ranks).  Sends never block.  This is the same execution model as the interpreter (blocking
receives, asynchronous sends), so the simulated order is the executed order.

Costs follow the DualPipe README notation: ``F`` forward of a chunk, ``B`` *full* backward of a chunk
(input-grad plus weight-grad), ``W`` the weight-grad part of ``B`` (so a split input-grad step costs
``B - W``), ``FB`` ("F&B") one forward overlapped with one full backward (default ``F + B``: no overlap).
Published bubbles in this notation (equal per-chunk costs, ``PP`` = pipeline ranks of 1F1B/ZB1P, and for
DualPipe/DualPipeV the number of ranks of the bidirectional pipe, i.e. ``PP`` for DualPipe and ``2*P`` for
DualPipeV on ``P`` ranks): 1F1B ``(PP-1)(F+B)``, ZB1P ``(PP-1)(F+B-2W)``, DualPipe ``(PP/2-1)(F&B+B-3W)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from moerl.pipeline.schedules import Action, Schedule, ScheduleError, action_deps

__all__ = ["Costs", "SimResult", "simulate", "published_bubble"]

Num = Union[float, int]


@dataclass(frozen=True)
class Costs:
    """Per-chunk compute costs (any time unit; seconds when measured).

    ``F``, ``B``, ``W`` are scalars (same for every chunk) or sequences indexed by chunk id.  ``B`` is the
    full backward; ``W <= B`` its weight-gradient part.  ``FB`` is the cost of an overlapped F&B action:
    a scalar, a mapping ``(forward chunk, backward chunk) -> cost`` (measured per pair; pairs it lacks cost
    ``F[f] + B[b]``), or None for ``F[f] + B[b]`` (sequential, as on CPU).  ``comm`` is the latency added when a
    tensor crosses ranks.  ``Bi`` is the cost of a split input-grad step; None means ``B - W`` (an ideal
    split; moerl's generic autograd split costs more, so measured costs pass it explicitly).
    """

    F: Union[Num, Sequence[Num]] = 1.0
    B: Union[Num, Sequence[Num]] = 2.0
    W: Union[Num, Sequence[Num]] = 1.0
    FB: Union[None, Num, Mapping[tuple[int, int], Num]] = None
    comm: Num = 0.0
    Bi: Union[None, Num, Sequence[Num]] = None

    def _get(self, v, chunk: int) -> float:
        return float(v[chunk] if isinstance(v, (list, tuple)) else v)

    def cost(self, action: Action) -> float:
        """Duration of ``action``."""
        k, c = action.kind, action.chunk
        if k == "F":
            return self._get(self.F, c)
        if k == "BW":
            return self._get(self.B, c)
        if k == "W":
            return self._get(self.W, c)
        if k == "B":
            if self.Bi is not None:
                return self._get(self.Bi, c)
            return self._get(self.B, c) - self._get(self.W, c)
        if isinstance(self.FB, Mapping) and (c, action.chunk_b) in self.FB:
            return float(self.FB[(c, action.chunk_b)])
        if self.FB is not None and not isinstance(self.FB, Mapping):
            return float(self.FB)
        return self._get(self.F, c) + self._get(self.B, action.chunk_b)


@dataclass
class SimResult:
    """Simulation output.

    Attributes:
        timeline: per rank, ``(start, end, action)`` tuples in execution order.
        makespan: time from 0 to the last action's end.
        busy: per rank, total compute time.
        bubble: per rank, ``makespan - busy`` (idle time inside the step).
        peak_activations: per rank, the largest number of (chunk, micro-batch) whose forward has started
            and whose weight-gradient has not finished (activations that must stay in memory).
    """

    timeline: list[list[tuple[float, float, Action]]]
    makespan: float
    busy: list[float]
    bubble: list[float]
    peak_activations: list[int]
    idle_fraction: list[float] = field(default_factory=list)


def simulate(schedule: Schedule, costs: Costs) -> SimResult:
    """Simulate ``schedule`` under ``costs``.

    Raises:
        ScheduleError: the schedule deadlocks (some rank waits for an input that is never produced).
    """
    finish: dict[tuple[str, int, int], float] = {}
    rank_of = schedule.chunk_rank
    P = schedule.num_ranks
    pos = [0] * P
    clock = [0.0] * P
    timeline: list[list] = [[] for _ in range(P)]
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for r in range(P):
            acts = schedule.actions[r]
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = action_deps(schedule, a)
                if any(d not in finish for d in deps):
                    break
                start = clock[r]
                for d in deps:
                    t = finish[d] + (costs.comm if rank_of[d[1]] != r else 0.0)
                    start = max(start, t)
                end = start + costs.cost(a)
                for part in a.parts():
                    finish[part] = end
                timeline[r].append((start, end, a))
                clock[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(schedule.actions[r][pos[r]]) for r in range(P) if pos[r] < len(schedule.actions[r])}
            raise ScheduleError(f"schedule {schedule.name} deadlocks: ranks wait at {stuck}")
    makespan = max((tl[-1][1] for tl in timeline if tl), default=0.0)
    busy = [sum(e - s for s, e, _ in tl) for tl in timeline]
    bubble = [makespan - b for b in busy]
    peaks = []
    for tl in timeline:
        live = peak = 0
        for _, _, a in tl:
            for kind, _, _ in a.parts():
                if kind == "F":
                    live += 1
                    peak = max(peak, live)
                elif kind == "W":
                    live -= 1
        peaks.append(peak)
    idle = [b / makespan if makespan else 0.0 for b in bubble]
    return SimResult(timeline, makespan, busy, bubble, peaks, idle)


def published_bubble(name: str, pp: int, F: float, B: float, W: float, FB: Optional[float] = None) -> float:
    """The published per-rank bubble (DualPipe README table) for schedule ``name``.

    ``pp`` is the number of pipeline ranks for 1F1B/ZB1P/DualPipe.  For DualPipeV on ``P`` ranks pass
    ``pp = 2*P``: DualPipeV is one half of a DualPipe on ``2P`` ranks ("cut-in-half").
    """
    fb = F + B if FB is None else FB
    if name == "1f1b":
        return (pp - 1) * (F + B)
    if name == "zb1p":
        return (pp - 1) * (F + B - 2 * W)
    if name in ("dualpipe", "dualpipev"):
        return (pp / 2 - 1) * (fb + B - 3 * W)
    raise ValueError(f"unknown schedule {name!r}")
