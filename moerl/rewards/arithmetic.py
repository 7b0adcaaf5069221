"""Exact-answer verifier for arithmetic (and any integer-answer) tasks: a 0/1 reward."""

from __future__ import annotations

import re

_LEADING_DIGITS = re.compile(r"[0-9]*")


def _canonical_int(text: str) -> str | None:
    """Decimal digits without leading zeros ("0042" -> "42", "0" -> "0"), or None if not all digits."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    return text.lstrip("0") or "0"


def check_arithmetic_label(label, metadata=None) -> None:
    """The ``check_label`` hook of ``arithmetic``: ``label`` must be a non-negative integer (text or int).

    Raises:
        ValueError: it is not (the same message ``arithmetic_reward`` raises).
    """
    if _canonical_int(str(label).strip()) is None:
        raise ValueError(f"arithmetic_reward: label {label!r} is not a non-negative integer (check data.label_key)")


def arithmetic_reward(response_text: str, label: str) -> float:
    """1.0 iff the response's leading integer equals ``label`` as an integer, else 0.0.

    The answer is the run of ASCII digits at the start of the response after optional spaces
    (``"  579 apples"`` -> 579; ``"579abc"`` -> 579; ``"5 79"`` -> 5). Special tokens must already be
    stripped (decode with ``skip_special_tokens=True``). Leading zeros do not matter ("0579" == 579).
    Empty or garbage responses (no leading digit) score 0.0. Integers are compared as digit strings,
    so arbitrarily long responses are safe.

    Args:
        response_text: decoded response (str).
        label: the gold answer, a non-negative integer as text (surrounding whitespace allowed); an
            ``int`` is accepted too.

    Raises:
        ValueError: ``label`` is not a non-negative integer (a data error, not a model error).
    """
    check_arithmetic_label(label)
    gold = _canonical_int(str(label).strip())
    if not isinstance(response_text, str):
        return 0.0
    digits = _LEADING_DIGITS.match(response_text.lstrip(" ")).group(0)
    answer = _canonical_int(digits)
    return 1.0 if answer is not None and answer == gold else 0.0
