"""Text helpers shared by the built-in verifiers, and the ``exact_match`` reward."""

from __future__ import annotations

import re
from typing import Any, Optional

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def answer_tag(response: str) -> Optional[str]:
    """The text inside the LAST ``<answer>...</answer>`` of ``response`` (not stripped), or None."""
    found = _ANSWER_TAG.findall(response) if isinstance(response, str) else []
    return found[-1] if found else None


def collapse_ws(text: str) -> str:
    """``text`` stripped, every run of whitespace (spaces, tabs, newlines) replaced by one space."""
    return " ".join(str(text).split())


def exact_match_reward(response: str, label: str, metadata: Any = None) -> float:
    """1.0 iff ``response`` equals ``label`` after stripping and collapsing whitespace (case-sensitive).

    ``"  Paris \\n"`` matches ``"Paris"``; ``"New  York"`` matches ``"New York"``; ``"paris"`` does
    not match ``"Paris"``. A non-str response scores 0.0. ``metadata`` is ignored.
    """
    if not isinstance(response, str):
        return 0.0
    return 1.0 if collapse_ws(response) == collapse_ws(label) else 0.0
