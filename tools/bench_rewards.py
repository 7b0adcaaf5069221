#!/usr/bin/env python
"""Benchmark the reward scoring overhead per RL step: RewardPool (dispatcher thread in the caller's process)
against RewardBroker (the pool in a child process), as the rollout producer uses them.

Each "step" scores ``--groups`` groups of ``--n`` responses concurrently (``asyncio.gather`` of
``ascore_group``, as moerl.rollout.manager does when a batch's groups finish together) with the demo's
reward (``arithmetic``, 2 workers: configs/tiny_arith.yaml's 16 groups x 8 samples). Printed per backend,
per step: wall ms, CPU ms of the calling process (its main thread plus, for RewardPool, the dispatcher
thread: the time the trainer's interpreter would pay), CPU ms of the broker process, CPU ms of the
reward workers; and the ratio of the caller's CPU (pool / broker). CPU times come from /proc (Linux).
Both backends run interleaved, ``--rounds`` times each, and the medians are printed.

    python tools/bench_rewards.py [--steps 50] [--groups 16] [--n 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moerl.rewards import RewardBroker, RewardPool  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads) in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def run(cls, steps: int, groups: int, n: int) -> dict:
    """Score ``steps`` steps with a fresh ``cls`` pool; returns ms per step (wall, caller, broker, workers)."""
    with cls("arithmetic", num_workers=2, timeout_s=10.0) as pool:
        pool.wait_ready(timeout=60)
        broker = getattr(pool, "pid", None)
        workers = _children(broker if broker else os.getpid())
        batch = [(f"g{g}", "1 + 2 =", [str(3 + (k % 2)) for k in range(n)], "3") for g in range(groups)]

        async def step() -> None:
            out = await asyncio.gather(*(pool.ascore_group(*args) for args in batch))
            assert all(r.score == (1.0 if k % 2 == 0 else 0.0) for res in out for k, r in enumerate(res))

        loop = asyncio.new_event_loop()
        loop.run_until_complete(step())  # warm-up (worker imports)
        c0, b0 = time.process_time(), _cpu_s(broker) if broker else 0.0
        w0, t0 = sum(_cpu_s(w) for w in workers), time.perf_counter()
        for _ in range(steps):
            loop.run_until_complete(step())
        wall = time.perf_counter() - t0
        caller = time.process_time() - c0
        broker_s = (_cpu_s(broker) - b0) if broker else 0.0
        worker_s = sum(_cpu_s(w) for w in workers) - w0
        loop.close()
    ms = 1000.0 / steps
    return {"wall": wall * ms, "caller": caller * ms, "broker": broker_s * ms, "workers": worker_s * ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    res: dict[str, list[dict]] = {"RewardPool": [], "RewardBroker": []}
    for _ in range(a.rounds):
        for cls in (RewardPool, RewardBroker):
            res[cls.__name__].append(run(cls, a.steps, a.groups, a.n))
    print(f"{a.steps} steps x {a.groups} groups x {a.n} responses (arithmetic reward, 2 workers), medians of "
          f"{a.rounds} interleaved rounds, ms per step:")
    print(f"| backend | wall | caller CPU | broker CPU | workers CPU |\n|---|---:|---:|---:|---:|")
    med = {}
    for name, rows in res.items():
        med[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        m = med[name]
        print(f"| {name} | {m['wall']:.1f} | {m['caller']:.1f} | {m['broker']:.1f} | {m['workers']:.1f} |")
    print(f"caller CPU, RewardPool / RewardBroker: "
          f"{med['RewardPool']['caller'] / max(med['RewardBroker']['caller'], 1e-9):.1f}x")


if __name__ == "__main__":
    main()
