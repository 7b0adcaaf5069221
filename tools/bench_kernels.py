"""Benchmark of moerl's native kernels (csrc/) against naive torch and the chunked torch references.

Fused linear log-prob + entropy, for each T in --tokens (default 2048 8192), H = --hidden (1024),
V = --vocab (151,936, Qwen3), float32 on CPU, forward + backward (gradients for hidden and weight,
the loss using both the log-probs and the entropies):

* naive:  logits = h @ W^T / T, log_softmax, gather, entropy = -sum p log p (moerl.kernels.fused_logprob.
          naive_linear_log_probs), autograd backward;
* torch:  the chunked pure-torch reference (moerl.kernels.fused_logprob, impl="torch");
* native: the C++ op (csrc/cpu/fused_logprob.cpp, impl="native").

The FP8 block quantiser: quantize_weight (128 x 128, e4m3) of a --fp8-shape float32 weight, the
reference (moerl.precision.fp8) vs the native op, plus dequantisation.

Each measurement runs in its own fresh process (so allocations of one cannot hide in another's
peak) with glibc's mmap threshold pinned low (MALLOC_MMAP_THRESHOLD_=65536: freed blocks go back to
the OS), and reports:
* peak memory: the process's peak resident set (getrusage ru_maxrss) minus its resident set once the
  inputs exist, i.e. the peak of what the computation allocated, gradients included;
* time: wall seconds of forward + backward (best of --repeat).

Naive torch at a T whose [T, V] float32 logits alone exceed --naive-max-gib (default 2 GiB: 2048
tokens x 151,936 = 1.16 GiB runs, 8192 = 4.6 GiB does not, it would need about 20 GiB in all) is not run
(it would take this shared machine's memory); its figures are then projected from the smaller T
measured and marked "projected": time proportional to T, peak memory a + b * T through the two largest
measured T (--naive-extra, default 1024, adds a point), or proportional to T from one (an over-estimate).

Usage: python tools/bench_kernels.py [--tokens 2048 8192] [--naive-extra 1024] [--threads 2] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(kind: str, variant: str, tokens: int, hidden: int, vocab: int, repeat: int, threads: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    if kind == "fp8":
        from moerl.kernels import fp8_quant
        from moerl.kernels._build import load_native
        from moerl.precision import fp8 as ref

        load_native("cpu", required=True)
        w = torch.randn(tokens, hidden, generator=g)
        base = _rss_bytes()
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            if variant == "torch":
                q, s = ref.quantize_weight(w)
                ref.dequantize_weight(q, s)
            else:
                q, s = fp8_quant.quantize_weight(w, impl="native")
                fp8_quant.dequantize_weight(q, s, impl="native")
            best = min(best, time.perf_counter() - t0)
            del q, s
    else:
        from moerl.kernels._build import load_native
        from moerl.kernels.fused_logprob import fused_linear_log_probs, naive_linear_log_probs

        if variant == "native":
            load_native("cpu", required=True)
        h = (torch.randn(tokens, hidden, generator=g) * 0.5).requires_grad_()
        w = (torch.randn(vocab, hidden, generator=g) * 0.05).requires_grad_()
        labels = torch.randint(0, vocab, (tokens,), generator=g)
        g_lp = torch.randn(tokens, generator=g)
        g_ent = torch.randn(tokens, generator=g)
        base = _rss_bytes()
        best = float("inf")
        for _ in range(repeat):
            h.grad = w.grad = None
            t0 = time.perf_counter()
            if variant == "naive":
                lp, ent = naive_linear_log_probs(h, w, labels, 0.7)
            else:
                lp, ent = fused_linear_log_probs(h, w, labels, 0.7, impl=variant)
            (lp * g_lp + ent * g_ent).sum().backward()
            best = min(best, time.perf_counter() - t0)
            del lp, ent
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": max(0, peak - base), "seconds": best}


def _run_child(kind, variant, tokens, args) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_WAIT_POLICY="PASSIVE", TORCHDYNAMO_DISABLE="1")
    cmd = [sys.executable, __file__, "--_child", kind, variant, str(tokens), str(args.hidden), str(args.vocab),
           str(args.repeat), str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_kernels: {kind}/{variant} T={tokens} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _project_naive(results: dict, measured: list, t: int) -> dict:
    """Naive torch at ``t`` tokens from its measurements at smaller T: time scales with T (every GEMM and
    every [T, V] pass is linear in T); peak memory is a + b * T (the [V, H] weight gradient does not grow
    with T): a line through the two largest measured T, or proportional to T from one measurement (an
    over-estimate by the fixed part)."""
    top = measured[-1]
    r = {"seconds": results[("naive", top)]["seconds"] * t / top, "projected_from": top}
    if len(measured) >= 2:
        lo = measured[-2]
        m_lo, m_hi = results[("naive", lo)]["peak_bytes"], results[("naive", top)]["peak_bytes"]
        r["peak_bytes"] = m_hi + (m_hi - m_lo) / (top - lo) * (t - top)
        r["projected_from"] = f"{lo},{top}"
    else:
        r["peak_bytes"] = results[("naive", top)]["peak_bytes"] * t / top
    return r


def _gib(x: float) -> str:
    return f"{x / 2**30:7.3f} GiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--naive-extra", type=int, nargs="*", default=[1024],
                   help="extra T run for naive torch only (the memory projection's second point)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the variants round-robin this many times, a fresh process each, keeping each one's "
                        "best time: on a shared machine the load changes between runs, alternating evens it out")
    p.add_argument("--naive-max-gib", type=float, default=2.0,
                   help="largest [T, V] float32 logits naive torch is run with (GiB); beyond: projected")
    p.add_argument("--variants", nargs="+", default=["naive", "torch", "native"], choices=["naive", "torch", "native"])
    p.add_argument("--fp8-shape", type=int, nargs=2, default=[7168, 2048])
    p.add_argument("--skip-fp8", action="store_true")
    p.add_argument("--_child", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        kind, variant, t, h, v, r, th = args._child
        print(json.dumps(_child(kind, variant, int(t), int(h), int(v), int(r), int(th))))
        return 0
    load = os.getloadavg()
    print(f"bench_kernels: H={args.hidden} V={args.vocab} float32, {args.threads} torch threads, "
          f"{os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)")
    results: dict[tuple[str, int], dict] = {}
    extra = set(args.naive_extra) if "naive" in args.variants else set()
    for t in sorted(set(args.tokens) | extra):
        for rnd in range(args.rounds):
            for variant in args.variants:
                if t not in args.tokens and variant != "naive":
                    continue
                if variant == "naive" and 4 * t * args.vocab > args.naive_max_gib * 2**30:
                    measured = [k for k in results if k[0] == "naive"]
                    if rnd or not measured:
                        if not measured:
                            print(f"  naive  T={t}: not run (logits {4 * t * args.vocab / 2**30:.1f} GiB > "
                                  "--naive-max-gib) and nothing to project from")
                        continue
                    r = _project_naive(results, sorted(k[1] for k in measured), t)
                else:
                    r = _run_child("logprob", variant, t, args)
                    prev = results.get((variant, t))
                    if prev:  # rounds: the best time, the largest peak
                        r = {"peak_bytes": max(prev["peak_bytes"], r["peak_bytes"]),
                             "seconds": min(prev["seconds"], r["seconds"]), "round_seconds": r["seconds"]}
                results[(variant, t)] = r
                tag = f" (projected from T={r['projected_from']})" if "projected_from" in r else ""
                if "round_seconds" in r:
                    tag = f" (round {rnd + 1}: {r['round_seconds']:.2f} s; best so far)"
                print(f"  {variant:6s} T={t:5d}: peak {_gib(r['peak_bytes'])}  fwd+bwd {r['seconds']:8.2f} s{tag}  "
                      f"[load {os.getloadavg()[0]:.1f}]", flush=True)
    print("fused log-prob ratios (vs naive torch):")
    for t in sorted(args.tokens):
        base = results.get(("naive", t))
        if not base:
            continue
        for variant in ("torch", "native"):
            r = results.get((variant, t))
            if r:
                proj = " (naive projected)" if "projected_from" in base else ""
                print(f"  T={t:5d} {variant:6s}: memory {r['peak_bytes'] / base['peak_bytes']:.4f} of naive, "
                      f"time {r['seconds'] / base['seconds']:.3f}x naive{proj}")
    if not args.skip_fp8:
        n, k = args.fp8_shape
        fp8 = {v: _run_child("fp8", v, n, argparse.Namespace(hidden=k, vocab=0, repeat=max(3, args.repeat),
                                                             threads=args.threads)) for v in ("torch", "native")}
        print(f"FP8 128x128 quantise + dequantise of a [{n}, {k}] float32 weight:")
        for v, r in fp8.items():
            print(f"  {v:6s}: peak {_gib(r['peak_bytes'])}  {r['seconds']:.4f} s")
        print(f"  native / torch: memory {fp8['native']['peak_bytes'] / max(fp8['torch']['peak_bytes'], 1):.3f}, "
              f"time {fp8['native']['seconds'] / fp8['torch']['seconds']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
