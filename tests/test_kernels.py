"""Native kernels (csrc/, moerl.kernels): the fused linear log-prob + entropy against naive torch
(materialised logits, log_softmax, gather, -sum p log p) in fp32, at TP=2 on gloo against TP=1, the
actor's log-probs and update with train.fused_logprob on vs off, and the FP8 block quantiser bitwise
against moerl.precision.fp8. The C++ path is built and used here (load_native(required=True)): no
silent fallback to the references."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moerl.kernels import fp8_quant  # noqa: E402
from moerl.kernels._build import CSRC, load_native  # noqa: E402
from moerl.kernels.fused_logprob import fused_linear_log_probs, naive_linear_log_probs  # noqa: E402
from moerl.precision import fp8 as fp8_ref  # noqa: E402

RTOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def native():
    assert load_native("cpu", required=True)  # builds csrc/cpu on first use (cached afterwards)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (relative to the reference's scale)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _problem(n_shape=(3, 13), h=24, v=1001, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n_shape, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.6
    labels = torch.randint(0, v, n_shape, generator=g)
    labels[0, 2] = -100  # masked positions
    labels[-1, -1] = -1
    g_lp = torch.randn(n_shape, generator=g)
    g_ent = torch.randn(n_shape, generator=g)
    return hidden, weight, labels, g_lp, g_ent


def _run(fn, hidden, weight, labels, g_lp, g_ent, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = fn(h, w, labels, 0.7, **kw)
    (lp * g_lp + ent * g_ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("impl", ["native", "torch"])
def test_fused_matches_naive_fp32(impl):
    """Odd token count (39), V = 1001 not a multiple of the 256-column block, 5-token blocks (not a
    divisor of 39), temperature 0.7, masked labels: log-probs, entropies, d hidden and d weight within
    1e-5 relative of naive fp32 torch."""
    problem = _problem()
    want = _run(naive_linear_log_probs, *problem)
    got = _run(fused_linear_log_probs, *problem, impl=impl, token_chunk=5, vocab_chunk=256)
    for name, a, b in zip(("log_probs", "entropy", "d_hidden", "d_weight"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert _rel(a, b) <= RTOL, (impl, name, _rel(a, b))
    labels = problem[2]
    assert torch.all(got[0][labels < 0] == 0)
    # the masked tokens get no log-prob gradient: only the entropy's reaches their hidden states
    only_ent = _run(fused_linear_log_probs, problem[0], problem[1], labels, torch.zeros_like(problem[3]),
                    problem[4], impl=impl, token_chunk=5, vocab_chunk=256)
    masked = labels < 0
    assert _rel(got[2][masked], only_ent[2][masked]) <= RTOL
    assert _rel(got[2][~masked], only_ent[2][~masked]) > 1e-2  # the log-prob gradient is there elsewhere


def test_fused_default_blocks_and_log_prob_only_grad():
    """Default block shape (one partial vocab block) and a loss on the log-probs only (entropy
    gradient None), against naive torch and against the torch reference."""
    hidden, weight, labels, g_lp, _ = _problem(n_shape=(1, 29), h=16, v=4099, seed=1)

    def lp_only(fn, **kw):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, _ = fn(h, w, labels, 1.3, **kw)
        (lp * g_lp).sum().backward()
        return lp.detach(), h.grad, w.grad

    want = lp_only(naive_linear_log_probs)
    for impl in ("native", "torch"):
        for a, b in zip(lp_only(fused_linear_log_probs, impl=impl), want):
            assert _rel(a, b) <= RTOL, impl


def test_fused_bad_input_named():
    h, w, labels, _, _ = _problem(n_shape=(2, 3), h=8, v=50)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_log_probs(h, w, labels, 0.0)
    with pytest.raises(ValueError, match="agree on H"):
        fused_linear_log_probs(h, w[:, :5], labels, 1.0)
    with pytest.raises(ValueError, match="vocab size 50"):
        fused_linear_log_probs(h, w, labels + 50, 1.0)
    with pytest.raises(TypeError, match="integer"):
        fused_linear_log_probs(h, w, labels.float(), 1.0)


def _tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        load_native("cpu", required=True)
        hidden, weight, labels, g_lp, g_ent = _problem(n_shape=(3, 11), h=20, v=998, seed=2)
        shard = weight.shape[0] // world
        h = hidden.clone().requires_grad_()
        w = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
        lp, ent = fused_linear_log_probs(h, w, labels, 0.7, tp_group=dist.group.WORLD, impl="native",
                                         token_chunk=7, vocab_chunk=100)
        (lp * g_lp + ent * g_ent).sum().backward()
        dh = h.grad.clone()
        dist.all_reduce(dh)  # what Megatron's copy_to_tensor_model_parallel_region does in backward
        torch.save({"lp": lp.detach(), "ent": ent.detach(), "dh": dh, "dw": w.grad}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fused_tp2_gloo_matches_tp1(tmp_path):
    """Vocabulary-parallel: two gloo ranks holding halves of V (labels on both sides of the split)
    give the TP=1 log-probs and entropies on both ranks, the summed hidden gradient and each
    rank's slice of the weight gradient, within 1e-5."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    problem = _problem(n_shape=(3, 11), h=20, v=998, seed=2)
    lp, ent, dh, dw = _run(fused_linear_log_probs, *problem, impl="native")
    naive = _run(naive_linear_log_probs, *problem)
    assert all(_rel(a, b) <= RTOL for a, b in zip((lp, ent, dh, dw), naive))
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert _rel(r["lp"], lp) <= RTOL and _rel(r["ent"], ent) <= RTOL
        assert _rel(r["dh"], dh) <= RTOL
        assert _rel(r["dw"], dw[rank * 499:(rank + 1) * 499]) <= RTOL


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_native_bitwise_equal_to_reference(pow2):
    """1x128 and 128x128 (and ragged / non-square) blocks, fp32 / bf16 / fp16 inputs spanning 9
    decades, all-zero blocks: FP8 bytes, scales and dequantised values identical to moerl.precision.fp8."""
    g = torch.Generator().manual_seed(3)
    for shape, dtype, block in (((300, 259), torch.float32, (128, 128)), ((256, 384), torch.bfloat16, (128, 128)),
                                ((7, 130), torch.float16, (128, 128)), ((65, 100), torch.float32, (32, 48))):
        w = (torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[1])).to(dtype)
        w[:5, :60] = 0
        q, s = fp8_quant.quantize_weight(w, block, pow2, impl="native")
        qr, sr = fp8_ref.quantize_weight(w, block, pow2)
        assert q.dtype == torch.float8_e4m3fn and torch.equal(q.view(torch.uint8), qr.view(torch.uint8)), shape
        assert torch.equal(s, sr), shape
        for out in (torch.float32, torch.bfloat16):
            d = fp8_quant.dequantize_weight(q, s, block, out, impl="native")
            dr = fp8_ref.dequantize_weight(qr, sr, block, out)
            assert d.dtype == out and torch.equal(d, dr), (shape, out)
        x = w.reshape(1, *shape)
        a, sa = fp8_quant.quantize_activation(x, block[1], pow2, impl="native")
        ar, sar = fp8_ref.quantize_activation(x, block[1], pow2)
        assert torch.equal(a.view(torch.uint8), ar.view(torch.uint8)) and torch.equal(sa, sar), shape
        assert torch.equal(fp8_quant.dequantize_activation(a, sa, block[1], impl="native"),
                           fp8_ref.dequantize_activation(ar, sar, block[1]))


def test_fp8_native_refuses_what_the_reference_refuses():
    with pytest.raises(ValueError, match="NaN or inf"):
        fp8_quant.quantize_weight(torch.tensor([[1.0, float("nan")]]), impl="native")
    with pytest.raises(ValueError, match="does not match"):
        fp8_quant.dequantize_weight(torch.zeros(130, 10, dtype=torch.float8_e4m3fn), torch.ones(1, 1), impl="native")


def test_actor_fused_on_vs_off(dist):
    """train.fused_logprob on vs off on the tiny Qwen3-MoE: the old-log-prob pass (padded and
    packed micro-batches), and one policy update's loss, grad norm and gradients, within 1e-6."""
    from test_actor import ALGO, actor_with, make_samples
    from test_hf_convert import FIELDS, random_hf_model

    from moerl.train.batching import split_micro_batches, split_packed_micro_batches
    from moerl.train.losses import policy_loss

    hf = random_hf_model()
    actors = {flag: actor_with(hf, lr=1e-3, fused_logprob=flag) for flag in (False, True)}
    assert actors[True].fused_logprob and not actors[False].fused_logprob
    samples = make_samples(FIELDS["vocab_size"])
    outs = {}
    for flag, actor in actors.items():
        # every row (response_only=False): the prompt rows are compared too
        padded = actor.compute_log_probs(split_micro_batches(samples, 4, pad_id=0), 0.7, response_only=False)
        packed = actor.compute_log_probs(split_packed_micro_batches(samples, [[0, 1, 2], [3, 4, 5]], 0), 0.7,
                                         response_only=False)
        old = [None] * len(samples)
        for mb, lp, _ in padded:
            for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
                old[i] = resp.tolist()
        mbs = split_micro_batches(samples, 3, 0, {"old_log_probs": old})
        n_tok = int(sum(mb.loss_mask.sum() for mb in mbs))
        metrics = actor.train_step(mbs, policy_loss(ALGO, global_num_tokens=n_tok, global_num_seqs=len(samples)), 0.7)
        grads = {n: p.main_grad.detach().clone() for n, p in actor.model.named_parameters()}  # this step's
        outs[flag] = (padded, packed, metrics, grads)
    (pad0, pack0, m0, sd0), (pad1, pack1, m1, sd1) = outs[False], outs[True]
    for a, b in zip(pad0 + pack0, pad1 + pack1):
        assert torch.allclose(a[1], b[1], rtol=0, atol=1e-6) and torch.allclose(a[2], b[2], rtol=0, atol=1e-6)
    assert abs(m1["loss"] - m0["loss"]) <= 1e-6  # ~0 at the first step (ratio 1): rounding noise only
    assert m0["grad_norm"] > 1e-3 and m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-6)
    # the gradients themselves (Adam's first step is lr * sign(g) and would amplify rounding noise)
    assert sd0.keys() == sd1.keys() and any("output_layer" in k for k in sd0)
    scale = max(float(g.abs().max()) for g in sd0.values())
    assert max(float((sd0[k] - sd1[k]).abs().max()) for k in sd0) <= 1e-6 * scale


@pytest.mark.slow  # two nvcc processes: about 6 s each on a quiet core, 15 s at load 40
def test_nvcc_compiles_every_cu_file(tmp_path):
    """Every csrc/cuda/*.cu compiles with nvcc -c (sm_90); skipped where nvcc is absent."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc not found (install the CUDA toolkit to compile csrc/cuda)")
    sources = sorted((CSRC / "cuda").glob("*.cu"))
    assert sources, "no .cu sources under csrc/cuda"
    procs = [subprocess.Popen([nvcc, "-c", "-O2", "-std=c++17", "-arch=sm_90", str(src), "-o",
                               str(tmp_path / (src.stem + ".o"))], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for src in sources]
    for src, p in zip(sources, procs):
        out = p.communicate(timeout=120)[0].decode()
        assert p.returncode == 0, f"nvcc failed on {src.name}:\n{out}"
        assert (tmp_path / (src.stem + ".o")).stat().st_size > 0


def test_fp8_weight_sync_uses_the_kernel_bitwise():
    """quantize_state_dict (FP8 weight sync / checkpoints) goes through moerl.kernels.fp8_quant: the
    same bytes and scales as the reference quantize_weight; unquantised tensors pass through."""
    from moerl.precision.fp8_checkpoint import quantize_state_dict

    g = torch.Generator().manual_seed(4)
    sd = {"model.layers.0.mlp.down_proj.weight": torch.randn(200, 300, generator=g).to(torch.bfloat16),
          "model.norm.weight": torch.randn(300, generator=g)}
    out = quantize_state_dict(sd)
    q, s = fp8_ref.quantize_weight(sd["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out["model.layers.0.mlp.down_proj.weight_scale_inv"], s)
    assert out["model.norm.weight"] is sd["model.norm.weight"]


def test_doctor_reports_each_op(capsys, monkeypatch):
    """``moerl doctor`` names the implementation of each op: native here (exit 0); the torch
    reference with the reason when MOERL_KERNELS=torch or when no compiler is found (exit 1)."""
    from moerl.cli import main
    from moerl.kernels import _build

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "fused_logprob [cpu]" in out and "fp8_quantize [cpu]" in out and out.count("native cpu") == 2
    monkeypatch.setenv("MOERL_KERNELS", "torch")
    assert main(["doctor"]) == 1
    assert capsys.readouterr().out.count("torch reference") == 2
    monkeypatch.setenv("MOERL_KERNELS", "auto")
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(_build, "_state", {})
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert main(["doctor"]) == 1
    assert "no C++ compiler (no-such-compiler / g++) on PATH" in capsys.readouterr().out
    with pytest.raises(_build.NativeBuildError, match="no C\\+\\+ compiler"):
        load_native("cpu", required=True)
    monkeypatch.setenv("MOERL_KERNELS", "fast")
    assert main(["doctor"]) == 2  # a bad value is a bad input, named
    assert "MOERL_KERNELS" in capsys.readouterr().err


def test_recipe_refuses_fused_logprob_with_dualpipe():
    from moerl.config.loader import ConfigError, load_config

    base = ["train.pipeline_schedule=dualpipev", "parallel.pp_size=2", "train.pack=false",
            "model.hf_config.num_hidden_layers=4"]
    assert load_config("configs/tiny_arith.yaml", base).train.fused_logprob is None  # auto: off there
    with pytest.raises(ConfigError, match="train.fused_logprob=true needs train.pipeline_schedule=1f1b"):
        load_config("configs/tiny_arith.yaml", base + ["train.fused_logprob=true"])


def _actor_tp_case(out_path: str) -> None:
    """torchrun worker (2 ranks, tp=2 with sequence parallelism, tied embeddings): the old-log-prob pass
    (padded and packed) and one update with train.fused_logprob on and off; rank 0 writes the results."""
    import json

    from test_actor import ALGO, make_samples
    from test_hf_convert import FIELDS, random_hf_model

    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.actor import MegatronActor
    from moerl.train.batching import split_micro_batches, split_packed_micro_batches
    from moerl.train.losses import policy_loss

    info = init_distributed(tp_size=2, seed=0, num_threads=1)
    try:
        hf = random_hf_model(seed=0, tie_word_embeddings=True)
        samples = make_samples(FIELDS["vocab_size"])
        res = {}
        for flag in (False, True):
            actor = MegatronActor(hf.config, lr=1e-3, fused_logprob=flag)
            actor.load_hf_state_dict(hf.state_dict())
            padded = actor.compute_log_probs(split_micro_batches(samples, 3, pad_id=0), 0.7, response_only=False)
            packed = actor.compute_log_probs(
                split_packed_micro_batches(samples, [[0, 1, 2], [3, 4, 5]], 0, pad_to_multiple_of=2), 0.7,
                response_only=False)
            old = [None] * len(samples)
            for mb, lp, _ in padded:
                for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
                    old[i] = [x + 0.1 * (j % 3 - 1) for j, x in enumerate(resp.tolist())]
            mbs = split_micro_batches(samples, 3, 0, {"old_log_probs": old})
            n_tok = int(sum(mb.loss_mask.sum() for mb in mbs))
            m = actor.train_step(mbs, policy_loss(ALGO, global_num_tokens=n_tok, global_num_seqs=len(samples)), 0.7)
            emb = actor.model.embedding.word_embeddings.weight.main_grad
            res[str(flag)] = dict(fused=actor.fused_logprob,
                                  lp=[x[1].tolist() for x in padded + packed], ent=[x[2].tolist() for x in padded + packed],
                                  loss=m["loss"], grad_norm=m["grad_norm"], emb_grad=emb.abs().sum().item(),
                                  emb_grad_max=emb.abs().max().item())
        if info.rank == 0:
            Path(out_path).write_text(json.dumps(res))
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_actor_fused_on_vs_off_tp2(tmp_path):
    """tp=2 with sequence parallelism and a tied embedding (vocab-parallel shards of the shared weight,
    the sequence all-gather / reduce-scatter kept by skip_output_layer): log-probs and entropies
    (padded and packed), loss and grad norm within 1e-6 with train.fused_logprob on vs off."""
    import json

    import _mp_helpers as h

    out = tmp_path / "tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(h.free_port()), str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, env=h.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = json.loads(out.read_text())
    off, on = res["False"], res["True"]
    assert on["fused"] and not off["fused"]
    for key in ("lp", "ent"):
        a = torch.tensor([x for mb in off[key] for row in mb for x in row])
        b = torch.tensor([x for mb in on[key] for row in mb for x in row])
        assert float((a - b).abs().max()) <= 1e-6, key
    assert abs(on["loss"] - off["loss"]) <= 1e-6 and off["loss"] != 0.0
    assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-6)
    assert on["emb_grad"] == pytest.approx(off["emb_grad"], rel=1e-5) and off["emb_grad_max"] > 0


if __name__ == "__main__":  # torchrun worker of test_actor_fused_on_vs_off_tp2
    _actor_tp_case(sys.argv[1])
    from moerl.cli import exit_without_teardown

    exit_without_teardown(0)  # results written: skip the module teardown (about 1 s of CPU per rank)
