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


# --------------------------------------------------------------------------- built-in verifiers (issue #12)

import json  # noqa: E402
import textwrap  # noqa: E402

from moerl.rewards import (  # noqa: E402
    RewardConfigError,
    RewardValueError,
    check_label,
    countdown_reward,
    exact_match_reward,
    math_reward,
    normalize_reward,
    reasoning_gym_reward,
    resolve_reward_fn,
)
from moerl.rewards.math_reward import last_boxed  # noqa: E402


def test_builtins_registered():
    assert {"arithmetic", "math", "exact_match", "countdown", "reasoning_gym"} <= set(available_reward_fns())


@pytest.mark.parametrize(
    "response,gold,expected",
    [
        # fractions: LaTeX, decimal and slash forms are one number
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("1/2", "0.5", 1.0),
        ("The answer is 1/2", "\\frac{1}{2}", 1.0),
        ("Final: 0.50", "1/2", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),  # 6-decimal rounding: 0.333 != 0.333333
        # \boxed: the LAST box is the answer (math-verify alone would read {7, 9} as a set)
        ("First 2 then \\boxed{7} and \\boxed{9}", "9", 1.0),
        ("First 2 then \\boxed{7} and \\boxed{9}", "7", 0.0),
        ("\\boxed{5", "5", 0.0),  # unclosed box: nothing to read
        # plain answers: the last number
        ("x = 3, so answer 4", "4", 1.0),
        ("x = 3, so answer 4", "3", 0.0),
        ("answer: 12", "12.0", 1.0),
        ("1,000", "1000", 1.0),
        # units are dropped by math-verify's normalisation (sensible for a numeric gold)
        ("5 cm", "5", 1.0),
        ("\\boxed{5\\text{ cm}}", "5", 1.0),
        ("The result is 5 cm.", "5 cm", 1.0),
        # negative numbers
        ("-3", "-3", 1.0),
        ("The answer is \\boxed{-3}.", "-3", 1.0),
        ("\\boxed{3}", "-3", 0.0),
        ("\\boxed{-\\frac{3}{2}}", "-1.5", 1.0),
        ("\\boxed{-1.5}", "1.5", 0.0),
        # symbolic equivalence, roots, powers, constants, tuples, text
        ("$\\sqrt{4}$", "2", 1.0),
        ("\\boxed{1000000}", "10^6", 1.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{2\\pi}", "2\\pi", 1.0),
        ("\\boxed{(1,2)}", "(1,2)", 1.0),  # a bare-LaTeX gold is parsed inside $...$
        ("\\boxed{\\text{Paris}}", "Paris", 1.0),
        # wrong and empty answers
        ("\\boxed{6}", "5", 0.0),
        ("\\boxed{12.5}", "12.49", 0.0),
        ("no answer here", "3", 0.0),
        ("", "5", 0.0),
        ("   \n", "5", 0.0),
    ],
)
def test_math_reward_hand_cases(response, gold, expected):
    r = math_reward(response, gold, {})
    assert isinstance(r, float) and r == expected


def test_math_reward_percent_is_lenient():
    # math-verify accepts a percentage against both the percent number and the fraction.
    assert math_reward("\\boxed{50\\%}", "0.5") == 1.0
    assert math_reward("\\boxed{50\\%}", "50") == 1.0
    assert math_reward("\\boxed{40\\%}", "0.5") == 0.0


def test_math_reward_works_outside_the_main_thread():
    # math-verify's own timeout uses signal.alarm (main thread only); we turn it off.
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{1}{2}}", "0.5")))
    t.start()
    t.join()
    assert out == [1.0]


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{{a}{b}}") == "{a}{b}"
    assert last_boxed("\\fbox{3}") == "3"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{2} then \\boxed{3") == "2"  # an unclosed last box: the previous one


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("Paris", "Paris", 1.0),
        ("  Paris \n", "Paris", 1.0),
        ("New  York", "New York", 1.0),
        ("New\n\tYork ", " New York", 1.0),
        ("paris", "Paris", 0.0),  # case-sensitive
        ("Paris.", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("", "", 1.0),
        ("NewYork", "New York", 0.0),
    ],
)
def test_exact_match(response, label, expected):
    assert exact_match_reward(response, label) == expected
    assert resolve_reward_fn("exact_match")(response, label, {}) == expected


@pytest.mark.parametrize(
    "response,target,numbers,expected",
    [
        ("<answer>(6 + 4) * 2</answer>", "20", [6, 4, 2], 1.0),
        ("Let me think.\n(6+4)*2", "20", [6, 4, 2], 1.0),  # no tag: the last line
        ("<answer>6 * 4</answer>", "24", [6, 4, 2], 1.0),  # not every number must be used
        ("<answer>100 / 4 - 1</answer>", "24", [100, 4, 1], 1.0),  # division
        ("<answer>(8 / 3) * 3</answer>", "8", [8, 3, 3], 1.0),  # exact fractions: 8/3*3 == 8
        ("<answer>7 / 2</answer>", "3", [7, 2], 0.0),  # 3.5, not an integer division
        ("<answer>6 * 4 - 6</answer>", "18", [6, 4, 2], 0.0),  # reuses 6
        ("<answer>2 * 2</answer>", "4", [2, 2, 5], 1.0),  # 2 is given twice
        ("<answer>6 * 5</answer>", "30", [6, 4, 2], 0.0),  # 5 is not given
        ("<answer>(6 + 4) * 2</answer>", "21", [6, 4, 2], 0.0),  # wrong value
        ("<answer>6 / (4 - 4)</answer>", "0", [6, 4, 4], 0.0),  # division by zero
        ("<answer>-6 + 8</answer>", "2", [6, 8], 0.0),  # no unary minus
        ("<answer>2 ** 3</answer>", "8", [2, 3], 0.0),  # no power
        ("<answer>6.0 + 2</answer>", "8", [6, 2], 0.0),  # integers only
        ("<answer>(6 + 4) * 2 = 20</answer>", "20", [6, 4, 2], 0.0),  # an equation is not an expression
        ("<answer>__import__('os').system('true')</answer>", "0", [1], 0.0),
        ("<answer>[x for x in ()]</answer>", "0", [1], 0.0),
        ("<answer>" + "(" * 300 + "1" + ")" * 300 + "</answer>", "1", [1], 0.0),  # nested too deep
        ("<answer>1 +</answer>", "1", [1], 0.0),
        ("<answer>1</answer> then <answer>2</answer>", "2", [1, 2], 1.0),  # the last tag
        ("", "1", [1], 0.0),
    ],
)
def test_countdown(response, target, numbers, expected):
    assert countdown_reward(response, target, {"numbers": numbers}) == expected


def test_countdown_metadata_as_json_and_bad_data():
    assert countdown_reward("6*4", "24", json.dumps({"numbers": [6, 4]})) == 1.0
    with pytest.raises(ValueError, match="numbers"):
        countdown_reward("6*4", "24", {})
    with pytest.raises(ValueError, match="not an integer target"):
        countdown_reward("6*4", "x", {"numbers": [6, 4]})
    check_label("countdown", "24")
    with pytest.raises(ValueError, match="not an integer target"):
        check_label("countdown", "twenty")
    # with the row's metadata (moerl train checks every row before any work): numbers must be given
    check_label("countdown", "24", {"numbers": [6, 4]})
    for bad in ({}, {"numbers": "x"}, {"numbers": [6, 4.0]}):
        with pytest.raises(ValueError, match=r"metadata\['numbers'\] must be a list of ints"):
            check_label("countdown", "24", bad)


def _chain_sum_entries(n=6):
    import reasoning_gym

    return list(reasoning_gym.create_dataset("chain_sum", size=n, seed=7))


def test_reasoning_gym_chain_sum():
    for e in _chain_sum_entries():
        gold = int(e["answer"])
        md = dict(e["metadata"], question=e["question"])
        assert reasoning_gym_reward(f"<answer>{gold}</answer>", e["answer"], md) == 1.0
        assert reasoning_gym_reward(f"  {gold} \n", e["answer"], md) == 1.0  # no tag: the stripped response
        assert reasoning_gym_reward(f"<answer>{gold + 1}</answer>", e["answer"], md) < 1.0
        assert reasoning_gym_reward("I don't know", e["answer"], md) < 1.0
        # metadata as a JSON string, through the resolver
        assert resolve_reward_fn("reasoning_gym")(str(gold), e["answer"], json.dumps(e["metadata"])) == 1.0
    with pytest.raises(ValueError, match="source_dataset"):
        reasoning_gym_reward("1", "1", {})


def test_check_label():
    check_label("arithmetic", "12")
    check_label("arithmetic", 12)
    with pytest.raises(ValueError, match="not a non-negative integer"):
        check_label("arithmetic", "-3")
    check_label("math", "anything")  # no hook: nothing happens
    check_label("/some/file.py:fn", "anything")


@pytest.mark.parametrize(
    "out,expected",
    [
        (1.0, (1.0, {})),
        (0, (0.0, {})),
        (True, (1.0, {})),
        ({"score": 0.5}, (0.5, {})),
        ({"score": 1, "format": 1.0, "len": 3, "note": "text dropped"}, (1.0, {"format": 1.0, "len": 3.0})),
    ],
)
def test_normalize_reward(out, expected):
    score, metrics = normalize_reward(out)
    assert (score, metrics) == expected and type(score) is float


@pytest.mark.parametrize(
    "out,match",
    [
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        ({"score": float("nan")}, "finite"),
        ({"format": 1.0}, "no 'score'"),
        ({"score": "1"}, "must be a float"),
        ("1.0", "must be a float"),
        (None, "must be a float"),
        ([1.0], "must be a float"),
    ],
)
def test_normalize_reward_rejects(out, match):
    with pytest.raises(RewardValueError, match=match):
        normalize_reward(out)


_USER_REWARDS = textwrap.dedent('''
    def two_arg(response, label):
        return float(response == label)

    def three_arg(response, label, metadata):
        return float(response == label) * metadata.get("scale", 1.0)

    def with_metrics(response, label, metadata=None):
        return {"score": float(response == label), "length": len(response)}

    def group_rank(responses, label, metadata):
        order = sorted(range(len(responses)), key=lambda i: responses[i])
        return [float(order.index(i)) for i in range(len(responses))]

    def one_arg(response):
        return 1.0

    def four_arg(response, label, metadata, extra):
        return 1.0

    NOT_CALLABLE = 3
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "outside_pkg" / "my_rewards.py"
    path.parent.mkdir()
    path.write_text(_USER_REWARDS)
    return str(path)


def test_resolve_from_file(user_file):
    f = resolve_reward_fn(f"{user_file}:two_arg")
    assert f("a", "a", {"ignored": 1}) == 1.0 and f("a", "b", {}) == 0.0
    f = resolve_reward_fn(f"{user_file}:three_arg")
    assert f("a", "a", {"scale": 0.5}) == 0.5
    f = resolve_reward_fn(f"{user_file}:with_metrics")
    assert normalize_reward(f("abc", "abc", {})) == (1.0, {"length": 3.0})
    g = resolve_reward_fn(f"{user_file}:group_rank", group=True)
    assert g(["b", "c", "a"], "", {}) == [1.0, 2.0, 0.0]


def test_resolve_registered_and_module():
    assert resolve_reward_fn("arithmetic")("579", "579", {}) == 1.0
    f = resolve_reward_fn("moerl.rewards.text:exact_match_reward")
    assert f(" a ", "a", {}) == 1.0
    f = resolve_reward_fn("moerl.rewards.arithmetic:arithmetic_reward")  # 2-arg: metadata dropped
    assert f("12", "12", {"x": 1}) == 1.0


@pytest.mark.parametrize(
    "spec,group,match",
    [
        ("nope", False, r"reward.function='nope' is not a registered reward function; choose one of \[.*'math'"),
        ("no_such_pkg_xyz.mod:fn", False, "reward.function=.*module 'no_such_pkg_xyz.mod' is not importable"),
        ("/no/such/dir/r.py:fn", False, "reward.function=.*file /no/such/dir/r.py does not exist"),
        ("{file}:missing", False, "reward.function=.*has no attribute 'missing'"),
        ("{file}:NOT_CALLABLE", False, "reward.function=.*is a int, not a callable"),
        ("{file}:one_arg", False, "reward.function=.*per-sample reward function must take 2 or 3 positional"),
        ("{file}:four_arg", False, "reward.function=.*per-sample reward function must take 2 or 3 positional"),
        ("{file}:two_arg", True, "reward.function=.*group reward function must take 3 positional"),
        ("moerl.rewards.text:", False, "reward.function=.*expected package.module:function"),
        ("math", True, "reward.function='math' is a per-sample reward function; set reward.group=false"),
        ("", False, "reward.function must be a non-empty string"),
    ],
)
def test_resolve_errors(user_file, spec, group, match):
    with pytest.raises(RewardConfigError, match=match) as exc:
        resolve_reward_fn(spec.format(file=user_file), group=group)
    assert isinstance(exc.value, ValueError)


def test_resolve_file_that_fails_to_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(RewardConfigError, match="reward.function=.*importing .*bad.py failed: RuntimeError"):
        resolve_reward_fn(f"{bad}:fn")


def test_light_import():
    import subprocess
    import sys

    code = ("import sys, moerl.rewards; heavy = [m for m in ('torch', 'transformers', 'math_verify', "
            "'reasoning_gym', 'sympy') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
