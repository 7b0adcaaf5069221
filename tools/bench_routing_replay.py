#!/usr/bin/env python
"""Train-vs-rollout mismatch of an MoE with and without routing replay R3 (moerl.moe.routing_replay).

Setup (CPU, fp32, in one process): a random Qwen3-MoE checkpoint; the ROLLOUT side is moerl's reference
server engine (transformers ``generate``) whose routers differ slightly from the trainer's:

* ``noise``: router weights + N(0, (sigma * std(w))^2) (a stale or differently-rounded router);
* ``bf16``: router weights rounded to bfloat16 (a lower-precision rollout router).

The TRAINER is moerl's Megatron-Core actor with the exact (unperturbed) weights. The rollout samples
``--prompts`` x ``--n`` responses (temperature 1) and returns its log-probs and, with
``return_routed_experts``, its routing. The trainer then recomputes the response log-probs

* without replay: its own routers choose the experts;
* with R3: the rollout's experts are forced (gates = the trainer's router probabilities there).

Printed per variant: mean / max |lp_train - lp_rollout| over response tokens, and the routing
mismatch = fraction of (token position, MoE layer) pairs whose top-k expert SET differs between the
trainer's forward and the rollout's (over every position the rollout recorded); with R3 it is
measured on the trainer's routers' actual routing maps (forward hooks), so 0 means exact replay.

Usage: python tools/bench_routing_replay.py [--experts 16 --topk 4 --layers 4 --prompts 8 --n 4
       --max-new 32 --sigma 0.02 0.05 --seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _routing_maps(model):
    """Forward hooks on every Megatron TopKRouter: layer -> list of routing_map [tokens, E] per call."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: dict[int, list] = {}

    def hook(module, args, output):
        maps.setdefault(module.layer_number - 1, []).append(output[1].detach().clone())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopKRouter)]
    return maps, handles


def _trainer_pass(actor, samples, replay_mode, micro_batch_size):
    """(log-probs per sample [response], trainer routing per sample as expert-id sets per (pos, layer))."""
    from moerl.moe.routing_replay import RoutingReplay
    from moerl.train.batching import split_micro_batches

    actor.routing_replay = RoutingReplay(actor.model, replay_mode) if replay_mode != "none" else None
    maps, handles = _routing_maps(actor.model)
    mbs = split_micro_batches(samples, micro_batch_size, pad_id=0)
    try:
        results = actor.compute_log_probs(mbs, 1.0)
    finally:
        for h in handles:
            h.remove()
        if actor.routing_replay is not None:
            actor.routing_replay.remove()
        actor.routing_replay = None
    lps = [None] * len(samples)
    routes = [None] * len(samples)
    n_layers = len(maps)
    for k, (mb, lp, _) in enumerate(results):
        bsz = mb.tokens.shape[0]
        for row, (i, resp) in enumerate(zip(mb.sample_indices, mb.gather_response(lp))):
            lps[i] = resp.double()
            n = len(samples[i].tokens)
            routes[i] = [[set(torch.nonzero(maps[layer][k][t * bsz + row]).flatten().tolist())
                          for layer in range(n_layers)] for t in range(n)]
    return lps, routes


def _mismatch(samples, lps, routes):
    diffs = torch.cat([(lp - torch.tensor(s.rollout_log_probs, dtype=torch.float64)).abs()
                       for s, lp in zip(samples, lps)])
    n_diff = n_all = 0
    for s, r in zip(samples, routes):
        rec = s.metadata["rollout_routing"]  # [P, L, K]
        for t in range(rec.shape[0]):
            for layer in range(rec.shape[1]):
                n_all += 1
                n_diff += set(rec[t, layer].tolist()) != r[t][layer]
    return float(diffs.mean()), float(diffs.max()), n_diff / max(1, n_all)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="n_samples_per_prompt")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--sigma", type=float, nargs="*", default=[0.02, 0.05], help="router noise levels")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from transformers import AutoConfig

    from moerl.moe.routing_replay import decode_routed_experts
    from moerl.rollout.server import ReferenceEngine, load_safetensors_dir
    from moerl.rollout.testing import make_tiny_moe_checkpoint
    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.actor import MegatronActor
    from moerl.types import Sample

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench_rr_")
    make_tiny_moe_checkpoint(tmp, seed=args.seed, num_experts=args.experts, num_experts_per_tok=args.topk,
                             num_hidden_layers=args.layers)
    hf_config = AutoConfig.from_pretrained(tmp)
    exact = dict(load_safetensors_dir(tmp))
    gate_names = [k for k in exact if k.endswith("mlp.gate.weight")]

    init_distributed(seed=args.seed, num_threads=1)
    try:
        actor = MegatronActor(hf_config, trainable=False)
        actor.load_hf_state_dict(exact)
        engine = ReferenceEngine(tmp)
        g = torch.Generator().manual_seed(args.seed + 1)
        prompts = [torch.randint(3, hf_config.vocab_size, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.prompts)]
        variants = [("identical router (reference)", None)] + [(f"noise sigma={s:g}", s) for s in args.sigma] \
            + [("bf16-rounded router", "bf16")]
        print(f"model: {args.layers} layers, {args.experts} experts top-{args.topk}, fp32; rollout "
              f"{args.prompts} prompts x {args.n} samples, {args.max_new} new tokens, temperature 1")
        header = f"{'rollout router':30s} {'replay':6s} {'mean|dlp|':>11s} {'max|dlp|':>11s} {'routing mismatch':>17s}"
        print(header)
        print("-" * len(header))
        for name, how in variants:
            with torch.no_grad():
                for k in gate_names:
                    w = exact[k].clone()
                    if how == "bf16":
                        w = w.to(torch.bfloat16).float()
                    elif how is not None:
                        w = w + how * w.std() * torch.randn(w.shape, generator=g)
                    engine.mapper.params[k].copy_(w)
            inputs = [pr for pr in prompts for _ in range(args.n)]  # one seed per sample
            outs = engine.generate({
                "input_ids": inputs, "return_logprob": True, "return_routed_experts": True,
                "sampling_params": [{"max_new_tokens": args.max_new, "temperature": 1.0, "ignore_eos": True,
                                     "sampling_seed": 1000 * args.seed + j} for j in range(len(inputs))],
            })
            samples = []
            for j, o in enumerate(outs):
                s = Sample(index=j, group_id=j // args.n, prompt="", label="", prompt_ids=inputs[j],
                           response_ids=list(o["output_ids"]),
                           rollout_log_probs=[e[0] for e in o["meta_info"]["output_token_logprobs"]],
                           loss_mask=[1] * len(o["output_ids"]))
                s.metadata["rollout_routing"] = decode_routed_experts(
                    o["meta_info"]["routed_experts"], hf_config.num_hidden_layers, hf_config.num_experts_per_tok)
                samples.append(s)
            for mode in ("none", "r3"):
                for s in samples:
                    s.routed_experts = s.metadata["rollout_routing"] if mode == "r3" else None
                lps, routes = _trainer_pass(actor, samples, mode, args.micro_batch_size)
                mean, mx, rmis = _mismatch(samples, lps, routes)
                print(f"{name:30s} {('R3' if mode == 'r3' else 'off'):6s} {mean:11.3e} {mx:11.3e} {100 * rmis:16.2f}%")
        engine.close()
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
