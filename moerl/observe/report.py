"""What the main job prints once and every step: the step-0 checks and the step line."""

from __future__ import annotations

from moerl.runtime.world import log


STEP0_LOGPROB_TOL = 1e-5
# model.params_dtype or rollout.dtype bfloat16: trainer (Megatron) and server (transformers) round
# differently. Each side's log-softmax inherits the BF16 rounding of its logits, |dlog p| <= 2 u max|dz|
# with u = 2^-8 per rounding, and a few roundings (logits, last hidden state, attention/MLP outputs) of
# logits of a few units: 8u = 2^-5 bounds the MEAN |diff| (measured on the demo: 1.2e-2; the max, where a
# near-tie flips an expert choice, can reach ~1, so it is not checked).
STEP0_LOGPROB_TOL_BF16 = 2.0 ** -5
# rollout.weight_dtype fp8: every Linear weight of the servers is rounded once to E4M3 (relative rounding
# u = 2^-4, 3 mantissa bits) in 128x128 blocks; the rounding errors of a dot product's terms are independent
# and cancel in part, so a logit moves by well under u |z|; 2u = 2^-3 bounds the MEAN |diff| (measured on
# the demo's first step: 1.7e-2; the max is not checked, as for bf16).
STEP0_LOGPROB_TOL_FP8 = 2.0 ** -3


def step0_logprob_tolerance(cfg) -> float:
    """The step-0 log-prob tolerance of a recipe: 1e-5 when trainer and servers run in float32
    (model.params_dtype; rollout.dtype, see moerl.models.dtypes.rollout_serving_dtype),
    :data:`STEP0_LOGPROB_TOL_BF16` when either runs in bfloat16 (or SGLang chooses, or the weights
    travel as rollout.weight_dtype=bf16), :data:`STEP0_LOGPROB_TOL_FP8` with FP8 rollout weights."""
    from moerl.models.dtypes import rollout_serving_dtype

    weight_dtype = getattr(cfg.rollout, "weight_dtype", "auto")
    if weight_dtype == "fp8":
        return STEP0_LOGPROB_TOL_FP8
    fp32 = (cfg.model.params_dtype == "float32" and rollout_serving_dtype(cfg.rollout) == "float32"
            and weight_dtype == "auto")
    return STEP0_LOGPROB_TOL if fp32 else STEP0_LOGPROB_TOL_BF16


def step0_check(m: dict, tol: float = STEP0_LOGPROB_TOL) -> dict:
    """The step-0 checks, printed every run: right after a weight sync the trainer's log-probs of the
    rollout tokens match the server's (mean |diff| <= ``tol``: 1e-5 in fp32, see
    :func:`step0_logprob_tolerance`), and the policy ratio is exactly 1 before the first update (sum over
    tokens of |log_probs - old_log_probs| == 0; by construction when the old log-probs came from the update's
    own forward: ``ratio_by_construction``)."""
    lp = m.get("logprob_abs_diff_mean", float("nan"))
    dev = m.get("train/logratio_abs_sum", float("nan"))
    res = {
        "logprob_abs_diff_mean": lp,
        "logprob_abs_diff_max": m.get("logprob_abs_diff_max", float("nan")),
        "logprob_pass": bool(lp <= tol),
        "logprob_tolerance": tol,
        "logratio_abs_sum": dev,
        "ratio_pass": bool(dev == 0.0),
        "ratio_by_construction": bool(m.get("train/old_log_probs_from_update")),
    }
    how = (" by construction: the old log-probs were the update's own forward (algorithm.recompute_old_log_probs)"
           if res["ratio_by_construction"] else "")
    log(
        f"STEP-0 CHECK: trainer vs rollout-server log-probs mean |diff| {lp:.2e} (max {res['logprob_abs_diff_max']:.2e}, "
        f"tolerance {tol:g}): {'PASS' if res['logprob_pass'] else 'FAIL'}; policy ratio before the first "
        f"update: sum |log ratio| = {dev:g} (exactly 1{how}): {'PASS' if res['ratio_pass'] else 'FAIL'}"
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
