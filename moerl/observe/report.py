"""What the main job prints once and every step: the step-0 checks and the step line."""

from __future__ import annotations

from moerl.runtime.world import log


STEP0_LOGPROB_TOL = 1e-5


def step0_check(m: dict) -> dict:
    """The step-0 checks, printed every run: right after a weight sync the trainer's log-probs of the
    rollout tokens match the server's (mean |diff| <= 1e-5 in fp32), and the policy ratio is exactly
    1 before the first update (sum over tokens of |log_probs - old_log_probs| == 0)."""
    lp = m.get("logprob_abs_diff_mean", float("nan"))
    dev = m.get("train/logratio_abs_sum", float("nan"))
    res = {
        "logprob_abs_diff_mean": lp,
        "logprob_abs_diff_max": m.get("logprob_abs_diff_max", float("nan")),
        "logprob_pass": bool(lp <= STEP0_LOGPROB_TOL),
        "logratio_abs_sum": dev,
        "ratio_pass": bool(dev == 0.0),
    }
    log(
        f"STEP-0 CHECK: trainer vs rollout-server log-probs mean |diff| {lp:.2e} (max {res['logprob_abs_diff_max']:.2e}, "
        f"tolerance {STEP0_LOGPROB_TOL:g}): {'PASS' if res['logprob_pass'] else 'FAIL'}; policy ratio before the first "
        f"update: sum |log ratio| = {dev:g} (exactly 1): {'PASS' if res['ratio_pass'] else 'FAIL'}"
    )
    return res


def step_line(step: int, total: int, m: dict, eta: float) -> str:
    g = lambda k, fmt="{:.3f}": fmt.format(m[k]) if k in m else "-"  # noqa: E731
    t = " ".join(f"{k[5:]} {v:.2f}s" for k, v in m.items() if k.startswith("time/"))
    if "rollout/reward_s" in m:  # scoring runs in the reward workers, inside the rollout phase
        t += f" (reward {m['rollout/reward_s']:.2f}s" + (f", {m['rollout/reward_errors']:.0f} errors)"
                                                        if m.get("rollout/reward_errors") else ")")
    line = (
        f"step {step}/{total} reward {g('reward_mean')} acc {g('accuracy')} "
        f"kl {g('train/kl', '{:.2e}')} entropy {g('train/entropy')} aux {g('train/aux_loss', '{:.4f}')} "
        f"resp_len {g('response_length', '{:.2f}')} lp_diff {g('logprob_abs_diff_mean', '{:.1e}')} "
        f"mis_kl {g('rollout/mismatch_kl_k3', '{:.1e}')} "
        f"ratio {g('train/ratio_mean', '{:.6f}')} pack_util {g('train/pack_utilisation')} "
        f"stale {g('staleness/mean', '{:.2f}')} | {t} | eta {eta:.0f}s"
    )
    if "eval/accuracy" in m:
        line += f" | EVAL greedy acc {m['eval/accuracy']:.4f}"
    return line
