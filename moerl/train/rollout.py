"""Rollout and evaluation through SGLang-API servers (real SGLang or moerl's reference server).

Only fields of SGLang's native /generate API are used (REFERENCE.md sec. 5): input_ids,
sampling_params {temperature, top_p, top_k, max_new_tokens, stop_token_ids, sampling_seed},
return_logprob, rid; and meta_info {finish_reason, output_token_logprobs, weight_version}.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

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
    routing_shape: Optional[tuple[int, int]] = None,
) -> list[Sample]:
    """Generate ``n_samples_per_prompt`` responses for each row.

    ``routing_shape`` = (num_hidden_layers, num_experts_per_tok) asks every request for
    ``return_routed_experts`` (moe.routing_replay = r3) and stores the decoded routing in
    ``Sample.routed_experts`` (int32 [len(prompt) + len(response) - 1, num_layers, topk]).

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
    if routing_shape is not None:
        for body in requests:
            body["return_routed_experts"] = True
        outs = _generate_direct(client, requests, group_size=n)
    else:
        outs = client.generate_many(requests)
    items = [parse_generate_item(o) for o in outs]
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
        if routing_shape is not None:
            samples[-1].routed_experts = _routed_experts_of(outs[j], samples[-1], routing_shape)
    return samples


def _generate_direct(client, requests: list[dict], group_size: int) -> list:
    """Run /generate bodies straight on the cluster's servers, bypassing the router (results in order).

    sglang-router 0.3.2 re-serialises /generate bodies through its own struct, which has no
    ``return_routed_experts``, so the flag would be dropped (measured). With R3 every prompt group goes
    to one live server (``client.cluster.live_server_urls()``, groups round-robin), each server through
    its own RolloutClient with ``client``'s timeout / retries / liveness checks (``server_urls`` when
    the cluster has no ``live_server_urls``). A client without a cluster (a single server URL) is used
    as it is.
    """
    import asyncio

    from moerl.rollout.client import RolloutClient

    cluster = getattr(client, "cluster", None)
    live = getattr(cluster, "live_server_urls", None)
    urls = list(live() if callable(live) else getattr(cluster, "server_urls", None) or [])
    if not urls:
        return client.generate_many(requests)
    clients = [RolloutClient(u, timeout_s=client.timeout_s, max_retries=client.max_retries, cluster=cluster)
               for u in urls]
    shares: list[list[int]] = [[] for _ in urls]
    for j in range(len(requests)):
        shares[(j // group_size) % len(urls)].append(j)

    async def main():
        try:
            return await asyncio.gather(*(c.agenerate_many([requests[j] for j in share])
                                          for c, share in zip(clients, shares)))
        finally:
            for c in clients:
                await c.aclose()

    outs: list = [None] * len(requests)
    for share, results in zip(shares, asyncio.run(main())):
        for j, out in zip(share, results):
            outs[j] = out
    return outs


def _routed_experts_of(out: dict, sample: Sample, routing_shape: tuple[int, int]):
    """Decode meta_info.routed_experts of one /generate item (moerl.moe.routing_replay wire format).

    Raises:
        RolloutRequestError: missing (the server was not started with routing recording: real SGLang
            needs --enable-return-routed-experts) or of the wrong length.
    """
    from moerl.moe.routing_replay import decode_routed_experts
    from moerl.rollout.errors import RolloutRequestError

    payload = out.get("meta_info", {}).get("routed_experts")
    if payload is None:
        raise RolloutRequestError("moe.routing_replay=r3 but the server returned no meta_info.routed_experts "
                                  "(SGLang must run with --enable-return-routed-experts; sglang-router 0.3.2 drops "
                                  "the request field, so send R3 requests to the servers directly)")
    try:
        routed = decode_routed_experts(payload, *routing_shape)
    except ValueError as e:
        raise RolloutRequestError(str(e)) from None
    want = len(sample.prompt_ids) + len(sample.response_ids) - 1
    if routed.shape[0] != want:
        raise RolloutRequestError(f"meta_info.routed_experts has {routed.shape[0]} positions, expected "
                                  f"prompt + completion - 1 = {want}")
    return routed


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
