"""How close is `moerl plan`'s activation estimate to the memory a real forward/backward takes?

Builds moerl's MegatronActor of a small Qwen3-MoE in one process, takes one warm-up optimizer step
(so Adam's state and every persistent buffer exist), then measures one more training step of a
micro-batch of ``--batch`` x ``--seq`` tokens and prints, per recompute mode, the planner's
activation bytes (moerl.parallel.memory_model.plan_memory: ``activations[mode]``) against:

* saved: the bytes of the distinct storages autograd keeps for backward during the forward, i.e.
  until the backward first unpacks one (``torch.autograd.graph.saved_tensors_hooks``; parameters
  excluded; a view counts its whole storage), the quantity the planner models;
* peak: the peak of the memory the step allocates on top of what was allocated before it (on CPU,
  the PyTorch profiler's memory events' running "Total Allocated"; on CUDA,
  ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` before the step). The peak
  also holds temporaries (gradients of activations, the optimizer step's scratch), so planner/peak
  is expected below 1.

CPU (no flash attention: the planner counts the S x S softmax): ``python tools/check_plan_memory.py``.
GPU: ``python tools/check_plan_memory.py --device cuda`` (flash attention counted as absent only when
Transformer Engine is not installed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# a small Qwen3-MoE: 2 layers (one dense), GQA, 8 experts top-2, untied 512-token vocabulary
MODEL = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96, intermediate_size=256,
             max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, norm_topk_prob=True,
             tie_word_embeddings=False, vocab_size=512, mlp_only_layers=[0])


def _samples(batch: int, seq: int, vocab: int):
    import torch

    from moerl.types import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batch):
        ids = torch.randint(1, vocab, (seq,), generator=g).tolist()
        out.append(Sample(index=i, group_id=i, prompt="", label="", prompt_ids=ids[:4], response_ids=ids[4:],
                          loss_mask=[1] * (seq - 4)))
    return out


def _cpu_peak(step) -> int:
    """Peak bytes allocated by ``step()`` above the allocation level before it (profiler memory events)."""
    import tempfile

    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    mem = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                 key=lambda e: e["ts"])
    if not mem:
        raise RuntimeError("the profiler recorded no CPU memory events")
    base = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in mem) - base


def measure(recompute: str = "none", batch: int = 2, seq: int = 512, device: str = "cpu") -> dict[str, Any]:
    """Planner activation bytes vs saved-for-backward and peak bytes of one training step.

    Returns {"recompute", "tokens", "planner", "saved", "peak", "planner/saved", "planner/peak"} (bytes).

    Raises:
        RuntimeError: device "cuda" without CUDA.
    """
    import torch

    from moerl.models.qwen3_moe import make_hf_config
    from moerl.parallel.memory_model import plan_memory
    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.actor import MegatronActor
    from moerl.train.batching import split_micro_batches
    from moerl.train.losses import sft_loss

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    cfg = make_hf_config(MODEL)
    init_distributed(seed=0, num_threads=int(os.environ.get("OMP_NUM_THREADS", "2")))
    try:
        actor = MegatronActor(cfg, lr=1e-4, moe_aux_loss_coeff=1e-3, recompute=recompute)
        samples = _samples(batch, seq, cfg.vocab_size)
        mbs = split_micro_batches(samples, batch, 0)
        loss = sft_loss(sum(len(s.loss_mask) for s in samples))
        actor.train_step(mbs, loss, 1.0)  # warm-up: Adam state, buffers
        params = {p.untyped_storage().data_ptr() for p in actor.model.parameters()}
        saved: dict[int, int] = {}
        backward = [False]  # the first unpack starts the backward; recompute's saves come after it

        def pack(t):
            st = t.untyped_storage()
            if not backward[0] and st.data_ptr() not in params and st.nbytes() > 0:
                saved[st.data_ptr()] = st.nbytes()
            return t

        def unpack(t):
            backward[0] = True
            return t

        def step():
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                actor.train_step(mbs, loss, 1.0)

        if device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak = _cpu_peak(step)
    finally:
        destroy_distributed()
    flash = False
    if device == "cuda":
        import importlib.util

        flash = importlib.util.find_spec("transformer_engine") is not None
    planner = plan_memory(cfg, world_size=1, recompute=recompute, params_dtype="float32", seq_length=seq,
                          micro_batch_size=batch, flash_attention=flash).stages[0].activations[recompute]
    kept = float(sum(saved.values()))
    return {"recompute": recompute, "tokens": batch * seq, "planner": planner, "saved": kept, "peak": float(peak),
            "planner/saved": planner / kept, "planner/peak": planner / peak}


def main(argv=None) -> int:
    """Print the planner-vs-measured table; exit 2 on bad arguments."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, default=2, help="samples per micro-batch")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sample (<= 4096)")
    ap.add_argument("--recompute", default="none,full", help="comma-separated: none, selective, full")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.recompute.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("none", "selective", "full")]
    if args.batch < 1 or not 8 <= args.seq <= 4096 or bad or not modes:
        print(f"check_plan_memory: --batch >= 1, 8 <= --seq <= 4096, --recompute of none/selective/full (got "
              f"{args.batch}, {args.seq}, {args.recompute!r})", file=sys.stderr)
        return 2
    print(f"{'recompute':<10} {'tokens':>7} {'planner MiB':>12} {'saved MiB':>10} {'peak MiB':>9} "
          f"{'planner/saved':>14} {'planner/peak':>13}")
    for mode in modes:
        r = measure(mode, args.batch, args.seq, args.device)
        mib = 1024 ** 2
        print(f"{mode:<10} {r['tokens']:7d} {r['planner'] / mib:12.2f} {r['saved'] / mib:10.2f} {r['peak'] / mib:9.2f} "
              f"{r['planner/saved']:14.3f} {r['planner/peak']:13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
