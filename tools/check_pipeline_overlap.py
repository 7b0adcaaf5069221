"""Check (and time) DualPipe's overlapped F&B through Megatron-Core schedule plans against the plain interpreter.

Every rank builds its DualPipe / DualPipeV stage chunks of a tiny (or ``--hidden``/``--experts``-sized)
Megatron-Core Qwen3-MoE with expert parallelism inside the stages, and runs one training step of
``--microbatches`` micro-batches twice on the same weights:

- plain: ``PipelineInterpreter`` without executor (F&B = forward, then backward; stage_fn + autograd.grad);
- overlap: ``executor=MegatronOverlapExecutor`` (``moerl.pipeline.overlap``): each F&B is one
  ``TransformerModelChunkSchedulePlan.run(f_plan, b_plan)``, MoE all-to-all on Megatron's communication stream.

It prints whether the losses are bitwise equal, the worst gradient error 1 - 2*sum(xy)/sum(x^2+y^2) over all
local parameters (DualPipe's mirrored copies summed), how many F&B steps went through the plan, and the median
step time of each mode over ``--runs`` timed steps (after one warm-up) with the ratio overlap / plain.

GPUs (NCCL, real CUDA streams; one GPU per rank, so pp * ep * (dp) GPUs):
    torchrun --nproc_per_node 4 tools/check_pipeline_overlap.py --pp 2 --ep 2 --schedule dualpipev
CPU dry run (gloo, spawns pp * ep processes; Megatron's CUDA calls stubbed by ``cpu_dry_run``, nothing
overlaps, so the timing ratio means nothing there):
    python tools/check_pipeline_overlap.py --device cpu --pp 2 --ep 2
Exit status 0 when losses are bitwise equal and gradients agree (< ``--tol``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="dualpipev", choices=["dualpipe", "dualpipev"])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="decoder layers (divisible by the stage count)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--seq", type=int, default=12)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--runs", type=int, default=1, help="timed steps per mode (after one warm-up when > 1)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--tol", type=float, default=1e-12)
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    return p


def _micro_batches(M, batch, seq, vocab, seed):
    """M padded GSPO micro-batches [batch, seq]: prompt of ``start`` tokens, responses of different lengths
    (rows shorter than the micro-batch are padding after their end, so the MoE routers' padding mask
    matters)."""
    from moerl.train.batching import MicroBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    start = min(4, seq - 2)
    for i in range(M):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        lengths = [max(1, seq - start - 1 - (i + j) % 3) for j in range(batch)]
        mask = torch.zeros(batch, seq)
        for j, n in enumerate(lengths):
            mask[j, start:start + n] = 1.0
        out.append(MicroBatch(tokens, torch.roll(tokens, -1, dims=1), mask, torch.randn(batch, generator=g),
                              list(range(batch)), [start] * batch, lengths,
                              extras={"old_log_probs": -torch.rand(batch, seq, generator=g) * 5}))
    return out


def _rel_err(x, y) -> float:
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum()
    return 0.0 if den == 0 else float(1 - 2 * (x * y).sum() / den)


def run_rank(args) -> list[dict]:
    """This rank's check; returns every rank's result (all_gather_object).  Initialises torch.distributed
    (and Megatron's parallel state) from the torchrun-style environment and tears it down."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from moerl.models.qwen3_moe import make_hf_config
    from moerl.pipeline.interpreter import PipelineInterpreter, make_p2p_channels, sync_mirrored_grads
    from moerl.pipeline.megatron_stages import PolicyCriterion, build_chunk_modules, megatron_stage_fn
    from moerl.pipeline.overlap import (MegatronOverlapExecutor, check_overlap_supported, cpu_dry_run,
                                        megatron_stage_plan_fn)
    from moerl.pipeline.schedules import build_schedule
    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.losses import policy_loss

    info = init_distributed(pp_size=args.pp, ep_size=args.ep, seed=0, num_threads=1)
    try:
        cuda = info.device.type == "cuda"
        heads = max(1, args.hidden // 16)
        cfg = make_hf_config(dict(
            num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2), head_dim=16, num_experts=args.experts, num_experts_per_tok=2,
            moe_intermediate_size=max(8, 3 * args.hidden // 4), intermediate_size=3 * args.hidden // 2,
            max_position_embeddings=max(128, args.seq), rope_theta=10000.0, rms_norm_eps=1e-6, norm_topk_prob=True,
            tie_word_embeddings=False, vocab_size=96))
        group = parallel_state.get_pipeline_model_parallel_group()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        M = args.microbatches
        sched = build_schedule(args.schedule, args.pp, M)
        torch.manual_seed(7)
        chunks = build_chunk_modules(sched, pp_rank, cfg, init_method_std=0.2, moe_aux_loss_coeff=1e-2)
        for st in chunks.values():
            check_overlap_supported(st.model.config, require_cuda=cuda, last_stage=st.is_last)
        # NCCL: one directed channel per direction, built once (a collective over the world)
        p2p = make_p2p_channels(sched, group) if info.backend == "nccl" else "shared"
        mbs = _micro_batches(M, args.batch, args.seq, cfg.vocab_size,
                             seed=100 + parallel_state.get_data_parallel_rank(with_context_parallel=True))
        if cuda:
            from moerl.train.actor import _to_device

            mbs = [_to_device(mb, info.device) for mb in mbs]
        algo = types.SimpleNamespace(policy_loss="gspo", eps_clip_low=0.2, eps_clip_high=0.28,
                                     loss_agg_mode="seq-mean-token-mean", kl_coef=0.0, kl_estimator="k3")
        n_tok = sum(float(mb.loss_mask.sum()) for mb in mbs)
        crit = PolicyCriterion(policy_loss(algo, global_num_tokens=n_tok, global_num_seqs=M * args.batch))

        fb_calls = [0]

        class Counting(MegatronOverlapExecutor):
            def forward_backward(self, *a):
                fb_calls[0] += 1
                return super().forward_backward(*a)

        executor = Counting(megatron_stage_plan_fn(mbs), require_cuda=cuda)

        def step(ex):
            for mod in chunks.values():
                for p in mod.parameters():
                    p.grad = None
            interp = PipelineInterpreter(sched, chunks, crit, group=group, stage_fn=megatron_stage_fn(mbs), executor=ex,
                                         p2p=p2p)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            res = interp.run(mbs, mbs)
            sync_mirrored_grads(sched, chunks, group=group, channels=interp.channels)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            grads = {f"{c}.{n}": p.grad.detach().float().cpu().clone() for c, mod in chunks.items()
                     for n, p in mod.named_parameters() if p.grad is not None}
            return {m: v.cpu() for m, v in res.losses.items()}, grads, dt

        dry = cpu_dry_run() if not cuda else None
        times = {"plain": [], "overlap": []}
        out = {}
        reps = args.runs + (1 if args.runs > 1 else 0)
        for i in range(reps):
            for mode in ("plain", "overlap"):
                if mode == "overlap" and dry is not None:
                    with cpu_dry_run():
                        out[mode] = step(executor)
                else:
                    out[mode] = step(executor if mode == "overlap" else None)
                if reps == 1 or i > 0:
                    times[mode].append(out[mode][2])
        (l_ref, g_ref, _), (l_got, g_got, _) = out["plain"], out["overlap"]
        n_fb = sum(a.kind == "FB" for a in sched.actions[pp_rank])
        mine = {
            "rank": dist.get_rank(),
            "losses_bitwise": l_ref.keys() == l_got.keys() and all(torch.equal(l_ref[m], l_got[m]) for m in l_ref),
            "loss_microbatches": sorted(l_got),
            "max_grad_rel_err": max((_rel_err(g_got[k], g_ref[k]) for k in g_ref if k in g_got), default=0.0),
            "same_grad_params": g_ref.keys() == g_got.keys() and len(g_ref) > 0,
            "fb_actions": n_fb,
            "fb_through_plan": fb_calls[0] // reps,
            "step_s_plain": statistics.median(times["plain"]),
            "step_s_overlap": statistics.median(times["overlap"]),
            "device": str(info.device),
        }
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone
    finally:
        destroy_distributed()


def _summarise(args, ranks: list[dict]) -> dict:
    ok = (all(r["losses_bitwise"] and r["same_grad_params"] and r["max_grad_rel_err"] < args.tol
              and r["fb_through_plan"] == r["fb_actions"] for r in ranks)
          and sorted({m for r in ranks for m in r["loss_microbatches"]}) == list(range(args.microbatches)))
    plain = max(r["step_s_plain"] for r in ranks)
    overlap = max(r["step_s_overlap"] for r in ranks)
    return {"ok": ok, "schedule": args.schedule, "pp": args.pp, "ep": args.ep, "microbatches": args.microbatches,
            "device": ranks[0]["device"], "losses_bitwise": all(r["losses_bitwise"] for r in ranks),
            "max_grad_rel_err": max(r["max_grad_rel_err"] for r in ranks),
            "fb_actions": sum(r["fb_actions"] for r in ranks), "fb_through_plan": sum(r["fb_through_plan"] for r in ranks),
            "step_s_plain": plain, "step_s_overlap": overlap, "ratio_overlap_to_plain": overlap / plain, "ranks": ranks}


def _spawn_worker(rank, world, port, args, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    everyone = run_rank(args)
    if rank == 0:
        Path(out_dir, "ranks.json").write_text(json.dumps(everyone))


def _print(summary: dict) -> None:
    print(f"{summary['schedule']} pp={summary['pp']} ep={summary['ep']} M={summary['microbatches']} on "
          f"{summary['device']}: losses bitwise equal: {summary['losses_bitwise']}; max gradient error "
          f"{summary['max_grad_rel_err']:.2e}; F&B through Megatron's plan: {summary['fb_through_plan']}/"
          f"{summary['fb_actions']}")
    print(f"step time plain {summary['step_s_plain'] * 1e3:.1f} ms, overlap {summary['step_s_overlap'] * 1e3:.1f} ms, "
          f"ratio overlap/plain {summary['ratio_overlap_to_plain']:.3f}"
          + ("  (CPU dry run: nothing overlaps)" if summary["device"] == "cpu" else ""))
    print("OK" if summary["ok"] else "FAILED")


def main(argv=None) -> dict:
    """Run the check; returns the summary dict (also printed; ``--json`` writes it)."""
    args = _parser().parse_args(argv)
    if args.device == "cpu" and torch.cuda.is_available():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        ranks = run_rank(args)
        if int(os.environ["RANK"]) != 0:
            return _summarise(args, ranks)
    else:
        if args.device == "cuda":
            raise SystemExit("--device cuda: launch with torchrun --nproc_per_node <pp*ep> (one GPU per rank)")
        import socket

        import torch.multiprocessing as mp

        world = args.pp * args.ep
        port = None
        for cand in range(29650, 29950, 7):  # below the ephemeral range
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", cand))
                except OSError:
                    continue
            port = cand
            break
        with tempfile.TemporaryDirectory() as d:
            mp.start_processes(_spawn_worker, args=(world, port, args, d), nprocs=world, join=True,
                               start_method="spawn")
            ranks = json.loads(Path(d, "ranks.json").read_text())
    summary = _summarise(args, ranks)
    _print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
