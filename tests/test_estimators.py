"""Tests for moerl.algorithms.estimators (RLOO, REINFORCE++, GAE, whitening), shaping (DAPO overlong
penalty, KL in the reward) and value (PPO clipped value loss).

Expected numbers are worked by hand (written out in the comments) or by independent float64
loops written here from the papers' formulas, never by calling the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moerl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    gae_advantages,
    kl_reward_penalty,
    outcome_token_rewards,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    token_returns,
    value_loss,
    whiten,
)

F64 = torch.float64
NAN = float("nan")


def _close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=tol)


def test_estimator_names():
    assert ADVANTAGE_ESTIMATORS == (
        "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"
    )


# ----------------------------------------------------------------------------------------------
# RLOO
# ----------------------------------------------------------------------------------------------


def test_rloo_hand_values():
    # group 1: [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1)/3 = 2/3, A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    # group 2: [2, 5, 5, 0]: A = 2 - 10/3 = -4/3, 5 - 7/3 = 8/3, 8/3, 0 - 4 = -4
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 5.0, 5.0, 0.0], dtype=F64)
    adv = rloo_advantages(rewards, 4)
    _close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, -4 / 3, 8 / 3, 8 / 3, -4.0])
    # G = 2: A_i = r_i - r_other
    _close(rloo_advantages(torch.tensor([2.0, 5.0], dtype=F64), 2), [-3.0, 3.0])


def test_rloo_against_leave_one_out_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(15, generator=g, dtype=F64)
    G = 5
    expected = []
    for i in range(15):
        lo = (i // G) * G
        others = [rewards[j].item() for j in range(lo, lo + G) if j != i]
        expected.append(rewards[i].item() - sum(others) / len(others))
    _close(rloo_advantages(rewards, G), expected, 1e-14)
    assert rloo_advantages(rewards.float(), G).dtype == torch.float32


@pytest.mark.parametrize("group_size", [3, 7, 8])
def test_rloo_identical_rewards_exact_zero_and_group_size_one(group_size):
    adv = rloo_advantages(torch.tensor([0.1] * group_size + [0.7] * group_size), group_size)
    assert torch.equal(adv, torch.zeros(2 * group_size))
    assert torch.equal(rloo_advantages([0.3, -1.0, 2.0], 1), torch.zeros(3))


def test_rloo_errors():
    with pytest.raises(ValueError, match="multiple of group_size"):
        rloo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="NaN"):
        rloo_advantages(torch.tensor([0.0, NAN]), 2)
    with pytest.raises(TypeError):
        rloo_advantages(torch.zeros(4), 2.0)


# ----------------------------------------------------------------------------------------------
# token returns / REINFORCE++
# ----------------------------------------------------------------------------------------------

# rows: 0 = prompt position 0 masked, 3 response tokens; 1 = a single-token response;
# 2 = truncated at max_new_tokens (every position a loss token); 3 = empty (all-zero mask)
MASK = torch.tensor([[0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
OUTCOME = torch.tensor([1.0, -1.0, 0.5, 3.0], dtype=F64)
TOKEN_R = torch.tensor(
    [[NAN, -0.1, -0.2, -0.3], [-0.5, NAN, NAN, NAN], [0.1, 0.1, 0.1, 0.1], [NAN, NAN, NAN, NAN]], dtype=F64
)


def test_outcome_token_rewards_places_outcome_on_last_loss_token():
    r = outcome_token_rewards(OUTCOME, TOKEN_R, MASK)
    _close(r, [[0, -0.1, -0.2, 0.7], [-1.5, 0, 0, 0], [0.1, 0.1, 0.1, 0.6], [0, 0, 0, 0]])
    r = outcome_token_rewards([1.0, -1.0, 0.5, 3.0], None, MASK)
    assert r.dtype == torch.float32
    _close(r, [[0, 0, 0, 1.0], [-1.0, 0, 0, 0], [0, 0, 0, 0.5], [0, 0, 0, 0]])


def test_token_returns_hand_values():
    # gamma = 1: suffix sums of [0, -0.1, -0.2, 0.7] -> [0, 0.4, 0.5, 0.7]; [0.1, 0.1, 0.1, 0.6] -> [0.9, 0.8, 0.7, 0.6]
    g1 = token_returns(OUTCOME, TOKEN_R, MASK, gamma=1.0)
    _close(g1, [[0, 0.4, 0.5, 0.7], [-1.5, 0, 0, 0], [0.9, 0.8, 0.7, 0.6], [0, 0, 0, 0]])
    # gamma = 0.5: row 0: 0.7; -0.2 + 0.35 = 0.15; -0.1 + 0.075 = -0.025
    #              row 2: 0.6; 0.1 + 0.3 = 0.4; 0.1 + 0.2 = 0.3; 0.1 + 0.15 = 0.25
    g5 = token_returns(OUTCOME, TOKEN_R, MASK, gamma=0.5)
    _close(g5, [[0, -0.025, 0.15, 0.7], [-1.5, 0, 0, 0], [0.25, 0.3, 0.4, 0.6], [0, 0, 0, 0]])


def test_token_returns_skip_masked_gap_inside_a_row():
    # loss tokens at 0, 2, 3 (position 1 e.g. a tool output): the gap is not a time step
    mask = torch.tensor([[1, 0, 1, 1]])
    g = token_returns(torch.tensor([1.0], dtype=F64), None, mask, gamma=0.5)
    _close(g, [[0.25, 0.0, 0.5, 1.0]])


def test_token_returns_against_loop():
    gen = torch.Generator().manual_seed(1)
    B, T, gamma = 5, 9, 0.9
    lengths = [1, 9, 4, 7, 9]
    mask = torch.zeros(B, T, dtype=torch.int64)
    for i, n in enumerate(lengths):
        mask[i, T - n:] = 1  # left-padded rows (prompt first)
    outcome = torch.randn(B, generator=gen, dtype=F64)
    dense = torch.randn(B, T, generator=gen, dtype=F64)
    expected = torch.zeros(B, T, dtype=F64)
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        r = [dense[i, t].item() for t in idx]
        r[-1] += outcome[i].item()
        for k, t in enumerate(idx):
            expected[i, t] = sum(gamma ** (j - k) * r[j] for j in range(k, len(idx)))
    _close(token_returns(outcome, dense, mask, gamma), expected, 1e-12)


def test_reinforce_pp_and_baseline():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.3], dtype=F64)
    kl_r = torch.full((4, 4), -0.1, dtype=F64)
    # REINFORCE++: returns of the raw rewards (gamma 1): row 0: 1 - 0.3, 1 - 0.2, 1 - 0.1
    a = reinforce_pp_advantages(rewards, mask, token_rewards=kl_r)
    _close(a, [[0.7, 0.8, 0.9, 0], [-0.1, 0, 0, 0], [-0.1, 0.0, 0.1, 0.2], [0.1, 0.2, 0, 0]])
    # baseline (G = 2): group 1 [1, 0] -> [0.5, -0.5]; group 2 [0.3, 0.3] identical -> exactly 0
    b = reinforce_pp_advantages(rewards, mask, token_rewards=kl_r, group_size=2, baseline=True)
    _close(b, [[0.2, 0.3, 0.4, 0], [-0.6, 0, 0, 0], [-0.4, -0.3, -0.2, -0.1], [-0.2, -0.1, 0, 0]])
    c = reinforce_pp_advantages(rewards, mask, group_size=2, baseline=True)
    assert torch.equal(c[2:], torch.zeros(2, 4, dtype=F64))  # identical group: exact zeros
    _close(c[:2], [[0.5, 0.5, 0.5, 0], [-0.5, 0, 0, 0]])
    with pytest.raises(ValueError, match="group_size"):
        reinforce_pp_advantages(rewards, mask, baseline=True)
    with pytest.raises(ValueError, match="multiple of group_size"):
        reinforce_pp_advantages(rewards, mask, group_size=3, baseline=True)


def test_token_returns_errors():
    with pytest.raises(ValueError, match="outcome_rewards"):
        token_returns(torch.zeros(3), None, MASK)
    with pytest.raises(ValueError, match="token_rewards"):
        token_returns(OUTCOME, torch.zeros(4, 3), MASK)
    with pytest.raises(ValueError, match="gamma"):
        token_returns(OUTCOME, None, MASK, gamma=1.5)
    with pytest.raises(ValueError, match="NaN"):
        token_returns(OUTCOME, torch.full((4, 4), NAN), MASK)  # NaN on loss tokens is refused


# ----------------------------------------------------------------------------------------------
# whitening
# ----------------------------------------------------------------------------------------------


def test_whiten_hand_values():
    values = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # mean 2.5; unbiased var = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    sd = math.sqrt(5 / 3)
    out = whiten(values, mask, eps=0.0)
    _close(out, [[-1.5 / sd, -0.5 / sd, 0], [0.5 / sd, 1.5 / sd, 0]])
    out = whiten(values, mask, eps=0.0, shift_mean=False)
    _close(out, [[-1.5 / sd + 2.5, -0.5 / sd + 2.5, 0], [0.5 / sd + 2.5, 1.5 / sd + 2.5, 0]])
    # eps inside the square root
    out = whiten(values, mask, eps=1.0)
    _close(out[0, 0], -1.5 / math.sqrt(5 / 3 + 1.0))
    assert whiten(values.float(), mask).dtype == torch.float32


def test_whiten_single_token_empty_and_constant():
    # one loss token (a single-token response): variance defined as 0, the token becomes 0
    _close(whiten(torch.tensor([[5.0, 7.0]], dtype=F64), torch.tensor([[1, 0]])), [[0.0, 0.0]])
    assert torch.equal(whiten(torch.ones(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))
    # all-zero advantages (e.g. every group had identical rewards) stay exactly 0
    assert torch.equal(whiten(torch.zeros(2, 3), torch.ones(2, 3)), torch.zeros(2, 3))


def test_whiten_errors():
    with pytest.raises(ValueError, match="shape"):
        whiten(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="eps"):
        whiten(torch.zeros(2, 3), torch.ones(2, 3), eps=-1.0)
    with pytest.raises(ValueError, match="NaN"):
        whiten(torch.tensor([[NAN]]), torch.ones(1, 1))


def _whiten_batch():
    """A global batch of 5 rows (ragged, with a single-token and a full-length row) and its split
    over two DP ranks (2 rows / 3 rows)."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(5, 6, generator=gen, dtype=F64) * 2 + 1
    values[1] += 10.0  # rank 0's tokens have another mean than rank 1's: local stats differ
    lengths = [6, 1, 3, 5, 2]
    mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).to(torch.int64)
    return values, mask


def _whiten_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        values, mask = _whiten_batch()
        rows = slice(0, 2) if rank == 0 else slice(2, 5)
        out = whiten(values[rows], mask[rows], group=dist.group.WORLD)
        out_nomean = whiten(values[rows], mask[rows], shift_mean=False, group=dist.group.WORLD)
        torch.save({"out": out, "nomean": out_nomean}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_whiten_two_dp_ranks_equals_one_rank(tmp_path):
    mp.spawn(_whiten_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    values, mask = _whiten_batch()
    # independent reference: plain Python over the masked values of the concatenated batch
    xs = [values[i, t].item() for i in range(5) for t in range(6) if mask[i, t]]
    mean = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) + 1e-8)
    expected = torch.where(mask.bool(), (values - mean) / sd, torch.zeros_like(values))
    got = torch.cat([r0["out"], r1["out"]])
    _close(got, expected, 1e-12)
    _close(torch.cat([r0["nomean"], r1["nomean"]]), torch.where(mask.bool(), expected + mean, expected), 1e-12)
    _close(whiten(values, mask), expected, 1e-12)  # one rank over the concatenated batch
    # the test can fail: per-rank (local) whitening gives something else
    local = torch.cat([whiten(values[:2], mask[:2]), whiten(values[2:], mask[2:])])
    assert (local - expected).abs().max() > 0.1


# ----------------------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------------------


def test_gae_hand_values():
    # row 0: prompt at 0; r = [., 0, 0, 1], V = [., 0.5, 0.6, 0.7], gamma 0.9, lam 0.8 (gamma*lam = 0.72)
    #   t3: delta = 1 + 0 - 0.7 = 0.3                 A = 0.3
    #   t2: delta = 0 + 0.9*0.7 - 0.6 = 0.03          A = 0.03 + 0.72*0.3 = 0.246
    #   t1: delta = 0 + 0.9*0.6 - 0.5 = 0.04          A = 0.04 + 0.72*0.246 = 0.21712
    # row 1: single-token response r = 2, V = 0.5: A = 1.5, R = 2.0
    r = torch.tensor([[NAN, 0.0, 0.0, 1.0], [2.0, NAN, NAN, NAN]], dtype=F64)
    v = torch.tensor([[NAN, 0.5, 0.6, 0.7], [0.5, NAN, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[0, 1, 1, 1], [1, 0, 0, 0]])
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.8)
    _close(adv, [[0, 0.21712, 0.246, 0.3], [1.5, 0, 0, 0]])
    _close(ret, [[0, 0.71712, 0.846, 1.0], [2.0, 0, 0, 0]])


def test_gae_against_explicit_sum_and_limits():
    gen = torch.Generator().manual_seed(4)
    B, T, gamma, lam = 4, 7, 0.95, 0.7
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0], [0, 1, 0, 1, 1, 1, 0]])
    r = torch.randn(B, T, generator=gen, dtype=F64)
    v = torch.randn(B, T, generator=gen, dtype=F64)
    expected = torch.zeros(B, T, dtype=F64)
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        vals = [v[i, t].item() for t in idx] + [0.0]  # terminal value 0 after the last loss token
        deltas = [r[i, t].item() + gamma * vals[k + 1] - vals[k] for k, t in enumerate(idx)]
        for k, t in enumerate(idx):  # eq. 16: sum_l (gamma lam)^l delta_{t+l}
            expected[i, t] = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(idx) - k))
    adv, ret = gae_advantages(r, v, mask, gamma, lam)
    _close(adv, expected, 1e-12)
    _close(ret, torch.where(mask.bool(), expected + v, torch.zeros_like(v)), 1e-12)
    # lam = 1: A = discounted return - V (Monte Carlo); lam = 0: one-step TD error
    outcome = torch.zeros(B, dtype=F64)
    mc = token_returns(outcome, r, mask, gamma)
    adv1, ret1 = gae_advantages(r, v, mask, gamma, 1.0)
    _close(adv1, torch.where(mask.bool(), mc - v, torch.zeros_like(v)), 1e-12)
    _close(ret1, mc, 1e-12)
    adv0, _ = gae_advantages(r, v, mask, gamma, 0.0)
    # row 0 (all loss tokens), t = 2: delta = r_2 + gamma V_3 - V_2
    assert adv0[0, 2].item() == pytest.approx(r[0, 2].item() + gamma * v[0, 3].item() - v[0, 2].item(), abs=1e-14)
    assert adv0[0, 6].item() == pytest.approx(r[0, 6].item() - v[0, 6].item(), abs=1e-14)  # terminal


def test_gae_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="lam"):
        gae_advantages(z, z, torch.ones(2, 3), 1.0, 1.1)
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(z, z, torch.ones(2, 3), -0.1, 0.9)
    with pytest.raises(ValueError, match="values"):
        gae_advantages(z, torch.zeros(2, 2), torch.ones(2, 3), 1.0, 0.9)


# ----------------------------------------------------------------------------------------------
# shaping
# ----------------------------------------------------------------------------------------------


def test_overlong_penalty_hand_values():
    # L_max 20, L_cache 4, factor 0.5: soft zone 16 < L < 20
    lengths = torch.tensor([0, 5, 16, 17, 19, 20, 25])
    pen = overlong_penalty(lengths, max_new_tokens=20, buffer_len=4, penalty_factor=0.5)
    assert pen.dtype == torch.float32
    # 17: (16 - 17) / 4 * 0.5 = -0.125 ; 19: -3/4 * 0.5 = -0.375 ; >= 20 (truncated): -0.5
    _close(pen, [0.0, 0.0, 0.0, -0.125, -0.375, -0.5, -0.5], 1e-7)
    # buffer = whole range (soft zone starts at 0), factor 1: L = 1 -> -1/4, L = 3 -> -3/4, L = 4 -> -1
    _close(overlong_penalty([0, 1, 3, 4], 4, 4), [0.0, -0.25, -0.75, -1.0], 1e-7)


def test_overlong_penalty_errors():
    for bad in (0, 21, 2.0, -1):
        with pytest.raises(ValueError, match="algorithm.overlong_buffer_len"):
            overlong_penalty([1], max_new_tokens=20, buffer_len=bad)
    with pytest.raises(ValueError, match="overlong_penalty_factor"):
        overlong_penalty([1], 20, 4, penalty_factor=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        overlong_penalty([-1], 20, 4)
    with pytest.raises(ValueError, match="integer"):
        overlong_penalty(torch.tensor([1.5]), 20, 4)


def test_kl_reward_penalty_hand_values():
    lp = torch.tensor([[-1.0, -2.0, NAN]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    # k1: delta = 0.5, -1.0 -> rewards -0.05, +0.1
    _close(kl_reward_penalty(lp, ref, mask, 0.1), [[-0.05, 0.1, 0.0]])
    # k3: exp(-delta) - 1 + delta
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    _close(kl_reward_penalty(lp, ref, mask, 0.1, "k3"), [[-0.1 * k3[0], -0.1 * k3[1], 0.0]])
    z = kl_reward_penalty(torch.full_like(lp, NAN), ref, mask, 0.0)
    assert torch.equal(z, torch.zeros_like(z))  # kl_coef 0: no 0 * NaN
    lpg = lp.clone().requires_grad_(True)
    assert not kl_reward_penalty(lpg, ref, mask, 0.1).requires_grad
    with pytest.raises(ValueError, match="kl_coef"):
        kl_reward_penalty(lp, ref, mask, -0.1)
    with pytest.raises(ValueError, match="estimator"):
        kl_reward_penalty(lp, ref, mask, 0.1, "k4")


# ----------------------------------------------------------------------------------------------
# value loss
# ----------------------------------------------------------------------------------------------

# tokens (clip 0.2): a: V 0.5, V_old 0.3, R 1 -> V_clip 0.5, both terms 0.25 -> 0.125, grad V - R = -0.5
#                    b: V 1.5, V_old 1.0, R 1 -> V_clip 1.2: 0.25 vs 0.04 -> 0.125, grad 0.5
#                    c: V 0.5, V_old 0.0, R 1 -> V_clip 0.2: 0.25 vs 0.64 -> 0.32 (clipped), grad 0
V = [[0.5, 1.5, NAN], [0.5, NAN, NAN]]
V_OLD = [[0.3, 1.0, 0.0], [0.0, 0.0, 0.0]]
RET = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
V_MASK = [[1, 1, 0], [1, 0, 0]]


def _value_inputs():
    v = torch.tensor(V, dtype=F64, requires_grad=True)
    return v, torch.tensor(V_OLD, dtype=F64), torch.tensor(RET, dtype=F64), torch.tensor(V_MASK)


def test_value_loss_hand_values():
    v, old, ret, mask = _value_inputs()
    loss, m = value_loss(v, old, ret, mask, clip=0.2, loss_agg_mode="token-mean", global_num_tokens=3)
    assert loss.item() == pytest.approx((0.125 + 0.125 + 0.32) / 3, abs=1e-14)
    loss.backward()
    _close(v.grad, [[-0.5 / 3, 0.5 / 3, 0.0], [0.0, 0.0, 0.0]])
    assert m["vf_loss"] == pytest.approx(0.19, abs=1e-14)
    assert m["vf_clip_frac"] == pytest.approx(1 / 3)
    assert m["value_mean"] == pytest.approx(2.5 / 3, abs=1e-14)
    v, old, ret, mask = _value_inputs()
    loss, _ = value_loss(v, old, ret, mask, clip=0.2, loss_agg_mode="seq-mean-token-mean", global_num_seqs=2)
    assert loss.item() == pytest.approx(((0.125 + 0.125) / 2 + 0.32) / 2, abs=1e-14)
    # no clipping: 0.5 * (V - R)^2 = 0.125 everywhere, token c gets gradient V - R = -0.5
    v, old, ret, mask = _value_inputs()
    loss, m = value_loss(v, old, ret, mask, clip=None, loss_agg_mode="token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(0.125, abs=1e-14) and m["vf_clip_frac"] == 0.0
    _close(v.grad, [[-0.5 / 3, 0.5 / 3, 0.0], [-0.5 / 3, 0.0, 0.0]])


def test_value_loss_micro_batch_invariant():
    v, old, ret, mask = _value_inputs()
    full, _ = value_loss(v, old, ret, mask, clip=0.2, loss_agg_mode="token-mean", global_num_tokens=3)
    parts = [
        value_loss(v[i:i + 1], old[i:i + 1], ret[i:i + 1], mask[i:i + 1], clip=0.2, loss_agg_mode="token-mean",
                   global_num_tokens=3)[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-15)
    assert parts[0].item() != pytest.approx(full.item())


def test_value_loss_errors():
    v, old, ret, mask = _value_inputs()
    with pytest.raises(ValueError, match="algorithm.value_clip"):
        value_loss(v, old, ret, mask, clip=0.0, loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="returns"):
        value_loss(v, old, ret[:, :2], mask, clip=0.2, loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        value_loss(v, old, ret, mask, clip=0.2, loss_agg_mode="mean")


def test_value_loss_seq_mean_token_sum():
    # sum of token losses 0.57 / (2 seqs * C = 4)
    v, old, ret, mask = _value_inputs()
    loss, _ = value_loss(v, old, ret, mask, clip=0.2, loss_agg_mode="seq-mean-token-sum", global_num_seqs=2,
                         seq_token_sum_constant=4)
    assert loss.item() == pytest.approx(0.57 / 8, abs=1e-14)
