"""Per-phase observability of the RL step: named ranges for profilers, memory peaks per phase, the
per-rank step-time spread (stragglers), and torch.profiler Chrome traces of chosen steps.

* :class:`PhaseTimers` is a drop-in :class:`~moerl.observe.timers.Timers` whose phases are also
  ``torch.profiler.record_function`` ranges (they appear by name in a Chrome trace), NVTX ranges on
  CUDA (``torch.cuda.nvtx``, for Nsight Systems: ``nsys profile --trace=cuda,nvtx``) and memory windows:
  the peak of each phase, ``torch.cuda.max_memory_allocated`` on GPU (the allocator's peak is reset at
  each phase start) or the process resident-set peak on CPU (Linux ``VmHWM``, reset per phase through
  ``/proc/self/clear_refs`` = 5; where that is refused, the process lifetime peak
  ``resource.getrusage(RUSAGE_SELF).ru_maxrss``).
* :func:`rank_spread` gathers one number (a step time) from every trainer rank.
* :class:`StepMonitor` (the RL loop's timers) adds the per-step figures: model FLOPs of the passes
  it is told about (moerl.observe.flops), MFU, tokens/s/device, memory peaks, the rank spread and the
  profiled steps.
* :class:`StepProfiler` runs ``torch.profiler.profile`` over recipe steps ``profile.steps: [a, b]`` on
  ranks ``profile.ranks`` and writes ``<output_dir>/profile/trace_rank<r>.json`` (chrome://tracing,
  https://ui.perfetto.dev).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from moerl.observe.timers import Timers

__all__ = ["PhaseTimers", "StepMonitor", "StepProfiler", "rank_spread", "read_peak_bytes", "reset_peak"]


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def reset_peak() -> bool:
    """Start a new peak window: CUDA allocator peak (GPU) or the process RSS high-water mark (CPU,
    Linux). Returns False when the CPU peak cannot be reset (then peaks are lifetime peaks)."""
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def read_peak_bytes() -> int:
    """Peak bytes since the last :func:`reset_peak`: ``torch.cuda.max_memory_allocated()`` on GPU,
    else the process's resident-set peak (``VmHWM`` of /proc/self/status, or ``ru_maxrss``)."""
    if _cuda():
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


class PhaseTimers(Timers):
    """:class:`Timers` whose phases are also profiler ranges and memory windows.

    ``with timers("update"): ...`` times the phase, opens ``record_function("update")`` (and an NVTX
    range on CUDA) and records the phase's memory peak. Nested phases: the outer phase's peak includes
    the inner one's. :meth:`pop_memory` returns and resets the peaks.

    Args:
        memory: track memory peaks per phase (one /proc read per phase end on CPU).
        cuda_sync, clock: as :class:`Timers`.
    """

    def __init__(self, memory: bool = True, **kw) -> None:
        super().__init__(**kw)
        self._memory = memory
        self._peaks: dict[str, int] = {}
        self._stack: list[list] = []  # [name, peak so far]

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        nvtx = _cuda()
        with super().__call__(name), torch.profiler.record_function(name):
            if nvtx:
                torch.cuda.nvtx.range_push(name)
            if self._memory:
                if self._stack:  # the enclosing phase keeps its peak so far
                    self._stack[-1][1] = max(self._stack[-1][1], read_peak_bytes())
                reset_peak()
                self._stack.append([name, 0])
            try:
                yield
            finally:
                if self._memory:
                    _, peak = self._stack.pop()
                    peak = max(peak, read_peak_bytes())
                    self._peaks[name] = max(self._peaks.get(name, 0), peak)
                    if self._stack:
                        self._stack[-1][1] = max(self._stack[-1][1], peak)
                if nvtx:
                    torch.cuda.nvtx.range_pop()

    def pop_memory(self) -> dict[str, int]:
        """Peak bytes per phase since the last call (GPU: allocated by torch; CPU: process RSS), reset."""
        out, self._peaks = self._peaks, {}
        return out


def rank_spread(value: float) -> Optional[dict[str, float]]:
    """All-gather ``value`` (e.g. this rank's step seconds) over the default process group.

    Collective: every rank calls it. Returns ``{"max", "min", "spread" (max - min), "slowest_rank"}``
    on every rank, or None in a single process.
    """
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return None
    nccl = "nccl" in str(tdist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(tdist.get_world_size())]
    tdist.all_gather(out, torch.tensor([float(value)], dtype=torch.float64, device=device))
    vals = [float(t.item()) for t in out]
    hi = max(range(len(vals)), key=vals.__getitem__)
    return {"max": vals[hi], "min": min(vals), "spread": vals[hi] - min(vals), "slowest_rank": float(hi)}


class StepProfiler:
    """torch.profiler over the recipe's steps ``[first, last]`` (inclusive) on the listed ranks.

    Call :meth:`step_begin` before and :meth:`step_end` after each step; the trace of this rank is
    written when ``last`` ends (or at :meth:`close`, for a run that stops earlier) to
    ``<out_dir>/trace_rank<rank>.json`` (Chrome trace format: ``json.load`` reads it; phases of
    :class:`PhaseTimers` appear as ``record_function`` events by name).

    Args:
        steps: [first, last] step numbers, or None for no profiling.
        ranks: global ranks that profile.
        rank: this process's global rank.
        out_dir: directory of the traces (created).
    """

    def __init__(self, steps: Optional[Sequence[int]], ranks: Sequence[int], rank: int, out_dir: os.PathLike) -> None:
        self.first, self.last = (steps if steps else (None, None))
        self.active = steps is not None and rank in ranks
        self.path = Path(out_dir) / f"trace_rank{rank}.json"
        self._prof = None
        self._step_range = None

    def step_begin(self, step: int) -> None:
        if not self.active or not self.first <= step <= self.last:
            return
        if self._prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
        self._step_range = torch.profiler.record_function(f"step {step}")
        self._step_range.__enter__()

    def step_end(self, step: int) -> None:
        if self._prof is None or self._step_range is None:
            return
        self._step_range.__exit__(None, None, None)
        self._step_range = None
        if step >= self.last:
            self.close()

    def close(self) -> Optional[Path]:
        """Stop profiling and write the trace; returns its path (None when nothing was profiled)."""
        if self._prof is None:
            return None
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        self.active = False
        return self.path


class StepMonitor(PhaseTimers):
    """The RL loop's timers plus the per-step performance figures (one per trainer rank).

    Usage (moerl.train.loop)::

        timers = StepMonitor(cfg, run_dir)
        for step in timers.steps(first, last):           # starts the step clock and the profiler
            ...  timers.count("logprob" | "update", hf_config, samples, passes)  ...
            metrics.update(timers.end(step, metrics))     # collective: every rank

    :meth:`end` returns ``time/<phase>`` seconds, ``memory/<phase>_peak_gib`` (GiB, 2^30 bytes),
    ``perf/*`` (moerl.observe.metrics.perf_metrics: MFU against ``hardware`` peak, tokens/s/device) and,
    with several ranks, ``straggler/busy_s_{max,min,spread}`` and ``straggler/slowest_rank``: the
    all-gathered busy seconds of each rank (step wall time minus the wait for the rollout batch, eval
    and checkpoint; collectives inside the update let a fast rank wait for a slow one, so the spread
    shows the rank that holds the others up only where the slow part is outside a collective), and
    ``memory/peak_gib_max_over_ranks`` / ``memory/peak_max_rank``: the highest phase peak over all ranks
    and its rank.

    Counted FLOPs: actor (and reference) log-prob passes and actor updates (moerl.observe.flops); the
    critic's passes are not counted. Generated tokens: ``response_length * num_samples`` of the batch.

    Args:
        cfg: the RecipeConfig (profile.*, hardware.*, rollout.num_servers/backend/server_*_size, train.mode).
        run_dir: the run's output directory (traces in ``run_dir/profile``).
    """

    def __init__(self, cfg, run_dir: os.PathLike, **kw) -> None:
        from moerl.observe.flops import peak_tflops
        from moerl.runtime import world

        super().__init__(**kw)
        self.cfg = cfg
        self.peak = peak_tflops(cfg.hardware)
        self.profiler = StepProfiler(cfg.profile.steps, cfg.profile.ranks, world.global_rank(),
                                     Path(run_dir) / "profile")
        self._counts: dict[str, float] = {}
        self._t0, self._before = 0.0, {}

    def steps(self, first: int, last: int) -> Iterator[int]:
        """Steps ``first..last``; each starts the step clock (and the profiler on a profiled step)."""
        import time

        try:
            for step in range(first, last + 1):
                self.profiler.step_begin(step)
                self._t0, self._before = time.perf_counter(), self.elapsed()  # phases before the step (SFT)
                yield step
        finally:
            self.profiler.close()

    def count(self, kind: str, hf_config, samples, passes: int = 1) -> None:
        """Add the model FLOPs of ``passes`` log-prob (``kind="logprob"``) or training (``"update"``)
        passes over ``samples`` (each sequence ``len(sample.tokens)`` tokens, packed apart)."""
        from moerl.observe.flops import logprob_flops, training_flops

        lens = [len(s.tokens) for s in samples]
        fn = {"logprob": logprob_flops, "update": training_flops}[kind]
        self._counts[f"perf/{kind}_flops"] = self._counts.get(f"perf/{kind}_flops", 0.0) + passes * fn(hf_config, lens)
        if kind == "update":
            self._counts["perf/trained_tokens"] = self._counts.get("perf/trained_tokens", 0.0) + sum(lens)

    def end(self, step: int, m: dict) -> dict:
        """The step's time, memory, perf and straggler metrics (see the class); resets the counters.
        Collective with several ranks."""
        import time

        from moerl.observe.metrics import perf_metrics
        from moerl.runtime import world

        wall = time.perf_counter() - self._t0
        totals = self.pop()
        inside = {k: v - self._before.get(k, 0.0) for k, v in totals.items()}  # this step's share
        out = {f"time/{k}": v for k, v in totals.items()}
        out.update({f"memory/{k}_peak_gib": v / 2**30 for k, v in self.pop_memory().items()})
        out.update(self._counts)
        self._counts = {}
        if "response_length" in m and "num_samples" in m:
            out["perf/generated_tokens"] = round(float(m["response_length"]) * float(m["num_samples"]))
        step_s = wall - inside.get("eval", 0.0) - inside.get("checkpoint", 0.0)
        ro = self.cfg.rollout
        per_server = ro.server_tp_size * ro.server_dp_size if ro.backend == "sglang" else 1
        out.update(perf_metrics({**out, **{f"time/{k}": v for k, v in inside.items()}}, step_s=step_s,
                                trainer_devices=world.world_size(),
                                rollout_devices=ro.num_servers * per_server, peak_tflops=self.peak,
                                rollout_overlaps=self.cfg.train.mode != "sync"))
        spread = rank_spread(step_s - inside.get("rollout", 0.0))
        if spread is not None:
            out.update({"straggler/slowest_rank": spread.pop("slowest_rank")})
            out.update({f"straggler/busy_s_{k}": v for k, v in spread.items()})
            mem = rank_spread(max((v for k, v in out.items() if k.startswith("memory/")), default=0.0))
            out.update({"memory/peak_gib_max_over_ranks": mem["max"], "memory/peak_max_rank": mem["slowest_rank"]})
        self.profiler.step_end(step)
        return out
