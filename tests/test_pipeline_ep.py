"""Expert (and tensor) parallelism inside the stages of DualPipe / DualPipeV (moerl.pipeline.megatron_stages,
MegatronActor(pipeline_schedule=...)) on 4 gloo processes, against one process holding the whole model.

Layouts: pp=2 x ep=2 (Megatron puts the two EP ranks in the dense DP dimension: dp=2, expert-dp=1, so each
EP rank runs its own copy of the schedule on its own 8 micro-batches, and the MoE all-to-all of a stage
runs among the EP ranks of one pp rank) and pp=2 x tp=2 (sequence parallel; dp=1).

Reference: a MegatronActor at world size 1 (no pipelining, tp = ep = 1, the whole model), same HF weights,
ALL micro-batches of all DP ranks in one train_step, the same GSPO loss with the same global denominators
(float32).  Compared: per-micro-batch log-probs and entropies (compute_log_probs), the step's loss metrics
(summed over micro-batches and DP ranks), grad_norm, aux_loss, and every parameter's gradient after the
DP / expert-DP / TP reductions, gathered to full HF names (export_hf_from_stages(tensors="grads")).

Tolerance (why not bitwise): EP sends a micro-batch's tokens through the all-to-all and the local experts
see them in another order/grouping than one process does (different GEMM shapes); TP splits the hidden
and vocabulary sums; DP sums gradients of two halves of the batch in another order.  Each of these
changes float32 sums only by rounding, so values agree to a few float32 ulps of the operands: log-probs
(magnitude ~5) and entropies to rtol 1e-5 / atol 1e-6 (measured: max abs diff 2.4e-6), step metrics to
rel 1e-5 (measured 1.9e-7); gradients by the relative squared error ``|x - y|^2 / (|x|^2 + |y|^2) < 1e-10``
(i.e. |x - y| / |x| < ~1e-5) per HF tensor (measured 1.5e-13 with EP, 1.4e-12 with TP).
A real bug (a missing expert, a gradient not reduced, a wrong shard or scaling) makes them differ by
O(1), and most gradients are checked non-zero.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from _mp_helpers import TINY_FIELDS, free_port_block, gspo_micro_batches, to_float64  # noqa: E402

SEQ, BATCH, M, LAYERS = 10, 2, 8, 4  # DualPipeV at pp 2: 4 stages of 1 layer; 8 micro-batches per DP rank
AUX = 1e-2
ALGO = types.SimpleNamespace(policy_loss="gspo", eps_clip_low=0.2, eps_clip_high=0.28,
                             loss_agg_mode="seq-mean-token-mean", kl_coef=0.0, kl_estimator="k3")


def hf_config():
    from moerl.models.qwen3_moe import make_hf_config

    return make_hf_config(dict(TINY_FIELDS, num_hidden_layers=LAYERS, tie_word_embeddings=False))


def micro_batches(n: int, vocab: int):
    """n padded GSPO micro-batches [BATCH, SEQ] (prompt of 4 tokens, responses of 3-5 tokens then padding, so
    the MoE routers' padding mask and its sequence-parallel slices matter; random old log-probs and
    advantages)."""
    return gspo_micro_batches(n, vocab, batch=BATCH, seq=SEQ, unique_ids=True, ragged=True)


def loss_fn(total_mbs: int):
    from moerl.train.losses import policy_loss

    return policy_loss(ALGO, global_num_tokens=total_mbs * BATCH * (SEQ - 4), global_num_seqs=total_mbs * BATCH)


ACTOR_KW = dict(lr=1e-4, clip_grad=1e9, moe_aux_loss_coeff=AUX)  # no clipping: main_grad stays the raw gradient


def _worker(rank, world, port, name, tp, ep, path, out_dir, overlap=False):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron.core import parallel_state as ps

    from moerl.pipeline.megatron_stages import export_hf_from_stages, model_copy_group
    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.actor import MegatronActor

    init_distributed(tp_size=tp, pp_size=world // (tp * ep), ep_size=ep, seed=0, num_threads=1)
    try:
        cfg = hf_config()
        dry = contextlib.nullcontext()
        if overlap:  # CPU dry run of train.pipeline_overlap: Megatron's plans with CUDA calls as no-ops
            import functools
            from unittest import mock

            from moerl.pipeline import megatron_stages, overlap as ov

            stack = contextlib.ExitStack()
            stack.enter_context(mock.patch.object(ov, "check_overlap_supported", functools.partial(
                ov.check_overlap_supported, require_cuda=False)))
            stack.enter_context(mock.patch.object(megatron_stages, "make_forward_backward_func", functools.partial(
                megatron_stages.make_forward_backward_func, overlap_require_cuda=False)))
            dry = stack
        with dry:
            actor = MegatronActor(cfg, pipeline_schedule=name, pipeline_overlap=overlap, **ACTOR_KW)
        hf_sd = torch.load(path)
        actor.load_hf_state_dict(hf_sd)
        exported = actor.export_hf_state_dict()
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mbs = micro_batches(M * dp, cfg.vocab_size)[dp_rank * M:(dp_rank + 1) * M]
        lp = actor.compute_log_probs(mbs, 1.0)
        if overlap:
            from moerl.pipeline.overlap import cpu_dry_run

            with cpu_dry_run():
                metrics = actor.train_step(mbs, loss_fn(M * dp), 1.0)
        else:
            metrics = actor.train_step(mbs, loss_fn(M * dp), 1.0)
        grads = export_hf_from_stages(actor._stages, cfg, tensors="grads", group=model_copy_group())
        torch.save({"dp_rank": dp_rank, "dp": dp, "log_probs": [(x[1], x[2]) for x in lp], "metrics": metrics,
                    "grads": grads, "export_ok": exported.keys() == hf_sd.keys()
                    and all(torch.equal(exported[k], hf_sd[k]) for k in hf_sd)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_distributed()


def rel_sq_err(x, y) -> float:
    """|x - y|^2 / (|x|^2 + |y|^2) in float64 (0 for two zero tensors)."""
    x, y = x.double(), y.double()
    den = (x * x + y * y).sum()
    return 0.0 if den == 0 else float(((x - y) ** 2).sum() / den)


def run_case(name: str, tp: int, ep: int, tmp_path, world: int = 4, overlap: bool = False):
    from moerl.checkpoint.hf_convert import megatron_to_hf
    from moerl.models.qwen3_moe import build_gpt_model
    from moerl.train.actor import MegatronActor

    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    cfg = hf_config()
    torch.manual_seed(11)
    init = build_gpt_model(cfg, init_method_std=0.2)  # large enough weights for uneven routing
    hf_sd = {k: v.clone() for k, v in megatron_to_hf(init.state_dict(), cfg).items()}
    torch.save(hf_sd, tmp_path / "hf.pt")
    mp.start_processes(_worker, args=(world, free_port_block(1), name, tp, ep, str(tmp_path / "hf.pt"), str(tmp_path),
                                      overlap),
                       nprocs=world, join=True, start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    dp = got[0]["dp"]
    assert dp == world // (2 * tp), dp  # pp 2

    # reference: the whole model in this process, every DP rank's micro-batches in one step, one thread
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = MegatronActor(cfg, **ACTOR_KW)
        ref.load_hf_state_dict(hf_sd)
        mbs = micro_batches(M * dp, cfg.vocab_size)
        ref_lp = ref.compute_log_probs(mbs, 1.0)
        ref_metrics = ref.train_step(mbs, loss_fn(M * dp), 1.0)
    finally:
        torch.set_num_threads(threads)
    params = dict(ref.model.named_parameters())
    ref_grads = megatron_to_hf({k: (params[k].main_grad if k in params else v) for k, v in ref.model.state_dict().items()},
                               cfg)

    for d in got:
        assert d["export_ok"]
        for i, (lp, ent) in enumerate(d["log_probs"]):
            _, rlp, rent = ref_lp[d["dp_rank"] * M + i]
            torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-6)
        m = d["metrics"]
        assert set(ref_metrics) <= set(m), sorted(set(ref_metrics) - set(m))
        for k, v in ref_metrics.items():
            assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, m[k], v)
        assert ref_metrics["aux_loss"] > 0 and ref_metrics["grad_norm"] > 0
        grads = d["grads"]
        assert grads.keys() == ref_grads.keys()
        nonzero = 0
        for k in ref_grads:
            assert rel_sq_err(grads[k], ref_grads[k]) < 1e-10, (k, rel_sq_err(grads[k], ref_grads[k]))
            nonzero += bool(ref_grads[k].abs().sum() > 0)
        assert nonzero > len(ref_grads) * 3 // 4


def test_pp2_ep2_dualpipev_matches_single_process(dist, tmp_path):  # ~13 s
    run_case("dualpipev", tp=1, ep=2, tmp_path=tmp_path)


@pytest.mark.slow
def test_pp2_ep2_dualpipe_matches_single_process(dist, tmp_path):  # mirrored copies: grad sum per ep rank
    run_case("dualpipe", tp=1, ep=2, tmp_path=tmp_path)


@pytest.mark.slow
def test_pp2_ep2_dualpipev_with_pipeline_overlap_matches_single_process(dist, tmp_path):
    """MegatronActor(pipeline_overlap=True): every F / B / FB through Megatron's schedule plans
    (moerl.pipeline.overlap), run on CPU inside cpu_dry_run (CUDA calls as no-ops, nothing overlaps)."""
    run_case("dualpipev", tp=1, ep=2, tmp_path=tmp_path, overlap=True)


@pytest.mark.slow
# dualpipe is slow_extra (not in CI): DualPipe with TP 2 in the stages repeats the dualpipev case's TP paths;
# DualPipe's schedule is in CI in test_pp2_ep2_dualpipe_matches_single_process
@pytest.mark.parametrize("name", ["dualpipev", pytest.param("dualpipe", marks=pytest.mark.slow_extra)])
def test_pp2_tp2_matches_single_process(name, dist, tmp_path):
    run_case(name, tp=2, ep=1, tmp_path=tmp_path)


# ---------------------------------------------------------------------------------------------------------
# split_backward="store" with EP / TP+SP inside the stages: B/W split (weight GEMMs of the column/row-parallel
# linears and the experts queued in B, run in W; sequence-parallel all-gather of the input redone in W) against
# the unsplit backward of the same layout (gpipe_on_layout: full backwards, Megatron's own linear function), in
# float64, every split schedule; per local parameter 1 - 2 sum(xy) / sum(x^2 + y^2) < 1e-12.


def _split_worker(rank, world, port, tp, ep, path, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from megatron.core import parallel_state as ps

    from moerl.pipeline.interpreter import PipelineInterpreter, sync_mirrored_grads
    from moerl.pipeline.megatron_stages import (PolicyCriterion, build_chunk_modules, load_hf_into_stages,
                                                megatron_stage_fn)
    from moerl.pipeline.schedules import build_schedule, gpipe_on_layout
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    init_distributed(tp_size=tp, pp_size=2, ep_size=ep, seed=0, num_threads=1)
    try:
        cfg, hf_sd = hf_config(), torch.load(path)
        group, pp_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mbs = to_float64(micro_batches(M * dp, cfg.vocab_size)[dp_rank * M:(dp_rank + 1) * M])
        out = {}
        for name in ("zb1p", "dualpipe", "dualpipev"):
            grads, gemms = {}, []
            for split in ("store", "unsplit"):
                sched = build_schedule(name, 2, M) if split == "store" else gpipe_on_layout(name, 2, M)
                chunks = build_chunk_modules(sched, pp_rank, cfg)
                load_hf_into_stages(chunks, hf_sd, cfg)
                for st in chunks.values():
                    st.double()
                interp = PipelineInterpreter(sched, chunks, PolicyCriterion(loss_fn(M * dp)), group=group,
                                             stage_fn=megatron_stage_fn(mbs))
                if interp.wgrad_store is not None:
                    run = interp.wgrad_store.run
                    interp.wgrad_store.run = lambda key, chunk=None, run=run: gemms.append(run(key, chunk)) or gemms[-1]
                interp.run(mbs, mbs)
                sync_mirrored_grads(sched, chunks, group=group)
                grads[split] = {(c, n): p.grad.clone() for c, mod in chunks.items() for n, p in mod.named_parameters()}
            out[name] = {"gemms": sum(gemms), "grads": grads}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_distributed()


@pytest.mark.slow
# (1, 2) is slow_extra (not in CI): the W split's store with EP 2 repeats (2, 1)'s with TP 2 (the same
# PipelineInterpreter paths; the EP all-to-all's backward is in test_pp2_ep2_* in CI)
@pytest.mark.parametrize("tp,ep", [pytest.param(1, 2, marks=pytest.mark.slow_extra), (2, 1)])
def test_store_split_equals_unsplit_backward_fp64(tp, ep, dist, tmp_path):
    from moerl.checkpoint.hf_convert import megatron_to_hf
    from moerl.models.qwen3_moe import build_gpt_model

    cfg = hf_config()
    torch.manual_seed(11)
    init = build_gpt_model(cfg, init_method_std=0.2)
    torch.save({k: v.clone() for k, v in megatron_to_hf(init.state_dict(), cfg).items()}, tmp_path / "hf.pt")
    mp.start_processes(_split_worker, args=(4, free_port_block(1), tp, ep, str(tmp_path / "hf.pt"), str(tmp_path)),
                       nprocs=4, join=True, start_method="spawn")
    for r in range(4):
        for name, d in torch.load(tmp_path / f"rank{r}.pt").items():
            assert d["gemms"] > 0, (r, name)  # W ran deferred GEMMs
            store, unsplit = d["grads"]["store"], d["grads"]["unsplit"]
            assert store.keys() == unsplit.keys()
            nonzero = 0
            for k, g in unsplit.items():
                assert g is not None and store[k] is not None and store[k].dtype == torch.float64, (r, name, k)
                den = (g * g + store[k] * store[k]).sum()
                err = 0.0 if den == 0 else float(1 - 2 * (g * store[k]).sum() / den)
                assert err < 1e-12, (r, name, k, err)
                nonzero += bool(den > 0)
            assert nonzero > len(unsplit) // 2, (r, name)


def test_reentrant_vocab_parallel_log_probs_backward_twice(dist):
    """At tp 1 the re-entrant form equals log_softmax(logits / T)[label] (torch reference), and its
    backward can run twice over one retained graph (what the interpreter's split B / W backward does)
    with the same gradient both times; labels of the wrong shape are rejected."""
    from moerl.pipeline.megatron_stages import vocab_parallel_log_probs_reentrant

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, 11, (2, 5), generator=g)
    out = vocab_parallel_log_probs_reentrant(logits, labels, 0.7)
    ref = torch.log_softmax(logits.detach() / 0.7, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out.detach(), ref, rtol=1e-6, atol=1e-6)
    w = torch.randn(2, 5, generator=g)
    (g1,) = torch.autograd.grad(out, logits, w, retain_graph=True)
    (g2,) = torch.autograd.grad(out, logits, w)
    x = logits.detach().clone().requires_grad_()
    (gref,) = torch.autograd.grad(torch.log_softmax(x / 0.7, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1), x, w)
    assert torch.equal(g1, g2)
    torch.testing.assert_close(g1, gref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="labels"):
        vocab_parallel_log_probs_reentrant(logits, labels[:, :4], 1.0)
