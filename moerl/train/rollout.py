"""Rollout and evaluation through SGLang-API servers (real SGLang or moerl's reference server).

Only fields of SGLang's native /generate API are used (REFERENCE.md sec. 5): input_ids,
sampling_params {temperature, top_p, top_k, max_new_tokens, stop_token_ids, sampling_seed},
return_logprob, rid; and meta_info {finish_reason, output_token_logprobs, weight_version}.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

from moerl.rollout.client import group_requests, parse_generate_item
from moerl.types import Sample


def sampling_seed(seed: int, *keys: int) -> int:
    """A stable 31-bit per-request sampling seed from the run seed and integer keys
    (e.g. step, group, sample): the same run reproduces the same samples whichever server
    serves a request."""
    h = hashlib.sha256(("/".join(str(k) for k in (seed,) + keys)).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def generate_rollout(
    client,
    rows: Sequence[dict],
    encode: Callable[[str], list[int]],
    *,
    n_samples_per_prompt: int,
    sampling_params: dict,
    seed: int,
    step: int,
    prompt_key: str = "prompt",
    label_key: str = "label",
) -> list[Sample]:
    """Generate ``n_samples_per_prompt`` responses for each row.

    One /generate request per sample (sglang-router takes one sampling_params dict per request),
    each with its own sampling_seed = sampling_seed(seed, step, group, k), so the same run draws the
    same samples whichever server serves a request; the servers batch concurrent requests.

    Returns Samples in group order (group g occupies indices g*n .. g*n+n-1).

    Raises:
        RolloutServerDiedError (from the client, naming the server) when a server died;
        RolloutRequestError for malformed responses (e.g. missing log-probs).
    """
    n = n_samples_per_prompt
    prompt_ids = [encode(row[prompt_key]) for row in rows]
    requests = []
    for g, ids in enumerate(prompt_ids):
        seeds = [sampling_seed(seed, step, g, k) for k in range(n)]
        requests += group_requests(ids, n, sampling_params, seeds=seeds, rid=f"s{step}-g{g}")
    items = [parse_generate_item(o) for o in client.generate_many(requests)]
    samples = []
    for j, item in enumerate(items):
        g = j // n
        samples.append(
            Sample(
                index=j,
                group_id=g,
                prompt=rows[g][prompt_key],
                label=str(rows[g][label_key]),
                prompt_ids=prompt_ids[g],
                response_ids=item.response_ids,
                rollout_log_probs=item.rollout_log_probs,
                loss_mask=[1] * len(item.response_ids),
                weight_version=item.weight_version,
                status=item.status,
                metadata={"finish_reason": item.finish_reason},
            )
        )
    return samples


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
