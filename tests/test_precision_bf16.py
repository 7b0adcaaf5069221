"""BF16 mixed precision (issue 14): model.params_dtype=bfloat16 through Megatron-Core's mixed precision.

Checked against independent references: the dtypes the optimizer really holds, the grad norm against
an fp64 norm of the FP32 main grads, BF16 log-probs against a transformers FP32 forward within the
BF16 rounding bound, the FP32 main params carried over an optimizer rebuild (SFT -> RL) and through a
distributed checkpoint (a resumed step equals the uninterrupted one bit for bit), and the recipe rules.
The layout equivalence (TP=2, EP=2, PP=2 vs one BF16 process) is in tests/test_parallel_layouts.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_actor import _old_log_probs, _policy_step, actor_with, make_samples  # noqa: E402
from test_hf_convert import FIELDS, random_hf_model  # noqa: E402
from test_parallel_layouts import mixed_precision_facts  # noqa: E402

from moerl.train.actor import _fp32_main_params, params_torch_dtype  # noqa: E402

U_BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits, round to nearest)


def _model_and_main_params(optimizer) -> list:
    """(BF16 model param, its FP32 main param) pairs of Megatron's Float16OptimizerWithFloat16Params
    (every sub-optimizer of a ChainedOptimizer: dense and expert parameters)."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [(w, main) for o in subs for mg, fg in zip(o.float16_groups, o.fp32_from_float16_groups)
            for w, main in zip(mg, fg)]


def test_params_dtype_names_and_float16_refusal():
    assert params_torch_dtype("bfloat16") is torch.bfloat16 and params_torch_dtype("float32") is torch.float32
    assert params_torch_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match=r"model.params_dtype=float16 .*loss scaling.*bfloat16"):
        params_torch_dtype("float16")
    with pytest.raises(ValueError, match="model.params_dtype must be one of"):
        params_torch_dtype("int8")


def test_bf16_actor_keeps_fp32_main_params_grads_moments_and_norm(dist):
    hf = random_hf_model()
    # clip_grad large: no clipping, so the reported norm is the norm of the main grads left after the step
    actor = actor_with(hf, lr=1e-3, clip_grad=1e9, params_dtype="bfloat16")
    samples = make_samples(FIELDS["vocab_size"])
    old = _old_log_probs(actor, samples, 3)
    m = _policy_step(actor, samples, old, 3)
    facts = mixed_precision_facts(actor)
    assert facts["params"] == ["torch.bfloat16"]
    assert facts["main_grad"] == ["torch.float32"]  # DDP buffers, reduced in FP32 (grad_reduce_in_fp32)
    assert facts["stepped"] == facts["grads"] == facts["moments"] == ["torch.float32"]
    assert facts["n_main"] == sum(1 for _ in actor.model.parameters())
    # the grad norm is the FP32 main grads' norm (fp64 reference); grads rounded to bf16 would be
    # off by ~u / sqrt(n) relative, well above 1e-6
    assert m["grad_norm"] > 0
    assert m["grad_norm"] == pytest.approx(facts["grad_sq"] ** 0.5, rel=1e-6)
    # the step moved the FP32 main params by less than a bf16 ulp in places: they are not bf16 values
    mains = _fp32_main_params(actor.optimizer)
    assert any(not torch.equal(p, p.bfloat16().float()) for p in mains)
    # and the model params are their BF16 rounding (Megatron copies main -> model after the step)
    pairs = _model_and_main_params(actor.optimizer)
    assert len(pairs) == facts["n_main"] and all(torch.equal(w, main.bfloat16()) for w, main in pairs)


def test_bf16_log_probs_match_fp32_transformers_within_bf16_rounding(dist):
    """Bound: a relative perturbation u of the logits z moves log p_y = z_y - logsumexp(z) by at most
    2 u max|z| (|dz_y| + sum_j p_j |dz_j|); the BF16 forward perturbs every layer by O(u), which we
    bound by K = 4 layers' worth: tol = 2 * 4 * u * max|z| (fp32 logits of the transformers model)."""
    hf = random_hf_model()
    actor = actor_with(hf, trainable=False, params_dtype="bfloat16")
    samples = make_samples(FIELDS["vocab_size"])
    worst, zmax = 0.0, 0.0
    for mb, lp, _ in actor.compute_log_probs(__import__("moerl.train.batching", fromlist=["x"]).split_micro_batches(
            samples, 3, 0), 1.0):
        assert lp.dtype == torch.float32  # Float16Module hands fp32 logits to the loss
        for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
            s = samples[i]
            with torch.no_grad():
                logits = hf(torch.tensor([s.tokens])).logits[0].double()
            zmax = max(zmax, float(logits.abs().max()))
            ref = torch.log_softmax(logits, -1)
            start = len(s.prompt_ids) - 1
            want = torch.stack([ref[start + t, tok] for t, tok in enumerate(s.response_ids)])
            worst = max(worst, float((resp.double() - want).abs().max()))
    tol = 2 * 4 * U_BF16 * zmax
    assert worst <= tol, (worst, tol)
    assert worst > 1e-4  # the forward really ran in bf16 (fp32 agrees to ~1e-6): the check can fail


def test_set_lr_keeps_the_fp32_main_params(dist):
    """SFT -> RL rebuilds the optimizer: the new one continues from the FP32 main params, not from the
    BF16-rounded model weights."""
    hf = random_hf_model()
    actor = actor_with(hf, lr=1e-3, params_dtype="bfloat16")
    samples = make_samples(FIELDS["vocab_size"])
    _policy_step(actor, samples, _old_log_probs(actor, samples, 3), 3)
    before = [p.clone() for p in _fp32_main_params(actor.optimizer)]
    assert any(not torch.equal(p, p.bfloat16().float()) for p in before)
    actor.set_lr(5e-4)
    after = _fp32_main_params(actor.optimizer)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("distopt", [False, True])
def test_bf16_checkpoint_keeps_fp32_main_params_and_resumes_bit_identically(dist, tmp_path, distopt):
    from moerl.checkpoint.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint

    hf = random_hf_model()
    samples = make_samples(FIELDS["vocab_size"])
    kw = dict(lr=1e-3, params_dtype="bfloat16", use_distributed_optimizer=distopt)
    a = actor_with(hf, **kw)
    old = _old_log_probs(a, samples, 3)
    for _ in range(2):
        _policy_step(a, samples, old, 3)
    save_dist_checkpoint(a.model, a.optimizer, tmp_path / "ckpt")
    saved_main = [p.clone() for p in _fp32_main_params(a.optimizer)]
    m_a = _policy_step(a, samples, old, 3)

    b = actor_with(random_hf_model(seed=7), **kw)  # other weights: everything must come from the checkpoint
    b.set_lr(1e-3)  # as moerl.checkpoint.run_state.load_checkpoint: rebuild the optimizer, then load
    load_dist_checkpoint(b.model, b.optimizer, tmp_path / "ckpt")
    main_b = _fp32_main_params(b.optimizer)
    # the checkpoint held the FP32 main params (not only the BF16 weights, which would round them)
    assert all(torch.equal(x, y) for x, y in zip(main_b, saved_main))
    assert any(not torch.equal(p, p.bfloat16().float()) for p in main_b)
    m_b = _policy_step(b, samples, old, 3)
    assert m_b["loss"] == m_a["loss"] and m_b["grad_norm"] == m_a["grad_norm"]
    for x, y in zip(_fp32_main_params(b.optimizer), _fp32_main_params(a.optimizer)):
        assert torch.equal(x, y)
    sd_a, sd_b = a.export_hf_state_dict(), b.export_hf_state_dict()
    assert all(sd_b[k].dtype == torch.bfloat16 and torch.equal(sd_b[k], sd_a[k]) for k in sd_a)


def test_step0_logprob_tolerance_follows_the_dtypes():
    from moerl.config import load_config
    from moerl.observe.report import STEP0_LOGPROB_TOL_BF16, step0_check, step0_logprob_tolerance

    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_arith.yaml")
    assert step0_logprob_tolerance(load_config(recipe, [])) == 1e-5
    for over in (["model.params_dtype=bfloat16"], ["rollout.dtype=bfloat16"],
                 ["model.params_dtype=bfloat16", "rollout.dtype=bfloat16"]):
        assert step0_logprob_tolerance(load_config(recipe, over)) == STEP0_LOGPROB_TOL_BF16 == 2.0 ** -5
    # the demo's bf16 figure (mean 1.2e-2) passes the bf16 tolerance and fails the fp32 one
    m = {"logprob_abs_diff_mean": 1.21e-2, "logprob_abs_diff_max": 1.08, "train/logratio_abs_sum": 0.0}
    assert step0_check(m, STEP0_LOGPROB_TOL_BF16)["logprob_pass"] and not step0_check(m)["logprob_pass"]


def test_params_dtype_change_at_resume_loads_weights_not_optimizer(dist, tmp_path):
    """A checkpoint of another model.params_dtype: its layout differs (run_state.layout), so resume loads
    the weights only (cast: bf16 = the fp32 weights' rounding) with fresh Adam, and the FP32 main params
    follow the loaded weights (else the first step would put the fresh model's weights back). Loading its
    optimizer state would fail: Megatron's bf16 optimizer holds other tensors."""
    import json
    from types import SimpleNamespace

    from moerl.checkpoint.dist_ckpt import load_dist_checkpoint
    from moerl.checkpoint.run_state import (COMPLETE_MARKER, TrainState, layout, load_checkpoint, save_checkpoint,
                                            saved_layout)
    from moerl.config import load_config

    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_arith.yaml")
    cfg32, cfg16 = (load_config(recipe, [f"model.params_dtype={d}"]) for d in ("float32", "bfloat16"))
    f32, b16 = layout(cfg32), layout(cfg16)
    assert f32 != b16 and {k: v for k, v in f32.items() if k != "params_dtype"} == \
        {k: v for k, v in b16.items() if k != "params_dtype"}
    old = {k: v for k, v in f32.items() if k != "params_dtype"}  # a marker written before the key existed
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / COMPLETE_MARKER).write_text(json.dumps({"layout": old}))
    assert saved_layout(tmp_path / "old") == f32

    a = actor_with(random_hf_model(), lr=1e-3)
    path = save_checkpoint(SimpleNamespace(cfg=cfg32, run_dir=tmp_path / "run"), a, TrainState(phase="rl", rl_step=1),
                           {})
    b = actor_with(random_hf_model(seed=3), lr=1e-3, params_dtype="bfloat16")
    state = load_checkpoint(SimpleNamespace(cfg=cfg16, run_dir=tmp_path / "run"), b, path)
    assert state.rl_step == 1
    sa, sb = a.export_hf_state_dict(), b.export_hf_state_dict()
    assert all(torch.equal(sb[k], sa[k].bfloat16()) for k in sa)
    pairs = _model_and_main_params(b.optimizer)
    assert len(pairs) == sum(1 for _ in b.model.parameters())
    assert all(torch.equal(main, w.float()) for w, main in pairs)
    with pytest.raises(BaseException):  # torch's CheckpointException is a BaseException
        c = actor_with(random_hf_model(seed=3), lr=1e-3, params_dtype="bfloat16")
        load_dist_checkpoint(c.model, c.optimizer, path)
