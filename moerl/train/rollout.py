"""Greedy evaluation through SGLang-API servers (real SGLang or moerl's reference server).

Only fields of SGLang's native /generate API are used (REFERENCE.md sec. 5): input_ids,
sampling_params {temperature, max_new_tokens, stop_token_ids}, return_logprob; and output_ids. RL
rollouts go through moerl.rollout.manager.RolloutManager.
"""

from __future__ import annotations

from typing import Callable, Sequence


def greedy_answers(
    client,
    prompts: Sequence[str],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
) -> list[str]:
    """Greedy (temperature 0) decoded responses for ``prompts``, one /generate request each (the
    servers batch concurrent requests)."""
    params = dict(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids))
    requests = [dict(input_ids=encode(p), sampling_params=params, return_logprob=False) for p in prompts]
    return [decode(list(o["output_ids"])) for o in client.generate_many(requests)]


def evaluate_accuracy(client, rows, encode, decode, reward_fn, *, prompt_key, label_key, **kw) -> float:
    """Greedy accuracy (mean reward) on ``rows`` through the rollout servers."""
    if not rows:
        raise ValueError("evaluation set is empty")
    texts = greedy_answers(client, [r[prompt_key] for r in rows], encode, decode, **kw)
    return sum(reward_fn(t, str(r[label_key])) for t, r in zip(texts, rows)) / len(rows)
