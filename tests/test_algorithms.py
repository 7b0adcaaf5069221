"""Tests for moerl.algorithms: advantages, KL estimators, policy losses, aggregation, log-probs.

References are independent: hand-worked numbers, Python's statistics module, float64 direct
implementations of the papers' formulas, and torch.autograd on float64 log_softmax.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from moerl.algorithms import (
    POLICY_LOSSES,
    aggregate_loss,
    cispo_token_loss,
    compute_policy_loss,
    count_loss_tokens_and_seqs,
    entropy_from_logits,
    group_has_signal,
    grpo_advantages,
    gspo_token_loss,
    kl_penalty,
    masked_mean,
    ppo_dual_clip_token_loss,
    ppo_token_loss,
    token_log_probs_from_logits,
)

F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# advantages
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_identical_rewards_give_exact_zero(normalize_std, dtype):
    rewards = torch.tensor([0.1] * 8 + [0.7] * 8 + [1.0, 0.0] * 4, dtype=dtype)
    adv = grpo_advantages(rewards, 8, normalize_std=normalize_std)
    assert adv.dtype == dtype
    assert torch.equal(adv[:16], torch.zeros(16, dtype=dtype))  # exactly 0.0, not 1e-9
    assert (adv[16:] != 0).all()


@pytest.mark.parametrize("group_size", [3, 7])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_identical_rewards_exact_zero_where_float64_mean_is_off_by_an_ulp(group_size, normalize_std):
    # the float64 mean of 3 or 7 copies of 0.1 / 0.7 differs from the value by ~1e-17
    rewards = torch.tensor([0.1] * group_size + [0.7] * group_size, dtype=F64)
    assert (rewards[:group_size] - rewards[:group_size].mean()).abs().max() > 0
    adv = grpo_advantages(rewards, group_size, normalize_std=normalize_std)
    assert torch.equal(adv, torch.zeros_like(adv))


def test_identical_rewards_zero_even_with_eps_zero():
    adv = grpo_advantages(torch.tensor([0.3] * 4), 4, eps=0.0)
    assert torch.equal(adv, torch.zeros(4)) and not torch.isnan(adv).any()


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_size_one_is_zero_not_nan(normalize_std):
    adv = grpo_advantages(torch.tensor([0.5, 1.0, -2.0]), 1, normalize_std=normalize_std)
    assert torch.equal(adv, torch.zeros(3))


def test_hand_worked_grpo_and_dr_grpo():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25; centred [0.75, -0.25 x3]; unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25 -> std 0.5
    adv = grpo_advantages(r, 4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), rtol=0, atol=1e-7)
    dr = grpo_advantages(r, 4, normalize_std=False)
    torch.testing.assert_close(dr, torch.tensor([0.75, -0.25, -0.25, -0.25]), rtol=0, atol=1e-7)


def test_near_constant_group_uses_centred_values():
    vals = [0.0] + [0.95] * 7
    rewards = torch.tensor(vals, dtype=torch.float32)
    adv = grpo_advantages(rewards, 8)
    # independent float64 reference (Python statistics, Bessel-corrected)
    vals64 = [float(v) for v in rewards.tolist()]  # the fp32-rounded values, in double
    mean, std = statistics.fmean(vals64), statistics.stdev(vals64)
    ref = torch.tensor([(v - mean) / (std + 1e-6) for v in vals64], dtype=F64)
    torch.testing.assert_close(adv.to(F64), ref, rtol=1e-6, atol=1e-6)
    # hand-worked: centred[0] = -7/8 c, unbiased std = c * sqrt(1/8) (c = 0.95) -> A_0 = -7 / sqrt(8)
    assert abs(adv[0].item() - (-7 / math.sqrt(8))) < 1e-5
    assert abs(adv.sum().item()) < 1e-5


def test_random_groups_against_statistics_module():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 5, generator=g) * 3 - 1
    adv = grpo_advantages(rewards, 5)
    ref = []
    for k in range(6):
        grp = [float(x) for x in rewards[5 * k : 5 * k + 5].tolist()]
        m, s = statistics.fmean(grp), statistics.stdev(grp)
        ref += [(x - m) / (s + 1e-6) for x in grp]
    torch.testing.assert_close(adv.to(F64), torch.tensor(ref, dtype=F64), rtol=1e-6, atol=1e-6)


def test_group_has_signal():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.2, 0.2])
    assert group_has_signal(r, 2).tolist() == [False, True, True, False]
    assert group_has_signal(r, 4).tolist() == [True, True]
    assert group_has_signal(r, 1).tolist() == [False] * 8


def test_advantage_input_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        grpo_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="NaN or inf"):
        grpo_advantages(torch.tensor([0.0, float("nan")]), 2)
    with pytest.raises(TypeError, match="group_size"):
        grpo_advantages(torch.zeros(4), 2.0)


# ----------------------------------------------------------------------------------------------
# KL
# ----------------------------------------------------------------------------------------------


def test_kl_hand_values():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-2.0, -1.0, -0.5])  # delta = 1, -1, 0
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5, 0.5, 0.0]))
    k3 = torch.tensor([math.exp(-1.0) - 1 + 1, math.exp(1.0) - 1 - 1, 0.0])
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), k3)


def test_k3_nonnegative_and_clamped():
    g = torch.Generator().manual_seed(1)
    d = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-8, 1e-4, 1e-2, 1.0, 5.0)])
    d = torch.cat([d, torch.logspace(-12, 2, 500), -torch.logspace(-12, 2, 500)])
    k3 = kl_penalty(d, torch.zeros_like(d), "k3")
    assert (k3 >= 0).all()
    assert (k3 <= 10).all()
    # clamped ends: delta = -5 -> e^5 - 6 = 142 -> 10; delta = 15 -> 14 -> 10; delta = 2 unclamped
    v = kl_penalty(torch.tensor([-5.0, 15.0, 2.0]), torch.zeros(3), "k3")
    torch.testing.assert_close(v, torch.tensor([10.0, 10.0, math.exp(-2.0) + 1.0]))


def test_k3_gradient_finite_when_extreme():
    lp = torch.tensor([-200.0, 0.3, 100.0], requires_grad=True)
    kl_penalty(lp, torch.zeros(3), "k3").sum().backward()
    assert torch.isfinite(lp.grad).all()
    # unclamped token: d/dd (e^-d - 1 + d) = 1 - e^-d
    assert lp.grad[0] == 0 and lp.grad[2] == 0
    assert abs(lp.grad[1].item() - (1 - math.exp(-0.3))) < 1e-6


def test_kl_errors():
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "k1")


# ----------------------------------------------------------------------------------------------
# PPO / GSPO token losses
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage(policy_loss):
    g = torch.Generator().manual_seed(2)
    lp = torch.randn(3, 4, generator=g, dtype=F64)
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    if policy_loss == "ppo":
        loss_t, clipped = ppo_token_loss(lp, lp.clone(), adv, 0.2, 0.28)
    else:
        loss_t, clipped, s = gspo_token_loss(lp, lp.clone(), adv, mask, 3e-4, 4e-4)
        assert torch.equal(s, torch.ones(3, dtype=F64))
    assert torch.equal(loss_t, -adv[:, None].expand(3, 4))
    assert not clipped.any()
    tm = aggregate_loss(loss_t, mask, "token-mean")
    assert abs(tm.item() - (-(4 * 0.5 + 2 * -1.0 + 1 * 2.0) / 7)) < 1e-12
    sm = aggregate_loss(loss_t, mask, "seq-mean-token-mean")
    assert abs(sm.item() - (-(0.5 - 1.0 + 2.0) / 3)) < 1e-12


def test_ppo_hand_worked_values_and_gradients():
    # ratios 1.5, 1.5, 0.5, 0.5, 1.1 ; advantages +1, -1, +1, -1, +2 ; eps_low 0.2, eps_high 0.28
    ratios = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.1]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0]], dtype=F64)
    old = torch.full_like(ratios, -1.3)
    lp = (old + ratios.log()).requires_grad_(True)
    loss, clipped = ppo_token_loss(lp, old, adv, 0.2, 0.28)
    expected = torch.tensor([[-1.28, 1.5, -0.5, 0.8, -2.2]], dtype=F64)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=1e-12)
    assert clipped.tolist() == [[True, False, False, True, False]]
    loss.sum().backward()
    # d/dlogp of -rho*A is -rho*A; clipped tokens have zero gradient
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 1.5, -0.5, 0.0, -2.2]], dtype=F64), rtol=0, atol=1e-12)


def test_ppo_per_sequence_advantage_broadcasts():
    g = torch.Generator().manual_seed(3)
    lp, old = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    adv = torch.tensor([1.0, -0.5])
    a, ca = ppo_token_loss(lp, old, adv, 0.2, 0.2)
    b, cb = ppo_token_loss(lp, old, adv[:, None].expand(2, 3), 0.2, 0.2)
    assert torch.equal(a, b) and torch.equal(ca, cb)
    with pytest.raises(ValueError, match="advantages"):
        ppo_token_loss(lp, old, torch.zeros(3), 0.2, 0.2)


def _gspo_reference(lp, old, adv, mask, el, eh):
    """Paper's sequence-level objective (arXiv 2507.18071 eq. 5-7) as a loss: -J, float64."""
    terms = []
    for i in range(lp.shape[0]):
        m = mask[i].bool()
        s = torch.exp((lp[i][m] - old[i][m]).sum() / m.sum())
        terms.append(torch.minimum(s * adv[i], torch.clamp(s, 1 - el, 1 + eh) * adv[i]))
    return -torch.stack(terms).mean()


def test_gspo_value_and_gradient_match_sequence_level_formula():
    g = torch.Generator().manual_seed(4)
    B, T = 8, 7
    lengths = torch.tensor([1, 3, 7, 5, 2, 6, 4, 7])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.int64)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    lp0 = old + torch.randn(B, T, generator=g, dtype=F64) * 0.08
    adv = torch.randn(B, generator=g, dtype=F64)
    el, eh = 0.03, 0.04

    lp = lp0.clone().requires_grad_(True)
    per_tok, clipped, s = gspo_token_loss(lp, old, adv, mask, el, eh)
    loss = aggregate_loss(per_tok, mask, "seq-mean-token-mean", global_num_seqs=B)
    loss.backward()

    lp_ref = lp0.clone().requires_grad_(True)
    ref = _gspo_reference(lp_ref, old, adv, mask, el, eh)
    ref.backward()

    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-10, atol=1e-14)
    # the batch exercises both regimes
    seq_clipped = clipped.any(dim=1)
    assert 0 < int(seq_clipped.sum()) < B
    # clip mask is constant along each row's loss tokens and 0-gradient rows are exactly the clipped ones
    assert ((lp.grad.abs().sum(dim=1) == 0) == seq_clipped).all()
    torch.testing.assert_close(
        s, torch.stack([torch.exp((lp0[i, : lengths[i]] - old[i, : lengths[i]]).mean()) for i in range(B)])
    )


@pytest.mark.parametrize(
    "seq_ratio,adv,killed",
    [
        (1.01, 1.0, True),  # A > 0, s > 1 + eps_high -> clipped, no gradient
        (1.01, -1.0, False),  # A < 0, s > 1 + eps_high -> gradient kept
        (0.99, -1.0, True),  # A < 0, s < 1 - eps_low -> clipped
        (0.99, 1.0, False),  # A > 0, s < 1 - eps_low -> kept
        (1.0002, 1.0, False),  # inside the clip range -> kept
    ],
)
def test_gspo_clipping_side(seq_ratio, adv, killed):
    T = 4
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], dtype=F64)
    # token log-ratios that average to log(seq_ratio) but differ per token
    offs = torch.tensor([[0.3, -0.1, -0.4, 0.2]], dtype=F64)
    lp = (old + math.log(seq_ratio) + offs).requires_grad_(True)
    mask = torch.ones(1, T)
    per_tok, clipped, s = gspo_token_loss(lp, old, torch.tensor([adv], dtype=F64), mask, 3e-4, 4e-4)
    assert abs(s.item() - seq_ratio) < 1e-12
    aggregate_loss(per_tok, mask, "seq-mean-token-mean").backward()
    if killed:
        assert clipped.all() and torch.equal(lp.grad, torch.zeros_like(lp.grad))
    else:
        assert not clipped.any()
        # d(-s*A)/dlogp_t = -A * s / |y|
        torch.testing.assert_close(lp.grad, torch.full_like(lp.grad, -adv * seq_ratio / T), rtol=1e-12, atol=0)


def test_gspo_ignores_padding_even_if_nan():
    lp = torch.tensor([[-1.0, -0.5, float("nan")]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    per_tok, _, s = gspo_token_loss(lp, old, torch.tensor([1.0], dtype=F64), mask, 0.2, 0.2)
    assert abs(s.item() - 1.0) < 1e-12  # mean of (+0.1, -0.1)
    loss = aggregate_loss(per_tok, mask, "token-mean")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and lp.grad[0, 2] == 0


# ----------------------------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------------------------


def test_aggregate_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("inf")], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10.0 / 4)
    assert aggregate_loss(loss, mask, "token-mean", global_num_tokens=10).item() == pytest.approx(1.0)
    # own seq count: rows with a loss token = 2 ; (2 + 4) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean", global_num_seqs=6).item() == pytest.approx(1.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    v = aggregate_loss(loss, mask, "seq-mean-token-sum", global_num_seqs=4, seq_token_sum_constant=5)
    assert v.item() == pytest.approx(10.0 / 20)
    assert count_loss_tokens_and_seqs(mask) == (4, 2)
    assert masked_mean(loss, mask).item() == pytest.approx(2.5)
    assert masked_mean(loss, torch.zeros_like(mask)).item() == 0.0


def test_aggregate_errors():
    l, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(l, m, "mean")
    with pytest.raises(ValueError, match="global_num_tokens"):
        aggregate_loss(l, m, "token-mean", global_num_tokens=0)
    with pytest.raises(ValueError, match="seq_token_sum_constant"):
        aggregate_loss(l, m, "seq-mean-token-sum", seq_token_sum_constant=0)
    with pytest.raises(ValueError, match="shape"):
        aggregate_loss(l, torch.ones(2, 2), "token-mean")


def _batch(seed=5):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 6, 2, 5, 4]  # includes one 1-token and one 3-token response
    B, T = len(lengths), max(lengths)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2
    lp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    ref = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    adv = torch.randn(B, generator=g, dtype=F64)
    return lengths, mask, old, lp, ref, adv


def _grad_over_micro_batches(policy_loss, mode, mbs, use_global, extra=None):
    """Sum of compute_policy_loss over micro-batches of ``mbs`` rows -> (loss, grad wrt log_probs).
    ``extra``: more keyword arguments; "token_adv" (use per-token advantages) and "entropy" (an
    entropy bonus from a differentiable function of log_probs) are handled here."""
    extra = dict(extra or {})
    token_adv = extra.pop("token_adv", False)
    with_entropy = extra.pop("entropy", False)
    lengths, mask, old, lp0, ref, adv = _batch()
    if token_adv:
        adv = adv[:, None] + torch.linspace(-1.0, 1.0, lp0.shape[1], dtype=F64)[None, :]
    lp = lp0.clone().requires_grad_(True)
    n_tok, n_seq = count_loss_tokens_and_seqs(mask)
    eps = (0.2, 0.28) if policy_loss in ("ppo", "cispo") else (0.05, 0.06)
    total = 0.0
    for s in range(0, len(lengths), mbs):
        rows = slice(s, s + mbs)
        t = max(lengths[rows])  # each micro-batch padded only to its own longest response
        loss, _ = compute_policy_loss(
            lp[rows, :t],
            old[rows, :t],
            adv[rows, :t] if token_adv else adv[rows],
            mask[rows, :t],
            policy_loss=policy_loss,
            eps_clip_low=eps[0],
            eps_clip_high=eps[1],
            loss_agg_mode=mode,
            global_num_tokens=n_tok if use_global else None,
            global_num_seqs=n_seq if use_global else None,
            seq_token_sum_constant=8 if mode == "seq-mean-token-sum" else None,
            ref_log_probs=ref[rows, :t],
            kl_coef=0.1,
            entropy=-lp[rows, :t].exp() * lp[rows, :t] if with_entropy else None,
            **extra,
        )
        total = total + loss
    total.backward()
    return total.detach(), lp.grad


MB_CASES = {
    "ppo": ("ppo", {}),
    "gspo": ("gspo", {}),
    "gspo_token-token_adv": ("gspo_token", {"token_adv": True}),
    "cispo-token_adv": ("cispo", {"token_adv": True}),
    "ppo-dual_clip-entropy": ("ppo", {"dual_clip_c": 1.2, "entropy_coef": 0.05, "entropy": True}),
}


@pytest.mark.parametrize("case", list(MB_CASES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradient_independent_of_micro_batch_cut(case, mode):
    policy_loss, extra = MB_CASES[case]
    full_loss, full_grad = _grad_over_micro_batches(policy_loss, mode, 6, True, extra)
    assert full_grad.abs().sum() > 0
    for mbs in (1, 2, 3):  # mbs=3 is also "DP=2 ranks x 1 micro-batch"
        loss, grad = _grad_over_micro_batches(policy_loss, mode, mbs, True, extra)
        assert abs(loss - full_loss) <= 1e-12 * max(1.0, abs(full_loss))
        rel = (grad - full_grad).norm() / full_grad.norm()
        assert rel <= 1e-6, (mbs, rel)


def test_micro_batch_means_without_global_counts_differ():
    # the invariance test above can fail: local token means over micro-batches give another gradient
    _, full_grad = _grad_over_micro_batches("ppo", "token-mean", 6, True)
    _, grad = _grad_over_micro_batches("ppo", "token-mean", 2, False)
    assert (grad / 3 - full_grad).norm() / full_grad.norm() > 1e-3


# ----------------------------------------------------------------------------------------------
# compute_policy_loss
# ----------------------------------------------------------------------------------------------


def test_compute_policy_loss_kl_and_metrics():
    _, mask, old, lp0, ref, adv = _batch(6)
    kw = dict(policy_loss="ppo", eps_clip_low=0.2, eps_clip_high=0.28, loss_agg_mode="token-mean")
    pg_only, m0 = compute_policy_loss(lp0, old, adv, mask, **kw)
    with_kl, m1 = compute_policy_loss(lp0, old, adv, mask, ref_log_probs=ref, kl_coef=0.5, kl_estimator="k2", **kw)
    kl_tok = 0.5 * (lp0 - ref) ** 2
    kl_mean = (kl_tok * mask).sum() / mask.sum()
    assert with_kl.item() == pytest.approx(pg_only.item() + 0.5 * kl_mean.item(), rel=1e-12)
    assert m1["kl"] == pytest.approx(kl_mean.item(), rel=1e-12)
    assert m1["kl_loss"] == pytest.approx(kl_mean.item(), rel=1e-12)
    assert m0["pg_loss"] == pytest.approx(pg_only.item())
    ratio = torch.exp(lp0 - old)
    assert m0["ratio_mean"] == pytest.approx(((ratio * mask).sum() / mask.sum()).item(), rel=1e-12)
    low, high = 0.8, 1.28
    a = adv[:, None].expand_as(ratio)
    clip = ((a > 0) & (ratio > high)) | ((a < 0) & (ratio < low))
    assert m0["clip_frac"] == pytest.approx(((clip * mask).sum() / mask.sum()).item())
    assert m0["num_tokens"] == float(mask.sum())
    assert "kl" not in m0 and "entropy" not in m0
    ent = torch.rand_like(lp0)
    _, m2 = compute_policy_loss(lp0, old, adv, mask, entropy=ent, **kw)
    assert m2["entropy"] == pytest.approx(((ent * mask).sum() / mask.sum()).item())
    assert all(isinstance(v, float) for v in {**m0, **m1, **m2}.values())


def test_kl_coef_zero_skips_nan_reference():
    _, mask, old, lp0, ref, adv = _batch(7)
    bad_ref = torch.full_like(ref, float("nan"))
    kw = dict(policy_loss="gspo", eps_clip_low=3e-4, eps_clip_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    lp = lp0.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(lp, old, adv, mask, ref_log_probs=bad_ref, kl_coef=0.0, **kw)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert math.isnan(metrics["kl"]) and "kl_loss" not in metrics
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_policy_loss(lp0, old, adv, mask, kl_coef=0.1, **kw)
    with pytest.raises(ValueError, match="policy_loss"):
        compute_policy_loss(lp0, old, adv, mask, **{**kw, "policy_loss": "grpo"})
    with pytest.raises(ValueError, match="kl_estimator"):
        compute_policy_loss(lp0, old, adv, mask, kl_estimator="low_var", **kw)


# ----------------------------------------------------------------------------------------------
# log-probs and entropy from logits
# ----------------------------------------------------------------------------------------------


def _ref_logprobs(logits64, labels, t):
    return torch.log_softmax(logits64 / t, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _ref_entropy(logits64, t):
    logp = torch.log_softmax(logits64 / t, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_token_log_probs_and_grad_vs_float64(dtype, chunk_size):
    g = torch.Generator().manual_seed(8)
    B, S, V, t = 2, 7, 13, 0.7
    logits = (torch.randn(B, S, V, generator=g) * 4).to(dtype).requires_grad_(True)
    labels = torch.randint(0, V, (B, S), generator=g)
    out = token_log_probs_from_logits(logits, labels, t, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (B, S)
    x64 = logits.detach().to(F64).requires_grad_(True)
    ref = _ref_logprobs(x64, labels, t)
    torch.testing.assert_close(out.to(F64), ref, rtol=0, atol=2e-6)
    w = torch.randn(B, S, generator=g)
    (out * w).sum().backward()
    (ref * w.to(F64)).sum().backward()
    assert logits.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits.grad.to(F64), x64.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_entropy_and_grad_vs_float64(chunk_size):
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(3, 5, 11, generator=g) * 3).requires_grad_(True)
    out = entropy_from_logits(logits, 1.3, chunk_size=chunk_size)
    x64 = logits.detach().to(F64).requires_grad_(True)
    ref = _ref_entropy(x64, 1.3)
    torch.testing.assert_close(out.to(F64), ref, rtol=0, atol=2e-6)
    w = torch.randn(3, 5, generator=g)
    (out * w).sum().backward()
    (ref * w.to(F64)).sum().backward()
    torch.testing.assert_close(logits.grad.to(F64), x64.grad, rtol=1e-5, atol=1e-6)
    assert abs(entropy_from_logits(torch.zeros(1, 1, 11), 1.0).item() - math.log(11)) < 1e-6


def test_logprob_and_entropy_gradcheck_float64():
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 3, 5, generator=g, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: token_log_probs_from_logits(z, labels, 0.9, chunk_size=2), (x,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, 0.9, chunk_size=4), (x,))


def test_negative_labels_are_ignored_and_errors():
    logits = torch.randn(1, 3, 4, requires_grad=True)
    labels = torch.tensor([[1, -100, 3]])
    out = token_log_probs_from_logits(logits, labels, 1.0)
    assert out[0, 1] == 0
    out.sum().backward()
    assert torch.equal(logits.grad[0, 1], torch.zeros(4))
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs_from_logits(logits, labels, 0.0)
    with pytest.raises(ValueError, match="vocab size"):
        token_log_probs_from_logits(logits, torch.tensor([[1, 4, 0]]), 1.0)
    with pytest.raises(ValueError, match="labels shape"):
        token_log_probs_from_logits(logits, torch.tensor([1, 2, 0]), 1.0)
    with pytest.raises(TypeError, match="labels"):
        token_log_probs_from_logits(logits, labels.float(), 1.0)


# ----------------------------------------------------------------------------------------------
# GSPO-token, CISPO, dual-clip PPO, entropy bonus
# ----------------------------------------------------------------------------------------------


def test_policy_loss_names():
    assert POLICY_LOSSES == ("gspo", "ppo", "gspo_token", "cispo")


def test_gspo_token_equals_gspo_with_row_constant_advantages():
    g = torch.Generator().manual_seed(8)
    B, T = 6, 5
    lengths = torch.tensor([1, 5, 3, 5, 2, 4])  # a single-token and two full-length (truncated) rows
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.int64)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    lp0 = old + torch.randn(B, T, generator=g, dtype=F64) * 0.08
    adv = torch.randn(B, generator=g, dtype=F64)
    el, eh = 0.03, 0.04
    kw = dict(eps_clip_low=el, eps_clip_high=eh, loss_agg_mode="seq-mean-token-mean", global_num_seqs=B)
    lp = lp0.clone().requires_grad_(True)
    loss, m = compute_policy_loss(lp, old, adv[:, None].expand(B, T), mask, policy_loss="gspo_token", **kw)
    loss.backward()
    lp_ref = lp0.clone().requires_grad_(True)
    ref = _gspo_reference(lp_ref, old, adv, mask, el, eh)  # the paper's sequence-level objective
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-10, atol=1e-14)
    assert 0 < m["clip_frac"] < 1  # both regimes present


def test_gspo_token_per_token_advantages_hand_values():
    # one row of 3 tokens, token log-ratios +0.01, -0.02, +0.01: s = exp(0) = 1, inside the clip range
    # J = (1/3) sum_t s * A_t = (1/3)(1 - 2 + 0.5) = -1/6 -> loss = +1/6
    # d loss / d logp_t = -A_t * s / 3  -> [-1/3, 2/3, -1/6]
    # (sequence-level GSPO with A = mean_t A_t = -1/6 would give -A/3 = 1/18 on every token)
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    lp = (old + torch.tensor([[0.01, -0.02, 0.01]], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=F64)
    mask = torch.ones(1, 3)
    kw = dict(eps_clip_low=0.2, eps_clip_high=0.2, loss_agg_mode="seq-mean-token-mean")
    loss, m = compute_policy_loss(lp, old, adv, mask, policy_loss="gspo_token", **kw)
    loss.backward()
    assert loss.item() == pytest.approx(1 / 6, abs=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, 2 / 3, -1 / 6]], dtype=F64), rtol=0, atol=1e-12)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-15)


def test_gspo_token_clips_per_token_by_advantage_sign():
    # s = exp(0.1) = 1.10517 > 1 + eps_high = 1.05: tokens with A > 0 are clipped (gradient 0),
    # tokens with A < 0 keep d loss / d logp_t = -A_t * s / |y| = s / 2
    old = torch.tensor([[-1.0, -1.0]], dtype=F64)
    lp = (old + torch.tensor([[0.15, 0.05]], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    s = math.exp(0.1)
    loss, m = compute_policy_loss(lp, old, adv, torch.ones(1, 2), policy_loss="gspo_token", eps_clip_low=0.05,
                                  eps_clip_high=0.05, loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    # loss = (1/2)(-1.05 * 1 + s * 1)
    assert loss.item() == pytest.approx(0.5 * (-1.05 + s), abs=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, s / 2]], dtype=F64), rtol=0, atol=1e-12)
    assert m["clip_frac"] == 0.5


def test_cispo_hand_values_and_gradients():
    # ratios 1.5, 0.5, 1.1, 0.7 ; A +1, -1, +2, +1 ; eps_low 0.2, eps_high 0.28
    # IS weights clip(r) = 1.28, 0.8, 1.1, 0.8 (detached); loss_t = -w_t A_t logp_t; grad = -w_t A_t
    ratios = [1.5, 0.5, 1.1, 0.7]
    weights, advs = [1.28, 0.8, 1.1, 0.8], [1.0, -1.0, 2.0, 1.0]
    old = torch.full((1, 4), -1.3, dtype=F64)
    lp = (old + torch.tensor([ratios], dtype=F64).log()).requires_grad_(True)
    adv = torch.tensor([advs], dtype=F64)
    loss, clipped = cispo_token_loss(lp, old, adv, 0.2, 0.28)
    expected = [-w * a * (-1.3 + math.log(r)) for w, a, r in zip(weights, advs, ratios)]
    torch.testing.assert_close(loss.detach(), torch.tensor([expected], dtype=F64), rtol=0, atol=1e-12)
    assert clipped.tolist() == [[True, True, False, True]]
    loss.sum().backward()
    # unlike PPO, clipped tokens keep their gradient
    want = [-w * a for w, a in zip(weights, advs)]
    torch.testing.assert_close(lp.grad, torch.tensor([want], dtype=F64), rtol=0, atol=1e-12)


def test_cispo_through_compute_policy_loss_with_padding():
    # row 0 truncated (full), row 1 a single-token response with NaN padding
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=F64)
    r = torch.tensor([[1.5, 0.9], [1.0, 1.0]], dtype=F64)
    lp = (old + r.log()).detach()
    lp[1, 1] = float("nan")
    lp.requires_grad_(True)
    adv = torch.tensor([2.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = compute_policy_loss(lp, old, adv, mask, policy_loss="cispo", eps_clip_low=0.2, eps_clip_high=0.2,
                                  loss_agg_mode="token-mean", global_num_tokens=3)
    loss.backward()
    # weights 1.2, 0.9, 1.0 ; token-mean over 3 tokens
    lp00, lp01, lp10 = -1.0 + math.log(1.5), -2.0 + math.log(0.9), -0.5
    want = (-1.2 * 2 * lp00 - 0.9 * 2 * lp01 + 1.0 * 1 * lp10) / 3
    assert loss.item() == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(
        lp.grad, torch.tensor([[-2.4 / 3, -1.8 / 3], [1 / 3, 0.0]], dtype=F64), rtol=0, atol=1e-12
    )
    assert m["clip_frac"] == pytest.approx(1 / 3)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.9 + 1.0) / 3, abs=1e-12)


def test_dual_clip_hand_values_and_gradients():
    # c = 3, eps 0.2 / 0.28; PPO loss l = -min(rA, clip(r)A)
    #   r 4.0, A -1  : l = max(4, 1.28) = 4 > bound 3      -> 3, grad 0, dual
    #   r 2.0, A -1  : l = 2 < 3                            -> 2, grad -rA = 2
    #   r 4.0, A +1  : PPO clip -> -1.28, grad 0 (A > 0: no dual bound)
    #   r 0.5, A -1  : PPO clip -> 0.8, grad 0, bound inactive
    #   r 5.0, A -0.5: l = 2.5 > bound 1.5                 -> 1.5, grad 0, dual
    #   r 1.1, A -0.5: l = 0.55                             -> 0.55, grad 0.55
    ratios = torch.tensor([[4.0, 2.0, 4.0, 0.5, 5.0, 1.1]], dtype=F64)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0, -0.5, -0.5]], dtype=F64)
    old = torch.full_like(ratios, -2.0)
    lp = (old + ratios.log()).requires_grad_(True)
    loss, clipped, dual = ppo_dual_clip_token_loss(lp, old, adv, 0.2, 0.28, 3.0)
    torch.testing.assert_close(
        loss.detach(), torch.tensor([[3.0, 2.0, -1.28, 0.8, 1.5, 0.55]], dtype=F64), rtol=0, atol=1e-12
    )
    assert dual.tolist() == [[True, False, False, False, True, False]]
    assert clipped.tolist() == [[False, False, True, True, False, False]]
    loss.sum().backward()
    torch.testing.assert_close(
        lp.grad, torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0, 0.55]], dtype=F64), rtol=0, atol=1e-12
    )
    # through compute_policy_loss: the same values, token-mean, and the dual-clip metric
    lp2 = (old + ratios.log()).requires_grad_(True)
    total, m = compute_policy_loss(lp2, old, adv, torch.ones(1, 6), policy_loss="ppo", eps_clip_low=0.2,
                                   eps_clip_high=0.28, loss_agg_mode="token-mean", dual_clip_c=3.0)
    assert total.item() == pytest.approx((3.0 + 2.0 - 1.28 + 0.8 + 1.5 + 0.55) / 6, abs=1e-12)
    assert m["dual_clip_frac"] == pytest.approx(2 / 6)
    assert m["clip_frac"] == pytest.approx(2 / 6)
    # without dual clip the same batch gives PPO's 4 and 2.5 on the two exploded tokens
    plain, m0 = compute_policy_loss(lp2, old, adv, torch.ones(1, 6), policy_loss="ppo", eps_clip_low=0.2,
                                    eps_clip_high=0.28, loss_agg_mode="token-mean")
    assert plain.item() == pytest.approx((4.0 + 2.0 - 1.28 + 0.8 + 2.5 + 0.55) / 6, abs=1e-12)
    assert "dual_clip_frac" not in m0


def test_dual_clip_errors():
    lp, mask, adv = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1)
    kw = dict(eps_clip_low=0.2, eps_clip_high=0.2, loss_agg_mode="token-mean")
    for bad in (1.0, 0.5, float("inf"), True):
        with pytest.raises(ValueError, match="algorithm.dual_clip_c"):
            compute_policy_loss(lp, lp, adv, mask, policy_loss="ppo", dual_clip_c=bad, **kw)
        with pytest.raises(ValueError, match="algorithm.dual_clip_c"):
            ppo_dual_clip_token_loss(lp, lp, adv, 0.2, 0.2, bad)
    with pytest.raises(ValueError, match="algorithm.dual_clip_c.*ppo"):
        compute_policy_loss(lp, lp, adv, mask, policy_loss="gspo", dual_clip_c=3.0, **kw)


def test_entropy_bonus_value_gradient_and_errors():
    # on-policy (ratio 1): pg loss = -token-mean(A); bonus -0.1 * token-mean(entropy)
    lp0 = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 9.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    ent = torch.tensor([[0.5, 1.0, 2.0], [0.3, float("nan"), 0.0]], dtype=F64, requires_grad=True)
    lp = lp0.clone().requires_grad_(True)
    kw = dict(policy_loss="ppo", eps_clip_low=0.2, eps_clip_high=0.2, loss_agg_mode="token-mean")
    loss, m = compute_policy_loss(lp, lp0, adv, mask, entropy=ent, entropy_coef=0.1, global_num_tokens=4, **kw)
    loss.backward()
    # pg = -(1 + 1 + 1 - 2) / 4 = -0.25 ; entropy term = (0.5 + 1 + 2 + 0.3) / 4 = 0.95
    assert loss.item() == pytest.approx(-0.25 - 0.1 * 0.95, abs=1e-12)
    assert m["entropy_loss"] == pytest.approx(0.95, abs=1e-12)
    assert m["pg_loss"] == pytest.approx(-0.25, abs=1e-12)
    torch.testing.assert_close(
        ent.grad, torch.tensor([[-0.025, -0.025, -0.025], [-0.025, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-15
    )
    # seq-mean-token-mean: (0.5 + 1 + 2)/3 and 0.3 -> mean over 2 sequences
    loss2, m2 = compute_policy_loss(lp0, lp0, adv, mask, entropy=ent, entropy_coef=0.1,
                                    **{**kw, "loss_agg_mode": "seq-mean-token-mean"})
    assert m2["entropy_loss"] == pytest.approx((3.5 / 3 + 0.3) / 2, abs=1e-12)
    # coefficient 0: no term (NaN entropy harmless), no entropy_loss metric
    _, m3 = compute_policy_loss(lp0, lp0, adv, mask, entropy=torch.full_like(lp0, float("nan")), **kw)
    assert "entropy_loss" not in m3
    with pytest.raises(ValueError, match="algorithm.entropy_coef"):
        compute_policy_loss(lp, lp0, adv, mask, entropy_coef=0.1, **kw)  # no entropy
    with pytest.raises(ValueError, match="differentiable"):
        compute_policy_loss(lp, lp0, adv, mask, entropy=ent.detach(), entropy_coef=0.1, **kw)
    with pytest.raises(ValueError, match="algorithm.entropy_coef"):
        compute_policy_loss(lp, lp0, adv, mask, entropy=ent, entropy_coef=-0.1, **kw)
