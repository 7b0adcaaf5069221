"""Benchmark moerl's pipeline schedules on gloo with a tiny Megatron-Core Qwen3-MoE.

For each schedule (default 1F1B, DualPipe, DualPipeV) at the same work -- the same model (``--layers``
decoder layers cut into PP stages for 1F1B/ZB1P/DualPipe and 2*PP stages for DualPipeV), the same
``--microbatches`` micro-batches of the same shape -- it runs ``--runs`` timed training steps (after
``--warmup`` untimed ones; the schedules take turns step after step) with ``moerl.pipeline.interpreter`` and
reports:

- the measured step time (median over runs; the step spans from the earliest rank's start to the latest
  rank's end, ``time.perf_counter`` is system-wide on Linux) and each rank's idle fraction
  (1 - compute time / step time, medians);
- the simulator's prediction (``moerl.pipeline.simulator``) from the F, B, W and F&B costs measured in the
  same runs (per-chunk medians of the timed actions; F&B per (forward chunk, backward chunk) pair), the
  measured p2p latency (ping-pong) and per-action overhead (see ``_analyse``);
- ratios measured/predicted and between schedules;
- per chunk of every schedule that splits its backward, measured alone on each rank (no pipeline, same
  process, ``--chunk-runs`` medians): F, the unsplit backward (input + weight grads in one ``autograd.grad``), and
  B and W of ``--split-backward`` (default ``store``: the layer-level split of ``moerl.pipeline.wgrad_store``),
  with (B + W) / unsplit.

Runs:
  python tools/bench_pipeline.py --pp 4 --microbatches 8 --runs 5
  python tools/bench_pipeline.py --pp 2 --pin --microbatches 4,8 --schedules 1f1b,zb1p,dualpipev
``--pin`` pins rank r to the r-th CPU this process may use (``os.sched_setaffinity``), one rank per core.
With more processes than cores (or other programs on the cores) the ranks compete for CPU, so compute times
measured during a pipelined step include contention and idle fractions are noisy; the medians are reported
as measured.
"""

from __future__ import annotations

import argparse
import contextlib
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


def _model_config(args):
    from moerl.models.qwen3_moe import make_hf_config

    return make_hf_config(dict(TINY, num_hidden_layers=args.layers, hidden_size=args.hidden, head_dim=args.hidden // 4,
                               moe_intermediate_size=args.moe_ffn, intermediate_size=2 * args.moe_ffn))


def _chunk_costs(sched, chunks, mbs, crit, args) -> dict:
    """Per chunk held here, measured alone: medians (s) of F, the unsplit backward, and B / W of
    ``args.split_backward`` ("store": the weight-grad store; "retrace"/"torch": the interpreter's graph split).
    Each backward starts from a fresh forward of micro-batch 0 (a random stage input / output gradient);
    ``args.chunk_runs`` rounds after one warm-up, unsplit and split measured alternately."""
    import time

    from moerl.pipeline.wgrad_store import WeightGradStore, accumulate_grad

    out = {}
    g = torch.Generator().manual_seed(1)
    for c, mod in chunks.items():
        params = [p for p in mod.parameters() if p.requires_grad]
        first, last = sched.chunk_stage[c] == 0, sched.chunk_stage[c] == sched.num_stages - 1
        store = WeightGradStore()
        store.install(mod, chunk=c, log=False)
        mb = mbs[0]
        x0 = torch.randn(args.seq, args.batch, args.hidden, generator=g)
        dy = None

        def forward(arm: bool):
            x = None if first else x0.clone().requires_grad_(True)
            with store.arm() if arm else contextlib.nullcontext():
                y = mod(x, mb)
                y = crit(y, mb) if last else y
            return x, y

        times: dict[str, list[float]] = {k: [] for k in ("F", "BW", "B", "W")}
        for i in range(args.chunk_runs + 1):
            t = time.perf_counter()
            x, y = forward(False)
            tf = time.perf_counter() - t
            if dy is None and not last:
                dy = torch.randn(y.shape, generator=g, dtype=y.dtype)
            targets = ([] if first else [x]) + params
            t = time.perf_counter()
            grads = torch.autograd.grad(y, targets, None if last else dy, allow_unused=True)
            for p, gr in zip(params, grads[len(targets) - len(params):]):
                accumulate_grad(p, gr)
            tbw = time.perf_counter() - t
            if args.split_backward == "store":
                x, y = forward(True)
                t = time.perf_counter()
                with store.capture((c, 0)):
                    grads = torch.autograd.grad(y, ([] if first else [x]) + params, None if last else dy,
                                                allow_unused=True)
                for p, gr in zip(params, grads[len(grads) - len(params):]):
                    accumulate_grad(p, gr)
                tb = time.perf_counter() - t
                t = time.perf_counter()
                store.run((c, 0))
                tw = time.perf_counter() - t
            else:
                x, y = forward(False)
                t = time.perf_counter()
                if not first:
                    torch.autograd.grad(y, [x], None if last else dy, retain_graph=True)
                tb = time.perf_counter() - t
                t = time.perf_counter()
                grads = torch.autograd.grad(y, params, None if last else dy, allow_unused=True)
                for p, gr in zip(params, grads):
                    accumulate_grad(p, gr)
                tw = time.perf_counter() - t
            if i:  # the first round warms up
                for k, v in zip(("F", "BW", "B", "W"), (tf, tbw, tb, tw)):
                    times[k].append(v)
        for p in params:
            p.grad = None
        out[c] = {k: statistics.median(v) for k, v in times.items()}
    return out


def _ping_pong(rank, world, args, rounds: int = 30) -> float:
    """One-way latency (s) of an activation message between pp ranks 0 and 1: half the median round trip of
    a header (13 int64, as the interpreter's) and a float32 [seq, batch, hidden] tensor, blocking gloo
    send/recv.  Other ranks return 0."""
    import time

    import torch.distributed as dist

    hdr, act = torch.zeros(13, dtype=torch.int64), torch.zeros(args.seq, args.batch, args.hidden)
    trips = []
    for _ in range(rounds + 2):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            for x in (hdr, act):
                dist.send(x, 1)
            for x in (hdr, act):
                dist.recv(x, 1)
        elif rank == 1:
            for x in (hdr, act):
                dist.recv(x, 0)
            for x in (hdr, act):
                dist.send(x, 0)
        trips.append(time.perf_counter() - t)
    return statistics.median(trips[2:]) / 2 if rank == 0 else 0.0


def _worker(rank, world, port, args, out_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import time

    import torch.distributed as dist

    from moerl.pipeline.interpreter import PipelineInterpreter, sync_mirrored_grads
    from moerl.pipeline.megatron_stages import PolicyCriterion, build_chunk_modules, megatron_stage_fn
    from moerl.pipeline.schedules import build_schedule
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    if args.pin:  # one rank per core
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    init_distributed(seed=0, num_threads=args.threads)
    results = {}
    try:
        cfg = _model_config(args)
        results["comm_s"] = _ping_pong(rank, world, args)
        for M in args.microbatches:
            mbs = _micro_batches(M, args.batch, args.seq, cfg.vocab_size)
            setups = {}
            for name in args.schedules:
                sched = build_schedule(name, world, M)
                chunks = build_chunk_modules(sched, rank, cfg)
                crit = PolicyCriterion(_loss_fn(M, args.batch, args.seq))
                interp = PipelineInterpreter(sched, chunks, crit, stage_fn=megatron_stage_fn(mbs),
                                             split_backward=args.split_backward, p2p=args.p2p)
                setups[name] = (sched, chunks, crit, interp)
                results[f"{name}/{M}"] = []
            # the schedules take turns run after run, so slow phases of a shared machine hit them alike
            for i in range(args.warmup + args.runs):
                for name, (sched, chunks, crit, interp) in setups.items():
                    for m in chunks.values():
                        m.zero_grad(set_to_none=True)
                    dist.barrier()
                    t0 = time.perf_counter()
                    res = interp.run(mbs, mbs, record_timeline=True)
                    t1 = time.perf_counter()
                    sync_mirrored_grads(sched, chunks, channels=interp.channels)
                    if i >= args.warmup:
                        tl = [(w - t0, s - t0, e - t0, a.kind, a.chunk, a.chunk_b) for w, s, e, a in res.timeline]
                        results[f"{name}/{M}"].append({"t0": t0, "t1": t1, "timeline": tl})
            if M == args.microbatches[0]:
                for name, (sched, chunks, crit, interp) in setups.items():
                    if any(a.kind == "W" for a in sched.actions[rank]):
                        dist.barrier()
                        results[f"{name}/chunks"] = _chunk_costs(sched, chunks, mbs, crit, args)
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            Path(out_path).write_text(json.dumps(gathered))
    finally:
        destroy_distributed()


def _analyse(name, per_rank, world, M):
    """Measured step / idle of schedule ``name`` at M micro-batches, and the simulator's prediction, run by
    run: each timed run's own compute costs (per chunk, the mean over that run's actions of F, unsplit
    backward BW, split B and W, and F&B per (forward, backward) chunk pair), the measured one-way p2p latency
    (``comm``) and the per-action overhead ``o`` (median time between an action's turn and its compute start
    when its plan round receives nothing: posting sends, bookkeeping) are simulated, so a slow phase of a
    shared machine enters measurement and prediction alike; medians over runs are reported.  The simulator
    charges ``cost + o`` per action; its idle fraction counts ``o`` as idle, as the measurement does (busy =
    compute only)."""
    from moerl.pipeline.schedules import build_schedule, comm_plan
    from moerl.pipeline.simulator import Costs, simulate

    sched = build_schedule(name, world, M)
    plans = comm_plan(sched)
    key = f"{name}/{M}"
    nruns = len(per_rank[0][key])
    comm = max(r.get("comm_s", 0.0) for r in per_rank)
    over = [s - w for r in range(world) for run in per_rank[r][key] for j, (w, s, *_) in enumerate(run["timeline"])
            if not any(recvs for _, recvs in plans[r][j])]
    o = statistics.median(over) if over else 0.0
    C = sched.num_chunks
    steps, idles, preds, pred_idles, costs = [], [], [], [], []
    for i in range(nruns):
        t0 = min(per_rank[r][key][i]["t0"] for r in range(world))
        t1 = max(per_rank[r][key][i]["t1"] for r in range(world))
        step = t1 - t0
        steps.append(step)
        idle = []
        durs: dict[tuple, list[float]] = {}
        for r in range(world):
            tl = per_rank[r][key][i]["timeline"]
            idle.append(1 - sum(e - s for _, s, e, *_ in tl) / step)
            for w, s, e, kind, c, cb in tl:
                durs.setdefault((kind, c, cb) if kind == "FB" else (kind, c), []).append(e - s)
        idles.append(idle)
        mean = {k: statistics.fmean(v) for k, v in durs.items()}
        F = [mean.get(("F", c), 0.0) for c in range(C)]
        W = [mean.get(("W", c), 0.0) for c in range(C)]
        Bi = [mean.get(("B", c), 0.0) for c in range(C)]
        B = [mean[("BW", c)] if ("BW", c) in mean else Bi[c] + W[c] for c in range(C)]
        Bi = [Bi[c] if ("B", c) in mean else B[c] - W[c] for c in range(C)]
        FB = {(k[1], k[2]): v + o for k, v in mean.items() if k[0] == "FB"}
        sim = simulate(sched, Costs(F=[x + o for x in F], B=[x + o for x in B], W=[x + o for x in W], FB=FB,
                                    Bi=[x + o for x in Bi], comm=comm))
        preds.append(sim.makespan)
        pred_idles.append([1 - (sum(e - s for s, e, _ in tl) - o * len(tl)) / sim.makespan for tl in sim.timeline])
        costs.append((F, B, W, Bi))
    return {
        "step_s": statistics.median(steps),
        "step_all_s": steps,
        "idle": [statistics.median(x[r] for x in idles) for r in range(world)],
        "pred_step_s": statistics.median(preds),
        "pred_all_s": preds,
        "pred_idle": [statistics.median(x[r] for x in pred_idles) for r in range(world)],
        "overhead_ms": 1e3 * o,
        "comm_ms": 1e3 * comm,
        "costs_ms": {k: 1e3 * statistics.median(statistics.fmean(c[j]) for c in costs)
                     for j, k in enumerate(("F", "B", "W", "Bi"))},
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=_ints, default=[8], help="micro-batches per step (comma list: 4,8)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (divisible by 2*pp)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (4 query heads of hidden/4)")
    ap.add_argument("--moe-ffn", type=int, default=48, help="expert FFN size (dense FFN: twice that)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each schedule first")
    ap.add_argument("--chunk-runs", type=int, default=10, help="timed rounds of the per-chunk cost measurement")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pin", action="store_true", help="pin rank r to the r-th usable CPU (os.sched_setaffinity)")
    ap.add_argument("--schedules", type=lambda t: t.split(","), default=["1f1b", "dualpipe", "dualpipev"])
    ap.add_argument("--split-backward", default="store", choices=["store", "torch", "retrace"],
                    help="how split B/W steps compute weight grads (PipelineInterpreter.split_backward)")
    ap.add_argument("--p2p", default=None, choices=["directed", "shared"],
                    help="p2p transport (PipelineInterpreter.p2p; default: its default, shared on gloo)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.layers % (2 * args.pp):
        raise SystemExit(f"--layers must be divisible by 2*pp={2 * args.pp} (DualPipeV stages), got {args.layers}")
    if args.hidden % 4:
        raise SystemExit(f"--hidden must be divisible by 4 (4 attention heads), got {args.hidden}")
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
    names = args.schedules
    report = {"chunks": {}, "steps": {}}
    print(f"PP={args.pp} layers={args.layers} hidden={args.hidden} micro-batch {args.batch}x{args.seq}, "
          f"{args.runs} runs (medians), {len(os.sched_getaffinity(0))} usable cores"
          f"{' (one rank pinned per core)' if args.pin else ''}, split_backward={args.split_backward}"
          + (f", p2p={args.p2p}" if args.p2p else ""))
    for n in names:
        if f"{n}/chunks" not in per_rank[0]:
            continue
        print(f"{n}: per chunk, alone (ms): {'chunk':>5s} {'F':>7s} {'unsplit':>8s} {'B':>7s} {'W':>7s} "
              f"{'(B+W)/unsplit':>14s}")
        rows = {}
        for r in range(args.pp):
            for c, t in sorted(per_rank[r][f"{n}/chunks"].items(), key=lambda kv: int(kv[0])):
                ratio = (t["B"] + t["W"]) / t["BW"]
                rows[int(c)] = dict(t, ratio=ratio)
                print(f"{'':27s}{int(c):5d} {1e3 * t['F']:7.2f} {1e3 * t['BW']:8.2f} {1e3 * t['B']:7.2f} "
                      f"{1e3 * t['W']:7.2f} {ratio:14.2f}")
        print(f"{'':27s}max (B+W)/unsplit {max(x['ratio'] for x in rows.values()):.2f}")
        report["chunks"][n] = rows
    for M in args.microbatches:
        rows = {n: _analyse(n, per_rank, args.pp, M) for n in names}
        report["steps"][M] = rows
        print(f"M={M}: {'schedule':10s} {'step s':>8s} {'pred s':>8s} {'meas/pred':>9s}  {'idle meas (per rank)':22s} "
              f"{'idle pred':22s} {'max |diff|':>10s}  F/B/W/Bi ms")
        for n in names:
            r = rows[n]
            c = r["costs_ms"]
            diff = max(abs(a - b) for a, b in zip(r["idle"], r["pred_idle"]))
            r["idle_max_abs_diff"] = diff
            print(f"{'':5s}{n:10s} {r['step_s']:8.3f} {r['pred_step_s']:8.3f} {r['step_s'] / r['pred_step_s']:9.2f}  "
                  f"{' '.join(f'{x:.3f}' for x in r['idle']):22s} {' '.join(f'{x:.3f}' for x in r['pred_idle']):22s} "
                  f"{diff:10.3f}  {c['F']:.1f}/{c['B']:.1f}/{c['W']:.1f}/{c['Bi']:.1f}")
        print(f"{'':5s}simulator inputs: p2p latency {rows[names[0]]['comm_ms']:.2f} ms, per-action overhead "
              + ", ".join(f"{n} {rows[n]['overhead_ms']:.2f} ms" for n in names))
        base = names[0]
        for n in names[1:]:
            print(f"{'':5s}{n}/{base}: measured step ratio {rows[n]['step_s'] / rows[base]['step_s']:.3f}, "
                  f"predicted {rows[n]['pred_step_s'] / rows[base]['pred_step_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
