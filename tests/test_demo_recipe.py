"""eval.stop_at_gain (issue #17, demo speed): the recipe key is checked before any work, and the RL loop's
stop decision compares the step's greedy eval with the warm start's on hand-worked accuracies (the
whole demo with the key as shipped is tests/test_main_job.py::test_full_demo_recipe_rl_gain, demo marker)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from moerl.config.loader import ConfigError, load_config
from moerl.train.stop_rule import stop_at_gain as _stop_at_gain

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "tiny_arith.yaml"


@pytest.mark.parametrize("overrides, needles", [
    (["eval.stop_at_gain=0"], ["eval.stop_at_gain", "greater than 0"]),
    (["eval.stop_at_gain=1.5"], ["eval.stop_at_gain", "less than or equal to 1"]),
    (["eval.stop_at_gain=lots"], ["eval.stop_at_gain"]),
])
def test_stop_at_gain_bad_values_name_the_key(overrides, needles):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, overrides)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_demo_stop_leaves_a_margin_over_the_ten_point_check():
    """The shipped demo stops RL at a gain above the demo tests' +10-point check (so stopping at the first
    eval over it cannot be what passes that check), evaluating >= 200 prompts every few steps."""
    cfg = load_config(RECIPE)
    assert cfg.eval.stop_at_gain is not None and cfg.eval.stop_at_gain >= 0.15
    assert cfg.eval.num_prompts >= 200 and 0 < cfg.eval.every_steps <= cfg.train.num_steps
    assert load_config(RECIPE, ["eval.stop_at_gain=null"]).eval.stop_at_gain is None  # all train.num_steps


def _cfg(gain):
    return SimpleNamespace(eval=SimpleNamespace(stop_at_gain=gain))


@pytest.mark.parametrize("gain, acc, expected", [
    (0.15, 190 / 300, True),    # 145/300 -> 190/300: exactly +15 points (45 prompts), float rounding tolerated
    (0.15, 189 / 300, False),   # +14.67 points
    (0.15, 250 / 300, True),
    (0.10, 175 / 300, True),    # +10 points exactly
    (None, 299 / 300, False),   # key unset: never stops
])
def test_stop_decision_on_hand_worked_accuracies(gain, acc, expected):
    summary = {"accuracy_after_warm_start": 145 / 300}
    assert _stop_at_gain(_cfg(gain), {"eval/accuracy": acc}, summary) is expected
    assert _stop_at_gain(_cfg(gain), {"reward_mean": 1.0}, summary) is False  # steps without an eval never stop
