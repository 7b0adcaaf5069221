"""Tokens/s of one moerl (Megatron-Core) actor training step vs one transformers training step of the
same tiny MoE, weights and batch, on CPU.

    python tools/bench_train.py [--recipe configs/tiny_arith.yaml] [--repeats 7] [--warmup 2]
                                [--threads 2] [--batch 128] [key=value ...]

Both sides start from the same weights (a transformers ``AutoModelForCausalLM`` of the recipe's HF
config, random init, seed ``--seed``; the actor loads its state dict) and train on the same batch:
``--batch`` supervised arithmetic examples of the recipe's task (prompt + gold answer + eos, loss on
the answer tokens, moerl's byte tokenizer), token-mean NLL over the batch plus the router's
load-balancing loss with the recipe's coefficient, gradient clipping at ``train.clip_grad`` and an
AdamW step at ``sft.lr``.

* moerl: ``MegatronActor.train_step`` on the micro-batches moerl builds for it
  (``moerl.train.micro_batches.build_micro_batches``: best-fit packed THD micro-batches when
  ``train.pack``, else padded micro-batches of ``train.micro_batch_size``), with the recipe's MoE keys;
* transformers: one right-padded ``[batch, max_len]`` forward with ``attention_mask``,
  ``output_router_logits=True`` (its ``aux_loss``), backward, ``clip_grad_norm_``, ``torch.optim.AdamW``.

Steps alternate (moerl, transformers, moerl, ...) so that load from other processes hits both alike;
the first ``--warmup`` of each are not timed. tokens/s = the batch's real (unpadded) tokens / the
step's wall seconds; the median over ``--repeats`` is printed with the ratio moerl / transformers.
The first step's NLL of both sides is printed too: same weights and batch give the same loss
(|diff| ~1e-6 in FP32), which shows the two sides compute the same thing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]


def _samples(cfg, tokenizer, n: int, seed: int):
    """``n`` supervised samples of the recipe's arithmetic task (moerl's SFT encoding)."""
    import random

    from moerl.data.tasks import arithmetic_problem
    from moerl.data.tokenizer import encode_sft_example
    from moerl.types import Sample

    rng, base = random.Random(seed), 10 ** cfg.data.digits
    out = []
    for i in range(n):
        row = arithmetic_problem(rng.randrange(base), rng.randrange(base), cfg.data.digits)
        ids, mask = encode_sft_example(tokenizer, row["prompt"], str(row["label"]), cfg.data.system_prompt)
        k = mask.index(1)
        out.append(Sample(index=i, group_id=i, prompt=row["prompt"], label=str(row["label"]), prompt_ids=ids[:k],
                          response_ids=ids[k:], loss_mask=mask[k:]))
    return out


def _hf_batch(samples, pad_id: int):
    """Right-padded input_ids / attention_mask / loss mask [B, S] (loss mask on the predicted tokens,
    shifted: position t predicts token t + 1)."""
    import torch

    s = max(len(x.tokens) for x in samples)
    ids = torch.full((len(samples), s), pad_id, dtype=torch.long)
    att = torch.zeros((len(samples), s), dtype=torch.long)
    lmask = torch.zeros((len(samples), s), dtype=torch.float32)
    for i, x in enumerate(samples):
        n, p = len(x.tokens), len(x.prompt_ids)
        ids[i, :n] = torch.tensor(x.tokens)
        att[i, :n] = 1
        lmask[i, p - 1: n - 1] = torch.tensor(x.loss_mask, dtype=torch.float32)
    return ids, att, lmask


def run(args) -> dict:
    """Build both sides, time them, print the table; returns the figures (medians in tokens/s)."""
    import torch
    from transformers import AutoModelForCausalLM

    from moerl.config.loader import load_config
    from moerl.data.tokenizer import build_tokenizer
    from moerl.models.qwen3_moe import make_hf_config
    from moerl.moe.config import moe_actor_kwargs
    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.actor import MegatronActor
    from moerl.train.components import actor_kwargs
    from moerl.train.losses import sft_loss
    from moerl.train.micro_batches import build_micro_batches

    cfg = load_config(args.recipe, args.overrides)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(tmp)
    fields = cfg.model.hf_config.model_dump()
    fields["vocab_size"] = cfg.model.hf_config.resolve_vocab_size(len(tokenizer))
    hf_config = make_hf_config(fields)
    samples = _samples(cfg, tokenizer, args.batch, args.seed)
    pad_id = int(tokenizer.pad_token_id)
    n_tokens = sum(len(s.tokens) for s in samples)
    n_loss = sum(sum(s.loss_mask) for s in samples)

    init_distributed(seed=args.seed, num_threads=args.threads)
    try:
        torch.manual_seed(args.seed)
        mk = moe_actor_kwargs(cfg)
        hf_config.output_router_logits = True
        hf_config.router_aux_loss_coef = float(mk["moe_aux_loss_coeff"])
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        actor = MegatronActor(hf_config, lr=cfg.sft.lr, weight_decay=cfg.train.weight_decay,
                              adam_beta1=cfg.train.adam_beta1, adam_beta2=cfg.train.adam_beta2,
                              clip_grad=cfg.train.clip_grad, moe_aux_loss_coeff=mk["moe_aux_loss_coeff"],
                              moe_load_balancing_type=mk["moe_load_balancing_type"], **actor_kwargs(cfg, mk))
        actor.load_hf_state_dict({k: v.detach().clone() for k, v in hf.state_dict().items()})
        ctx = SimpleNamespace(cfg=cfg, pad_id=pad_id, hf_config=hf_config)
        mbs, _ = build_micro_batches(ctx, samples)
        opt = torch.optim.AdamW(hf.parameters(), lr=cfg.sft.lr, betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
                                eps=1e-8, weight_decay=cfg.train.weight_decay)
        ids, att, lmask = _hf_batch(samples, pad_id)
        hf.train()

        def megatron_step() -> float:
            return float(actor.train_step(mbs, sft_loss(n_loss), 1.0)["sft_loss"])

        def hf_step() -> float:
            out = hf(input_ids=ids, attention_mask=att)
            logp = torch.log_softmax(out.logits.float(), -1)[:, :-1]
            tok = logp.gather(-1, ids[:, 1:, None])[..., 0]
            nll = -(tok * lmask[:, :-1]).sum() / n_loss
            loss = nll + hf_config.router_aux_loss_coef * out.aux_loss
            loss.backward()
            if cfg.train.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.train.clip_grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(nll.detach())

        times = {"moerl": [], "transformers": []}
        first = {}
        for i in range(args.warmup + args.repeats):
            for name, fn in (("moerl", megatron_step), ("transformers", hf_step)):
                t0 = time.perf_counter()
                nll = fn()
                dt = time.perf_counter() - t0
                first.setdefault(name, nll)
                if i >= args.warmup:
                    times[name].append(dt)
    finally:
        destroy_distributed()
    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: n_tokens / v for k, v in med.items()}
    ratio = tps["moerl"] / tps["transformers"]
    print(f"batch: {len(samples)} samples, {n_tokens} tokens ({n_loss} in the loss), longest "
          f"{ids.shape[1]}; moerl micro-batches: {len(mbs)} ({'packed THD' if cfg.train.pack else 'padded'}); "
          f"threads {args.threads}; {args.repeats} timed steps each after {args.warmup} warm-up")
    print(f"first-step NLL: moerl {first['moerl']:.6f}, transformers {first['transformers']:.6f} "
          f"(|diff| {abs(first['moerl'] - first['transformers']):.1e}: same weights, same batch)")
    for k in ("moerl", "transformers"):
        print(f"{k:13s} step median {med[k] * 1e3:8.1f} ms (min {min(times[k]) * 1e3:.1f}, max "
              f"{max(times[k]) * 1e3:.1f})  {tps[k]:9.0f} tokens/s")
    print(f"ratio moerl / transformers tokens/s: {ratio:.3f} (goal >= 1.0)")
    return {"tokens_per_s": tps, "median_s": med, "ratio": ratio, "first_nll": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=str(REPO / "configs" / "tiny_arith.yaml"))
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per side (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both sides)")
    ap.add_argument("--batch", type=int, default=128, help="samples in the batch (tiny_arith's SFT batch: 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="recipe overrides key=value (e.g. train.pack=false)")
    args = ap.parse_args(argv)
    from moerl.cli import _quiet_runtime  # OMP_WAIT_POLICY=PASSIVE, megatron-core's CPU fallback warnings off

    _quiet_runtime()
    from moerl.errors import CLIError, run_entry

    def body():
        for flag in ("repeats", "batch", "threads"):
            if getattr(args, flag) < 1:
                raise CLIError(f"--{flag} must be >= 1, got {getattr(args, flag)}", key=f"--{flag}",
                               hint=f"give --{flag} 1 or more")
        if args.warmup < 0:
            raise CLIError(f"--warmup must be >= 0, got {args.warmup}", key="--warmup", hint="give --warmup 0 or more")
        run(args)

    return run_entry("bench_train", body)


if __name__ == "__main__":
    sys.exit(main())
