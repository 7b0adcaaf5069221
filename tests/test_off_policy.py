"""Tests for the off-policy corrections (moerl.algorithms.off_policy and their use in
compute_policy_loss / the policy_loss closure).

References are hand-worked: every expected weight, loss and gradient below is plain Python arithmetic
on the listed numbers (ratios, importance weights, advantages), never a second call of the code under
test. All tensors are float64.

The batch (B=4, T=4) used throughout:

- row 0: 3 loss tokens, A = +1, policy ratios r = pi_theta/pi_prox = 1.1, 1.5, 0.9 and importance
  weights w = pi_prox/mu = 0.5, 1.2, 3.0; one padding position (behaviour NaN there);
- row 1: 2 loss tokens, A = -1, r = 0.7, 1.1, w = 2.5, 0.9;
- row 2: a zero-length response (all-zero loss_mask, padding values, behaviour NaN);
- row 3: an aborted response (real tokens, loss_mask all 0, r = 2, w = 50, staleness 5).

Clip range 0.2 / 0.28. PPO per-token losses -min(r A, clip(r) A) and their d/dlogp (-r A where the
unclipped branch wins, 0 where the clipped one does):
row 0: (-1.1, -1.28, -0.9), grads (-1.1, 0, -0.9); row 1: (0.8, 1.1), grads (0, 1.1).
GSPO: s_0 = (1.1 * 1.5 * 0.9)^(1/3) = 1.1410 and s_1 = (0.7 * 1.1)^(1/2) = 0.8775 are inside
[0.8, 1.28], so every token's loss is -s_i A_i and its gradient -s_i A_i.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from moerl.algorithms.off_policy import IS_LEVELS, LOG_WEIGHT_CLAMP, OFF_POLICY_CORRECTIONS, off_policy_weights
from moerl.algorithms.policy_loss import LOG_RATIO_CLAMP, compute_policy_loss
from moerl.train.batching import MicroBatch
from moerl.train.losses import combine_micro_batch_metrics, policy_loss

F64 = torch.float64
NAN = float("nan")
EPS_LOW, EPS_HIGH = 0.2, 0.28

OLD = [[-1.0, -0.5, -2.0, 0.0], [-0.7, -1.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-0.3, -0.9, -1.4, -0.2]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
RATIO = [[1.1, 1.5, 0.9, 1.0], [0.7, 1.1, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]
W = [[0.5, 1.2, 3.0, NAN], [2.5, 0.9, NAN, NAN], [NAN, NAN, NAN, NAN], [50.0, 50.0, 50.0, 50.0]]
ADV = [1.0, -1.0, 2.0, 3.0]
N_TOKENS, N_SEQS, ROW_TOKENS = 5, 2, [3, 2]

PPO_LOSS = [[-1.1, -1.28, -0.9], [0.8, 1.1]]
PPO_GRAD = [[-1.1, 0.0, -0.9], [0.0, 1.1]]
S0 = (1.1 * 1.5 * 0.9) ** (1 / 3)
S1 = (0.7 * 1.1) ** 0.5
GSPO_LOSS = [[-S0, -S0, -S0], [S1, S1]]
GSPO_GRAD = [[-S0, -S0, -S0], [S1, S1]]
# CISPO: IS weight clip(r, 0.8, 1.28) = (1.1, 1.28, 0.9), (0.8, 1.1), detached; loss -w A logp, grad -w A
CISPO_W = [[1.1, 1.28, 0.9], [0.8, 1.1]]
CISPO_LOSS = [
    [-w * 1.0 * (o + math.log(r)) for w, o, r in zip(CISPO_W[0], OLD[0], RATIO[0])],
    [-w * -1.0 * (o + math.log(r)) for w, o, r in zip(CISPO_W[1], OLD[1], RATIO[1])],
]
CISPO_GRAD = [[-1.1, -1.28, -0.9], [0.8, 1.1]]
# GSPO-token with these per-sequence advantages is GSPO
HAND = {"ppo": (PPO_LOSS, PPO_GRAD), "gspo": (GSPO_LOSS, GSPO_GRAD), "gspo_token": (GSPO_LOSS, GSPO_GRAD),
        "cispo": (CISPO_LOSS, CISPO_GRAD)}

# raw weights of the loss tokens per level (row 0, row 1)
W_TOK = [[0.5, 1.2, 3.0], [2.5, 0.9]]
W_SEQ = [0.5 * 1.2 * 3.0, 2.5 * 0.9]  # 1.8, 2.25
W_GEO = [(0.5 * 1.2 * 3.0) ** (1 / 3), (2.5 * 0.9) ** 0.5]  # 1.2164, 1.5
# k3 of KL(mu || pi_prox) per token: delta = log mu - log pi_prox = -log w, k3 = w - 1 - log w
BEHAV_PROX_KL = sum(w - 1 - math.log(w) for row in W_TOK for w in row) / N_TOKENS
RAW = {
    "token": W_TOK,
    "sequence": [[W_SEQ[0]] * 3, [W_SEQ[1]] * 2],
    "geo_mean": [[W_GEO[0]] * 3, [W_GEO[1]] * 2],
}

# (correction, level, options, hand-worked weights c per loss token, fraction of loss tokens removed)
CASES = [
    # tis: c = min(w, cap)
    ("tis", "token", dict(is_cap=2.0), [[0.5, 1.2, 2.0], [2.0, 0.9]], 0.0),
    ("tis", "sequence", dict(is_cap=2.0), [[1.8, 1.8, 1.8], [2.0, 2.0]], 0.0),  # W_1 = 2.25 -> 2
    ("tis", "geo_mean", dict(is_cap=1.4), [[1.8 ** (1 / 3)] * 3, [1.4, 1.4]], 0.0),  # G_1 = 1.5 -> 1.4
    # decoupled (AReaL): tokens with w > cap removed, the others keep w
    ("decoupled", "token", dict(is_cap=2.0), [[0.5, 1.2, 0.0], [0.0, 0.9]], 2 / 5),
    ("decoupled", "sequence", dict(is_cap=2.0), [[1.8, 1.8, 1.8], [0.0, 0.0]], 2 / 5),
    # mis: keep w in [is_lower, is_cap]
    ("mis", "token", dict(is_lower=0.6, is_cap=2.0), [[0.0, 1.2, 0.0], [0.0, 0.9]], 3 / 5),
    ("mis", "sequence", dict(is_lower=0.6, is_cap=2.0), [[1.8, 1.8, 1.8], [0.0, 0.0]], 2 / 5),
    ("mis", "geo_mean", dict(is_lower=1.3, is_cap=2.0), [[0.0, 0.0, 0.0], [1.5, 1.5]], 3 / 5),  # G_0 = 1.2164
    # icepop: keep w in [1/beta, beta] (1/2.6 = 0.385; 1/2 = 0.5)
    ("icepop", "token", dict(icepop_beta=2.6), [[0.5, 1.2, 0.0], [2.5, 0.9]], 1 / 5),
    ("icepop", "sequence", dict(icepop_beta=2.0), [[1.8, 1.8, 1.8], [0.0, 0.0]], 2 / 5),
]
CASE_IDS = [f"{c}-{lvl}" for c, lvl, *_ in CASES]
KEY = {"is_cap": "cap", "is_lower": "lower", "icepop_beta": "beta"}


def _batch(requires_grad: bool = True):
    """(log_probs [leaf], old, behaviour, loss_mask, advantages) from the listed numbers."""
    old = torch.tensor(OLD, dtype=F64)
    lp = (old + torch.tensor(RATIO, dtype=F64).log()).requires_grad_(requires_grad)
    behav = old - torch.tensor(W, dtype=F64).log()  # NaN at the padding positions
    return lp, old, behav, torch.tensor(MASK, dtype=F64), torch.tensor(ADV, dtype=F64)


def _expected(c, policy: str, mode: str, grad_extra=None):
    """Hand formula: token-mean sum c*l / 5, grad c*g / 5; seq-mean-token-mean sum_i (sum_t c*l / n_i) / 2,
    grad c*g / n_i / 2. Returns (loss, [B, T] grad list with zeros on rows 2, 3 and padding)."""
    losses, grads = HAND[policy]
    loss, grad = 0.0, [[0.0] * 4 for _ in range(4)]
    for i in range(2):
        denom = N_TOKENS if mode == "token-mean" else ROW_TOKENS[i] * N_SEQS
        for t in range(ROW_TOKENS[i]):
            loss += c[i][t] * losses[i][t] / denom
            grad[i][t] = c[i][t] * grads[i][t] / denom
    return loss, grad


def _run(policy, mode, correction, level, opts, lp, old, behav, mask, adv, **kw):
    return compute_policy_loss(
        lp, old, adv, mask, policy_loss=policy, eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH,
        loss_agg_mode=mode, global_num_tokens=N_TOKENS, global_num_seqs=N_SEQS,
        behaviour_log_probs=behav, off_policy_correction=correction, is_level=level, **opts, **kw,
    )


# ----------------------------------------------------------------------------------------------
# off_policy_weights
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("correction,level,opts,c,masked", CASES, ids=CASE_IDS)
def test_weights_keep_mask_and_metrics_hand_values(correction, level, opts, c, masked):
    _, old, behav, mask, _ = _batch(False)
    weights, keep, m = off_policy_weights(
        old, behav, mask, correction=correction, level=level, **{KEY[k]: v for k, v in opts.items()}
    )
    assert not weights.requires_grad and weights.dtype == F64 and keep.dtype == torch.bool
    want = [c[0] + [0.0], c[1] + [0.0, 0.0], [0.0] * 4, [0.0] * 4]  # 0 off the loss tokens
    torch.testing.assert_close(weights, torch.tensor(want, dtype=F64), rtol=1e-12, atol=0)
    assert keep.tolist() == [[x != 0 for x in row] for row in want]
    raw = RAW[level]
    assert m["is_weight_mean"] == pytest.approx(sum(map(sum, raw)) / N_TOKENS, rel=1e-12)
    assert m["is_weight_max"] == pytest.approx(max(map(max, raw)), rel=1e-12)  # not row 3's 50
    assert m["is_masked_frac"] == pytest.approx(masked, abs=1e-15)
    assert m["behav_prox_kl"] == pytest.approx(BEHAV_PROX_KL, rel=1e-12)


def test_none_weights_are_one_on_loss_tokens():
    _, old, behav, mask, _ = _batch(False)
    weights, keep, m = off_policy_weights(old, behav, mask, correction="none")
    assert torch.equal(weights, mask) and torch.equal(keep, mask.bool())
    assert m["is_weight_mean"] == pytest.approx((0.5 + 1.2 + 3.0 + 2.5 + 0.9) / 5, rel=1e-12)
    assert m["is_weight_max"] == pytest.approx(3.0, rel=1e-12)
    assert m["is_masked_frac"] == 0.0


def test_log_weight_clamped_before_exp():
    assert LOG_WEIGHT_CLAMP == LOG_RATIO_CLAMP == 20.0
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    behav = torch.tensor([[-26.0, -21.0, -1.0]], dtype=F64)  # log w = 25, 20, 0
    mask = torch.ones(1, 3, dtype=F64)
    w_tok, _, m = off_policy_weights(old, behav, mask, correction="tis", cap=1e12)
    assert w_tok.tolist() == [[math.exp(20.0), math.exp(20.0), 1.0]]
    assert m["is_weight_max"] == math.exp(20.0)
    w_seq, _, _ = off_policy_weights(old, behav, mask, correction="tis", level="sequence", cap=1e12)
    assert w_seq.tolist() == [[math.exp(20.0)] * 3]  # log W = 45 -> 20
    w_geo, _, _ = off_policy_weights(old, behav, mask, correction="tis", level="geo_mean", cap=1e12)
    torch.testing.assert_close(w_geo, torch.full((1, 3), math.exp(15.0), dtype=F64), rtol=1e-12, atol=0)  # 45/3
    _, keep, _ = off_policy_weights(old, behav, mask, correction="icepop", beta=5.0)
    assert keep.tolist() == [[False, False, True]]


def test_empty_micro_batch_metrics_are_zero():
    z = torch.zeros(2, 3, dtype=F64)
    weights, keep, m = off_policy_weights(z, z, z, correction="mis", level="sequence", lower=0.5)
    assert not keep.any() and torch.equal(weights, z)
    assert m == {"is_weight_mean": 0.0, "is_weight_max": 0.0, "is_masked_frac": 0.0, "behav_prox_kl": 0.0}


# ----------------------------------------------------------------------------------------------
# compute_policy_loss: value and gradient against hand values
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("policy", ["ppo", "gspo", "gspo_token", "cispo"])
@pytest.mark.parametrize("correction,level,opts,c,masked", CASES, ids=CASE_IDS)
def test_loss_and_grad_hand_values(policy, mode, correction, level, opts, c, masked):
    lp, old, behav, mask, adv = _batch()
    loss, m = _run(policy, mode, correction, level, opts, lp, old, behav, mask, adv)
    loss.backward()
    want_loss, want_grad = _expected(c, policy, mode)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(lp.grad, torch.tensor(want_grad, dtype=F64), rtol=1e-12, atol=1e-15)
    # zero-length row 2 and aborted row 3: nothing, not even NaN
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert torch.equal(lp.grad[2:], torch.zeros(2, 4, dtype=F64))
    assert m["pg_loss"] == pytest.approx(want_loss, rel=1e-12, abs=1e-15)
    assert m["is_masked_frac"] == pytest.approx(masked, abs=1e-15)
    assert m["is_weight_max"] == pytest.approx(max(map(max, RAW[level])), rel=1e-12)
    assert m["behav_prox_kl"] == pytest.approx(BEHAV_PROX_KL, rel=1e-12)
    assert "over_bound_token_frac" not in m


def test_decoupled_and_tis_differ_only_on_tokens_above_the_cap():
    # cap 3.5 is above every loss-token weight (max 3.0): both give c = w exactly
    lp, old, behav, mask, adv = _batch(False)
    a, _ = _run("ppo", "token-mean", "decoupled", "token", dict(is_cap=3.5), lp, old, behav, mask, adv)
    b, _ = _run("ppo", "token-mean", "tis", "token", dict(is_cap=3.5), lp, old, behav, mask, adv)
    want, _ = _expected(W_TOK, "ppo", "token-mean")
    assert a.item() == pytest.approx(want, rel=1e-12) and b.item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("policy", ["ppo", "gspo"])
def test_stale_token_removed_from_loss_and_kl(policy):
    # row 0's third token has staleness 3 > max_staleness 2 (row 1's first is exactly 2: kept);
    # rows 2, 3 are not loss tokens, so their staleness counts for nothing.
    lp, old, behav, mask, adv = _batch()
    stale = torch.tensor([[0, 1, 3, 0], [2, 0, 0, 0], [9, 9, 9, 9], [5, 5, 5, 5]])
    ref = (lp.detach() - 0.1)  # k1 = log_probs - ref = 0.1 on every token, d k1 / d logp = 1
    loss, m = _run(policy, "token-mean", "tis", "token", dict(is_cap=2.0), lp, old, behav, mask, adv,
                   token_staleness=stale, max_staleness=2, ref_log_probs=ref, kl_coef=0.5, kl_estimator="k1")
    loss.backward()
    c = [[0.5, 1.2, 0.0], [2.0, 0.9]]  # tis weights with the stale token removed
    pg, grad = _expected(c, policy, "token-mean")
    kept = [[1, 1, 0], [1, 1]]
    kl_loss = sum(0.1 * k for row in kept for k in row) / N_TOKENS  # 4 * 0.1 / 5, denominator stays 5
    for i in range(2):
        for t in range(ROW_TOKENS[i]):
            grad[i][t] += 0.5 * kept[i][t] / N_TOKENS
    assert loss.item() == pytest.approx(pg + 0.5 * kl_loss, rel=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=F64), rtol=1e-12, atol=1e-15)
    assert lp.grad[0, 2].item() == 0.0
    assert m["over_bound_token_frac"] == pytest.approx(1 / 5, rel=1e-12)
    assert m["kl_loss"] == pytest.approx(kl_loss, rel=1e-12)
    assert m["kl"] == pytest.approx(0.1, rel=1e-12)  # logged over all loss tokens


def test_staleness_defence_without_correction():
    lp, old, _, mask, adv = _batch()
    stale = torch.tensor([[0, 1, 3, 0], [2, 0, 0, 0], [0] * 4, [5] * 4], dtype=F64)
    loss, m = compute_policy_loss(lp, old, adv, mask, policy_loss="ppo", eps_clip_low=EPS_LOW,
                                  eps_clip_high=EPS_HIGH, loss_agg_mode="token-mean",
                                  token_staleness=stale, max_staleness=2)
    loss.backward()
    assert loss.item() == pytest.approx((-1.1 - 1.28 + 0.8 + 1.1) / 5, rel=1e-12)
    torch.testing.assert_close(
        lp.grad, torch.tensor([[-1.1 / 5, 0, 0, 0], [0, 1.1 / 5, 0, 0], [0] * 4, [0] * 4], dtype=F64),
        rtol=1e-12, atol=1e-15,
    )
    assert m["over_bound_token_frac"] == pytest.approx(0.2) and "is_weight_mean" not in m
    # max_staleness 3: nothing is stale, nothing changes
    lp2, *_ = _batch()
    loss3, m3 = compute_policy_loss(lp2, old, adv, mask, policy_loss="ppo", eps_clip_low=EPS_LOW,
                                    eps_clip_high=EPS_HIGH, loss_agg_mode="token-mean",
                                    token_staleness=stale, max_staleness=3)
    assert loss3.item() == pytest.approx((-1.1 - 1.28 - 0.9 + 0.8 + 1.1) / 5, rel=1e-12)
    assert m3["over_bound_token_frac"] == 0.0


@pytest.mark.parametrize("policy", ["ppo", "gspo"])
def test_empty_and_aborted_rows_contribute_nothing(policy):
    # the same loss and gradient with rows 2 (zero-length) and 3 (aborted) dropped from the batch
    lp, old, behav, mask, adv = _batch()
    loss, _ = _run(policy, "seq-mean-token-mean", "mis", "sequence", dict(is_lower=0.6, is_cap=2.0),
                   lp, old, behav, mask, adv)
    loss.backward()
    lp2 = lp.detach()[:2].clone().requires_grad_(True)
    loss2, _ = _run(policy, "seq-mean-token-mean", "mis", "sequence", dict(is_lower=0.6, is_cap=2.0),
                    lp2, old[:2], behav[:2], mask[:2], adv[:2])
    loss2.backward()
    assert loss.item() == loss2.item()
    assert torch.equal(lp.grad[:2], lp2.grad) and torch.equal(lp.grad[2:], torch.zeros(2, 4, dtype=F64))
    # an all-empty micro-batch: loss 0, gradient 0, no NaN
    lp3 = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    z = torch.zeros(2, 4, dtype=F64)
    loss3, m3 = _run(policy, "token-mean", "icepop", "geo_mean", {}, lp3, z, z + NAN, z, adv[:2],
                     token_staleness=z + 7, max_staleness=0)
    loss3.backward()
    assert loss3.item() == 0.0 and torch.equal(lp3.grad, z)
    assert m3["over_bound_token_frac"] == 0.0 and m3["is_weight_max"] == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("policy", ["ppo", "gspo"])
def test_none_with_behaviour_is_bitwise_todays_loss(policy, mode):
    lp, old, behav, mask, adv = _batch()
    ref = old - 0.3
    kw = dict(policy_loss=policy, eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH, loss_agg_mode=mode,
              ref_log_probs=ref, kl_coef=0.1)
    today, m0 = compute_policy_loss(lp, old, adv, mask, **kw)
    today.backward()
    g0 = lp.grad.clone()
    lp.grad = None
    with_b, m1 = compute_policy_loss(lp, old, adv, mask, behaviour_log_probs=behav, off_policy_correction="none",
                                     is_level="sequence", is_cap=0.1, **kw)
    with_b.backward()
    assert torch.equal(today, with_b) and torch.equal(g0, lp.grad)
    assert {k: v for k, v in m1.items() if k in m0} == m0
    assert set(m1) - set(m0) == {"is_weight_mean", "is_weight_max", "is_masked_frac", "behav_prox_kl"}
    assert m1["is_masked_frac"] == 0.0 and m1["is_weight_max"] == pytest.approx(2.25, rel=1e-12)


def test_weights_carry_no_gradient_to_old_or_behaviour():
    lp, old, behav, mask, adv = _batch()
    old = old.clone().requires_grad_(True)
    behav = torch.where(mask.bool(), behav, torch.zeros_like(behav)).requires_grad_(True)
    loss, _ = _run("ppo", "token-mean", "tis", "token", dict(is_cap=2.0), lp, old, behav, mask, adv)
    loss.backward()
    assert old.grad is None and behav.grad is None and lp.grad is not None


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def test_off_policy_weights_errors():
    _, old, behav, mask, _ = _batch(False)
    bad = [
        (dict(correction="clip"), "algorithm.off_policy_correction"),
        (dict(correction="tis", level="row"), "algorithm.is_level"),
        (dict(correction="tis", cap=0.0), "algorithm.is_cap"),
        (dict(correction="tis", cap=-1.0), "algorithm.is_cap"),
        (dict(correction="tis", cap=NAN), "algorithm.is_cap"),
        (dict(correction="mis", lower=-0.1), "algorithm.is_lower"),
        (dict(correction="mis", lower=3.0, cap=2.0), "algorithm.is_lower"),
        (dict(correction="icepop", beta=1.0), "algorithm.icepop_beta"),
        (dict(correction="icepop", beta=0.5), "algorithm.icepop_beta"),
    ]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            off_policy_weights(old, behav, mask, **kw)
    with pytest.raises(ValueError, match="behaviour_log_probs"):
        off_policy_weights(old, behav[:, :3], mask, correction="tis")
    with pytest.raises(ValueError, match="loss_mask"):
        off_policy_weights(old, behav, mask[:3], correction="tis")
    with pytest.raises(ValueError, match="old_log_probs"):
        off_policy_weights(old[0], behav[0], mask[0], correction="tis")
    assert OFF_POLICY_CORRECTIONS == ("none", "decoupled", "tis", "mis", "icepop")
    assert IS_LEVELS == ("token", "sequence", "geo_mean")


def test_compute_policy_loss_off_policy_errors():
    lp, old, behav, mask, adv = _batch(False)
    kw = dict(policy_loss="ppo", eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH, loss_agg_mode="token-mean")
    for corr in ("decoupled", "tis", "mis", "icepop"):
        with pytest.raises(ValueError, match="algorithm.off_policy_correction"):
            compute_policy_loss(lp, old, adv, mask, off_policy_correction=corr, **kw)
    with pytest.raises(ValueError, match="algorithm.off_policy_correction"):
        compute_policy_loss(lp, old, adv, mask, behaviour_log_probs=behav, off_policy_correction="TIS", **kw)
    with pytest.raises(ValueError, match="algorithm.icepop_beta"):
        compute_policy_loss(lp, old, adv, mask, behaviour_log_probs=behav, off_policy_correction="icepop",
                            icepop_beta=1.0, **kw)
    with pytest.raises(ValueError, match="token_staleness"):
        compute_policy_loss(lp, old, adv, mask, max_staleness=2, **kw)
    with pytest.raises(ValueError, match="token_staleness"):
        compute_policy_loss(lp, old, adv, mask, token_staleness=torch.zeros(4, 3), max_staleness=2, **kw)
    with pytest.raises(ValueError, match="max_staleness"):
        compute_policy_loss(lp, old, adv, mask, token_staleness=torch.zeros(4, 4), max_staleness=-1, **kw)


# ----------------------------------------------------------------------------------------------
# the policy_loss closure and metric reduction over micro-batches
# ----------------------------------------------------------------------------------------------


def _algo(**kw):
    base = dict(policy_loss="ppo", eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH, loss_agg_mode="token-mean",
                kl_coef=0.0, kl_estimator="k3", off_policy_correction="mis", is_level="token", is_cap=2.0,
                is_lower=0.6, icepop_beta=2.0)
    base.update(kw)
    return SimpleNamespace(**base)


def _micro_batch(rows, lp, old, behav, mask, adv, stale=None):
    extras = {"old_log_probs": old[rows], "behaviour_log_probs": behav[rows]}
    if stale is not None:
        extras["token_staleness"] = stale[rows]
    z = torch.zeros(len(rows), 4, dtype=torch.long)
    return MicroBatch(z, z, mask[rows], adv[rows], list(rows), [0] * len(rows), [4] * len(rows), extras)


def test_closure_passes_extras_and_reduces_metrics_over_micro_batches():
    lp, old, behav, mask, adv = _batch()
    stale = torch.tensor([[0, 1, 3, 0], [2, 0, 0, 0], [0] * 4, [5] * 4], dtype=torch.float32)
    fn = policy_loss(_algo(), global_num_tokens=N_TOKENS, global_num_seqs=N_SEQS, max_staleness=2)
    outs, total = [], 0.0
    for rows in ([0, 2], [1, 3]):  # row 0 (3 loss tokens) with the empty row; row 1 (2) with the aborted one
        idx = torch.tensor(rows)
        loss, out = fn(lp[idx], torch.zeros(2, 4, dtype=F64), _micro_batch(idx, lp, old, behav, mask, adv, stale))
        loss.backward()
        total += loss.item()
        outs.append(out)
    # mis token [0.6, 2]: row 0 keeps only w = 1.2 (token 2 is also stale), row 1 keeps w = 0.9
    want = (1.2 * -1.28 + 0.9 * 1.1) / 5
    assert total == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(
        [[0, 0, 0, 0], [0, 0.9 * 1.1 / 5, 0, 0], [0] * 4, [0] * 4], dtype=F64), rtol=1e-12, atol=1e-15)
    m = combine_micro_batch_metrics(outs)
    assert m["pg_loss"] == pytest.approx(want, rel=1e-12)
    assert m["is_weight_mean"] == pytest.approx((0.5 + 1.2 + 3.0 + 2.5 + 0.9) / 5, rel=1e-12)
    assert m["is_weight_max"] == pytest.approx(3.0, rel=1e-12)  # max over micro-batches, not a share sum
    assert [o["is_weight_max"] for o in outs] == pytest.approx([3.0, 2.5], rel=1e-12)
    assert m["is_masked_frac"] == pytest.approx(3 / 5, rel=1e-12)
    assert m["over_bound_token_frac"] == pytest.approx(1 / 5, rel=1e-12)
    assert m["behav_prox_kl"] == pytest.approx(BEHAV_PROX_KL, rel=1e-12)


def test_closure_without_behaviour_extra():
    lp, old, behav, mask, adv = _batch(False)
    mb = _micro_batch(torch.arange(4), lp, old, behav, mask, adv)
    del mb.extras["behaviour_log_probs"]
    with pytest.raises(ValueError, match="algorithm.off_policy_correction"):
        policy_loss(_algo(), global_num_tokens=N_TOKENS, global_num_seqs=N_SEQS)(lp, torch.zeros_like(lp), mb)
    _, out = policy_loss(_algo(off_policy_correction="none"), global_num_tokens=N_TOKENS,
                         global_num_seqs=N_SEQS)(lp, torch.zeros_like(lp), mb)
    assert "is_weight_mean" not in out and "over_bound_token_frac" not in out
    with pytest.raises(ValueError, match="token_staleness"):
        policy_loss(_algo(off_policy_correction="none"), global_num_tokens=N_TOKENS, global_num_seqs=N_SEQS,
                    max_staleness=1)(lp, torch.zeros_like(lp), mb)


def test_combine_micro_batch_metrics_rule():
    outs = [{"a": 1.0, "x_max": 2.0}, {"a": torch.tensor(0.5), "x_max": 5.0, "b": 1.0}, {"x_max": -1.0}]
    assert combine_micro_batch_metrics(outs) == {"a": 1.5, "x_max": 5.0, "b": 1.0}
