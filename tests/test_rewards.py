"""The arithmetic verifier and the reward registry (moerl/rewards)."""

from __future__ import annotations

import pytest

from moerl.rewards import arithmetic_reward, available_reward_fns, get_reward_fn, register_reward_fn


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("579", "579", 1.0),  # 123+456
        ("579", "578", 0.0),
        ("  579", "579", 1.0),  # leading spaces allowed
        ("579abc", "579", 1.0),  # answer ends at the first non-digit
        ("579 is the answer", "579", 1.0),
        ("5790", "579", 0.0),  # extra digit: a different number
        ("57", "579", 0.0),  # truncated
        ("5 79", "579", 0.0),  # the answer stops at the space
        ("0579", "579", 1.0),  # equal as integers
        ("000", "0", 1.0),
        ("0", "0", 1.0),
        ("", "0", 0.0),  # empty response
        ("   ", "5", 0.0),
        ("abc579", "579", 0.0),  # garbage before the digits
        ("+579", "579", 0.0),
        ("-5", "5", 0.0),
        ("\n579", "579", 0.0),  # only spaces may precede the answer
        ("\u0665\u0667\u0669", "579", 0.0),  # Arabic-Indic digits are not ASCII digits
        ("1998", " 1998\n", 1.0),  # label whitespace is ignored
        ("9" * 5000, "9" * 5000, 1.0),  # longer than Python's int-from-str limit
        ("9" * 5000, "9" * 4999, 0.0),
    ],
)
def test_arithmetic_reward_hand_cases(response, label, expected):
    r = arithmetic_reward(response, label)
    assert isinstance(r, float) and r == expected


def test_arithmetic_reward_int_label_and_non_str_response():
    assert arithmetic_reward("1106", 1106) == 1.0  # 999+107
    assert arithmetic_reward(None, "1") == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize("label", ["", "abc", "-3", "1.5", "12 3"])
def test_arithmetic_reward_rejects_bad_labels(label):
    with pytest.raises(ValueError, match="not a non-negative integer"):
        arithmetic_reward("3", label)


def test_reward_on_generated_problems_brute_force():
    # Every 1-digit problem: the true sum scores 1, sum +- 1 scores 0.
    for a in range(10):
        for b in range(10):
            assert arithmetic_reward(str(a + b), str(a + b)) == 1.0
            assert arithmetic_reward(str(a + b + 1), str(a + b)) == 0.0


def test_registry():
    assert get_reward_fn("arithmetic") is arithmetic_reward
    assert "arithmetic" in available_reward_fns()
    with pytest.raises(ValueError, match="unknown reward function 'nope'; registered: .*arithmetic"):
        get_reward_fn("nope")

    def exact(resp: str, label: str) -> float:
        return float(resp == label)

    register_reward_fn("test_exact_match", exact)
    assert get_reward_fn("test_exact_match")("a", "a") == 1.0
    register_reward_fn("test_exact_match", exact)  # same function again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward_fn("test_exact_match", lambda r, l: 0.0)
    with pytest.raises(TypeError):
        register_reward_fn("test_bad", 3)  # type: ignore[arg-type]
