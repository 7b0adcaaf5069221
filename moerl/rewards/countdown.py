"""The Countdown verifier: combine the given numbers with + - * / and parentheses to hit a target.

Task format (as in TinyZero / the Countdown RL recipes): ``label`` is the target integer as text,
``metadata["numbers"]`` the list of integers that may be used. Expressions are parsed with ``ast``
and evaluated over exact fractions by a tiny interpreter that knows only integers, the four binary
operators and parentheses: no ``eval``, so ``__import__('os')...`` is just an invalid answer.
"""

from __future__ import annotations

import ast
from collections import Counter
from fractions import Fraction
from typing import Any

from moerl.rewards.registry import as_metadata
from moerl.rewards.text import answer_tag

MAX_EXPRESSION_CHARS = 1000  # longer answers are invalid (bounds parse and big-integer work)

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


class _Invalid(Exception):
    pass


def _eval(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left, used), _eval(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise _Invalid("division by zero")
        return _OPS[type(node.op)](left, right)
    raise _Invalid(f"not allowed: {type(node).__name__}")


def countdown_answer(response: str) -> str:
    """The answer part of a response: the text in the last ``<answer>...</answer>`` tag if there is
    one, else the last non-empty line; stripped."""
    if not isinstance(response, str):
        return ""
    tagged = answer_tag(response)
    if tagged is not None:
        return tagged.strip()
    lines = [ln for ln in response.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def evaluate_countdown(expression: str, numbers: list[int]) -> Fraction | None:
    """The exact value of ``expression`` if it is valid for ``numbers``, else None.

    Valid: at most ``MAX_EXPRESSION_CHARS`` characters, a Python-syntax expression of non-negative
    integer literals, binary ``+ - * /`` and parentheses only (no unary minus, no ``**``, no names,
    no calls, no floats), using each entry of ``numbers`` at most once (a number listed twice may be
    used twice) and no other number, without division by zero.
    """
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval")
        used: list[int] = []
        value = _eval(tree, used)
    except (SyntaxError, ValueError, _Invalid, RecursionError, MemoryError):
        return None
    if Counter(used) - Counter(numbers):  # some number used more often than given (or not given)
        return None
    return value


def check_countdown_label(label: Any, metadata: Any = None) -> None:
    """The ``check_label`` hook of ``countdown``: the label (the target) must be an integer and, when
    ``metadata`` is given, ``metadata["numbers"]`` a list of ints.

    Raises:
        ValueError: either is not.
    """
    try:
        int(str(label).strip())
    except ValueError:
        raise ValueError(f"countdown: label {label!r} is not an integer target (check data.label_key)") from None
    if metadata is not None:
        _numbers(metadata)


def _numbers(metadata: Any) -> list[int]:
    numbers = as_metadata(metadata).get("numbers")
    if not isinstance(numbers, (list, tuple)) or not all(type(x) is int for x in numbers):
        raise ValueError(f"countdown: metadata['numbers'] must be a list of ints (the numbers the expression may "
                         f"use), got {numbers!r:.200}")
    return list(numbers)


def countdown_reward(response: str, label: str, metadata: Any) -> float:
    """1.0 iff the response's answer (``countdown_answer``) is a valid expression over
    ``metadata["numbers"]`` (``evaluate_countdown``) whose value equals ``int(label)`` within 1e-6;
    else 0.0. Invalid or malicious answers score 0.0, never raise.

    Args:
        response: decoded response text.
        label: the target integer as text.
        metadata: dict (or JSON object string) with ``"numbers"``: list of ints.

    Raises:
        ValueError: ``label`` is not an integer or ``metadata["numbers"]`` is missing / not a list of
            ints (data errors, not model errors).
    """
    check_countdown_label(label)
    target = int(str(label).strip())
    value = evaluate_countdown(countdown_answer(response), _numbers(metadata))
    if value is None:
        return 0.0
    return 1.0 if abs(value - target) <= Fraction(1, 10**6) else 0.0
