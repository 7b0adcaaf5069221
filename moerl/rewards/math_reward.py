"""The ``math`` verifier: answer equivalence with Hugging Face's math-verify (``math_verify.parse`` /
``math_verify.verify``, https://github.com/huggingface/Math-Verify), imported lazily."""

from __future__ import annotations

from typing import Any, Optional

_BOXED = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> Optional[str]:
    """The content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced, or
    None if there is none (or its braces never close)."""
    start = max(text.rfind(tag) for tag in _BOXED)
    while start >= 0:
        i = text.find("{", start)
        if i >= 0 and text[start:i].strip() in _BOXED:
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
        start = max(text.rfind(tag, 0, start) for tag in _BOXED)
    return None


def _parse(text: str) -> list:
    from math_verify import parse

    # parsing_timeout=None: math-verify's own timeout uses signal.alarm, which fails outside the main
    # thread; the reward pool enforces reward.timeout_s from outside instead.
    return parse(text, parsing_timeout=None)


def parse_gold(label: str) -> list:
    """math-verify's parse of a gold answer. A bare label (no ``$`` and no ``\\boxed``) is parsed inside
    ``$...$`` first, since bare LaTeX such as ``2\\pi`` or ``(1,2)`` is read whole only inside math
    delimiters (as written, math-verify would take the ``2`` of ``2\\pi``); then as written. ``[]`` if
    neither parses."""
    label = str(label).strip()
    gold = []
    if "$" not in label and "\\boxed" not in label:
        gold = _parse(f"${label}$")
    return gold or _parse(label)


def math_reward(response: str, label: str, metadata: Any = None) -> float:
    """1.0 iff the response's final answer is mathematically equivalent to ``label``, else 0.0.

    The answer: the content of the LAST ``\\boxed{}`` if the response has one (math-verify alone
    would take every boxed answer as a set); else what ``math_verify.parse`` extracts from the whole
    response (the last number / LaTeX expression). Equivalence is ``math_verify.verify(gold, answer)``:
    ``\\frac{1}{2}``, ``0.5`` and ``1/2`` are equal; ``\\sqrt{4}`` equals 2; a percentage ``50\\%`` is
    0.5; text units are dropped (``5 cm`` and ``\\boxed{5\\text{ cm}}`` both equal 5); floats compare
    after rounding to 6 decimals. Math-verify's own signal-based timeouts are off (see ``_parse``);
    run it in the reward pool for a wall-clock limit.

    A gold that math-verify cannot parse falls back to an exact comparison of whitespace-collapsed
    text with the answer (boxed content, else the stripped response). Empty / non-str responses
    score 0.0. ``metadata`` is ignored.
    """
    from math_verify import verify

    from moerl.rewards.text import collapse_ws

    if not isinstance(response, str) or not response.strip():
        return 0.0
    boxed = last_boxed(response)
    gold = parse_gold(label)
    if not gold:
        answer_text = boxed if boxed is not None else response
        return 1.0 if collapse_ws(answer_text) == collapse_ws(label) else 0.0
    answer = _parse("\\boxed{" + boxed + "}" if boxed is not None else response)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=None) else 0.0
