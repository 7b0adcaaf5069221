"""Pipeline-parallel schedules written as data.

A schedule is, for every pipeline rank, the ordered list of compute actions it runs:

- ``F``  forward of one (chunk, micro-batch);
- ``B``  input-gradient backward of one (chunk, micro-batch) (zero-bubble split, weight grad deferred);
- ``W``  weight-gradient backward of one (chunk, micro-batch) whose ``B`` ran earlier;
- ``BW`` full backward (``B`` immediately followed by ``W``, not split);
- ``FB`` the forward of one (chunk, micro-batch) overlapped with the full backward of another
  (DualPipe's "F&B": on GPU the all-to-all of one hides behind the compute of the other).

A *chunk* is one piece of one model copy placed on one rank.  Every micro-batch follows a *route*:
the ordered list of chunk ids it traverses (forward in route order, backward in reverse).  The point-to-
point sends and receives an action implies follow from the routes (:meth:`Schedule.p2p`): a forward
receives its input activation from the rank holding the previous chunk of the route and sends its
output to the rank holding the next one; a backward does the same with gradients in the other direction.
Consecutive chunks on the same rank exchange tensors locally, without communication.

Schedules implemented (``P`` = number of pipeline ranks, ``M`` = number of micro-batches):

- ``1f1b``  (PipeDream-flush / Megatron 1F1B, Narayanan et al. 2021): ``P`` chunks, chunk ``s`` on rank ``s``.
- ``zb1p``  (ZB-H1 of Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with B/W split; the W of
  a micro-batch is deferred to fill the cool-down bubble; same peak activation count as 1F1B.
- ``dualpipe`` (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.2.1): two model copies run in
  opposite directions; rank ``r`` holds stage ``r`` of copy 0 and stage ``P-1-r`` of copy 1.
  Micro-batches ``0..M/2-1`` flow 0 -> P-1 through copy 0, ``M/2..M-1`` flow P-1 -> 0 through copy 1.
  Needs even ``P`` and even ``M >= 2P``.  The gradients of the two copies of each stage must be summed.
- ``dualpipev`` ("cut-in-half" DualPipe, the V-shape): ``2P`` stages, rank ``r`` holds stages ``r`` and
  ``2P-1-r``; inputs, labels and loss live on rank 0.  Needs ``M >= 2P``.

Tag-free communication: NCCL ignores point-to-point tags and matches the messages between a pair of ranks
in posting order.  :func:`comm_plan` derives, for every ordered pair, the order in which the sender sends,
and makes the receiver take that peer's messages in exactly that order (buffering the ones it needs
later); :func:`validate_fifo` (run by :func:`validate_schedule`) simulates the resulting posting under
FIFO matching and proves it matches every message right and cannot deadlock.

For steps with too few micro-batches, ``build_schedule(..., fallback=True)`` returns
:func:`gpipe_on_layout` (all forwards, then all backwards) on the same chunk layout.

The per-rank orders of DualPipe(V) follow the phase structure published with deepseek-ai/DualPipe
(warm-up forwards, forward pairs, zero-bubble B/W/F steps, the overlapped F&B main loop, cool-down
backwards and trailing weight-gradient steps); they were derived here as action lists, not copied code.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from dataclasses import dataclass
from typing import Optional

__all__ = [
    "Action",
    "P2P",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "one_f_one_b",
    "zb1p",
    "dualpipe",
    "dualpipev",
    "validate_schedule",
    "validate_fifo",
    "comm_plan",
    "gpipe_on_layout",
    "SCHEDULE_NAMES",
]

SCHEDULE_NAMES = ("1f1b", "zb1p", "dualpipe", "dualpipev")
KINDS = ("F", "B", "W", "BW", "FB")


class ScheduleError(ValueError):
    """A schedule violates a rule (missing/duplicate action, dependency order, deadlock)."""


@dataclass(frozen=True)
class Action:
    """One compute step of a rank.

    ``kind`` is one of ``F, B, W, BW, FB``.  ``chunk``/``microbatch`` name the (chunk, micro-batch) it
    acts on; for ``FB`` they name the forward part and ``chunk_b``/``microbatch_b`` the (full) backward part.
    """

    kind: str
    chunk: int
    microbatch: int
    chunk_b: Optional[int] = None
    microbatch_b: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action.kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "FB") != (self.chunk_b is not None and self.microbatch_b is not None):
            raise ValueError("Action: chunk_b/microbatch_b are required for kind 'FB' and only for it")

    def parts(self) -> list[tuple[str, int, int]]:
        """The elementary (kind, chunk, microbatch) parts, kind in F/B/W, in execution order."""
        if self.kind == "BW":
            return [("B", self.chunk, self.microbatch), ("W", self.chunk, self.microbatch)]
        if self.kind == "FB":
            return [("F", self.chunk, self.microbatch), ("B", self.chunk_b, self.microbatch_b),
                    ("W", self.chunk_b, self.microbatch_b)]
        return [(self.kind, self.chunk, self.microbatch)]

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"F{self.chunk}.{self.microbatch}&B{self.chunk_b}.{self.microbatch_b}"
        return f"{self.kind}{self.chunk}.{self.microbatch}"


@dataclass(frozen=True)
class P2P:
    """A point-to-point transfer implied by an action: ``op`` is ``send`` or ``recv``, ``peer`` the other
    rank, ``what`` is ``act`` (forward activation) or ``grad`` (gradient w.r.t. that activation), and
    (``chunk``, ``microbatch``) name the chunk whose *output* the activation is (for ``grad``: the chunk
    whose output the gradient is taken with respect to)."""

    op: str
    peer: int
    what: str
    chunk: int
    microbatch: int


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as data.

    Attributes:
        name: schedule name (one of :data:`SCHEDULE_NAMES`).
        num_ranks: pipeline-parallel size ``P``.
        num_microbatches: ``M``.
        chunk_rank: rank holding each chunk id.
        chunk_stage: model stage (module index, ``0..num_stages-1``) each chunk runs; two chunks share a
            stage in DualPipe (mirrored copies).
        routes: for each micro-batch, the chunk ids it traverses in forward order.
        actions: for each rank, its ordered tuple of :class:`Action`.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    chunk_rank: tuple[int, ...]
    chunk_stage: tuple[int, ...]
    routes: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_rank)

    @property
    def num_stages(self) -> int:
        return max(self.chunk_stage) + 1

    def chunks_of_rank(self, rank: int) -> list[int]:
        """Chunk ids held by ``rank`` (ascending)."""
        return [c for c, r in enumerate(self.chunk_rank) if r == rank]

    def stages_of_rank(self, rank: int) -> list[int]:
        """Model stage indices whose module ``rank`` must hold (one module per chunk)."""
        return [self.chunk_stage[c] for c in self.chunks_of_rank(rank)]

    def prev_chunk(self, chunk: int, microbatch: int) -> Optional[int]:
        """The chunk before ``chunk`` on ``microbatch``'s route, or None if it is the first."""
        route = self.routes[microbatch]
        i = route.index(chunk)
        return route[i - 1] if i > 0 else None

    def next_chunk(self, chunk: int, microbatch: int) -> Optional[int]:
        """The chunk after ``chunk`` on ``microbatch``'s route, or None if it is the last (loss chunk)."""
        route = self.routes[microbatch]
        i = route.index(chunk)
        return route[i + 1] if i + 1 < len(route) else None

    def is_first(self, chunk: int, microbatch: int) -> bool:
        return self.routes[microbatch][0] == chunk

    def is_last(self, chunk: int, microbatch: int) -> bool:
        return self.routes[microbatch][-1] == chunk

    def input_ranks(self) -> set[int]:
        """Ranks that need the micro-batch inputs (hold a first chunk of some route)."""
        return {self.chunk_rank[r[0]] for r in self.routes}

    def loss_ranks(self) -> set[int]:
        """Ranks that need the labels and run the criterion (hold a last chunk of some route)."""
        return {self.chunk_rank[r[-1]] for r in self.routes}

    def p2p(self, rank: int, action: Action) -> tuple[list[P2P], list[P2P]]:
        """The (receives before, sends after) that ``action`` on ``rank`` implies."""
        recvs: list[P2P] = []
        sends: list[P2P] = []
        for kind, c, m in action.parts():
            if kind == "F":
                p = self.prev_chunk(c, m)
                if p is not None and self.chunk_rank[p] != rank:
                    recvs.append(P2P("recv", self.chunk_rank[p], "act", p, m))
                n = self.next_chunk(c, m)
                if n is not None and self.chunk_rank[n] != rank:
                    sends.append(P2P("send", self.chunk_rank[n], "act", c, m))
            elif kind == "B":
                n = self.next_chunk(c, m)
                if n is not None and self.chunk_rank[n] != rank:
                    recvs.append(P2P("recv", self.chunk_rank[n], "grad", c, m))
                p = self.prev_chunk(c, m)
                if p is not None and self.chunk_rank[p] != rank:
                    sends.append(P2P("send", self.chunk_rank[p], "grad", p, m))
        return recvs, sends

    def describe(self) -> str:
        """Human-readable per-rank listing (one line per rank)."""
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions))


# ----------------------------------------------------------------------------------------------------------
# argument checks


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# ----------------------------------------------------------------------------------------------------------
# 1F1B and ZB1P


def _linear_layout(num_ranks: int, num_microbatches: int):
    chunk_rank = tuple(range(num_ranks))
    routes = tuple(tuple(range(num_ranks)) for _ in range(num_microbatches))
    return chunk_rank, chunk_rank, routes


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B: rank ``r`` runs ``min(P-1-r, M)`` warm-up forwards, then alternates one
    forward and one full backward, then drains the remaining backwards.  Any ``M >= 1``."""
    P = _check_int("num_ranks (pp size)", num_ranks, 1)
    M = _check_int("num_microbatches", num_microbatches, 1)
    chunk_rank, chunk_stage, routes = _linear_layout(P, M)
    actions = []
    for r in range(P):
        warm = min(P - 1 - r, M)
        acts = [Action("F", r, m) for m in range(warm)]
        for k in range(M - warm):
            acts.append(Action("F", r, warm + k))
            acts.append(Action("BW", r, k))
        acts.extend(Action("BW", r, m) for m in range(M - warm, M))
        actions.append(tuple(acts))
    return Schedule("1f1b", P, M, chunk_rank, chunk_stage, routes, tuple(actions))


def zb1p(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", handcrafted schedule 1): the 1F1B order
    of F and input-grad B (``min(P-1-r, M)`` warm-up forwards on rank ``r``), with rank ``r`` keeping its
    ``r`` most recent weight-grad steps W pending (running the oldest W right after each B) and draining
    them at the end.  Gradients thus travel upstream after ``B`` only and the W's fill the cool-down
    bubble; activations live until W, so every rank peaks at ``P`` live micro-batches, the same peak as
    1F1B's rank 0.  Any ``M >= 1``."""
    P = _check_int("num_ranks (pp size)", num_ranks, 1)
    M = _check_int("num_microbatches", num_microbatches, 1)
    chunk_rank, chunk_stage, routes = _linear_layout(P, M)
    actions = []
    for r in range(P):
        warm = min(P - 1 - r, M)
        acts = [Action("F", r, m) for m in range(warm)]
        pending: deque[int] = deque()

        def backward(m: int) -> None:
            acts.append(Action("B", r, m))
            pending.append(m)
            while len(pending) > r:
                acts.append(Action("W", r, pending.popleft()))

        for k in range(M - warm):
            acts.append(Action("F", r, warm + k))
            backward(k)
        for m in range(M - warm, M):
            backward(m)
        acts.extend(Action("W", r, m) for m in pending)
        actions.append(tuple(acts))
    return Schedule("zb1p", P, M, chunk_rank, chunk_stage, routes, tuple(actions))


# ----------------------------------------------------------------------------------------------------------
# DualPipe / DualPipeV


def _dual_phase_actions(n: int, m: int, h: int) -> list[tuple]:
    """Phase-level action list of one rank of a V of ``n`` ranks (index ``h``) with ``m`` micro-batches
    per phase.  Phase 0 is the chunk whose inputs flow in towards the V's turn, phase 1 the chunk on the
    way back.  Items: ("F", ph), ("B", ph) (zero-bubble: W deferred to a FIFO), ("BW", ph),
    ("W",) (pop the oldest deferred W), ("FB", ph_f, ph_b)."""
    out: list[tuple] = []
    last = h == n - 1  # the rank at the turn of the V
    out += [("F", 0)] * (2 * (n - h - 1))  # warm-up forwards of phase 0
    for _ in range(h + 1):  # forward pairs
        out += [("F", 0), ("F", 1)]
    for _ in range(n - h - 1):  # zero-bubble: B1, W1, F1
        out += [("B", 1), ("W",), ("F", 1)]
    for i in range(m - 2 * n + h + 1):  # main loop: F0&B1, F1&B0
        if i == 0 and last:
            out += [("F", 0), ("BW", 1)]  # not overlapped: shortens the turn's critical path
        else:
            out += [("FB", 0, 1)]
        out += [("FB", 1, 0)]
    for _ in range(n - h - 1):  # B1, F1&B0
        out += [("BW", 1), ("FB", 1, 0)]
    zb = False
    s6 = h + 1
    for i in range(s6):  # cool-down backwards; second half zero-bubble
        if i == s6 // 2 and h % 2 == 1:
            zb = True
        out.append(("B", 1) if zb else ("BW", 1))
        if i == s6 // 2 and h % 2 == 0:
            zb = True
        out.append(("B", 0) if zb else ("BW", 0))
    for _ in range(n - h - 1):
        out += [("W",), ("B", 0)]
    out += [("W",)] * (h + 1)
    return out


def _lower_phases(items, phase_chunk, phase_mbs) -> tuple[Action, ...]:
    """Turn phase-level items into Actions with concrete chunk ids and micro-batch indices."""
    nf = [0, 0]
    nb = [0, 0]
    wq: deque[tuple[int, int]] = deque()
    acts = []
    for it in items:
        kind = it[0]
        if kind == "F":
            ph = it[1]
            acts.append(Action("F", phase_chunk[ph], phase_mbs[ph][nf[ph]]))
            nf[ph] += 1
        elif kind in ("B", "BW"):
            ph = it[1]
            c, mb = phase_chunk[ph], phase_mbs[ph][nb[ph]]
            nb[ph] += 1
            acts.append(Action(kind, c, mb))
            if kind == "B":
                wq.append((c, mb))
        elif kind == "W":
            c, mb = wq.popleft()
            acts.append(Action("W", c, mb))
        else:  # FB
            pf, pb = it[1], it[2]
            cf, mf = phase_chunk[pf], phase_mbs[pf][nf[pf]]
            nf[pf] += 1
            cb, mb = phase_chunk[pb], phase_mbs[pb][nb[pb]]
            nb[pb] += 1
            acts.append(Action("FB", cf, mf, cb, mb))
    if wq:
        raise AssertionError("internal: deferred weight-grad steps left over")
    return tuple(acts)


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV: ``2P`` stages in a V; rank ``r`` holds stage ``r`` (chunk ``r``) and stage ``2P-1-r``
    (chunk ``2P-1-r``).  Every micro-batch enters and leaves on rank 0.

    Raises:
        ValueError: ``num_microbatches < 2 * num_ranks``.
    """
    P = _check_int("num_ranks (pp size)", num_ranks, 1)
    M = _check_int("num_microbatches", num_microbatches, 1)
    if M < 2 * P:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2 * pp size (rule: M >= 2*PP); got M={M}, PP={P}: "
            f"use at least {2 * P} micro-batches")
    S = 2 * P
    chunk_rank = tuple(min(c, S - 1 - c) for c in range(S))
    chunk_stage = tuple(range(S))
    routes = tuple(tuple(range(S)) for _ in range(M))
    actions = []
    for r in range(P):
        items = _dual_phase_actions(P, M, r)
        actions.append(_lower_phases(items, (r, S - 1 - r), (list(range(M)), list(range(M)))))
    return Schedule("dualpipev", P, M, chunk_rank, chunk_stage, routes, tuple(actions))


def dualpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """Bidirectional DualPipe: chunk ``d*P + s`` is stage ``s`` of model copy ``d``; copy 0's stage ``s``
    lives on rank ``s``, copy 1's on rank ``P-1-s``.  Micro-batches ``0..M/2-1`` use copy 0 (enter on
    rank 0, loss on rank P-1), ``M/2..M-1`` use copy 1 (enter on rank P-1, loss on rank 0).

    Raises:
        ValueError: odd ``num_ranks``, odd ``num_microbatches`` or ``num_microbatches < 2 * num_ranks``.
    """
    P = _check_int("num_ranks (pp size)", num_ranks, 2)
    M = _check_int("num_microbatches", num_microbatches, 1)
    if P % 2:
        raise ValueError(f"dualpipe needs an even pp size (rule: PP even); got PP={P}: use dualpipev or PP={P + 1}")
    if M % 2 or M < 2 * P:
        raise ValueError(
            f"dualpipe needs an even num_microbatches >= 2 * pp size (rule: M even and M >= 2*PP); "
            f"got M={M}, PP={P}: use at least {2 * P} and an even number")
    H = M // 2
    chunk_rank = tuple(list(range(P)) + [P - 1 - s for s in range(P)])
    chunk_stage = tuple(list(range(P)) + list(range(P)))
    routes = tuple(tuple((0 if m < H else 1) * P + s for s in range(P)) for m in range(M))
    mbs = (list(range(H)), list(range(H, M)))
    actions = []
    for r in range(P):
        h = min(r, P - 1 - r)
        items = _dual_phase_actions(P // 2, H, h)
        own0, own1 = r, P + (P - 1 - r)  # copy-0 chunk and copy-1 chunk on this rank
        if r < P // 2:
            phase_chunk, phase_mbs = (own0, own1), (mbs[0], mbs[1])
        else:
            phase_chunk, phase_mbs = (own1, own0), (mbs[1], mbs[0])
        actions.append(_lower_phases(items, phase_chunk, phase_mbs))
    return Schedule("dualpipe", P, M, chunk_rank, chunk_stage, routes, tuple(actions))


def _layout_of(name: str, num_ranks: int, num_microbatches: int):
    """(chunk_rank, chunk_stage, routes) of schedule ``name`` for any ``num_microbatches >= 1``."""
    P, M = num_ranks, num_microbatches
    if name in ("1f1b", "zb1p"):
        return _linear_layout(P, M)
    if name == "dualpipev":
        S = 2 * P
        return (tuple(min(c, S - 1 - c) for c in range(S)), tuple(range(S)),
                tuple(tuple(range(S)) for _ in range(M)))
    if name == "dualpipe":
        H = M // 2
        return (tuple(list(range(P)) + [P - 1 - s for s in range(P)]), tuple(list(range(P)) + list(range(P))),
                tuple(tuple((0 if m < H else 1) * P + s for s in range(P)) for m in range(M)))
    raise ValueError(f"pipeline_schedule must be one of {SCHEDULE_NAMES}, got {name!r}")


def gpipe_on_layout(name: str, num_ranks: int, num_microbatches: int) -> Schedule:
    """A GPipe-order schedule (all forwards, then all full backwards) on the chunk layout of schedule
    ``name``, valid for any ``num_microbatches >= 1``: the fallback when a step has too few micro-batches
    for DualPipe(V) (e.g. a one-micro-batch SFT step), keeping the same modules on the same ranks.

    Each rank runs its forwards in increasing (route position, micro-batch) order and its backwards in
    increasing (-route position, micro-batch) order, so every dependency is produced earlier in that global
    order and the schedule cannot deadlock.  All micro-batches' activations stay live until their backward.
    The returned schedule's name is ``name + "-gpipe"``.
    """
    P = _check_int("num_ranks (pp size)", num_ranks, 1)
    M = _check_int("num_microbatches", num_microbatches, 1)
    if name == "dualpipe" and P % 2:
        raise ValueError(f"dualpipe needs an even pp size (rule: PP even); got PP={P}")
    chunk_rank, chunk_stage, routes = _layout_of(name, P, M)
    pos = {(c, m): i for m in range(M) for i, c in enumerate(routes[m])}
    actions = []
    for r in range(P):
        mine = sorted((i, m, c) for (c, m), i in pos.items() if chunk_rank[c] == r)
        fwd = [Action("F", c, m) for i, m, c in mine]
        bwd = [Action("BW", c, m) for i, m, c in sorted(mine, key=lambda t: (-t[0], t[1]))]
        actions.append(tuple(fwd + bwd))
    return Schedule(f"{name}-gpipe", P, M, chunk_rank, chunk_stage, routes, tuple(actions))


def build_schedule(name: str, num_ranks: int, num_microbatches: int, *, fallback: bool = False) -> Schedule:
    """Build the schedule ``name`` (one of :data:`SCHEDULE_NAMES`) and validate it.

    With ``fallback=True``, a micro-batch count that DualPipe/DualPipeV reject (too few, or odd for
    DualPipe) gives :func:`gpipe_on_layout` on the same chunk layout instead of raising.
    """
    builders = {"1f1b": one_f_one_b, "zb1p": zb1p, "dualpipe": dualpipe, "dualpipev": dualpipev}
    if name not in builders:
        raise ValueError(f"pipeline_schedule must be one of {SCHEDULE_NAMES}, got {name!r}")
    too_few = name in ("dualpipe", "dualpipev") and (
        num_microbatches < 2 * num_ranks or (name == "dualpipe" and num_microbatches % 2))
    if fallback and too_few and isinstance(num_microbatches, int) and num_microbatches >= 1:
        sched = gpipe_on_layout(name, num_ranks, num_microbatches)
    else:
        sched = builders[name](num_ranks, num_microbatches)
    validate_schedule(sched)
    return sched


# ----------------------------------------------------------------------------------------------------------
# validity


def validate_schedule(schedule: Schedule) -> None:
    """Check a schedule: every action runs on the rank holding its chunk; every (chunk, micro-batch) on
    each micro-batch's route has exactly one F, one B and one W (and nothing off-route); and executing each
    rank's list in order with non-blocking sends and blocking receives terminates (no deadlock), with
    every dependency (F after the previous chunk's F, B after own F and the next chunk's B, W after own B)
    satisfied; and (:func:`validate_fifo`) that the tag-free posting plan the interpreter uses matches
    every message right and terminates when each pair of ranks matches messages in posting order.

    Raises:
        ScheduleError: naming the first violation found.
    """
    need = {(c, m) for m in range(schedule.num_microbatches) for c in schedule.routes[m]}
    seen: dict[tuple[str, int, int], int] = {}
    for r, acts in enumerate(schedule.actions):
        for a in acts:
            for kind, c, m in a.parts():
                if not (0 <= c < schedule.num_chunks) or not (0 <= m < schedule.num_microbatches):
                    raise ScheduleError(f"rank {r}: action {a} names chunk/micro-batch out of range")
                if schedule.chunk_rank[c] != r:
                    raise ScheduleError(f"rank {r}: action {a} runs chunk {c} held by rank {schedule.chunk_rank[c]}")
                if (c, m) not in need:
                    raise ScheduleError(f"rank {r}: action {a}: chunk {c} is not on micro-batch {m}'s route")
                key = (kind, c, m)
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > 1:
                    raise ScheduleError(f"rank {r}: {kind} of (chunk {c}, micro-batch {m}) appears twice")
    for c, m in sorted(need):
        for kind in ("F", "B", "W"):
            if (kind, c, m) not in seen:
                raise ScheduleError(f"{kind} of (chunk {c}, micro-batch {m}) is missing")
    # dependency-respecting, deadlock-free execution with blocking receives
    done: set[tuple[str, int, int]] = set()
    pos = [0] * schedule.num_ranks
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for r in range(schedule.num_ranks):
            while pos[r] < len(schedule.actions[r]):
                a = schedule.actions[r][pos[r]]
                if not _ready(schedule, a, done):
                    break
                for part in a.parts():
                    done.add(part)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(schedule.actions[r][pos[r]]) for r in range(schedule.num_ranks)
                     if pos[r] < len(schedule.actions[r])}
            raise ScheduleError(f"schedule {schedule.name} deadlocks: ranks wait at {stuck}")
    validate_fifo(schedule)


def action_deps(schedule: Schedule, action: Action) -> list[tuple[str, int, int]]:
    """Elementary (kind, chunk, micro-batch) parts that must have finished before ``action`` starts
    (parts finished inside the same action are excluded)."""
    own = set(action.parts())
    deps = []
    for kind, c, m in action.parts():
        if kind == "F":
            p = schedule.prev_chunk(c, m)
            if p is not None:
                deps.append(("F", p, m))
        elif kind == "B":
            deps.append(("F", c, m))
            n = schedule.next_chunk(c, m)
            if n is not None:
                deps.append(("B", n, m))
        else:
            deps.append(("B", c, m))
    return [d for d in deps if d not in own]


def _ready(schedule: Schedule, action: Action, done: set) -> bool:
    return all(d in done for d in action_deps(schedule, action))


# ----------------------------------------------------------------------------------------------------------
# FIFO (tag-free) communication plan and its check


def _plan_actions(schedule: Schedule, rank: int, forward_only: bool) -> list[Action]:
    """The actions ``rank`` executes: its list, or (``forward_only``) the F part of each in order."""
    acts = schedule.actions[rank]
    if not forward_only:
        return list(acts)
    return [Action("F", c, m) for a in acts for kind, c, m in a.parts() if kind == "F"]


_Plan = tuple[tuple[tuple[tuple[tuple[P2P, ...], tuple[P2P, ...]], ...], ...], ...]


def comm_plan(schedule: Schedule, *, forward_only: bool = False, blocking_sends: bool = False,
              buffer_early: bool = True) -> _Plan:
    """The tag-free point-to-point posting plan of every rank, correct when messages between a pair of
    ranks are matched strictly in posting order (NCCL ignores tags: FIFO per ordered (src, dst) pair).

    Rank ``r`` executing ``n`` actions posts ``n + 1`` *batches*: batch ``i`` (``i < n``) runs before action
    ``i`` and holds the sends of action ``i-1`` and the receives action ``i`` needs; batch ``n`` holds the
    sends of the last action.  The sends of one batch to one peer form a *segment*.  A receiver takes the
    segments of each peer whole and in the order that peer sent them: when an action needs a message whose
    segment is not in yet, it also receives every earlier unreceived segment of that peer and buffers the
    messages it does not need yet.

    A batch is a tuple of *rounds* ``(sends, recvs)``; round ``k`` of the receives takes the ``k``-th due
    segment of each peer (peers ascending, messages in send order).  By default a batch's sends share
    round 0 with its first receives.  The interpreter posts a round's sends as one asynchronous
    ``batch_isend_irecv`` (all fixed-size headers -- dtype, shape, message id -- then all tensors, so each
    pair sees ``h1 h2 .. t1 t2 ..``), then its receives as two blocking groups: the headers, then the
    tensors.  Deterministic: every rank computes the same plan from the schedule alone.

    With directed channels (the interpreter's ``p2p="directed"``, NCCL's default: one process group per
    direction of a pair) a round's sends to one peer go as one header group then one tensor group on that
    direction's channel, the same groups its receiver posts there; the plan is the same.

    With ``blocking_sends=True`` the plan is the one for the stricter model of :func:`validate_fifo`
    (sends and receives of a round share the header group and the tensor group, as Megatron's
    ``send_forward_recv_backward`` pairs them; where that deadlocks, a batch's sends get a round of their
    own before its receives); the interpreter does not use it.  ``buffer_early=False`` gives the naive
    plan (each action receives exactly what it needs, in its own order, as the tag-matched interpreter
    did): only for showing what :func:`validate_fifo` rejects.

    Returns:
        ``plan[rank][batch]`` = tuple of rounds, each ``(sends, recvs)``: tuples of :class:`P2P` (nested
        tuples, cached per schedule).

    Raises:
        ScheduleError: a needed message is never sent, or the plan mismatches or deadlocks (see
            :func:`validate_fifo`).
    """
    return _fifo_plan(schedule, forward_only, blocking_sends, buffer_early)[0]


@lru_cache(maxsize=64)
def _fifo_plan(schedule: Schedule, forward_only: bool, blocking_sends: bool, buffer_early: bool = True):
    """(plan, wire groups) of :func:`comm_plan`, checked by :func:`_simulate_fifo` (with blocking sends:
    batches split until it finishes)."""
    split: set[tuple[int, int]] = set()
    mode = ("forward-only" if forward_only else "training") + (", blocking sends" if blocking_sends else "")
    while True:
        plan = _build_plan(schedule, forward_only, split, buffer_early)
        groups = [_wire_groups(pr, blocking_sends) for pr in plan]
        _check_pairs(schedule, groups, mode)
        stuck = _simulate_fifo(groups, blocking_sends)
        if stuck is None:
            return plan, groups
        new = set()
        if blocking_sends:  # split the merged batches the stuck ranks wait in
            new = {(r, groups[r][g][1]) for r, g in stuck.items()
                   if groups[r][g][2] and (r, groups[r][g][1]) not in split}
        if not new:
            desc = {r: [f"{op} {it[0]}:{it[1]}{it[2]}.{it[3]} {'to' if op == 'send' else 'from'} {p}"
                        for op, p, it in groups[r][g][0]] for r, g in stuck.items()}
            raise ScheduleError(f"schedule {schedule.name} ({mode}) deadlocks under FIFO p2p without tags: "
                                f"ranks wait in groups {desc}: reorder the ranks' actions")
        split |= new


def _build_plan(schedule: Schedule, forward_only: bool, split: set, buffer_early: bool = True):
    """:func:`comm_plan` with the batches ``(rank, batch)`` in ``split`` posting their sends alone first."""
    P = schedule.num_ranks
    acts = [_plan_actions(schedule, r, forward_only) for r in range(P)]
    sends = [[()] + [tuple(schedule.p2p(r, a)[1]) for a in acts[r]] for r in range(P)]
    segs: dict[tuple[int, int], list[tuple[tuple[str, int, int], ...]]] = {}
    where: dict[tuple[int, int, tuple[str, int, int]], int] = {}  # (src, dst, msg) -> segment index
    for r in range(P):
        for batch in sends[r]:
            by_peer: dict[int, list] = {}
            for x in batch:
                by_peer.setdefault(x.peer, []).append((x.what, x.chunk, x.microbatch))
            for q, msgs in by_peer.items():
                lst = segs.setdefault((r, q), [])
                for msg in msgs:
                    where[(r, q, msg)] = len(lst)
                lst.append(tuple(msgs))
    plan = []
    for r in range(P):
        nxt: dict[int, int] = {}  # peer -> next segment index to receive from it
        batches = []
        for i in range(len(acts[r]) + 1):
            upto: dict[int, int] = {}
            if i < len(acts[r]):
                for rv in schedule.p2p(r, acts[r][i])[0]:
                    msg = (rv.what, rv.chunk, rv.microbatch)
                    k = where.get((rv.peer, r, msg))
                    if k is None:
                        raise ScheduleError(f"rank {r}: action {acts[r][i]} needs {msg} from rank {rv.peer}, "
                                            f"which never sends it")
                    if k >= nxt.get(rv.peer, 0):
                        upto[rv.peer] = max(upto.get(rv.peer, -1), k)
            rounds = []
            if not buffer_early:
                need = tuple(schedule.p2p(r, acts[r][i])[0]) if i < len(acts[r]) else ()
                batches.append(((sends[r][i], need),) if sends[r][i] or need else ())
                continue
            if (r, i) in split and sends[r][i]:
                rounds.append((sends[r][i], ()))
            k = 0
            while any(nxt.get(p, 0) + k <= e for p, e in upto.items()):
                recvs = []
                for p in sorted(upto):
                    j = nxt.get(p, 0) + k
                    if j <= upto[p]:
                        recvs += [P2P("recv", p, w, c, m) for w, c, m in segs[(p, r)][j]]
                rounds.append(((), tuple(recvs)))
                k += 1
            if (r, i) not in split and sends[r][i]:
                rounds[0:1] = [(sends[r][i], rounds[0][1] if rounds else ())]
            for p, e in upto.items():
                nxt[p] = e + 1
            batches.append(tuple(rounds))
        plan.append(tuple(batches))
    return tuple(plan)


def _wire_groups(plan_rank, blocking_sends: bool) -> list[tuple[list[tuple[str, int, tuple]], int, bool]]:
    """The ``batch_isend_irecv`` groups one rank posts for its plan, in order.  Items ``(ops, batch index,
    merged)``: ops are ``(op, peer, (part, what, chunk, microbatch))`` with part ``h`` (header) or ``t``
    (tensor); ``merged`` says the group holds both sends and receives.  Per round: with asynchronous sends
    (the interpreter) the sends' headers and tensors, then the receives' headers, then their tensors; with
    ``blocking_sends``, headers of sends and receives, then tensors of both."""
    groups = []
    for b, batch in enumerate(plan_rank):
        for sends, recvs in batch:
            if blocking_sends:
                parts = [(("h",), ("h",)), (("t",), ("t",))]
            else:
                parts = [(("h", "t"), ()), ((), ("h",)), ((), ("t",))]
            for send_parts, recv_parts in parts:
                g = [("send", x.peer, (part, x.what, x.chunk, x.microbatch)) for part in send_parts for x in sends]
                g += [("recv", v.peer, (part, v.what, v.chunk, v.microbatch)) for part in recv_parts for v in recvs]
                if g:
                    groups.append((g, b, bool(send_parts) and bool(recv_parts) and bool(sends) and bool(recvs)))
    return groups


def _check_pairs(schedule: Schedule, groups, mode: str) -> None:
    """Every ordered pair's send sequence equals its receive sequence (FIFO matching pairs them right)."""
    seq: dict[tuple[str, int, int], list] = {}
    for r, gs in enumerate(groups):
        for g, _, _ in gs:
            for op, peer, item in g:
                seq.setdefault((op, r, peer) if op == "send" else (op, peer, r), []).append(item)
    for (op, src, dst), items in seq.items():
        other = seq.get(("recv" if op == "send" else "send", src, dst), [])
        for k in range(max(len(items), len(other))):
            a = items[k] if k < len(items) else None
            b = other[k] if k < len(other) else None
            if a != b:
                raise ScheduleError(f"schedule {schedule.name} ({mode}): FIFO mismatch on pair {src}->{dst}: "
                                    f"message #{k} is {a} on the {op} side but {b} on the other")


def _simulate_fifo(groups, blocking_sends: bool) -> Optional[dict[int, int]]:
    """Run the groups under FIFO p2p; None when every rank finishes, else {rank: stuck group}.

    The ``k``-th send from ``src`` to ``dst`` meets the ``k``-th receive on ``dst`` from ``src``.  A rank's
    current group finishes when each of its ops has met its partner.  With ``blocking_sends`` ops meet
    only while both groups are current; otherwise a send is complete once posted and a receive meets a
    send posted at any earlier time."""
    P = len(groups)
    index = []  # FIFO index of every op on its ordered pair
    count: dict[tuple[str, int, int], int] = {}
    for r in range(P):
        idx_r = []
        for g, _, _ in groups[r]:
            idx_g = []
            for op, peer, _ in g:
                key = (op, r, peer) if op == "send" else (op, peer, r)
                idx_g.append(count.get(key, 0))
                count[key] = idx_g[-1] + 1
            idx_r.append(idx_g)
        index.append(idx_r)
    pos = [0] * P
    done = [[[False] * len(g) for g, _, _ in groups[r]] for r in range(P)]
    posted: set[tuple[int, int, int]] = set()  # (src, dst, fifo index) of posted sends (async model)
    while True:
        current = {}  # (rank, op, peer, fifo index) -> slot in that rank's current group
        for r in range(P):
            if pos[r] < len(groups[r]):
                for j, (op, peer, _) in enumerate(groups[r][pos[r]][0]):
                    current[(r, op, peer, index[r][pos[r]][j])] = j
        progressed = False
        for r in range(P):
            if pos[r] >= len(groups[r]):
                continue
            g, flags = groups[r][pos[r]][0], done[r][pos[r]]
            for j, (op, peer, _) in enumerate(g):
                if not blocking_sends:
                    if op == "send":
                        flags[j] = True
                        posted.add((r, peer, index[r][pos[r]][j]))
                    elif (peer, r, index[r][pos[r]][j]) in posted:
                        flags[j] = True
                    continue
                if not flags[j]:
                    jj = current.get((peer, "recv" if op == "send" else "send", r, index[r][pos[r]][j]))
                    if jj is not None:
                        flags[j] = True
                        done[peer][pos[peer]][jj] = True
        for r in range(P):
            while pos[r] < len(groups[r]) and all(done[r][pos[r]]):
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(groups[r]) for r in range(P)):
            return None
        if not progressed:
            return {r: pos[r] for r in range(P) if pos[r] < len(groups[r])}


def validate_fifo(schedule: Schedule, *, blocking_sends: bool = False, buffer_early: bool = True) -> None:
    """Prove that the schedule runs with tag-free point-to-point messages (:func:`comm_plan`), in training
    and forward-only mode, by simulating the exact ``batch_isend_irecv`` groups every rank posts.

    Model: the ``k``-th send from ``src`` to ``dst`` meets the ``k``-th receive posted on ``dst`` from
    ``src`` (FIFO per ordered pair, tags ignored: NCCL's matching); every rank posts its groups in order and
    waits for each receive group to finish.  By default sends are asynchronous (complete once posted).
    ``blocking_sends=True`` checks NCCL's documented worst case over one communicator instead: a group
    finishes only when every op in it met its partner while both groups were current (a send blocks until
    its receive is posted); the real schedules do NOT all pass that model with a header-then-tensor protocol
    (1F1B does; zb1p, dualpipe and dualpipev deadlock).

    Which model applies to which transport of :class:`~moerl.pipeline.interpreter.PipelineInterpreter`:

    - gloo (``p2p="shared"`` or ``"directed"``): sends never block -- asynchronous model;
    - NCCL with directed channels (``p2p="directed"``, the default on NCCL: one communicator and stream per
      direction of each pair): a blocked send only delays later sends of its own direction, whose receiver
      posts the same groups in the same FIFO order, and the host never waits on a send until the end of a
      step, so a receive group completes once its sender posted the matching group -- asynchronous model;
    - NCCL over one shared communicator (``p2p="shared"``): all p2p ops of a rank run in one stream in
      posting order -- ``blocking_sends=True`` (deadlocks all schedules but 1F1B).

    Checks that each pair's send and receive sequences are identical (no message lands in a buffer meant
    for another) and that every rank finishes (no deadlock).  ``buffer_early=False`` checks the naive
    plan of :func:`comm_plan` instead.

    Raises:
        ScheduleError: the first mismatching message of a pair, or the ranks' waiting groups on deadlock.
    """
    for forward_only in (False, True):
        _fifo_plan(schedule, forward_only, blocking_sends, buffer_early)
