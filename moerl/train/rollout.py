"""Greedy evaluation through SGLang-API servers (real SGLang or moerl's reference server).

Only fields of SGLang's native /generate API are used (REFERENCE.md sec. 5): input_ids,
sampling_params {temperature, max_new_tokens, stop_token_ids}, return_logprob; and output_ids. RL
rollouts go through moerl.rollout.manager.RolloutManager.
"""

from __future__ import annotations

from typing import Callable, Sequence


def greedy_answers(
    client,
    prompts: Sequence,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
) -> list[str]:
    """Greedy (temperature 0) decoded responses for ``prompts`` (texts or chat-message lists, as
    ``encode`` takes them), one /generate request each (the servers batch concurrent requests)."""
    params = dict(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids))
    requests = [dict(input_ids=encode(p), sampling_params=params, return_logprob=False) for p in prompts]
    return [decode(list(o["output_ids"])) for o in client.generate_many(requests)]


def evaluate_accuracy(client, rows, encode, decode, scorer, *, prompt_key, label_key, **kw) -> float:
    """Greedy accuracy on ``rows`` through the rollout servers: the fraction of responses whose rule
    score is >= 1.0 (a 0/1 verifier: the mean reward).

    ``scorer``: a moerl.rewards.RewardPool (``score(items)``, items (response, label, metadata): sandboxed,
    timed out; with a reward model its rule part ``metrics["rule"]`` decides) or a plain
    ``reward_fn(text, label) -> float``.

    Raises:
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("evaluation set is empty")
    texts = greedy_answers(client, [r[prompt_key] for r in rows], encode, decode, **kw)
    if hasattr(scorer, "score"):
        from moerl.data.tasks import row_metadata

        results = scorer.score([(t, str(r[label_key]), row_metadata(r)) for t, r in zip(texts, rows)])
        scores = [float(res.metrics.get("rule", res.score)) for res in results]
    else:
        scores = [float(scorer(t, str(r[label_key]))) for t, r in zip(texts, rows)]
    return sum(x >= 1.0 for x in scores) / len(rows)
