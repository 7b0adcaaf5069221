"""``eval.stop_at_gain``: RL ends at the first periodic greedy eval at least that far above the warm start.

The decision is the same on every rank (every rank sees the broadcast eval accuracy). A run that stopped
early records ``summary["stopped_at_step"]``; resumed, it stays stopped unless resumed with
``eval.stop_at_gain=null``, which lets RL go on to ``train.num_steps``.
"""

from __future__ import annotations

from moerl.runtime.world import log


def stop_at_gain(cfg, metrics: dict, summary: dict) -> bool:
    """True when ``eval.stop_at_gain`` is set and this step's greedy eval (``metrics["eval/accuracy"]``, a
    fraction of eval.num_prompts held-out prompts) is at least that much above
    ``summary["accuracy_after_warm_start"]``; False on steps without an eval."""
    gain = cfg.eval.stop_at_gain
    if gain is None or "eval/accuracy" not in metrics:
        return False
    return metrics["eval/accuracy"] - summary["accuracy_after_warm_start"] >= gain - 1e-9


def first_rl_step(cfg, summary: dict, first: int) -> int:
    """The first RL step to run: ``first`` (the step after the checkpoint's), or past ``train.num_steps``
    when the resumed run had been ended by eval.stop_at_gain and the recipe still sets it. Logs when the
    key cannot act (``eval.every_steps=0``: no evals during RL)."""
    if cfg.eval.stop_at_gain is not None and not cfg.eval.every_steps:
        log(f"eval.stop_at_gain={cfg.eval.stop_at_gain} has no effect: eval.every_steps=0 (no evals during RL)")
    if "stopped_at_step" in summary:
        if cfg.eval.stop_at_gain is not None:
            return cfg.train.num_steps + 1
        del summary["stopped_at_step"]  # resumed with eval.stop_at_gain=null: RL goes on to train.num_steps
    return first


def should_stop(cfg, step: int, metrics: dict, summary: dict) -> bool:
    """Whether RL ends after ``step``: :func:`stop_at_gain` on a step before the last (stopping on the last
    step is no early stop, so a resume with more train.num_steps goes on); records
    ``summary["stopped_at_step"]`` and logs the decision."""
    if step >= cfg.train.num_steps or not stop_at_gain(cfg, metrics, summary):
        return False
    summary["stopped_at_step"] = step
    log(f"eval.stop_at_gain: greedy accuracy {metrics['eval/accuracy']:.4f} is >= "
        f"{cfg.eval.stop_at_gain:+.2f} over the warm start at step {step}: RL ends here")
    return True
