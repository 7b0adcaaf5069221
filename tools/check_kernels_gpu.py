"""GPU check of moerl's CUDA kernels (csrc/cuda, issue #15): builds them, then runs each op on the GPU
against its reference and prints PASS / FAIL lines (exit 0 when all pass, 1 otherwise, 2 without a
CUDA device).

* fused linear log-prob + entropy (CUDA) vs naive torch on the GPU (TF32 off), fp32, odd shapes,
  temperature 0.7, masked labels: log-probs, entropies and both gradients within 1e-5 relative;
  then the peak CUDA memory and time of both at T=8192, H=1024, V=151,936 (forward + backward);
* blockwise FP8 quantise / dequantise (CUDA) vs moerl.precision.fp8 on the GPU: bitwise.

Usage: python tools/check_kernels_gpu.py [--skip-bench]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-bench", action="store_true")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("check_kernels_gpu: no CUDA device (run it on a GPU machine with the CUDA toolkit)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    from moerl.kernels import fp8_quant
    from moerl.kernels._build import load_native
    from moerl.kernels.fused_logprob import fused_linear_log_probs, naive_linear_log_probs
    from moerl.precision import fp8 as ref

    load_native("cuda", required=True)
    ok = True

    def report(name: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, h, v = 37, 96, 5003
    hidden = torch.randn(n, h, generator=g, device=dev)
    weight = torch.randn(v, h, generator=g, device=dev) * 0.3
    labels = torch.randint(0, v, (n,), generator=g, device=dev)
    labels[[2, 30]] = -100
    g_lp, g_ent = torch.randn(n, generator=g, device=dev), torch.randn(n, generator=g, device=dev)

    def run(fn, **kw):
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(hh, ww, labels, 0.7, **kw)
        (lp * g_lp + ent * g_ent).sum().backward()
        return lp.detach(), ent.detach(), hh.grad, ww.grad

    want = run(naive_linear_log_probs)
    got = run(fused_linear_log_probs, impl="native", token_chunk=16, vocab_chunk=1000)
    for name, a, b in zip(("log_probs", "entropy", "d_hidden", "d_weight"), got, want):
        report(f"fused_logprob cuda {name}", _rel(a, b) <= 1e-5, f"relative error {_rel(a, b):.2e}")

    for pow2 in (False, True):
        w = torch.randn(300, 259, generator=g, device=dev) * torch.logspace(-6, 3, 259, device=dev)
        q, s = fp8_quant.quantize_weight(w, pow2=pow2, impl="native")
        qr, sr = ref.quantize_weight(w, pow2=pow2)
        same = torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
        same &= torch.equal(fp8_quant.dequantize_weight(q, s, impl="native"), ref.dequantize_weight(qr, sr))
        report(f"fp8 quantise/dequantise cuda pow2={pow2}", same, "bitwise" if same else "bits differ")

    if not args.skip_bench:
        t, h, v = 8192, 1024, 151936
        hidden = torch.randn(t, h, generator=g, device=dev) * 0.5
        weight = torch.randn(v, h, generator=g, device=dev) * 0.05
        labels = torch.randint(0, v, (t,), generator=g, device=dev)
        g_lp, g_ent = torch.randn(t, generator=g, device=dev), torch.randn(t, generator=g, device=dev)
        for name, fn, kw in (("naive", naive_linear_log_probs, {}), ("native", fused_linear_log_probs,
                                                                   {"impl": "native", "token_chunk": 4096,
                                                                    "vocab_chunk": 16384})):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            run(fn, **kw)
            torch.cuda.synchronize()
            print(f"bench {name}: T={t} peak {(torch.cuda.max_memory_allocated() - base) / 2**30:.3f} GiB, "
                  f"fwd+bwd {time.perf_counter() - t0:.3f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
