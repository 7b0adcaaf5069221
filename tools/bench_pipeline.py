"""Benchmark moerl's pipeline schedules on gloo with a tiny Megatron-Core Qwen3-MoE.

For each schedule (default 1F1B, DualPipe, DualPipeV) at the same work -- the same model (``--layers``
decoder layers cut into PP stages for 1F1B/DualPipe and 2*PP stages for DualPipeV), the same
``--microbatches`` micro-batches of the same shape -- it runs ``--runs`` timed training steps (after one
warm-up) with ``moerl.pipeline.interpreter`` and reports:

- the measured step time (median over runs; the step spans from the earliest rank's start to the latest
  rank's end, ``time.perf_counter`` is system-wide on Linux) and each rank's idle fraction
  (1 - compute time / step time, medians);
- the simulator's prediction (``moerl.pipeline.simulator``) from the F, B, W costs measured in the same runs
  (per-chunk medians of the timed actions; F&B = F + B since CPU runs them sequentially);
- ratios measured/predicted and between schedules.

Run:  python tools/bench_pipeline.py --pp 4 --microbatches 8 --runs 5
With more processes than cores the ranks compete for CPU, so compute times measured during a pipelined
step include contention and idle fractions are noisy; the medians are reported as measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=48, intermediate_size=96, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False, vocab_size=96)


def _micro_batches(M, batch, seq, vocab):
    from moerl.train.batching import MicroBatch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(M):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq)
        out.append(MicroBatch(tokens, torch.roll(tokens, -1, 1), mask, torch.randn(batch, generator=g),
                              list(range(batch)), [0] * batch, [seq] * batch,
                              extras={"old_log_probs": -torch.rand(batch, seq, generator=g)}))
    return out


def _loss_fn(M, batch, seq):
    def loss_fn(log_probs, entropy, mb):
        return -(log_probs * mb.loss_mask * mb.advantages[:, None]).sum() / (M * batch * seq), {}

    return loss_fn


def _worker(rank, world, port, args, out_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import time

    import torch.distributed as dist

    from moerl.models.qwen3_moe import make_hf_config
    from moerl.pipeline.interpreter import PipelineInterpreter, sync_mirrored_grads
    from moerl.pipeline.megatron_stages import PolicyCriterion, build_chunk_modules, megatron_stage_fn
    from moerl.pipeline.schedules import build_schedule
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    init_distributed(seed=0, num_threads=args.threads)
    results = {}
    try:
        cfg = make_hf_config(dict(TINY, num_hidden_layers=args.layers))
        mbs = _micro_batches(args.microbatches, args.batch, args.seq, cfg.vocab_size)
        for name in args.schedules.split(","):
            sched = build_schedule(name, world, args.microbatches)
            chunks = build_chunk_modules(sched, rank, cfg)
            crit = PolicyCriterion(_loss_fn(args.microbatches, args.batch, args.seq))
            interp = PipelineInterpreter(sched, chunks, crit, stage_fn=megatron_stage_fn(mbs),
                                         split_backward=args.split_backward, p2p=args.p2p)
            runs = []
            for i in range(args.runs + 1):
                for m in chunks.values():
                    m.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                res = interp.run(mbs, mbs, record_timeline=True)
                t1 = time.perf_counter()
                sync_mirrored_grads(sched, chunks, channels=interp.channels)
                if i == 0:
                    continue  # warm-up
                tl = [(s - t0, e - t0, a.kind, a.chunk, a.chunk_b) for _, s, e, a in res.timeline]
                runs.append({"t0": t0, "t1": t1, "timeline": tl})
            results[name] = runs
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            Path(out_path).write_text(json.dumps(gathered))
    finally:
        destroy_distributed()


def _analyse(name, per_rank, world, M):
    from moerl.pipeline.schedules import build_schedule
    from moerl.pipeline.simulator import Costs, simulate

    sched = build_schedule(name, world, M)
    nruns = len(per_rank[0][name])
    steps, idles = [], []
    durs: dict[tuple[str, int], list[float]] = {}
    for i in range(nruns):
        t0 = min(per_rank[r][name][i]["t0"] for r in range(world))
        t1 = max(per_rank[r][name][i]["t1"] for r in range(world))
        step = t1 - t0
        steps.append(step)
        idle = []
        for r in range(world):
            tl = per_rank[r][name][i]["timeline"]
            busy = sum(e - s for s, e, *_ in tl)
            idle.append(1 - busy / step)
            for s, e, kind, c, cb in tl:
                durs.setdefault((kind, c), []).append(e - s)
        idles.append(idle)
    med = {k: statistics.median(v) for k, v in durs.items()}
    C = sched.num_chunks
    F = [med.get(("F", c), 0.0) for c in range(C)]
    W = [med.get(("W", c), 0.0) for c in range(C)]
    Bi = [med.get(("B", c), 0.0) for c in range(C)]
    B = [med[("BW", c)] if ("BW", c) in med else Bi[c] + W[c] for c in range(C)]
    # F&B actions are not used as a cost: the simulator charges F + B for them, which is what the CPU does
    sim = simulate(sched, Costs(F=F, B=B, W=W, Bi=[Bi[c] if ("B", c) in med else B[c] - W[c] for c in range(C)]))
    return {
        "step_s": statistics.median(steps),
        "step_all_s": steps,
        "idle": [statistics.median(x[r] for x in idles) for r in range(world)],
        "pred_step_s": sim.makespan,
        "pred_idle": sim.idle_fraction,
        "costs_ms": {"F": 1e3 * statistics.median(F), "B": 1e3 * statistics.median(B),
                     "W": 1e3 * statistics.median(W), "Bi": 1e3 * statistics.median(Bi)},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (divisible by 2*pp)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schedules", default="1f1b,dualpipe,dualpipev")
    ap.add_argument("--split-backward", default="torch", choices=["torch", "retrace"],
                    help="how split B/W steps compute weight grads (PipelineInterpreter.split_backward)")
    ap.add_argument("--p2p", default=None, choices=["directed", "shared"],
                    help="p2p transport (PipelineInterpreter.p2p; default: its default, shared on gloo)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.layers % (2 * args.pp):
        raise SystemExit(f"--layers must be divisible by 2*pp={2 * args.pp} (DualPipeV stages), got {args.layers}")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import socket
    import tempfile

    with socket.socket() as s:  # a port below the ephemeral range
        for port in range(29611, 32000, 7):
            try:
                s.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
    out = Path(tempfile.mkdtemp()) / "bench.json"
    mp.start_processes(_worker, args=(args.pp, port, args, str(out)), nprocs=args.pp, join=True,
                       start_method="spawn")
    per_rank = json.loads(out.read_text())
    names = args.schedules.split(",")
    rows = {n: _analyse(n, per_rank, args.pp, args.microbatches) for n in names}
    print(f"PP={args.pp} M={args.microbatches} layers={args.layers} micro-batch {args.batch}x{args.seq}, "
          f"{args.runs} runs (medians), {os.cpu_count()} cores, split_backward={args.split_backward}"
          + (f", p2p={args.p2p}" if args.p2p else ""))
    print(f"{'schedule':10s} {'step s':>8s} {'pred s':>8s} {'meas/pred':>9s}  {'idle meas (per rank)':28s} "
          f"{'idle pred':28s} F/B/W/Bi ms")
    for n in names:
        r = rows[n]
        c = r["costs_ms"]
        print(f"{n:10s} {r['step_s']:8.3f} {r['pred_step_s']:8.3f} {r['step_s'] / r['pred_step_s']:9.2f}  "
              f"{' '.join(f'{x:.2f}' for x in r['idle']):28s} {' '.join(f'{x:.2f}' for x in r['pred_idle']):28s} "
              f"{c['F']:.1f}/{c['B']:.1f}/{c['W']:.1f}/{c['Bi']:.1f}")
    base = names[0]
    for n in names[1:]:
        print(f"{n}/{base}: measured step ratio {rows[n]['step_s'] / rows[base]['step_s']:.2f}, "
              f"predicted {rows[n]['pred_step_s'] / rows[base]['pred_step_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
