"""moerl's GPU check: the checks a one-GPU machine runs to show what moerl does on CUDA.

    python tools/gpu_check.py [--device cuda|cpu] [--budget-s 450] [--only NAME ...] [--dry-run]

(``bash tools/gpu_check.sh`` installs the wheel folder first and calls this.) One line per check,
``PASS | FAIL | SKIP <name>: <figures or reason> (<seconds> s)``, then ``SUMMARY: ...``. Exit 0 when
no check FAILs (skips included), 1 otherwise, 2 for a bad command line.

Checks (each heavy one in its own worker process, so a crash or hang is one FAIL, not the end):

==================  =================================================================================
actor_bf16          moerl's MegatronActor (local layer spec) on CUDA in BF16 vs the same actor on CPU in
                    FP32: log-probs of the same tokens from the same weights (a random tiny Qwen3-MoE).
                    PASS: mean |diff| <= 2^-5, the step-0 BF16 bound (moerl.observe.report
                    STEP0_LOGPROB_TOL_BF16).
kernels             moerl's native CUDA kernels (csrc/cuda, moerl.kernels) vs their pure-torch
                    references: fused linear log-prob + entropy, forward and gradients, against a
                    float64 naive log_softmax (max relative error <= 1e-4); blockwise FP8 quantisation
                    bitwise equal to moerl.precision.fp8 (weights and activations, ragged edges, pow2
                    scales). SKIP when csrc/cuda holds no sources or they do not build (no nvcc: the kit
                    cannot carry a CUDA toolkit).
fp8_gemm            a block-scaled FP8 (E4M3) GEMM on the GPU's FP8 tensor cores (``torch._scaled_mm``
                    per 128-wide K-block, FP32 output, the 1x128 / 128x128 scales applied in FP32 between
                    K-blocks as DeepSeek-V3 sec. 3.3 describes) vs moerl.precision.fp8.block_scaled_gemm
                    on CPU (exact FP32 products). PASS: max |diff| <= 1e-5 * max |ref| (only the FP32
                    summation order differs).
server_step0        the reference rollout server (``moerl serve``) generates with log-probs; the actor on
                    CUDA recomputes them (the step-0 check of every run): mean |diff| <= 1e-5 in FP32. The
                    server runs on CUDA when ``moerl serve`` has a ``--device`` option, else on CPU (said
                    on the line): then it is the CUDA trainer vs the CPU server.
mfu                 one BF16 training step (forward, backward, Adam) of a small MoE (8 layers, hidden 1024,
                    32 experts top-4, 16 x 1024 tokens): median step time, tokens/s and MFU against the
                    GPU's dense BF16 peak (moerl.observe.flops.training_flops / peak_tflops).
te_spec             tools/check_te_spec.py (Transformer Engine layer spec, FP8 through TE) when
                    transformer_engine is importable.
==================  =================================================================================

``--device cpu`` is a SELF-TEST of this script on a machine without a GPU: the same checks with "cpu"
in place of "cuda" (actor_bf16 compares CPU BF16 with CPU FP32; fp8_gemm uses ``torch._scaled_mm`` on
CPU when torch supports it; server_step0 runs the CPU server); every line then says "(CPU self-test)"
and is no evidence about GPUs. Without a CUDA device and without ``--device cpu`` every check SKIPs
with its reason and the exit code is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("actor_bf16", "kernels", "fp8_gemm", "server_step0", "mfu", "te_spec")
# worst-case seconds of each check on a GPU machine (start-up of torch + megatron-core included): a
# check is SKIPped when less than this is left of --budget-s
ESTIMATE_S = {"actor_bf16": 90, "kernels": 120, "fp8_gemm": 30, "server_step0": 120, "mfu": 120, "te_spec": 150}
WHAT = {
    "actor_bf16": "MegatronActor log-probs, CUDA BF16 vs CPU FP32",
    "kernels": "csrc CUDA kernels vs their pure-torch references",
    "fp8_gemm": "block-scaled FP8 GEMM (torch._scaled_mm) vs moerl.precision.fp8 reference",
    "server_step0": "reference rollout server + step-0 log-prob check vs the CUDA actor",
    "mfu": "MFU of a small MoE BF16 training step",
    "te_spec": "tools/check_te_spec.py (Transformer Engine spec, FP8)",
}


# ----------------------------------------------------------------------------------------- workers
# Each worker runs in its own process (``--_worker NAME``) and writes one JSON object to ``--_out``.


def _tiny_checkpoint(path: str) -> str:
    """A random tiny Qwen3-MoE HF checkpoint + tokenizer (moerl.rollout.testing), once per path."""
    if not (Path(path) / "config.json").is_file():
        from moerl.rollout.testing import make_tiny_moe_checkpoint

        make_tiny_moe_checkpoint(path, seed=0)
    return path


def _samples(vocab: int, n: int = 8, seed: int = 3):
    """``n`` samples of different prompt / response lengths, random tokens in [2, vocab)."""
    import torch

    from moerl.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 4 + i % 5, 3 + i % 4
        ids = torch.randint(2, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(index=i, group_id=i, prompt="", label="", prompt_ids=ids[:p], response_ids=ids[p:],
                          loss_mask=[1] * r))
    return out


def _actor(model_dir: str, params_dtype: str, trainable: bool = False, **kw):
    """A MegatronActor (on CUDA when this process sees one) holding ``model_dir``'s HF weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from moerl.train.actor import MegatronActor

    hf_config = AutoConfig.from_pretrained(model_dir)
    sd = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    actor = MegatronActor(hf_config, trainable=trainable, params_dtype=params_dtype, **kw)
    actor.load_hf_state_dict(sd)
    return actor, hf_config


def _response_log_probs(actor, samples, temperature: float = 1.0) -> list[list[float]]:
    from moerl.train.batching import split_micro_batches

    out: list = [None] * len(samples)
    for mb, lp, _ in actor.compute_log_probs(split_micro_batches(samples, 4, pad_id=0), temperature):
        for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
            out[i] = [float(x) for x in resp]
    return out


def worker_actor_logprobs(args) -> dict:
    """Log-probs of fixed samples under the tiny checkpoint, actor in ``args.dtype`` on this process's device."""
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    info = init_distributed(seed=0, num_threads=2)
    try:
        actor, hf_config = _actor(args.model_dir, args.dtype)
        lps = _response_log_probs(actor, _samples(hf_config.vocab_size))
    finally:
        destroy_distributed()
    return {"device": str(info.device), "dtype": args.dtype, "log_probs": lps}


def worker_fp8_gemm(args) -> dict:
    """FP8 tensor-core GEMM per K-block vs the FP32 reference (module docstring, fp8_gemm)."""
    import torch

    from moerl.precision.fp8 import BLOCK, block_scaled_gemm, quantize_activation, quantize_weight

    if not hasattr(torch, "_scaled_mm"):
        return {"skip": f"torch {torch.__version__} has no torch._scaled_mm"}
    g = torch.Generator().manual_seed(0)
    m, n, k = 256, 384, 512
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 4.0, k)  # channels of different scales
    w = torch.randn(n, k, generator=g) * 0.05
    xq, xs = quantize_activation(x)
    wq, ws = quantize_weight(w)
    ref = block_scaled_gemm(xq, xs, wq, ws)
    dev = torch.device(args.device)
    xq_d, wq_d = xq.to(dev), wq.to(dev)
    xs_d = xs.to(dev)
    ws_rows = ws.repeat_interleave(BLOCK, dim=0)[:n].to(dev)  # [N, K/128]: row n's block scale per K-block
    one = torch.ones((), dtype=torch.float32, device=dev)
    acc = torch.zeros(m, n, dtype=torch.float32, device=dev)
    try:
        for b in range(k // BLOCK):
            lo, hi = b * BLOCK, (b + 1) * BLOCK
            part = torch._scaled_mm(xq_d[:, lo:hi].contiguous(), wq_d[:, lo:hi].contiguous().T, scale_a=one,
                                    scale_b=one, out_dtype=torch.float32)
            acc += part * xs_d[:, b:b + 1] * ws_rows[:, b][None, :]
    except (RuntimeError, NotImplementedError) as e:
        return {"skip": f"torch._scaled_mm on {dev} refused FP8 operands: {str(e).splitlines()[0][:160]}"}
    if dev.type == "cuda":
        torch.cuda.synchronize()
    diff = (acc.cpu() - ref).abs().max().item()
    scale = ref.abs().max().item()
    # the FP8 rounding itself, for the record: reference vs the unquantised FP32 product
    quant_err = ((x @ w.T) - ref).abs().max().item() / scale
    return {"max_abs_diff": diff, "ref_max_abs": scale, "quant_rel_err": quant_err, "shape": [m, n, k]}


def worker_kernels(args) -> dict:
    """moerl.kernels' native op on ``args.device`` vs a float64 naive log_softmax (forward and grads)."""
    import torch

    try:
        from moerl.kernels import _build
        from moerl.kernels.fused_logprob import fused_linear_log_probs
    except ImportError as e:
        return {"skip": f"moerl.kernels is not importable here: {e}"}
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    srcs = _build.cuda_sources() if kind == "cuda" else _build.cpu_sources()
    if not srcs:
        return {"skip": f"csrc/{kind} holds no kernel sources in this checkout"}
    try:
        _build.load_native(kind, required=True)
    except Exception as e:  # NativeBuildError: no nvcc / compiler error (named)
        return {"skip": f"the {kind} kernels did not build here: {str(e).splitlines()[0][:200]}"}
    g = torch.Generator().manual_seed(0)
    n, h, v, temp = 300, 64, 5000, 0.7
    hid = torch.randn(n, h, generator=g)
    wt = torch.randn(v, h, generator=g) * 0.2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::17] = -1  # masked tokens
    hd = hid.to(args.device, copy=True).requires_grad_(True)
    wd = wt.to(args.device, copy=True).requires_grad_(True)
    lp, ent = fused_linear_log_probs(hd, wd, labels.to(args.device), temp, impl="native", token_chunk=128,
                                     vocab_chunk=1024)
    (lp.sum() + 0.5 * ent.sum()).backward()
    h64, w64 = hid.double().requires_grad_(True), wt.double().requires_grad_(True)
    logits = torch.log_softmax(h64 @ w64.T / temp, -1)
    ref_lp = torch.where(labels >= 0, logits.gather(1, labels.clamp(min=0)[:, None])[:, 0], torch.zeros((), dtype=torch.float64))
    ref_ent = -(logits.exp() * logits).sum(-1)
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    rel = lambda a, b: float((a.detach().double().cpu() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-30))  # noqa: E731
    out = {"fused_logprob": {"log_prob": rel(lp, ref_lp), "entropy": rel(ent, ref_ent), "grad_hidden": rel(hd.grad, h64.grad),
                             "grad_weight": rel(wd.grad, w64.grad)},
           "sources": sorted(p.name for p in srcs)}
    try:
        from moerl.kernels import fp8_quant as native
    except ImportError:
        return out
    from moerl.precision import fp8 as ref

    # blockwise FP8 quantisation: bitwise equal to the reference (ragged 300 x 200 edges, pow2 scales too)
    mismatches, cases = [], 0
    for shape in ((256, 384), (300, 200)):
        x = torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[1])
        for pow2 in (False, True):
            for name, fn, rfn in (("weight", native.quantize_weight, ref.quantize_weight),
                                  ("activation", native.quantize_activation, ref.quantize_activation)):
                cases += 1
                q, sc = fn(x.to(args.device), pow2=pow2, impl="native")
                rq, rsc = rfn(x, pow2=pow2)
                if not (torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sc.cpu(), rsc)):
                    mismatches.append(f"{name} {list(shape)} pow2={pow2}")
    out["fp8_quant"] = {"cases": cases, "mismatches": mismatches}
    return out


def _serve_supports_device() -> bool:
    from moerl.rollout import server

    src = Path(server.__file__).read_text()
    return '"--device"' in src


def worker_server_step0(args) -> dict:
    """Start ``moerl serve`` on the tiny checkpoint, generate with log-probs, recompute them with the actor."""
    import httpx

    from moerl.observe.report import STEP0_LOGPROB_TOL
    from moerl.rollout.launcher import free_port, wait_healthy
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    port = free_port()
    cmd = [sys.executable, "-m", "moerl.cli", "serve", "--model-path", args.model_dir, "--port", str(port),
           "--num-threads", "2"]
    server_device = "cpu"
    if args.device.startswith("cuda") and _serve_supports_device():
        cmd += ["--device", args.device]
        server_device = args.device
    log = Path(args.work) / "server.log"
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, cwd=str(REPO))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout_s=120, log_path=str(log))
        vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
        samples = _samples(vocab, n=8)
        body = {"input_ids": [s.prompt_ids for s in samples], "return_logprob": True,
                "sampling_params": [{"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 100 + i,
                                     "ignore_eos": True} for i in range(len(samples))]}
        resp = httpx.post(url + "/generate", json=body, timeout=120)
        res = resp.json()
        if resp.status_code != 200 or not isinstance(res, list):
            raise RuntimeError(f"/generate answered HTTP {resp.status_code}: {str(res)[:300]}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    server_lp = []
    for s, r in zip(samples, res):
        s.response_ids = list(r["output_ids"])
        s.loss_mask = [1] * len(s.response_ids)
        server_lp.append([float(e[0]) for e in r["meta_info"]["output_token_logprobs"]])
    info = init_distributed(seed=0, num_threads=2)
    try:
        actor, _ = _actor(args.model_dir, "float32")
        trainer_lp = _response_log_probs(actor, samples)
    finally:
        destroy_distributed()
    diffs = [abs(a - b) for x, y in zip(trainer_lp, server_lp) for a, b in zip(x, y)]
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs), "tokens": len(diffs), "tol": STEP0_LOGPROB_TOL,
            "server_device": server_device, "trainer_device": str(info.device)}


def worker_mfu(args) -> dict:
    """Median time of a BF16 training step of a small MoE; tokens/s, model TFLOP/s, MFU."""
    import statistics

    import torch

    from moerl.models.qwen3_moe import make_hf_config
    from moerl.observe.flops import mfu, peak_tflops, training_flops
    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.actor import MegatronActor
    from moerl.train.batching import split_micro_batches
    from moerl.train.losses import sft_loss
    from moerl.types import Sample

    gpu = args.device.startswith("cuda")
    if gpu:
        fields = dict(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                      intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048)
        n_seq, seq, mbs, steps = 16, 1024, 4, 5
    else:  # self-test: small enough for 2 CPU cores
        fields = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      intermediate_size=256, vocab_size=512, max_position_embeddings=256)
        n_seq, seq, mbs, steps = 4, 128, 2, 3
    hf_config = make_hf_config(fields)
    info = init_distributed(seed=0, num_threads=2)
    try:
        actor = MegatronActor(hf_config, lr=1e-4, params_dtype="bfloat16" if gpu else "float32")
        g = torch.Generator().manual_seed(0)
        samples = []
        for i in range(n_seq):
            ids = torch.randint(0, fields["vocab_size"], (seq,), generator=g).tolist()
            samples.append(Sample(index=i, group_id=i, prompt="", label="", prompt_ids=ids[:1], response_ids=ids[1:],
                                  loss_mask=[1] * (seq - 1)))
        mb = split_micro_batches(samples, mbs, pad_id=0)
        loss = sft_loss(n_seq * (seq - 1))
        times = []
        for i in range(2 + steps):
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            actor.train_step(mb, loss, 1.0)
            if gpu:
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
    finally:
        destroy_distributed()
    t = statistics.median(times)
    flops = training_flops(hf_config, [seq] * n_seq)
    peak = peak_tflops() if gpu else None
    return {"step_s": t, "tokens_per_s": n_seq * seq / t, "model_tflops": flops / t / 1e12, "peak_tflops": peak,
            "mfu": mfu(flops, t, 1, peak), "peak_mem_gib": peak_mem, "device": str(info.device),
            "device_name": torch.cuda.get_device_name() if gpu else "cpu"}


WORKERS: dict[str, Callable] = {"actor_logprobs": worker_actor_logprobs, "fp8_gemm": worker_fp8_gemm,
                                "kernels": worker_kernels, "server_step0": worker_server_step0, "mfu": worker_mfu}


# ------------------------------------------------------------------------------------------ parent


class Skip(Exception):
    """A check that cannot run here (the message is the reason)."""


class Failed(Exception):
    """A check that ran and did not meet its bound (the message has the figures)."""


class Runner:
    """Runs the checks in order within ``budget_s`` seconds and prints one line each."""

    def __init__(self, device: str, budget_s: float, work: str, self_test: bool):
        self.device, self.budget_s, self.work, self.self_test = device, budget_s, work, self_test
        self.t0 = time.monotonic()
        self.results: list[tuple[str, str]] = []

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def worker(self, name: str, *, env: Optional[dict] = None, timeout: Optional[float] = None, **kw) -> dict:
        """Run worker ``name`` in a fresh process; its JSON result (FAIL on a crash / timeout)."""
        out = Path(self.work) / f"{name}_{len(self.results)}_{time.monotonic_ns()}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", name, "--_out", str(out), "--device",
               self.device, "--_work", self.work]
        for k, v in kw.items():
            cmd += [f"--_{k.replace('_', '-')}", str(v)]
        e = dict(os.environ, **(env or {}))
        e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
        limit = max(10.0, min(timeout or self.left(), self.left()))
        try:
            p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=limit, cwd=str(REPO))
        except subprocess.TimeoutExpired:
            raise Failed(f"worker {name} did not finish in {limit:.0f} s") from None
        if p.returncode != 0 or not out.is_file():
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
            raise Failed(f"worker {name} exited {p.returncode}: {' | '.join(tail)[-400:]}")
        res = json.loads(out.read_text())
        if "skip" in res:
            raise Skip(res["skip"])
        return res

    def need(self, name: str) -> None:
        """Raise :class:`Skip` when less than the check's worst-case seconds are left of the budget (each
        check calls it after its cheap prerequisites, so a check that cannot run here says why first)."""
        if self.left() < ESTIMATE_S[name]:
            raise Skip(f"{self.left():.0f} s left of --budget-s, the check needs up to {ESTIMATE_S[name]} s")

    def run(self, name: str, fn: Callable[[], str]) -> None:
        t = time.monotonic()
        try:
            status, msg = "PASS", fn()
        except Skip as e:
            status, msg = "SKIP", str(e)
        except Failed as e:
            status, msg = "FAIL", str(e)
        except Exception as e:  # noqa: BLE001 - a bug or an environment problem is that check's FAIL
            status, msg = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        tag = " (CPU self-test, not a GPU result)" if self.self_test and status != "SKIP" else ""
        print(f"{status} {name}: {msg}{tag} ({time.monotonic() - t:.1f} s)", flush=True)
        self.results.append((name, status))


def _model_dir(r: Runner) -> str:
    return _tiny_checkpoint(str(Path(r.work) / "tiny_moe"))


def check_actor_bf16(r: Runner) -> str:
    r.need("actor_bf16")
    from moerl.observe.report import STEP0_LOGPROB_TOL_BF16

    md = _model_dir(r)
    ref = r.worker("actor_logprobs", env={"CUDA_VISIBLE_DEVICES": ""}, model_dir=md, dtype="float32")
    got = r.worker("actor_logprobs", model_dir=md, dtype="bfloat16")
    if not r.self_test and not got["device"].startswith("cuda"):
        raise Failed(f"the BF16 actor ran on {got['device']}, not CUDA")
    d = [abs(a - b) for x, y in zip(got["log_probs"], ref["log_probs"]) for a, b in zip(x, y)]
    mean, mx = sum(d) / len(d), max(d)
    msg = (f"{got['device']} bf16 vs {ref['device']} fp32 log-probs of {len(d)} tokens: mean |diff| {mean:.2e}, "
           f"max {mx:.2e} (bound on the mean {STEP0_LOGPROB_TOL_BF16:g})")
    if not mean <= STEP0_LOGPROB_TOL_BF16:
        raise Failed(msg)
    return msg


def check_kernels(r: Runner) -> str:
    r.need("kernels")
    res = r.worker("kernels")
    f = res["fused_logprob"]
    msg = (f"{', '.join(res['sources'])}: fused_logprob vs float64, max relative error " +
           ", ".join(f"{k} {v:.1e}" for k, v in f.items()) + " (bound 1e-4)")
    q = res.get("fp8_quant")
    msg += (f"; fp8_quant bitwise equal to moerl.precision.fp8 in {q['cases'] - len(q['mismatches'])} of {q['cases']} "
            f"cases{' (differs: ' + '; '.join(q['mismatches']) + ')' if q['mismatches'] else ''}"
            if q else "; moerl.kernels.fp8_quant not importable: not checked")
    if not all(v <= 1e-4 for v in f.values()) or (q and q["mismatches"]):
        raise Failed(msg)
    return msg


def check_fp8_gemm(r: Runner) -> str:
    r.need("fp8_gemm")
    res = r.worker("fp8_gemm")
    rel = res["max_abs_diff"] / res["ref_max_abs"]
    msg = (f"[M,N,K]={res['shape']}: max |scaled_mm - reference| {res['max_abs_diff']:.2e} = {rel:.1e} of max |ref| "
           f"(bound 1e-5); FP8 rounding itself vs the FP32 product: {res['quant_rel_err']:.1e}")
    if not rel <= 1e-5:
        raise Failed(msg)
    return msg


def check_server_step0(r: Runner) -> str:
    r.need("server_step0")
    res = r.worker("server_step0", model_dir=_model_dir(r))
    msg = (f"trainer ({res['trainer_device']}, fp32) vs server ({res['server_device']}, fp32) log-probs of "
           f"{res['tokens']} generated tokens: mean |diff| {res['mean']:.2e}, max {res['max']:.2e} (step-0 bound on "
           f"the mean {res['tol']:g})")
    if not r.self_test and res["server_device"] == "cpu":
        msg += "; the server ran on CPU: moerl serve has no --device option yet"
    if not res["mean"] <= res["tol"]:
        raise Failed(msg)
    return msg


def check_mfu(r: Runner) -> str:
    r.need("mfu")
    res = r.worker("mfu")
    msg = (f"{res['device_name']}: step {res['step_s'] * 1e3:.1f} ms, {res['tokens_per_s']:.0f} tokens/s, "
           f"{res['model_tflops']:.3g} model TFLOP/s")
    if res["mfu"] is not None:
        msg += f", MFU {100 * res['mfu']:.1f}% of {res['peak_tflops']:g} TFLOP/s BF16 peak"
        if res["peak_mem_gib"] is not None:
            msg += f", peak allocated {res['peak_mem_gib']:.1f} GiB"
        if not 0 < res["mfu"] <= 1:
            raise Failed(msg + " (MFU outside (0, 1]: FLOP count or timing wrong)")
    else:
        msg += ", MFU n/a (no BF16 peak known for this device)"
    return msg


def check_te_spec(r: Runner) -> str:
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a broken TE build
        raise Skip(f"transformer_engine is not importable ({type(e).__name__}); pip install "
                   "transformer-engine[pytorch] matching the CUDA torch (too large for the 60 MiB kit)") from None
    if r.self_test:
        raise Skip("TE's FP8 layers need CUDA (not part of the CPU self-test)")
    r.need("te_spec")
    p = subprocess.run([sys.executable, str(REPO / "tools" / "check_te_spec.py")], capture_output=True, text=True,
                       timeout=max(10.0, r.left()), cwd=str(REPO))
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    if p.returncode != 0:
        raise Failed(f"check_te_spec.py exited {p.returncode}: {' | '.join(lines[-2:])[-400:]}")
    return f"check_te_spec.py passed: {' | '.join(lines[-2:])[-300:]}"


CHECK_FNS = {"actor_bf16": check_actor_bf16, "kernels": check_kernels, "fp8_gemm": check_fp8_gemm,
             "server_step0": check_server_step0, "mfu": check_mfu, "te_spec": check_te_spec}


def environment_line() -> tuple[str, Optional[str]]:
    """(one line describing python / torch / the GPU, the reason GPU checks cannot run or None)."""
    import platform

    try:
        import torch
    except ImportError:
        return f"python {platform.python_version()}, no torch", "torch is not installed (the kit expects a CUDA torch)"
    line = f"python {platform.python_version()}, torch {torch.__version__} (CUDA build {torch.version.cuda})"
    if not torch.cuda.is_available():
        why = ("torch.cuda.is_available() is False: "
               + ("this torch is a CPU build" if torch.version.cuda is None else "no visible CUDA device / driver"))
        return line, why
    cap = torch.cuda.get_device_capability()
    return line + f", GPU {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), {torch.cuda.device_count()} visible", None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) | cpu: self-test of this script without a GPU")
    ap.add_argument("--budget-s", type=float, default=450.0, help="seconds for all checks (a check that may not "
                    "fit in what is left is skipped)")
    ap.add_argument("--only", nargs="+", choices=CHECKS, default=None, help="run these checks only")
    ap.add_argument("--dry-run", action="store_true", help="list the checks and what each needs; run nothing")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    for hidden in ("worker", "out", "work", "model-dir", "dtype"):
        ap.add_argument(f"--_{hidden}", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Writing model shards" bars
    if args._worker:
        return _run_worker(args)
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        print(f"gpu_check: bad CLI input: --device {args.device!r} is not cuda, cuda:N or cpu\n  fix: give --device cuda "
              "(the GPU check) or --device cpu (self-test)", file=sys.stderr)
        return 2
    checks = args.only or list(CHECKS)
    if args.dry_run:
        print("gpu_check: dry run (nothing imported, nothing run)")
        for c in checks:
            print(f"SKIP {c}: dry run; would run: {WHAT[c]} (up to {ESTIMATE_S[c]} s)")
        print(f"SUMMARY: 0 PASS, 0 FAIL, {len(checks)} SKIP (dry run)")
        return 0
    env, why = environment_line()
    self_test = args.device == "cpu"
    print(f"gpu_check: {env}" + ("; --device cpu: CPU SELF-TEST of the checks, no GPU evidence" if self_test else ""),
          flush=True)
    t0 = time.monotonic()
    if why is not None and not self_test:
        for c in checks:
            print(f"SKIP {c}: {why}; needs a CUDA GPU ({WHAT[c]})")
        print(f"SUMMARY: 0 PASS, 0 FAIL, {len(checks)} SKIP in {time.monotonic() - t0:.1f} s (no GPU: nothing checked)")
        return 0
    with tempfile.TemporaryDirectory(prefix="moerl_gpu_check_") as tmp:
        work = args.work or tmp
        Path(work).mkdir(parents=True, exist_ok=True)
        r = Runner(args.device, args.budget_s, work, self_test)
        for c in checks:
            r.run(c, lambda c=c: CHECK_FNS[c](r))
    counts = {s: sum(1 for _, st in r.results if st == s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"SUMMARY: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {time.monotonic() - t0:.1f} s"
          + (" (CPU self-test)" if self_test else ""))
    return 1 if counts["FAIL"] else 0


def _run_worker(args) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    ns = argparse.Namespace(device=args.device, model_dir=args._model_dir, dtype=args._dtype, work=args._work)
    res = WORKERS[args._worker](ns)
    Path(args._out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
