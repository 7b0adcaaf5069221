"""Best-fit-decreasing packing of variable-length samples into micro-batches, balanced across
data-parallel (DP) ranks.

Pipeline of :func:`pack_micro_batches`:

1. validate lengths (a sample longer than the model's maximum is an error; one longer than
   ``max_tokens_per_micro_batch`` gets a micro-batch of its own and a :class:`PackingWarning`);
2. best-fit decreasing (BFD) under the token cap: samples sorted by length, longest first, each
   placed in the open micro-batch whose free space is smallest but still large enough, a new one
   when none fits. BFD, like FFD, uses at most 11/9 OPT + 6/9 bins (Dosa 2007; shared design
   REFERENCE.md sec. 7);
3. the micro-batch count is raised to ``dp_size * per_rank`` where ``per_rank`` is a multiple of
   what the pipeline schedule needs (:func:`schedule_micro_batch_multiple`), by splitting the
   heaviest multi-sample micro-batches in two; only when every sample is already alone (fewer
   samples than micro-batches) are EMPTY micro-batches added. An empty micro-batch contributes
   zero loss and zero tokens (the actor runs it as one all-padding row so that every rank issues
   the same collectives; moerl.train.batching.make_packed_micro_batch of no samples);
4. micro-batches are dealt to DP ranks, the same count to every rank (collectives require it),
   balancing the per-rank load (tokens, or estimated FLOPs ``a*L + L^2`` per sample) by
   longest-processing-time-first with a per-rank quota, then moves between the heaviest and the
   lightest rank (swap two micro-batches, move one sample into a micro-batch with room, or
   exchange two samples).

Everything works on sample lengths (python ints, prompt + response tokens); turning a plan into
tensors is :func:`moerl.train.batching.make_packed_micro_batch`.
"""

from __future__ import annotations

import bisect
import heapq
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = [
    "BALANCE_MODES",
    "PackingPlan",
    "PackingWarning",
    "best_fit_decreasing",
    "flops_linear_coeff",
    "pack_micro_batches",
    "schedule_micro_batch_multiple",
    "sequence_loads",
]

BALANCE_MODES = ("tokens", "flops")
# balancing stops when max - min per-rank load <= this fraction of the max (max/min <= 1.00001)
_BALANCE_TOL = 1e-5
SCHEDULES = ("none", "1f1b", "interleaved", "dualpipe")


class PackingWarning(UserWarning):
    """A sample longer than ``max_tokens_per_micro_batch`` was given a micro-batch of its own."""


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _pos_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    out = list(lengths)
    if out and all(type(n) is int for n in out) and min(out) >= 1:  # fast path
        return out
    out = []
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"lengths[{i}] must be an int >= 1 (tokens of the sample), got {n!r}")
        out.append(int(n))
    if not out:
        raise ValueError("lengths is empty: there are no samples to pack")
    return out


# --------------------------------------------------------------------------------------------
# loads and schedule requirements
# --------------------------------------------------------------------------------------------


def flops_linear_coeff(num_layers: int, hidden_size: int, active_params: float) -> float:
    """The ``a`` of the per-sequence load ``a*L + L^2`` proportional to training FLOPs.

    Training FLOPs of a sequence of L tokens ~ ``6 * N_active * L + 6 * num_layers * hidden_size
    * L^2`` (dense matmuls plus causal attention, whose ``12 * layers * d_model * L`` per token is
    halved by the causal mask; REFERENCE.md sec. 8). Dividing by ``6 * num_layers * hidden_size``
    gives ``a = N_active / (num_layers * hidden_size)``.

    Args:
        num_layers: transformer layers.
        hidden_size: d_model.
        active_params: parameters active per token (non-expert + top-k routed + shared experts).

    Returns:
        a (float, tokens).

    Raises:
        ValueError: a non-positive argument.
    """
    _pos_int("num_layers", num_layers)
    _pos_int("hidden_size", hidden_size)
    if not active_params > 0:
        raise ValueError(f"active_params must be > 0, got {active_params!r}")
    return float(active_params) / (num_layers * hidden_size)


def sequence_loads(
    lengths: Sequence[int], balance: str = "tokens", linear_coeff: Optional[float] = None
) -> list[float]:
    """Per-sample load used for DP balancing.

    Args:
        lengths: tokens per sample.
        balance: "tokens" (load = L) or "flops" (load = a*L + L^2, a = ``linear_coeff``).
        linear_coeff: a for "flops" (see :func:`flops_linear_coeff`); required for "flops".

    Returns:
        list of float loads, one per sample.

    Raises:
        ValueError: unknown balance mode, or "flops" without a positive linear_coeff.
    """
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance must be one of {BALANCE_MODES}, got {balance!r}")
    if balance == "tokens":
        return [float(n) for n in lengths]
    if linear_coeff is None or not linear_coeff >= 0:
        raise ValueError(
            "balance='flops' needs linear_coeff = a in a*L + L^2 (>= 0); compute it with "
            "flops_linear_coeff(num_layers, hidden_size, active_params)"
        )
    a = float(linear_coeff)
    return [a * n + float(n) * n for n in lengths]


def schedule_micro_batch_multiple(schedule: str, pp_size: int = 1) -> tuple[int, int]:
    """What a pipeline schedule needs of the per-DP-rank micro-batch count M.

    - "none" (pp_size 1) and "1f1b" (Megatron's non-interleaved schedule): any M >= 1
      (M >= pp_size only shrinks the bubble).
    - "interleaved" (Megatron virtual pipeline, microbatch_group_size_per_vp_stage = pp_size):
      M a multiple of pp_size, M >= pp_size (schedules.py raises otherwise).
    - "dualpipe" (deepseek-ai/DualPipe): M even and M >= 2 * pp_size.

    Returns:
        (multiple, minimum): M must satisfy M % multiple == 0 and M >= minimum.

    Raises:
        ValueError: unknown schedule or pp_size < 1.
    """
    pp = _pos_int("pp_size", pp_size)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule in ("none", "1f1b"):
        return 1, 1
    if schedule == "interleaved":
        return pp, pp
    return 2, 2 * pp


# --------------------------------------------------------------------------------------------
# best-fit decreasing
# --------------------------------------------------------------------------------------------


def _bfd(lengths: list[int], cap: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)  # stable
    min_len = lengths[order[-1]]
    shift = max(len(lengths), 1).bit_length() + 1
    id_mask = (1 << shift) - 1
    free: list[int] = []  # sorted keys (free_space << shift) | bin_id of bins that can take an item
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        j = bisect.bisect_left(free, n << shift) if n <= cap else len(free)
        if j < len(free):
            key = free.pop(j)
            b = key & id_mask
            room = (key >> shift) - n
            bins[b].append(i)
        else:
            b = len(bins)
            bins.append([i])
            room = cap - n
        if room >= min_len:
            bisect.insort(free, (room << shift) | b)
    return bins


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing of ``lengths`` into bins of ``capacity`` tokens.

    Items are taken longest first (ties: lower index first); each goes into the bin with the
    least free space that still holds it (ties: the earliest opened), or a new bin. An item
    longer than ``capacity`` gets a bin of its own (no warning here; see
    :func:`pack_micro_batches`). Runs in O(n log n) plus O(n * open bins) memmoves (about 0.1 s
    for 100k samples).

    Args:
        lengths: item sizes (ints >= 1).
        capacity: bin size (int >= 1).

    Returns:
        list of bins, each a list of item indices (longest first); bins in opening order.

    Raises:
        ValueError: empty input, a non-positive length or capacity.
    """
    return _bfd(_check_lengths(lengths), _pos_int("capacity", capacity))


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------


@dataclass
class PackingPlan:
    """Micro-batches of sample indices for every DP rank.

    Attributes:
        micro_batches: ``micro_batches[dp_rank][k]`` = indices (into ``lengths``) of the samples
            of micro-batch k on that rank; every rank has the same number of micro-batches. A
            micro-batch is empty only when there are fewer samples than micro-batches.
        lengths: tokens per sample (the input).
        max_tokens_per_micro_batch: the cap C.
        loads: per-sample balancing load (tokens or a*L + L^2).
        balance: "tokens" or "flops".
        oversize: indices of samples longer than the cap (each alone in its micro-batch).
    """

    micro_batches: list[list[list[int]]]
    lengths: list[int]
    max_tokens_per_micro_batch: int
    loads: list[float]
    balance: str
    oversize: list[int] = field(default_factory=list)

    @property
    def dp_size(self) -> int:
        """Number of DP ranks the plan was made for."""
        return len(self.micro_batches)

    @property
    def num_micro_batches_per_rank(self) -> int:
        """Micro-batches each DP rank runs (the same on every rank)."""
        return len(self.micro_batches[0])

    @property
    def num_micro_batches(self) -> int:
        """Total over all DP ranks."""
        return self.dp_size * self.num_micro_batches_per_rank

    def for_rank(self, dp_rank: int) -> list[list[int]]:
        """This rank's micro-batches (lists of sample indices).

        Raises:
            ValueError: dp_rank outside [0, dp_size).
        """
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, {self.dp_size}), got {dp_rank}")
        return self.micro_batches[dp_rank]

    def rank_loads(self) -> list[float]:
        """Balancing load per DP rank."""
        return [sum(self.loads[i] for mb in rank for i in mb) for rank in self.micro_batches]

    def rank_tokens(self) -> list[int]:
        """Tokens per DP rank."""
        return [sum(self.lengths[i] for mb in rank for i in mb) for rank in self.micro_batches]

    def stats(self) -> dict[str, float]:
        """Quality numbers for logging (each a python float).

        - ``utilisation`` = sum(lengths) / (num_micro_batches * cap) (may exceed 1 only with
          oversize samples);
        - ``utilisation_bound`` = sum(lengths) / (ceil(sum(lengths) / cap) * cap): the best any
          packing with this many tokens can do;
        - ``utilisation_vs_bound`` = utilisation / utilisation_bound
          (= ceil(sum/cap) / num_micro_batches);
        - ``num_micro_batches`` (all ranks), ``num_micro_batches_per_rank``;
        - ``dp_load_ratio`` = max / min per-rank load (1.0 = perfect balance), and
          ``dp_token_ratio`` the same for tokens;
        - ``max_micro_batch_tokens``, ``num_oversize``.
        """
        total = sum(self.lengths)
        cap = self.max_tokens_per_micro_batch
        lower = math.ceil(total / cap)
        n = self.num_micro_batches
        loads = self.rank_loads()
        toks = self.rank_tokens()
        util = total / (n * cap)
        bound = total / (lower * cap)
        return {
            "utilisation": util,
            "utilisation_bound": bound,
            "utilisation_vs_bound": util / bound,
            "num_micro_batches": float(n),
            "num_micro_batches_per_rank": float(self.num_micro_batches_per_rank),
            "dp_load_ratio": max(loads) / min(loads) if min(loads) > 0 else float("inf"),
            "dp_token_ratio": max(toks) / min(toks) if min(toks) > 0 else float("inf"),
            "max_micro_batch_tokens": float(
                max(sum(self.lengths[i] for i in mb) for rank in self.micro_batches for mb in rank)
            ),
            "num_oversize": float(len(self.oversize)),
        }


def _split_bin(items: list[int], loads: Sequence[float]) -> tuple[list[int], list[int]]:
    """Two halves of a multi-item bin with balanced load (greedy, heaviest first)."""
    a: list[int] = []
    b: list[int] = []
    la = lb = 0.0
    for i in sorted(items, key=lambda i: -loads[i]):
        if la <= lb:
            a.append(i)
            la += loads[i]
        else:
            b.append(i)
            lb += loads[i]
    return a, b


def _deal(bin_loads: list[float], dp_size: int, per_rank: int) -> list[list[int]]:
    """Assign bins to ranks, exactly ``per_rank`` each: longest-processing-time first with a
    per-rank quota (each bin, heaviest first, to the lightest rank that still has room)."""
    order = sorted(range(len(bin_loads)), key=lambda b: -bin_loads[b])
    heap = [(0.0, r) for r in range(dp_size)]
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for b in order:
        load, r = heapq.heappop(heap)
        ranks[r].append(b)
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + bin_loads[b], r))
    return ranks


def _refine(
    ranks: list[list[int]],
    bins: list[list[int]],
    lengths: Sequence[int],
    loads: Sequence[float],
    cap: int,
    rounds: int,
    bin_load: list[float],
) -> None:
    """Even out the heaviest and the lightest rank, in place, for up to ``rounds`` moves.

    Each round considers (a) swapping a bin of the heaviest rank with a bin of the lightest one
    and (b) moving one sample from a multi-sample bin of the heaviest rank into the emptiest bin
    of the lightest rank where it fits under ``cap``, and only when neither exists (c) exchanging
    two samples between bins of the two ranks where both still fit; it applies the move whose
    load transfer d (0 < d < gap) is closest to gap / 2, which strictly lowers the larger of the
    two loads.
    Bin counts per rank never change and no bin is emptied."""
    dp = len(ranks)
    if dp == 1 or rounds <= 0:
        return
    bin_tok = [sum(map(lengths.__getitem__, b)) for b in bins]
    totals = [sum(map(bin_load.__getitem__, r)) for r in ranks]
    for _ in range(rounds):
        hi = max(range(dp), key=totals.__getitem__)
        lo = min(range(dp), key=totals.__getitem__)
        gap = totals[hi] - totals[lo]
        if not gap > _BALANCE_TOL * totals[hi]:
            return
        half = gap / 2
        best = None  # (score, kind, payload, d)
        lo_sorted = sorted((bin_load[b], b) for b in ranks[lo])
        lo_w = [w for w, _ in lo_sorted]
        for a in ranks[hi]:
            k = bisect.bisect_left(lo_w, bin_load[a] - half)
            for kk in (k - 1, k):
                if 0 <= kk < len(lo_w):
                    d = bin_load[a] - lo_w[kk]
                    if 0 < d < gap and (best is None or abs(half - d) < best[0]):
                        best = (abs(half - d), "swap", (a, lo_sorted[kk][1]), d)
        dest = max(ranks[lo], key=lambda b: cap - bin_tok[b])
        room = cap - bin_tok[dest]
        if room > 0:
            for a in ranks[hi]:
                if len(bins[a]) < 2:
                    continue
                for i in bins[a]:
                    d = loads[i]
                    if lengths[i] <= room and 0 < d < gap and (best is None or abs(half - d) < best[0]):
                        best = (abs(half - d), "move", (a, i, dest), d)
        if best is None:
            # fall back to swapping two samples x (hi) and y (lo) that fit each other's bin
            lo_items = sorted((loads[i], i, b) for b in ranks[lo] for i in bins[b])
            lo_keys = [w for w, _, _ in lo_items]
            for a in ranks[hi]:
                for x in bins[a]:
                    k = bisect.bisect_left(lo_keys, loads[x] - half)
                    for kk in range(max(0, k - 2), min(len(lo_keys), k + 2)):
                        w, y, b = lo_items[kk]
                        d = loads[x] - w
                        if not (0 < d < gap) or (best is not None and abs(half - d) >= best[0]):
                            continue
                        if bin_tok[a] - lengths[x] + lengths[y] <= cap and bin_tok[b] - lengths[y] + lengths[x] <= cap:
                            best = (abs(half - d), "exchange", (a, x, b, y), d)
        if best is None:
            return
        _, kind, payload, d = best
        if kind == "swap":
            a, b = payload
            ranks[hi][ranks[hi].index(a)] = b
            ranks[lo][ranks[lo].index(b)] = a
        elif kind == "exchange":
            a, x, b, y = payload
            bins[a][bins[a].index(x)] = y
            bins[b][bins[b].index(y)] = x
            bin_load[a] -= d
            bin_load[b] += d
            bin_tok[a] += lengths[y] - lengths[x]
            bin_tok[b] += lengths[x] - lengths[y]
        else:
            a, i, dest = payload
            bins[a].remove(i)
            bins[dest].append(i)
            bin_load[a] -= d
            bin_load[dest] += d
            bin_tok[a] -= lengths[i]
            bin_tok[dest] += lengths[i]
        totals[hi] -= d
        totals[lo] += d


def pack_micro_batches(
    lengths: Sequence[int],
    max_tokens_per_micro_batch: int,
    *,
    dp_size: int = 1,
    max_seq_len: Optional[int] = None,
    micro_batch_multiple: int = 1,
    min_micro_batches_per_rank: int = 1,
    balance: str = "tokens",
    linear_coeff: Optional[float] = None,
    max_refine_rounds: Optional[int] = None,
) -> PackingPlan:
    """Pack samples into micro-batches under a token cap and balance them across DP ranks.

    Args:
        lengths: tokens per sample (prompt + response), ints >= 1.
        max_tokens_per_micro_batch: cap C on the summed lengths of one micro-batch (recipe key
            ``train.max_tokens_per_micro_batch``). With sequence parallelism the caller pads each
            packed micro-batch to a multiple of tp_size; keep C a multiple of tp_size so the
            padded size stays <= C.
        dp_size: data-parallel ranks; each gets the same number of micro-batches.
        max_seq_len: the model's maximum sequence length (max_position_embeddings); a longer
            sample is an error. None: no check.
        micro_batch_multiple, min_micro_batches_per_rank: the per-rank count M satisfies
            M % micro_batch_multiple == 0 and M >= min_micro_batches_per_rank (get them from
            :func:`schedule_micro_batch_multiple`).
        balance: "tokens" or "flops" (load a*L + L^2 with a = ``linear_coeff``).
        linear_coeff: a for balance="flops".
        max_refine_rounds: balancing moves between the heaviest and the lightest rank after the
            deal (bin swaps, or moving one sample into a bin with room); default 8 * dp_size.

    Returns:
        :class:`PackingPlan`. Micro-batch count per rank = the smallest M >= ceil(B / dp_size)
        meeting the schedule's requirements, B = number of BFD bins; when M * dp_size exceeds the
        number of samples, every sample is alone in its micro-batch and the rest are empty (``[]``).
        Balance: the per-rank load is dealt longest-processing-time first with a per-rank quota
        and then refined, which on one-sample micro-batches stays within 4/3 of the best
        equal-count assignment (tests/test_packing.py checks both against brute force).

    Warns:
        PackingWarning: for samples longer than the cap (each gets a micro-batch of its own).

    Raises:
        ValueError: bad arguments (named in the message); a sample longer than ``max_seq_len``.
            Fewer samples than micro-batches is not an error (empty micro-batches, see above).
    """
    lengths = _check_lengths(lengths)
    cap = _pos_int("max_tokens_per_micro_batch", max_tokens_per_micro_batch)
    dp = _pos_int("dp_size", dp_size)
    mult = _pos_int("micro_batch_multiple", micro_batch_multiple)
    min_per_rank = _pos_int("min_micro_batches_per_rank", min_micro_batches_per_rank)
    loads = sequence_loads(lengths, balance, linear_coeff)
    if max_seq_len is not None:
        max_seq_len = _pos_int("max_seq_len", max_seq_len)
        too_long = [i for i, n in enumerate(lengths) if n > max_seq_len]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"{len(too_long)} sample(s) are longer than the model's maximum sequence length "
                f"{max_seq_len} (first: sample {i} with {lengths[i]} tokens); lower "
                "rollout.max_new_tokens / the prompt length, or drop such samples before packing"
            )
    oversize = [i for i, n in enumerate(lengths) if n > cap]
    if oversize:
        warnings.warn(
            f"{len(oversize)} sample(s) exceed max_tokens_per_micro_batch={cap} (longest "
            f"{max(lengths[i] for i in oversize)} tokens); each is packed alone in its own "
            "micro-batch. Raise train.max_tokens_per_micro_batch if that runs out of memory.",
            PackingWarning,
            stacklevel=2,
        )

    bins = _bfd(lengths, cap)
    per_rank = max(math.ceil(len(bins) / dp), min_per_rank)
    per_rank = math.ceil(per_rank / mult) * mult
    target = per_rank * dp
    bin_loads = [sum(map(loads.__getitem__, b)) for b in bins]
    if target > len(bins):
        # split the heaviest multi-sample bins until there are `target` of them (or every sample
        # is alone), then add empty micro-batches for the rest
        heap = [(-bin_loads[k], k) for k, b in enumerate(bins) if len(b) > 1]
        heapq.heapify(heap)
        while len(bins) < target and heap:
            _, k = heapq.heappop(heap)
            a, b = _split_bin(bins[k], loads)
            bins[k] = a
            bins.append(b)
            bin_loads[k] = sum(map(loads.__getitem__, a))
            bin_loads.append(sum(map(loads.__getitem__, b)))
            for idx in (k, len(bins) - 1):
                if len(bins[idx]) > 1:
                    heapq.heappush(heap, (-bin_loads[idx], idx))
        while len(bins) < target:
            bins.append([])
            bin_loads.append(0.0)
    ranks = _deal(bin_loads, dp, per_rank)
    rounds = 8 * dp if max_refine_rounds is None else max(0, int(max_refine_rounds))
    _refine(ranks, bins, lengths, loads, cap, rounds, bin_loads)
    micro_batches = [[bins[b] for b in rank] for rank in ranks]
    return PackingPlan(micro_batches, lengths, cap, loads, balance, oversize)
