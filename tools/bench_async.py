#!/usr/bin/env python
"""Benchmark train.mode sync / one_step_off / async (max_staleness 1 and 2) on the demo recipe.

Every mode runs the demo recipe (configs/tiny_arith.yaml) as its own subprocess
``python -m moerl.cli train configs/tiny_arith.yaml ...`` (own output_dir, free ports) for the same
train.num_steps and batch sizes (= the same number of consumed samples), from ONE shared SFT warm start
(made once at the start by a short run of the recipe, whose <output_dir>/hf_warm_start is reused with
``model.init_from=... sft.enabled=false``; or an existing dir given with --warm-start).

Emulated devices: every mode runs with the same pinning, ``train.cpu_affinity=[0] rollout.cpu_affinity=[1]
train.num_threads=1 rollout.threads_per_server=1``: the trainer process on core 0, the rollout servers
and the router it starts on core 1 (``rollout.num_servers`` servers share that core; see --num-servers).

Figures per mode (from the run's TensorBoard events, summary.json and /proc samples):

* RL wall: from the start of step 1 (its batch request) to the end of step N's weight push:
  ``t_log[N] - t_log[1] + sum(time/* of step 1) - sum(time/eval)`` where t_log[k] is the wall time of
  step k's TensorBoard events (written at the end of the step). SFT, the evals before / after RL and
  process start-up are excluded; step 1's unmeasured bookkeeping (advantages, logging: milliseconds) is
  the only thing left out.
* trainer idle: sum(time/rollout) / RL wall (time/rollout = the trainer waiting for its batch). In
  one_step_off the push also waits for the in-flight generation: that wait is inside time/weight_sync
  (shown in the phase table; compare with sync's weight_sync).
* server idle: 1 - (CPU seconds of the rollout servers + router during the RL window) / RL wall, i.e.
  how much of the emulated rollout device (core 1) our rollout processes did NOT use (from /proc samples
  every 0.25 s). Also shown: 1 - the time-weighted mean of rollout/server_busy_frac (the fraction of
  wall time with at least one generation request in flight), which counts a request as busy even while
  it waits (e.g. in the router or on a paused server), so it overstates real server work.
* greedy accuracy after RL: summary.json accuracy_after_rl on eval.num_prompts held-out prompts
  (algorithm.off_policy_correction=icepop in every mode by default, see --off-policy-correction). A run is
  deterministic for its seed, so round k of --repeats (every mode) uses RL seed ``seed + k - 1`` (rollout
  sampling and batch order; the recipe's seed or --set seed=N) on the warm start's prompt split
  (data.seed = that seed): the accuracy is the mean over the rounds' seeds, the per-round differences are
  printed; the timings stay from each mode's median run.
* staleness: token-weighted mean of staleness/mean, max of staleness/max over the steps.
* CPU: trainer-core use (trainer process CPU / RL wall), the CPU per step of the trainer's busiest
  non-main thread (in sync the rollout producer: HTTP client, reward scoring; it shares core 0 with
  training; in one_step_off / async the producer is a process of its own and counts as rollout-side CPU)
  and of its other threads (the process's CPU minus the main thread's and the busiest one's: threads that
  have exited count, e.g. each weight push's thread), and the foreign load on cores 0 / 1 (busy ticks of the core minus our
  processes' ticks on it: a trainer thread pinned to core 1 alone, if any, counts as core-1 time (moerl
  keeps the producer, weight push and reward dispatcher threads on the trainer's core); what is left is
  other jobs and this tool; the report warns above 10%).

Time model (from the sync run's per-step phase means; S = steps):

  R = time/rollout (generation + scoring as the trainer sees it), L = time/log_prob, U = time/update,
  W = time/weight_sync, O = RL wall / S - (R + L + U + W) (other trainer work), P = producer-thread CPU
  per step (measured on the sync run's trainer core). W splits into the push to the servers,
  Wp = rollout/pause_s + push_s + continue_s (the manager's timing of the push itself), and the
  trainer's own part We = W - Wp (the HF export).
  sync step   = R + L + U + W + O                                 (= the measured sync step)
  overlapped  = max(R + Wp, L + U + O + P + We)   (rollout.background_push: the default)
              = W + max(R, L + U + O + P)         (--set rollout.background_push=false: Wp = We = W)
  one_step_off and async both serialise the push with generation (one_step_off pushes when nothing is in
  flight; async pauses the servers for it), so the rollout side needs R + Wp per step; with the
  background push the trainer pays only the export We (the push runs on a thread while it trains the
  next batch), without it the whole W; plus the producer's CPU, which in sync hid inside R and now
  competes with one side: here the rollout side (one_step_off / async run the producer as a process,
  pinned to core 1 by DEFAULT_SETTINGS), overlapped = max(R + P + Wp, L + U + O + We); with
  --set rollout.producer_cpu_affinity=[0] or rollout.producer_process=false it is the trainer's core, as
  written above.
  With max_staleness 1 (and one_step_off) each step pairs one generation with one training phase, so the
  step is the mean over all pairs (i, j) of sync steps of max(R_i + Wp, T_j + We) (independent draws;
  the per-step variance makes this larger than max of the means); with max_staleness 2 the extra batch
  of buffer absorbs the variance: max(mean R + Wp, mean T + We). Step 1 of every mode is a whole sync
  step (nothing is buffered yet): predicted wall = sync_step + (S - 1) * overlapped. The report also
  gives the steady-state ratio if an overhead went away (producer off the trainer core: P = 0; a push
  that does not pause generation: Wp = 0 on the rollout side), to say which overhead bounds the
  speed-up.

Cluster scale (the table): N devices, a fraction f for rollout (N_r = f N) and the rest for training
(N_t = N - N_r); ASSUMPTION: the rollout and training phase times scale inversely with their device
counts from the measured one-core ("one device") times R and T = L + U + O, and the weight push W stays
as measured (it does not shrink with more devices); the producer's CPU is host CPU, not device time, so P
is left out. sync (same split) = R / N_r + T / N_t + W; async = max(R / N_r + Wp, T / N_t + We) (= W +
max(R / N_r, T / N_t) without the background push); sync colocated (every device does both, no offload
cost) = (R + T) / N + W.

Targets (PASS / FAIL printed; the exit code stays 0): sync wall / async(s=1) wall >= 1.6; async(s=1)
greedy accuracy (mean over the rounds' seeds) within 3 points of sync's; the model's predicted sync / async(s=1) ratio within 20% of the
measured one.

Measured (--repeats 3; the README's Async section has the tables). Latest, 2026-12-05 (commits 7d1520c to
0ff87eb, the same AMD EPYC 2-core VM, sync 0.209-0.228 s/step): async s=1 median 1.67, 1.68, 1.75, 1.76, 1.63,
1.76 and 1.70 at 100 steps (rounds 1.50-1.82), accuracy -0.9 to +0.2 points against sync, time model 0-6% off,
steady-state limit 1.75-1.79;
and one run on a bad stretch of the VM, 1.34 (FAIL): the trainer's page faults at the steps where its memory
grows cost 30-40 us each while the rollout core was busy (2.5 us in sync), stalling async updates 0.1-0.65 s.
train.warm_memory_mb (512 MiB touched and unmapped before RL, the default in the overlapped modes on CPU since
4d36966) made those faults cheap in 6 of 6 runs on that stretch (4 with the memory kept in the heap, 2 touched and
unmapped as the default does). d2c2bc1 moved the producer process's httpx
import and GC freeze off its first draw (async's step-1 wait 0.149 -> 0.105-0.119 s). Before, commit cb123fb (a 14% faster CPU
training step: the update 0.114-0.122 s per step in both modes, from 0.142-0.148), an AMD EPYC 2-core VM (sync
0.234-0.237 s/step): async s=1 median 1.76 and 1.68 at 40 steps, 1.68 at 100 steps (rounds 1.58-1.78), accuracy
-0.9 and -1.7 points against sync, time model 1-5% off, steady-state limit 1.77-1.80. The demo is trainer-bound,
so a faster update raises sync / async = (R + U + W) / (U + We + wait). After midnight, the same code on the same
VM (sync 0.212-0.219 s/step) between 00:10 and 00:27: 1.57, 1.51, 1.54, 1.57 (time model 11-15% off): async's
update became 5-9% slower than sync's and its step 1 took 0.48-0.61 s against sync's 0.24-0.26; at 00:38-00:43
1.68 and 1.63 again (step 1 back at 0.32-0.36 s). Before, commits 13b0b73 to 2c97851, the
same VM (sync 0.25-0.29 s/step): async s=1 median 1.61, 1.72, 1.62, 1.54, 1.52, 1.54, 1.54 at 40 steps and
1.62 at 100 steps, accuracy -1.1 to -1.9 points against sync, time model 2-9% off. The async update now costs what
sync's does (0.136-0.154 s against 0.137-0.160): the producer process pauses and continues the servers itself,
the trainer keeps its HTTP connections alive, and an update pauses the servers only when a group is in flight
(5-8% of them at staleness 1), so the trainer's other threads use 7-8 ms of CPU per step in both modes (11-12
ms in async before) and the steady-state wait for a batch fell from 10 to 6 ms. The ratio moved with the VM's
update time (0.136 -> 0.148 s over the evening; the demo is trainer-bound, R 0.10 s against T 0.14-0.15 s);
the model's steady-state limit is 1.70-1.76. A 40-step run also pays the first batch's generation (3.5 ms per
step) and a slow first update in both modes (0.19-0.50 s against 0.13-0.15 later: ~24,000 first-touch page
faults of the optimizer state and gradients, the training thread's own CPU; it varies from run to run). Earlier, commit 7badf35 (sync 0.24 s/step): 1.56x at 40 and 100 steps, 1.64 / 1.63 at a9c228a.
Earlier benchmarks of the same design on VMs of the same kind gave
1.43-2.00x. Before commit 1f86af3 the trainer's producer / push / reward threads ran on core 1, where a
server preempted them while they held the trainer's interpreter lock: update 1.09-1.34x sync's, async s=1
1.26-1.57x. Earlier: commit 800c5f2 1.39-1.40x (single runs), commit 6d493aa (with the reference forward,
training-bound) 1.23-1.70x.

Usage: python tools/bench_async.py [--steps 40] [--warm-start DIR] [--modes sync one_step_off async_s1
       async_s2] [--out DIR] [--keep] [--num-servers 1] [--eval-prompts 1000]
       [--off-policy-correction icepop] [--devices 8 64] [--set key=value ...]
Defaults took about 8.5 minutes on the shared 2-core machine (measured: 502 s, of which the SFT warm
start 234 s; with --warm-start 184-221 s at commit 800c5f2: each mode 40-90 s, of which 12-24 s RL, the
rest start-up and greedy evals of 1000 prompts); since the recipe's SFT change (commit 7e26bd1) the warm
start takes 61-102 s (200 steps) on an AMD EPYC 2-core VM, the whole --repeats 3 run of sync and async_s1
209-421 s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from moerl.rollout.common import free_port_block

REPO = Path(__file__).resolve().parents[1]
RECIPE = "configs/tiny_arith.yaml"

#: every mode runs with exactly this pinning (emulated rollout device = core 1, trainer device = core 0)
TRAINER_CORES, ROLLOUT_CORES = [0], [1]
PIN = [f"train.cpu_affinity={TRAINER_CORES}", f"rollout.cpu_affinity={ROLLOUT_CORES}", "train.num_threads=1",
       "rollout.threads_per_server=1"]
PIN_LINE = ("pinning (every mode): trainer process on core 0 (train.cpu_affinity=[0] train.num_threads=1; in sync with "
            "its producer thread), rollout servers + router + reward workers on core 1 (rollout.cpu_affinity=[1] "
            "rollout.threads_per_server=1), and in one_step_off / async the producer process "
            "(rollout.producer_cpu_affinity=[1])")

MODES = {
    "sync": ["train.mode=sync"],
    "one_step_off": ["train.mode=one_step_off", "train.max_staleness=1"],
    "async_s1": ["train.mode=async", "train.max_staleness=1", "train.staleness_policy=wait"],
    "async_s2": ["train.mode=async", "train.max_staleness=2", "train.staleness_policy=wait"],
}

#: rollout.num_servers default, measured on this 2-core machine (sync mode, pinned as above, 15-20 steps,
#: 3 runs each, interleaved; the machine was shared, so noisy): time/rollout + time/weight_sync per step
#: 1 server 0.67 + 0.10, 0.71 + 0.10, 0.54 + 0.08 s; 2 servers 0.58 + 0.13, 0.65 + 0.17, 0.87 + 0.16 s.
#: The two servers time-share one core, so generation is not faster, while every push loads the weights
#: twice on that core; the overlapped modes pause generation for the push, so R + W is what counts.
DEFAULT_NUM_SERVERS = 1
SERVERS_NOTE = ("rollout.num_servers={n}: chosen by measurement (sync, pinned, 3 runs each): rollout wait + "
                "weight push per step 0.64 + 0.09 s with 1 server on core 1 vs 0.70 + 0.15 s with 2 (they "
                "time-share the core and both load every push) -> 1 server")

TARGET_SPEEDUP = 1.6
TARGET_ACC_POINTS = 3.0
TARGET_MODEL_REL_ERR = 0.20
#: off-policy correction of every mode. With the recipe's default (none) the overlapped modes trained on
#: one-version-stale samples lost 5-7 points of greedy accuracy against sync in 40 steps (56.9% sync vs
#: 51.8 / 50.4 / 49.9% one_step_off / async s=1 / s=2 on 1000 prompts; 56.3% vs 63.4% on a second warm start).
#: async s=1 against sync, points, on two warm starts (SFT seeds 1 and 2, AMD EPYC machine, commit f8696ff;
#: repeated runs gave the same accuracy): decoupled PPO (AReaL) -3.7 (58.8-60.1% vs 63.4%, five runs) and
#: +0.7; tis +4.7 / -0.5; icepop +1.1 / +0.2 (64.5% vs 63.4%, 47.7% vs 47.5%): IcePop's mask of tokens whose
#: weight leaves [1/2, 2] tracks sync closest. (On an earlier warm start decoupled gave +0.3.) In sync the
#: behaviour and proximal policies coincide, so the correction changes nothing there.
DEFAULT_CORRECTION = "icepop"
#: recipe settings of every mode (the SFT warm start too), before --set (which can override them):
#: - rollout.weight_sync=tensor: the weights go to the server over HTTP in memory, as between separate devices
#:   (the recipe's disk mode writes and reads safetensors files on both cores);
#: - algorithm.reference_policy=false: the recipe's kl_coef is 0, so its reference forward only LOGS a KL to
#:   the start policy; it was a third of the trainer's step (log_prob 0.09-0.11 of 0.33 s). verl and slime
#:   load no reference model when no KL term is used; the demo recipe keeps it as a diagnostic. A KL term
#:   (--set algorithm.kl_coef=...) needs --set algorithm.reference_policy=true too (the recipe check says so).
#: - rollout.producer_cpu_affinity=[1]: one_step_off's and async's producer process (rollout.producer_process)
#:   is rollout-side host work, like the HTTP worker and reward workers already on core 1. Measured on an AMD
#:   EPYC machine (40 steps, --repeats 2-3, commit 13a8be7 / eb4ac73): async staleness 1 was 1.47x sync with the
#:   process on core 1 (overlapped update 1.02x sync's) and 1.44x on core 0 (update 1.21x: it time-shares the
#:   trainer's core, 17% of it), 1.51x with the producer thread of rollout.producer_process=false.
DEFAULT_SETTINGS = ["rollout.weight_sync=tensor", "algorithm.reference_policy=false",
                    f"rollout.producer_cpu_affinity={ROLLOUT_CORES}"]
#: foreign load on a benchmark core (share of the RL wall) above which the report warns
FOREIGN_WARN = 0.10


# ============================================================================ pure parts (tested)

def step_timers(step: dict) -> float:
    """Sum of a step's time/* phases (seconds)."""
    return sum(v for k, v in step.items() if k.startswith("time/"))


def rl_window(steps: Sequence[dict]) -> tuple[float, float]:
    """(t_begin, t_end) of the RL phase from per-step records sorted by step; each has ``t_log`` (wall
    time of its events, written at the end of the step) and its time/* phases. t_begin = start of step
    1 (t_log[1] - its phases), t_end = t_log[N] - time/eval of step N (the final eval is excluded)."""
    if not steps:
        raise ValueError("no steps")
    first, last = steps[0], steps[-1]
    return first["t_log"] - step_timers(first), last["t_log"] - last.get("time/eval", 0.0)


def rl_wall(steps: Sequence[dict]) -> float:
    """RL wall seconds: the window of rl_window minus the evals of steps before the last."""
    t0, t1 = rl_window(steps)
    return t1 - t0 - sum(s.get("time/eval", 0.0) for s in steps[:-1])


def phase_means(steps: Sequence[dict]) -> dict:
    """Per-step means of R (rollout wait), L (log_prob), U (update), W (weight_sync), and O (other
    trainer work = RL wall / S - R - L - U - W)."""
    n = len(steps)
    mean = lambda k: sum(s.get(k, 0.0) for s in steps) / n  # noqa: E731
    out = {"R": mean("time/rollout"), "L": mean("time/log_prob"), "U": mean("time/update"),
           "W": mean("time/weight_sync")}
    out["O"] = max(0.0, rl_wall(steps) / n - out["R"] - out["L"] - out["U"] - out["W"])
    return out


def time_weighted_busy(steps: Sequence[dict]) -> float:
    """Time-weighted mean of rollout/server_busy_frac. Each value covers the interval between two
    batch hand-overs; step k's batch was handed over at t_log[k] - (its phases after the rollout wait),
    step 0's at the start of step 1."""
    t_begin, _ = rl_window(steps)
    prev, busy, total = t_begin, 0.0, 0.0
    for s in steps:
        handed = s["t_log"] - (step_timers(s) - s.get("time/rollout", 0.0))
        dt = max(0.0, handed - prev)
        busy += s.get("rollout/server_busy_frac", 0.0) * dt
        total += dt
        prev = handed
    return busy / total if total > 0 else 0.0


def staleness_summary(steps: Sequence[dict]) -> tuple[float, float]:
    """(token-weighted mean staleness, max staleness) over the steps; the token count of a step is the
    sum of its staleness/tokens_<v> values."""
    num = den = 0.0
    mx = 0.0
    for s in steps:
        tokens = sum(v for k, v in s.items() if k.startswith("staleness/tokens_"))
        if "staleness/mean" in s and tokens > 0:
            num += s["staleness/mean"] * tokens
            den += tokens
        mx = max(mx, s.get("staleness/max", 0.0))
    return (num / den if den else 0.0), mx


def interp(samples: Sequence[tuple[float, float]], t: float) -> float:
    """Linear interpolation of a cumulative series [(time, value), ...] (sorted by time) at t; clamped
    to the first / last value outside the sampled range."""
    if not samples:
        return 0.0
    if t <= samples[0][0]:
        return samples[0][1]
    for (t0, v0), (t1, v1) in zip(samples, samples[1:]):
        if t <= t1:
            return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return samples[-1][1]


def push_phase(steps: Sequence[dict]) -> float:
    """Mean push to the servers per weight update, Wp = rollout/pause_s + push_s + continue_s (the
    manager times the push after step k into step k+1's batch, so steps[1:] carry one each); 0.0 when
    the run logged none."""
    later = [s for s in steps[1:] if "rollout/push_s" in s]
    if not later:
        return 0.0
    return sum(s.get("rollout/pause_s", 0.0) + s["rollout/push_s"] + s.get("rollout/continue_s", 0.0)
               for s in later) / len(later)


def overlapped_step(R: Sequence[float], T: Sequence[float], w_trainer: float, w_rollout: float,
                    buffered: bool) -> float:
    """Predicted step of an overlapped mode from per-step rollout times R and trainer-side times T
    (both without the weight update), the update's trainer part ``w_trainer`` and its rollout part
    ``w_rollout`` (a foreground push: both = W): mean over all pairs of max(R_i + w_rollout, T_j +
    w_trainer) (one batch of slack: one_step_off, async max_staleness 1), or max(mean R + w_rollout,
    mean T + w_trainer) (buffered: max_staleness >= 2). Raises ValueError on empty R or T."""
    if not R or not T:
        raise ValueError("empty phase samples")
    if buffered:
        return max(sum(R) / len(R) + w_rollout, sum(T) / len(T) + w_trainer)
    return sum(max(r + w_rollout, t + w_trainer) for r, t in itertools.product(R, T)) / (len(R) * len(T))


def weight_update_split(ph: dict, wp: float, background_push: bool) -> tuple[float, float]:
    """(trainer part, rollout part) of the weight update W = ph["W"]: with the background push the
    trainer pays the export W - Wp and generation the push Wp; without it both wait for all of W."""
    if not background_push:
        return ph["W"], ph["W"]
    wp = min(wp, ph["W"])
    return ph["W"] - wp, wp


def time_model(sync_steps: Sequence[dict], producer_cpu_per_step: float = 0.0, background_push: bool = True,
               producer_on_rollout: bool = False) -> dict:
    """The module docstring's time model from the sync run's per-step records. Returns the phase means,
    the sync step, the weight-update split (We, Wp), the predicted overlapped steps (pairwise for
    one_step_off / async_s1, buffered for async_s2), predicted walls (step 1 = a sync step) and the
    predicted sync / mode ratios. ``producer_on_rollout`` (the overlapped modes' producer process pinned to
    the rollout core, rollout.producer_cpu_affinity): the producer's CPU P is rollout-side work (R + P)
    instead of the trainer's (T + P)."""
    S = len(sync_steps)
    ph = phase_means(sync_steps)
    sync_step = ph["R"] + ph["L"] + ph["U"] + ph["W"] + ph["O"]
    We, Wp = weight_update_split(ph, push_phase(sync_steps), background_push)
    P_r, P_t = (producer_cpu_per_step, 0.0) if producer_on_rollout else (0.0, producer_cpu_per_step)
    R = [s.get("time/rollout", 0.0) + P_r for s in sync_steps]
    T = [s.get("time/log_prob", 0.0) + s.get("time/update", 0.0) + ph["O"] + P_t for s in sync_steps]
    steps = {"one_step_off": overlapped_step(R, T, We, Wp, buffered=False),
             "async_s1": overlapped_step(R, T, We, Wp, buffered=False),
             "async_s2": overlapped_step(R, T, We, Wp, buffered=True)}
    sync_wall = sync_step * S
    walls = {m: sync_step + (S - 1) * st for m, st in steps.items()}
    # steady-state sync / overlapped ratios (means) if an overhead went away: the producer off the
    # trainer's core, the push not pausing generation (only the trainer pays its part), both
    Rm, Tm, P = ph["R"], ph["L"] + ph["U"] + ph["O"], producer_cpu_per_step
    what_if = {"as measured": max(Rm + P_r + Wp, Tm + P_t + We),
               "producer on the trainer core": max(Rm + Wp, Tm + P + We),
               "producer on the rollout core": max(Rm + P + Wp, Tm + We),
               "producer off the trainer core": max(Rm + Wp, Tm + We),
               "push does not pause generation": max(Rm + P_r, Tm + P_t + We), "both": max(Rm, Tm + We)}
    return {"phases": ph, "P": producer_cpu_per_step, "We": We, "Wp": Wp, "background_push": background_push,
            "producer_on_rollout": producer_on_rollout,
            "sync_step": sync_step, "steps": steps, "sync_wall": sync_wall, "walls": walls,
            "ratios": {m: sync_wall / w for m, w in walls.items()},
            "steady_ratios": {m: sync_step / st for m, st in steps.items()},
            "what_if_ratios": {k: sync_step / v for k, v in what_if.items()}}


def own_producer_step(model: dict, fig: dict) -> Optional[float]:
    """Diagnostic: the overlapped step max(R + Wp, L + U + O + P' + We) of the sync phases with P' = the
    producer CPU per step measured in the mode itself (which includes its resumed segments and its
    contention overheads) instead of the sync run's P; None without CPU samples."""
    if "producer_cpu_per_step" not in fig:
        return None
    ph = model["phases"]
    return max(ph["R"] + model["Wp"], ph["L"] + ph["U"] + ph["O"] + fig["producer_cpu_per_step"] + model["We"])


def rel_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
    return abs(predicted - measured) / abs(measured)


def cluster_row(R: float, T: float, W: float, n_devices: int, rollout_fraction: float,
                w_rollout: Optional[float] = None) -> dict:
    """Predicted steps on N devices split rollout / trainer (module docstring, cluster scale): R and T
    are one-device phase times, W the weight update (not scaled), ``w_rollout`` its push part with the
    background push (the trainer then pays W - w_rollout; None: a foreground push, both pay W)."""
    n_r = max(1, min(n_devices - 1, round(rollout_fraction * n_devices)))
    n_t = n_devices - n_r
    sync = R / n_r + T / n_t + W
    wr = W if w_rollout is None else w_rollout
    wt = W if w_rollout is None else W - w_rollout
    asyn = max(R / n_r + wr, T / n_t + wt)
    coloc = (R + T) / n_devices + W
    return {"devices": n_devices, "rollout_devices": n_r, "trainer_devices": n_t, "sync_step": sync,
            "async_step": asyn, "colocated_sync_step": coloc, "speedup": sync / asyn,
            "speedup_vs_colocated": coloc / asyn}


def background_push_of(overrides: Sequence[str]) -> bool:
    """Whether the overlapped modes push in the background: rollout.background_push null (the default:
    on in one_step_off / async) unless an override sets it false."""
    value = None
    for o in overrides:
        key, _, v = o.partition("=")
        if key.strip() == "rollout.background_push":
            value = v.strip().lower()
    return value not in ("false", "0", "no", "off")


def producer_on_rollout_of(overrides: Sequence[str]) -> bool:
    """Whether the overlapped modes' producer runs on the rollout core: a rollout.producer_cpu_affinity
    override equal to the benchmark's rollout cores (the default, null, keeps the producer process on the
    trainer's core, where sync's producer thread is)."""
    value = None
    for o in overrides:
        key, _, v = o.partition("=")
        if key.strip() == "rollout.producer_cpu_affinity":
            value = v.strip().replace(" ", "")
    return value == "[" + ",".join(str(c) for c in ROLLOUT_CORES) + "]"


def balanced_fraction(R: float, T: float) -> float:
    """Rollout fraction f where R / (f N) = T / ((1 - f) N): f = R / (R + T)."""
    return R / (R + T)


def verdicts(sync_wall: float, async_wall: float, sync_acc: float, async_acc: float,
             predicted_ratio: float) -> list[dict]:
    """The three acceptance targets, each {name, value, target, pass}."""
    measured = sync_wall / async_wall
    err = rel_error(predicted_ratio, measured)
    return [
        {"name": "speed-up sync / async(s=1)", "value": measured, "target": f">= {TARGET_SPEEDUP}",
         "pass": measured >= TARGET_SPEEDUP},
        {"name": "accuracy async(s=1) - sync (points)", "value": 100 * (async_acc - sync_acc),
         "target": f"within +-{TARGET_ACC_POINTS:g}", "pass": abs(100 * (async_acc - sync_acc)) <= TARGET_ACC_POINTS},
        {"name": "model ratio vs measured (rel. error)", "value": err,
         "target": f"<= {TARGET_MODEL_REL_ERR:.0%}", "pass": err <= TARGET_MODEL_REL_ERR},
    ]


def parse_task_stat(text: str) -> tuple[int, int]:
    """(ppid, utime + stime ticks) from a /proc/<pid>[/task/<tid>]/stat line (comm may hold spaces)."""
    rest = text.rsplit(")", 1)[1].split()
    return int(rest[1]), int(rest[11]) + int(rest[12])


def parse_proc_stat(text: str) -> dict[int, int]:
    """Busy ticks per core (user + nice + system + irq + softirq + steal) from /proc/stat."""
    out = {}
    for line in text.splitlines():
        f = line.split()
        if f and f[0].startswith("cpu") and f[0][3:].isdigit():
            v = [int(x) for x in f[1:9]]
            out[int(f[0][3:])] = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    return out


# ============================================================================ measurement

class ProcSampler:
    """Polls /proc every ``interval`` s while a trainer process runs: cumulative CPU seconds of its main
    thread, of its other threads, of all its descendant processes (rollout servers + router), and busy
    seconds of every core. Series are [(time.time(), value), ...]."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.hz = os.sysconf("SC_CLK_TCK")
        # threads_core1: the trainer's non-main threads pinned to core 1 alone, if any (moerl keeps its
        # producer, push and dispatcher threads on the trainer's core): their CPU is core-1 time
        self.series: dict[str, list[tuple[float, float]]] = {"main": [], "threads": [], "rollout": [],
                                                             "threads_core1": []}
        self._on_core1: set[int] = set()
        self.cores: dict[int, list[tuple[float, float]]] = {}
        self._threads: dict[int, int] = {}
        self._process = 0  # utime + stime of the whole process (exited threads included), ticks
        self.thread_series: dict[int, list[tuple[float, float]]] = {}  # non-main threads, by tid
        self._procs: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "ProcSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _read(self, path: str) -> Optional[str]:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    def _descendants(self) -> list[int]:
        parent = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                txt = self._read(f"/proc/{d}/stat")
                if txt:
                    try:
                        parent[int(d)] = parse_task_stat(txt)[0]
                    except (IndexError, ValueError):
                        pass
        out, frontier = [], [self.pid]
        while frontier:
            p = frontier.pop()
            kids = [c for c, pp in parent.items() if pp == p]
            out += kids
            frontier += kids
        return out

    def sample(self) -> None:
        now = time.time()
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]
        except OSError:
            tids = []
        for tid in tids:
            txt = self._read(f"/proc/{self.pid}/task/{tid}/stat")
            if txt:
                self._threads[tid] = max(self._threads.get(tid, 0), parse_task_stat(txt)[1])
            status = self._read(f"/proc/{self.pid}/task/{tid}/status") or ""
            if tid != self.pid and "Cpus_allowed_list:\t1\n" in status:
                self._on_core1.add(tid)
        for p in self._descendants():
            txt = self._read(f"/proc/{p}/stat")
            if txt:
                self._procs[p] = max(self._procs.get(p, 0), parse_task_stat(txt)[1])
        main = self._threads.get(self.pid, 0)
        for tid, ticks in self._threads.items():
            if tid != self.pid:
                self.thread_series.setdefault(tid, []).append((now, ticks / self.hz))
        # every thread the process ever ran: /proc/<pid>/stat's utime + stime include the threads that have
        # exited, which the per-thread snapshots miss when they start and end between two samples (each weight
        # push's thread, the pool threads of its pause / continue calls)
        txt = self._read(f"/proc/{self.pid}/stat")
        self._process = max(self._process, sum(self._threads.values()), parse_task_stat(txt)[1] if txt else 0)
        self.series["main"].append((now, main / self.hz))
        self.series["threads"].append((now, (self._process - main) / self.hz))
        self.series["rollout"].append((now, sum(self._procs.values()) / self.hz))
        self.series["threads_core1"].append((now, sum(self._threads.get(t, 0) for t in self._on_core1) / self.hz))
        for core, ticks in parse_proc_stat(self._read("/proc/stat") or "").items():
            self.cores.setdefault(core, []).append((now, ticks / self.hz))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def window(self, t0: float, t1: float) -> dict:
        """CPU seconds of each series (and each core's busy seconds) between t0 and t1."""
        out = {k: interp(v, t1) - interp(v, t0) for k, v in self.series.items()}
        out["cores"] = {c: interp(v, t1) - interp(v, t0) for c, v in self.cores.items()}
        # a thread born inside the window counts from 0 (interp clamps to its first sample otherwise)
        out["per_thread"] = sorted((interp(v, t1) - (interp(v, t0) if v[0][0] <= t0 else 0.0)
                                    for v in self.thread_series.values()), reverse=True)
        return out


def read_steps(tb_dir: Path) -> list[dict]:
    """Per-step records from a run's TensorBoard events: every scalar of step >= 1 by tag, plus t_log
    (the latest event wall time of that step)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(tb_dir), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    steps: dict[int, dict] = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            if e.step < 1:
                continue
            rec = steps.setdefault(e.step, {"step": e.step, "t_log": 0.0})
            rec[tag] = e.value
            rec["t_log"] = max(rec["t_log"], e.wall_time)
    return [steps[k] for k in sorted(steps)]




def run_train(overrides: list[str], run_dir: Path, num_servers: int, timeout_s: float,
              sampler_interval: Optional[float] = None) -> tuple[float, Optional[ProcSampler]]:
    """Run ``python -m moerl.cli train RECIPE output_dir=run_dir <overrides>`` (own ports; stdout and
    stderr to run_dir/../<name>.log); returns (wall seconds, the /proc sampler or None). Raises
    RuntimeError on a non-zero exit or a timeout (the process group it started is killed)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    base = free_port_block(num_servers + 1)
    cmd = [sys.executable, "-m", "moerl.cli", "train", RECIPE, f"output_dir={run_dir}",
           f"rollout.num_servers={num_servers}", f"rollout.base_port={base}",
           f"rollout.router_port={base + num_servers}", *overrides]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TORCHDYNAMO_DISABLE="1")
    log_path = run_dir.parent / f"{run_dir.name}.log"
    t0 = time.time()
    with open(log_path, "w") as log_f:
        log_f.write(" ".join(cmd) + "\n")
        log_f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = ProcSampler(proc.pid, sampler_interval).start() if sampler_interval else None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise RuntimeError(f"{run_dir.name}: timed out after {timeout_s:.0f}s (log: {log_path})")
        except BaseException:
            _kill(proc)
            raise
        finally:
            if sampler is not None:
                sampler.stop()
    if rc != 0:
        tail = "".join(open(log_path).readlines()[-15:])
        raise RuntimeError(f"{run_dir.name}: exit code {rc} (log: {log_path})\n{tail}")
    return time.time() - t0, sampler


def _kill(proc: subprocess.Popen) -> None:
    """SIGINT the trainer (it stops its servers), then SIGKILL the process group it leads."""
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    except (subprocess.TimeoutExpired, OSError):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def mode_figures(steps: list[dict], summary: dict, sampler: Optional[ProcSampler], num_steps: int) -> dict:
    """Every figure of one mode from its step records, summary.json and /proc samples."""
    if len(steps) != num_steps:
        raise RuntimeError(f"expected {num_steps} step records in TensorBoard, found {len(steps)}")
    t0, t1 = rl_window(steps)
    wall = rl_wall(steps)
    ph = phase_means(steps)
    stale_mean, stale_max = staleness_summary(steps)
    fig = {
        "rl_wall_s": wall, "step_s": wall / num_steps, "phases": ph,
        "trainer_wait_s": sum(s.get("time/rollout", 0.0) for s in steps),
        "samples": sum(s.get("num_samples", 0.0) for s in steps),
        "server_busy_frac_tw": time_weighted_busy(steps),
        "staleness_mean": stale_mean, "staleness_max": stale_max,
        "accuracy_after_rl": summary.get("accuracy_after_rl"),
        "accuracy_after_warm_start": summary.get("accuracy_after_warm_start"),
        "dropped_stale_groups": sum(s.get("rollout/dropped_stale_groups", 0.0) for s in steps),
        "resumed_segments": sum(s.get("rollout/resumed_segments", 0.0) for s in steps),
        "gate_wait_s": sum(s.get("rollout/wait_s", 0.0) for s in steps),
        "per_step": [{k: v for k, v in s.items() if k.startswith(("time/", "rollout/", "staleness/"))
                      or k in ("step", "t_log", "num_samples")} for s in steps],
    }
    fig["trainer_idle"] = fig["trainer_wait_s"] / wall
    fig["server_idle_requests"] = 1.0 - fig["server_busy_frac_tw"]
    if sampler is not None:
        cpu = sampler.window(t0, t1)
        trainer_cpu = cpu["main"] + cpu["threads"]
        fig["cpu"] = {"trainer_main_s": cpu["main"], "trainer_threads_s": cpu["threads"],
                      "trainer_per_thread_s": cpu["per_thread"], "rollout_s": cpu["rollout"],
                      "cores_busy_s": cpu["cores"]}
        # the producer: the busiest non-main thread of the trainer (asyncio loop: HTTP client, scoring)
        fig["producer_cpu_per_step"] = (cpu["per_thread"][0] if cpu["per_thread"] else 0.0) / num_steps
        fig["other_threads_cpu_per_step"] = (cpu["threads"] - sum(cpu["per_thread"][:1])) / num_steps
        fig["trainer_core_use"] = trainer_cpu / wall
        fig["server_idle"] = max(0.0, 1.0 - cpu["rollout"] / wall)
        cores = cpu["cores"]
        on1 = cpu.get("threads_core1", 0.0)  # trainer threads pinned to the rollout core, if any
        fig["cpu"]["trainer_threads_on_core1_s"] = on1
        fig["foreign_core0"] = max(0.0, cores.get(0, trainer_cpu - on1) - (trainer_cpu - on1)) / wall
        fig["foreign_core1"] = max(0.0, cores.get(1, cpu["rollout"] + on1) - cpu["rollout"] - on1) / wall
    return fig


# ============================================================================ report

def fmt_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def median_run(runs: list[dict]) -> dict:
    """Of one mode's repeated runs (each a mode_figures dict), the run with the median RL wall (the lower
    middle one for an even count), with ``repeat_walls_s`` (every run's RL wall, in run order) added: all
    of a mode's timing figures then come from one consistent run. The accuracy is not a timing: the rounds
    use different RL seeds (:func:`round_seed_overrides`), so ``repeat_accuracies`` (every run's
    accuracy_after_rl, in run order) and their mean ``accuracy_mean`` are added too.

    Raises:
        ValueError: no runs.
    """
    if not runs:
        raise ValueError("median_run needs at least one run")
    order = sorted(range(len(runs)), key=lambda i: runs[i]["rl_wall_s"])
    accs = [r.get("accuracy_after_rl") for r in runs]
    out = dict(runs[order[(len(runs) - 1) // 2]], repeat_walls_s=[r["rl_wall_s"] for r in runs])
    if all(a is not None for a in accs):
        out.update(repeat_accuracies=accs, accuracy_mean=sum(accs) / len(accs))
    return out


def seeds_of(overrides: Sequence[str]) -> tuple[int, int]:
    """(run seed, prompt-split seed) of the recipe with ``overrides`` (--set), as moerl's loader resolves them:
    the split seed is data.seed, else the run seed.

    Raises:
        moerl.config errors: an override the recipe refuses (the runs would refuse it too)."""
    from moerl.config import load_config

    cfg = load_config(str(REPO / RECIPE), list(overrides))
    return cfg.seed, cfg.data_seed


def round_seed_overrides(base_seed: int, rep: int, data_seed: Optional[int] = None) -> list[str]:
    """Recipe overrides of round ``rep`` (0-based) of every mode: RL seed ``base_seed + rep`` (rollout
    sampling, batch order), the prompt split of ``data_seed`` (default ``base_seed``: the warm start's SFT
    split, so no eval prompt was an SFT prompt). The runs are deterministic for a seed, so repeating one
    seed repeats one RL trajectory; other seeds give the accuracy difference's spread over trajectories."""
    return [f"seed={base_seed + rep}", f"data.seed={base_seed if data_seed is None else data_seed}"]


def round_ratios(sync_walls: Sequence[float], mode_walls: Sequence[float]) -> tuple[list[float], float]:
    """(sync wall / mode wall of each round, sum of sync walls / sum of the mode's walls) for the RL walls of
    interleaved repeats (round k = the k-th run of every mode).

    Raises:
        ValueError: the lists differ in length or are empty."""
    if len(sync_walls) != len(mode_walls) or not sync_walls:
        raise ValueError(f"need one wall per round of each mode, got {len(sync_walls)} and {len(mode_walls)}")
    return [s / m for s, m in zip(sync_walls, mode_walls)], sum(sync_walls) / sum(mode_walls)


def report(res: dict) -> str:
    modes, figs = res["modes"], res["figures"]
    sync = figs.get("sync")
    out = [PIN_LINE, res["servers_note"],
           f"{res['steps']} RL steps x {res['samples_per_step']:.0f} samples per mode, greedy eval on "
           f"{res['eval_prompts']} held-out prompts, algorithm.off_policy_correction="
           f"{res.get('off_policy_correction', 'none')}, warm start {res['warm_start']}",
           "RL wall = start of step 1 .. end of step N's weight push, from TensorBoard event times and the "
           "per-step timers (SFT, evals, start-up excluded); trainer idle = sum(time/rollout) / RL wall; "
           "server idle = 1 - rollout servers+router CPU / RL wall (in brackets: 1 - time-weighted "
           "rollout/server_busy_frac)", ""]
    rows = []
    for m in modes:
        f = figs[m]
        ratio = f"{sync['rl_wall_s'] / f['rl_wall_s']:.2f}" if sync else "-"
        srv = (f"{f['server_idle']:.2f} ({f['server_idle_requests']:.2f})" if "server_idle" in f
               else f"- ({f['server_idle_requests']:.2f})")
        rows.append([m, f"{f['rl_wall_s']:.1f}", f"{f['step_s']:.3f}", ratio, f"{f['trainer_idle']:.2f}", srv,
                     f"{100 * f.get('accuracy_mean', f['accuracy_after_rl']):.1f}",
                     f"{f['staleness_mean']:.2f}/{f['staleness_max']:.0f}",
                     f"{f['samples']:.0f}"])
    out.append(fmt_table(["mode", "RL wall s", "s/step", "sync/mode", "trainer idle", "server idle",
                          "acc % (after RL; mean of seeds)", "stale mean/max", "samples"], rows))
    if res.get("repeats", 1) > 1:
        out += ["", f"--repeats {res['repeats']}: the modes ran interleaved {res['repeats']} times; every timing of a "
                    "mode is from its median run, its accuracy the mean over the rounds' RL seeds (RL wall s of each "
                    "run, in order):"]
        out += [f"  {m}: " + " ".join(f"{w:.1f}" for w in figs[m]["repeat_walls_s"]) for m in modes]
        if sync:
            out += ["  the same as ratios sync / mode, per round (a round's runs are adjacent in time) and pooled "
                    "(sum of sync walls / sum of the mode's walls):"]
            for m in modes:
                if m != "sync":
                    per, pooled = round_ratios(sync["repeat_walls_s"], figs[m]["repeat_walls_s"])
                    out.append(f"  {m}: per round " + " ".join(f"{r:.2f}" for r in per) + f"; pooled {pooled:.2f}")
        out += [f"  greedy accuracy % after RL, round by round (RL seeds {', '.join(map(str, res['seeds']))}; one "
                f"prompt split, data.seed {res['data_seed']})" + ("; mode - sync in brackets:" if sync else ":")]
        for m in modes:
            accs = figs[m].get("repeat_accuracies")
            if not accs:
                continue
            diff = ([f" ({100 * (a - b):+.1f})" for a, b in zip(accs, sync["repeat_accuracies"])]
                    if sync and m != "sync" else [""] * len(accs))
            out.append(f"  {m}: " + " ".join(f"{100 * a:.1f}{d}" for a, d in zip(accs, diff))
                       + f"; mean {100 * figs[m]['accuracy_mean']:.1f}")
    out += ["", "per-step phase means (s); CPU: core0 use = trainer process CPU / RL wall, producer = its busiest "
                "non-main thread (CPU s/step), core1 use = servers + router CPU / RL wall, foreign = the core's "
                "busy time not ours / RL wall (other jobs: noise):"]
    rows = []
    for m in modes:
        f, ph = figs[m], figs[m]["phases"]
        cpu = ([f"{f['trainer_core_use']:.2f}", f"{f['producer_cpu_per_step']:.3f}",
                f"{f['other_threads_cpu_per_step']:.3f}", f"{1 - f['server_idle']:.2f}",
                f"{f['foreign_core0']:.2f}/{f['foreign_core1']:.2f}"]
               if "cpu" in f else ["-"] * 5)
        rows.append([m, f"{ph['R']:.3f}", f"{ph['L']:.3f}", f"{ph['U']:.3f}", f"{ph['W']:.3f}", f"{ph['O']:.3f}",
                     *cpu, f"{f['resumed_segments']:.0f}", f"{f['dropped_stale_groups']:.0f}"])
    out.append(fmt_table(["mode", "rollout wait", "log_prob", "update", "weight_sync", "other",
                          "core0 use", "producer cpu/step", "other thr cpu/step", "core1 use", "foreign 0/1", "resumed", "dropped"], rows))
    model = res.get("model")
    if model:
        ph = model["phases"]
        out += ["", f"time model (sync phases): R {ph['R']:.3f}  L {ph['L']:.3f}  U {ph['U']:.3f}  W {ph['W']:.3f}  "
                    f"O {ph['O']:.3f}  P (producer CPU, sync run) {model['P']:.3f} s/step; sync step "
                    f"{model['sync_step']:.3f} s; W = export We {model['We']:.3f} + push Wp {model['Wp']:.3f}; "
                    + (("overlapped step = max(R + P + Wp, L+U+O + We) (background push; producer on the "
                        "rollout core)" if model.get("producer_on_rollout") else
                        "overlapped step = max(R + Wp, L+U+O+P + We) (background push; producer on the "
                        "trainer core)")
                       if model["background_push"] else "overlapped step = W + max(R, L+U+O+P) (foreground push)")]
        rows = []
        for m in modes:
            if m == "sync" or m not in model["walls"]:
                continue
            meas = sync["rl_wall_s"] / figs[m]["rl_wall_s"]
            pred = model["ratios"][m]
            own = own_producer_step(model, figs[m])
            rows.append([m, f"{model['steps'][m]:.3f}", f"{figs[m]['step_s']:.3f}", f"{pred:.2f}", f"{meas:.2f}",
                         f"{100 * rel_error(pred, meas):.0f}%", f"{model['steady_ratios'][m]:.2f}",
                         f"{own:.3f} ({100 * rel_error(own, figs[m]['step_s']):.0f}%)" if own else "-"])
        out.append(fmt_table(["mode", "pred s/step", "meas s/step", "pred sync/mode", "meas sync/mode",
                              "rel. error", "pred steady-state", "s/step with the mode's own P (err)"], rows))
        out.append("steady-state sync/overlapped ratio if an overhead went away (model, phase means): " + "; ".join(
            f"{k} {v:.2f}" for k, v in model["what_if_ratios"].items()))
        cl = res["cluster"]
        out += ["", f"cluster scale (ASSUMPTION: rollout / training phase times scale as 1/devices from the "
                    f"one-core R = {cl['R']:.3f} s and T = L+U+O = {cl['T']:.3f} s; weight update W = {cl['W']:.3f} s (push Wp {cl.get('Wp', cl['W']):.3f}) fixed; "
                    f"balanced rollout fraction R/(R+T) = {cl['balanced_fraction']:.2f}):"]
        rows = [[str(r["devices"]), f"{r['rollout_devices']}/{r['trainer_devices']}", f"{1000 * r['sync_step']:.1f}",
                 f"{1000 * r['async_step']:.1f}", f"{r['speedup']:.2f}", f"{1000 * r['colocated_sync_step']:.1f}",
                 f"{r['speedup_vs_colocated']:.2f}"] for r in cl["rows"]]
        out.append(fmt_table(["N", "rollout/trainer", "sync ms", "async ms", "sync/async", "colocated sync ms",
                              "colocated/async"], rows))
    noisy = [f"{m} (core 0 {figs[m]['foreign_core0']:.0%}, core 1 {figs[m]['foreign_core1']:.0%})" for m in modes
             if max(figs[m].get("foreign_core0", 0.0), figs[m].get("foreign_core1", 0.0)) > FOREIGN_WARN]
    if noisy:
        out += ["", f"WARNING: other processes took more than {FOREIGN_WARN:.0%} of a benchmark core during: "
                    + ", ".join(noisy) + "; those timings are contaminated (rerun on a quiet machine)"]
    if res.get("targets"):
        out += ["", "targets:"]
        for t in res["targets"]:
            v = f"{t['value']:.2f}" if "points" in t["name"] or "speed" in t["name"] else f"{100 * t['value']:.0f}%"
            out.append(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['name']}: {v} (target {t['target']})")
    return "\n".join(out)


# ============================================================================ main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="RL steps per mode (same batches in every mode)")
    p.add_argument("--warm-start", default=None, help="existing HF warm-start dir (skips the SFT run)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--repeats", type=int, default=1,
                   help="run the modes this many times, interleaved, round k with RL seed seed+k-1; each mode's "
                        "timings are from its median run, its accuracy the mean over the seeds (this machine's "
                        "speed drifts by up to 25%% between minutes: 3 gives steadier ratios)")
    p.add_argument("--out", default="runs/bench_async", help="run dirs, logs and results.json")
    p.add_argument("--keep", action="store_true", help="keep the run dirs (default: logs and figures only)")
    p.add_argument("--num-servers", type=int, default=DEFAULT_NUM_SERVERS, choices=[1, 2],
                   help="rollout servers sharing core 1")
    p.add_argument("--eval-prompts", type=int, default=1000, help="eval.num_prompts = data.num_eval")
    p.add_argument("--off-policy-correction", default=DEFAULT_CORRECTION,
                   choices=["none", "decoupled", "tis", "mis", "icepop"],
                   help="algorithm.off_policy_correction of every mode (a no-op in sync up to the ~1e-6 "
                        "trainer/server log-prob mismatch); none = the recipe's default")
    p.add_argument("--devices", type=int, nargs="+", default=[8, 64], help="N of the cluster-scale table")
    p.add_argument("--mode-timeout", type=float, default=600.0, help="seconds before a run is killed")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="extra recipe override for every run (repeatable)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    usable = os.sched_getaffinity(0)
    if not {0, 1} <= usable:
        p.error(f"needs cores 0 and 1 (usable: {sorted(usable)})")
    t_bench = time.time()
    base_seed, data_seed = seeds_of(args.extra)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = [f"eval.num_prompts={args.eval_prompts}", f"data.num_eval={args.eval_prompts}"]
    print(PIN_LINE, flush=True)
    print(SERVERS_NOTE.format(n=args.num_servers) if args.num_servers == DEFAULT_NUM_SERVERS
          else f"rollout.num_servers={args.num_servers} (--num-servers)", flush=True)

    if args.warm_start:
        warm = Path(args.warm_start).resolve()
        if not (warm / "config.json").exists():
            p.error(f"--warm-start {warm}: no config.json (expected an HF dir such as <run>/hf_warm_start)")
        print(f"warm start: {warm} (it should come from an SFT run with data.num_eval={args.eval_prompts} and "
              f"data.seed (else seed) {data_seed}: otherwise some eval prompts may have been SFT training prompts)",
              flush=True)
    else:
        run = out / "warm_start"
        print("warm start: SFT run of the recipe (both cores, until sft.target_accuracy) ...", flush=True)
        secs, _ = run_train(["train.num_steps=1", "eval.every_steps=0", "eval.num_prompts=100",
                             f"data.num_eval={args.eval_prompts}", *DEFAULT_SETTINGS, *args.extra,
                             *round_seed_overrides(base_seed, 0, data_seed)], run, 2, args.mode_timeout)
        warm = out / "hf_warm_start"
        if warm.exists():
            shutil.rmtree(warm)
        shutil.copytree(run / "hf_warm_start", warm)
        if not args.keep:
            shutil.rmtree(run)
        print(f"warm start: done in {secs:.0f}s -> {warm} (reuse with --warm-start {warm})", flush=True)

    common = [f"model.init_from={warm}", "sft.enabled=false", f"train.num_steps={args.steps}",
              "eval.every_steps=0", "log.samples=false", f"algorithm.off_policy_correction={args.off_policy_correction}",
              *data, *PIN, *DEFAULT_SETTINGS, *args.extra]
    print(f"every mode: {args.steps} RL steps, algorithm.off_policy_correction={args.off_policy_correction}, "
          f"{' '.join(DEFAULT_SETTINGS)} (see DEFAULT_SETTINGS), "
          f"greedy eval on {args.eval_prompts} held-out prompts", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    for rep in range(args.repeats):  # interleaved: a slow spell of the machine hits every mode alike
        for m in args.modes:
            run = out / (m if args.repeats == 1 else f"{m}_r{rep + 1}")
            secs, sampler = run_train(common + MODES[m] + round_seed_overrides(base_seed, rep, data_seed), run,
                                      args.num_servers, args.mode_timeout, sampler_interval=0.25)
            steps = read_steps(run / "tensorboard")
            summary = json.loads((run / "summary.json").read_text())
            f = dict(mode_figures(steps, summary, sampler, args.steps), process_s=secs)
            runs[m].append(f)
            if not args.keep:
                shutil.rmtree(run)
            print(f"{m}{'' if args.repeats == 1 else f' (run {rep + 1}/{args.repeats})'}: RL wall "
                  f"{f['rl_wall_s']:.1f}s ({f['step_s']:.3f} s/step; whole run {secs:.0f}s), accuracy after RL "
                  f"{100 * f['accuracy_after_rl']:.1f}% (seed {base_seed + rep})", flush=True)
    figs = {m: median_run(rs) for m, rs in runs.items()}

    samples_per_step = max(f["samples"] for f in figs.values()) / args.steps  # trained samples (measured)
    res = {"command": " ".join([sys.executable, *sys.argv]), "steps": args.steps, "modes": args.modes,
           "repeats": args.repeats, "seeds": [base_seed + r for r in range(args.repeats)], "data_seed": data_seed,
           "samples_per_step": samples_per_step, "eval_prompts": args.eval_prompts, "warm_start": str(warm),
           "num_servers": args.num_servers, "pinning": PIN, "pin_line": PIN_LINE,
           "servers_note": (SERVERS_NOTE.format(n=args.num_servers) if args.num_servers == DEFAULT_NUM_SERVERS
                            else f"rollout.num_servers={args.num_servers} (--num-servers)"),
           "off_policy_correction": args.off_policy_correction, "default_settings": DEFAULT_SETTINGS,
           "extra_overrides": args.extra, "figures": figs}
    if "sync" in figs:
        sync_steps = figs["sync"]["per_step"]
        background = background_push_of(DEFAULT_SETTINGS + args.extra)
        model = time_model(sync_steps, figs["sync"].get("producer_cpu_per_step", 0.0), background,
                           producer_on_rollout_of(DEFAULT_SETTINGS + args.extra))
        res["model"] = model
        ph = model["phases"]
        R, T, W = ph["R"], ph["L"] + ph["U"] + ph["O"], ph["W"]
        wr = model["Wp"] if background else None
        res["cluster"] = {"R": R, "T": T, "W": W, "Wp": model["Wp"], "balanced_fraction": balanced_fraction(R, T),
                          "rows": [cluster_row(R, T, W, n, f, wr) for n in args.devices for f in (0.25, 0.5, 0.75)]}
        if "async_s1" in figs:
            a = figs["async_s1"]
            res["targets"] = verdicts(figs["sync"]["rl_wall_s"], a["rl_wall_s"], figs["sync"]["accuracy_mean"],
                                      a["accuracy_mean"], model["ratios"]["async_s1"])
    res["bench_seconds"] = time.time() - t_bench
    text = report(res)
    res["report"] = text
    (out / "results.json").write_text(json.dumps(res, indent=1, default=float))
    print("\n" + text, flush=True)
    print(f"\nbenchmark wall time {res['bench_seconds']:.0f}s; figures in {out / 'results.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
