"""The ``reasoning_gym`` verifier: each reasoning-gym dataset's own ``score_answer``
(``reasoning_gym.get_score_answer_fn(name)``, reasoning-gym >= 0.1.19), imported lazily."""

from __future__ import annotations

import functools
from typing import Any, Callable

from moerl.rewards.registry import as_metadata
from moerl.rewards.text import answer_tag


@functools.lru_cache(maxsize=None)
def _scorer(name: str) -> Callable[..., float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


def reasoning_gym_reward(response: str, label: str, metadata: Any) -> float:
    """The reasoning-gym score (a float in [0, 1]; many datasets give partial credit) of the response.

    The answer is the text in the last ``<answer>...</answer>`` tag if present (stripped), else the
    stripped response. It is scored with
    ``reasoning_gym.get_score_answer_fn(metadata["source_dataset"])(answer=answer, entry={"question":
    metadata.get("question", ""), "answer": label, "metadata": metadata})``, the scorer being built
    once per dataset name and process.

    Args:
        response: decoded response text.
        label: the entry's ``"answer"``.
        metadata: the entry's ``"metadata"`` dict (or its JSON string), with ``"source_dataset"``.

    Raises:
        ValueError: ``metadata`` has no ``"source_dataset"`` or names a dataset reasoning-gym does not
            know (data errors).
    """
    md = as_metadata(metadata)
    name = md.get("source_dataset")
    if not isinstance(name, str):
        raise ValueError("reasoning_gym reward: metadata['source_dataset'] is missing; pass the reasoning-gym "
                         "entry's metadata dict as the sample metadata")
    if not isinstance(response, str):
        response = ""
    tagged = answer_tag(response)
    answer = (tagged if tagged is not None else response).strip()
    entry = {"question": md.get("question", ""), "answer": label, "metadata": md}
    return float(_scorer(name)(answer=answer, entry=entry))
