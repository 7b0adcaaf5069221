"""Async HTTP client of the rollout router (SGLang native /generate), with retries and liveness checks.

The RL loop sends one /generate per SAMPLE (sglang-router accepts one sampling_params dict and one
string rid per request; the servers batch concurrent requests) and turns each response into Sample
fields with :func:`parse_generate_item`::

    reqs = [body for g, ids in enumerate(prompts)
            for body in group_requests(ids, n, sampling_params, seeds=[seed_of(step, g, k) for k in range(n)])]
    outs = RolloutClient(cluster.router_url, cluster=cluster).generate_many(reqs)  # dicts, in order
    items = [parse_generate_item(o) for o in outs]          # group g = items[g*n:(g+1)*n]
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

import aiohttp

from moerl.rollout.common import (  # noqa: F401 - PAUSE_MODES re-exported (the contract)
    DEFAULT_PAUSE_MODE, PAUSE_MODES, check_pause_mode)
from moerl.rollout.errors import RolloutRequestError, RolloutRequestRefusedError

_RETRY_STATUS = {408, 429, 500, 502, 503, 504}

# ----------------------------------------------------------------------------- SGLang API contract
# The SGLang release moerl targets (GPU image: Dockerfile) and the router release it runs. The
# fields below are every request / response field of SGLang's native HTTP API that moerl sends or
# reads; tests/test_sglang_contract.py parses this SGLang release's source (io_struct.py,
# http_server.py, sampling_params.py, server_args.py, fetched as a wheel) and fails when one is missing.
SGLANG_VERSION = "0.5.9"
SGLANG_ROUTER_VERSION = "0.3.2"

#: /generate top-level request fields (sglang GenerateReqInput; ``rid`` comes from its BaseReq).
GENERATE_REQUEST_FIELDS = frozenset({
    "input_ids", "text", "sampling_params", "return_logprob", "return_text_in_logprobs",
    "logprob_start_len", "return_routed_experts", "rid"})
#: sampling_params keys (sglang SamplingParams.__init__ arguments).
SAMPLING_PARAM_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids", "sampling_seed",
    "n", "ignore_eos", "skip_special_tokens", "no_stop_trim", "stop", "frequency_penalty", "presence_penalty",
    "repetition_penalty"})
#: /generate response item: top level, meta_info, finish_reason (sglang TokenizerManager output).
GENERATE_RESPONSE_FIELDS = frozenset({"text", "output_ids", "meta_info"})
META_INFO_FIELDS = frozenset({
    "id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
    "output_token_logprobs", "weight_version", "e2e_latency", "routed_experts", "input_token_logprobs"})
FINISH_REASON_FIELDS = frozenset({"type", "matched", "length", "message", "status_code", "err_type"})
#: control endpoints: path -> (sglang io_struct request class or None for no body, fields moerl sends).
SGLANG_ENDPOINTS: dict[str, tuple[Optional[str], frozenset]] = {
    "/generate": ("GenerateReqInput", GENERATE_REQUEST_FIELDS),
    "/update_weights_from_disk": ("UpdateWeightFromDiskReqInput",
                                  frozenset({"model_path", "load_format", "weight_version", "abort_all_requests"})),
    "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput",
                                    frozenset({"serialized_named_tensors", "load_format", "flush_cache",
                                               "weight_version", "abort_all_requests"})),
    "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput",
                                   frozenset({"master_address", "master_port", "rank_offset", "world_size",
                                              "group_name", "backend"})),
    "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput",
                                         frozenset({"names", "dtypes", "shapes", "group_name", "flush_cache",
                                                    "weight_version"})),
    "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", frozenset({"group_name"})),
    "/release_memory_occupation": ("ReleaseMemoryOccupationReqInput", frozenset({"tags"})),
    "/resume_memory_occupation": ("ResumeMemoryOccupationReqInput", frozenset({"tags"})),
    "/abort_request": ("AbortReq", frozenset({"rid", "abort_all"})),
    "/pause_generation": ("PauseGenerationReqInput", frozenset({"mode"})),
    "/continue_generation": ("ContinueGenerationReqInput", frozenset()),  # a JSON body ({}) is required
    "/flush_cache": (None, frozenset()),
    "/freeze_gc": (None, frozenset()),
    "/health": (None, frozenset()),
    "/health_generate": (None, frozenset()),
    "/get_model_info": (None, frozenset()),
    "/get_server_info": (None, frozenset()),
    "/get_weight_version": (None, frozenset()),
}
#: fields moerl reads from the JSON answers of control endpoints.
UPDATE_RESPONSE_FIELDS = frozenset({"success", "message"})
#: /pause_generation and /continue_generation answer {"message": ..., "status": "ok"} (sglang
#: http_server.pause_generation / continue_generation); /pause_generation's ``mode`` is one of
#: PAUSE_MODES (sglang PauseGenerationReqInput.mode, default "abort"). sglang-router does not
#: forward either endpoint: they go to each server's own URL.
PAUSE_RESPONSE_FIELDS = frozenset({"message", "status"})
MODEL_INFO_FIELDS = frozenset({"weight_version", "model_path"})
#: memory-occupation tags (sglang.srt.constants GPU_MEMORY_TYPE_*).
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
#: sglang-router HTTP endpoints moerl uses (0.3.x: GET/POST /workers, DELETE /workers/{id}).
ROUTER_ENDPOINTS = frozenset({"/generate", "/readiness", "/workers", "/workers/{worker_id}"})


class _Pools:
    """The aiohttp session(s) of one event loop (aiohttp.ClientSession + TCPConnector).

    aiohttp rather than httpx: 128 concurrent /generate calls cost the client 0.07 s of CPU with
    aiohttp against 0.46-0.72 s with httpx.AsyncClient (measured on this project's 2-core machine, one
    reference server); the client shares a core with the trainer in async RL, so this CPU is training
    time. ``n_pools`` sessions of ``per_pool`` connections each are used round-robin.
    """

    def __init__(self, n_pools: int, per_pool: int, timeout_s: float):
        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(10.0, timeout_s))
        self.clients = [aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=per_pool),
                                              trust_env=False)
                        for _ in range(max(1, n_pools))]
        self._next = 0

    def pick(self) -> "aiohttp.ClientSession":
        c = self.clients[self._next % len(self.clients)]
        self._next += 1
        return c

    async def aclose(self) -> None:
        for c in self.clients:
            await c.close()


class RolloutClient:
    """Client of one router (or one server) URL, on aiohttp: async API plus a sync batch call.

    Args:
        router_url: base URL, e.g. cluster.router_url.
        timeout_s: per-request timeout in seconds (whole response).
        max_retries: retries after the first attempt, on connection errors, timeouts and HTTP
            408/429/5xx, with exponential backoff (backoff_s * 2**k, jittered, capped at 10 s).
        cluster: optional RolloutCluster; its check_alive() runs before every attempt and after every
            failure, so a dead server surfaces as RolloutServerDiedError naming it (sglang-router
            itself would otherwise hide a dead worker by retrying on the others). With a cluster
            started with failover=True, a dead server is not an error (the cluster restarts it):
            the request is retried (same body, same ``rid``) up to ``max_retries +
            failover_retries`` times while the router sends it to the other servers.
        failover_retries: extra attempts allowed when the cluster does failover (default
            4 * num_servers).
        max_connections: connections in all (spread over pools of connections_per_pool).
    Attribute ``worker``: None (requests from this process, aiohttp) or a started
        :class:`moerl.rollout.http_worker.HttpWorker`, which makes each attempt of :meth:`post` in its child
        process (the retry policy and cluster checks stay here); the RolloutManager sets it in
        one_step_off / async mode (``rollout.client_process``).
    Async use: ``await client.generate(...)`` / ``await client.agenerate_many(...)`` (pools are
    made per event loop and closed by ``await client.aclose()``). Sync use:
    ``client.generate_many(requests)`` runs its own event loop and pools for that call.
    """

    def __init__(self, router_url: str, timeout_s: float = 600.0, max_retries: int = 3,
                 cluster=None, backoff_s: float = 0.5, max_connections: int = 512,
                 connections_per_pool: int = 32, failover_retries: Optional[int] = None):
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_connections < 1 or connections_per_pool < 1:
            raise ValueError("max_connections and connections_per_pool must be >= 1")
        self.router_url = router_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.cluster = cluster
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.connections_per_pool = connections_per_pool
        self._pools: Optional[_Pools] = None
        self._pools_loop = None
        if failover_retries is None:
            failover_retries = 4 * getattr(cluster, "num_servers", 1)
        if failover_retries < 0:
            raise ValueError(f"failover_retries must be >= 0, got {failover_retries}")
        self.failover_retries = failover_retries
        self.worker = None  # an HttpWorker: attempts made in its child process (see the class docstring)

    def _new_pools(self, connections: int) -> _Pools:
        per = min(self.connections_per_pool, connections)
        return _Pools(-(-connections // per), per, self.timeout_s)

    def _client(self) -> "aiohttp.ClientSession":
        loop = asyncio.get_running_loop()
        if self._pools is None or self._pools_loop is not loop:
            self._pools, self._pools_loop = self._new_pools(self.max_connections), loop
        return self._pools.pick()

    async def __aenter__(self) -> "RolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._pools is not None:
            await self._pools.aclose()
            self._pools, self._pools_loop = None, None

    def _check_cluster(self) -> None:
        if self.cluster is not None:
            self.cluster.check_alive()

    async def post(self, path: str, payload: dict, http: Optional["aiohttp.ClientSession"] = None) -> Any:
        """POST JSON to router_url + path with the retry policy; returns the decoded JSON.

        Raises:
            RolloutServerDiedError: (via cluster.check_alive) a server or the router has exited.
            RolloutRequestRefusedError: HTTP 4xx other than 408/429 (not retried; the server's message
                is included; a RolloutRequestError).
            RolloutRequestError: still failing after max_retries retries.
        """
        if self.worker is None:
            http = http or self._client()
        url = self.router_url + path
        last = ""
        retries = self.max_retries
        if self.cluster is not None and getattr(self.cluster, "failover", False):
            retries += self.failover_retries
        for attempt in range(retries + 1):
            self._check_cluster()
            status, body, err = await self._attempt(http, url, payload)
            if err is not None:  # connection, timeout, bad JSON
                last = err
            else:
                if status < 400:
                    return body
                last = f"HTTP {status}: {body[:1000]}"
                if status not in _RETRY_STATUS:
                    self._check_cluster()
                    raise RolloutRequestRefusedError(f"POST {url} was refused: {last}")
            self._check_cluster()
            if attempt < retries:
                delay = min(10.0, self.backoff_s * (2 ** min(attempt, 8))) * (0.5 + random.random())
                await asyncio.sleep(delay)
        raise RolloutRequestError(f"POST {url} failed after {retries + 1} attempts; last error: {last}")

    async def _attempt(self, http, url: str, payload: dict) -> tuple[Optional[int], Any, Optional[str]]:
        """One POST: (status, decoded JSON or error text, None), or (None, None, error) for a connection
        error, timeout or undecodable body; through :attr:`worker` when set."""
        if self.worker is not None:
            return await self.worker.post(url, payload)
        try:
            async with http.post(url, json=payload) as r:
                status = r.status
                return status, await (r.json(content_type=None) if status < 400 else r.text()), None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return None, None, f"{type(e).__name__}: {e}"

    async def generate(self, input_ids: Union[list[int], list[list[int]]],
                       sampling_params: Union[dict, list[dict]], return_logprob: bool = True,
                       rid: Optional[Union[str, list[str]]] = None) -> Union[dict, list[dict]]:
        """POST /generate (SGLang GenerateReqInput fields); returns a dict, or a list for batched input."""
        payload: dict = {"input_ids": input_ids, "sampling_params": sampling_params,
                         "return_logprob": return_logprob}
        if rid is not None:
            payload["rid"] = rid
        return await self.post("/generate", payload)

    async def agenerate_many(self, requests: list[dict], max_concurrency: int = 256,
                             pools: Optional[_Pools] = None) -> list:
        """Run /generate bodies concurrently (at most max_concurrency in flight); results in order.

        Each request is a full /generate body (e.g. from :func:`group_request`); each result is what
        the server returned for it (a list for batched input_ids). The first failure cancels the
        others and is raised. Results are keyed by request: a body with a string ``rid`` (unique
        over ``requests``) gets exactly one result, whose ``meta_info.id`` must equal that rid, so
        a retried request (failover) can neither be lost nor counted twice.

        Raises:
            ValueError: two requests share a rid.
            RolloutRequestError: a response carries another request's id (see :meth:`post`).
        """
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        rids = [b.get("rid") for b in requests if isinstance(b.get("rid"), str)]
        if len(set(rids)) != len(rids):
            dup = sorted({r for r in rids if rids.count(r) > 1})
            raise ValueError(f"requests share rids {dup[:5]}; give every request its own rid")
        sem = asyncio.Semaphore(max_concurrency)

        async def one(body: dict):
            async with sem:
                out = await self.post("/generate", body, http=pools.pick() if pools else None)
            check_result_id(body, out)
            return out

        tasks = [asyncio.ensure_future(one(b)) for b in requests]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def generate_many(self, requests: list[dict], max_concurrency: int = 256) -> list:
        """Synchronous :meth:`agenerate_many` (own event loop and connection pool for this call).

        Raises:
            RuntimeError: called from inside a running event loop (await agenerate_many there).
        """
        return self._run_sync(
            "generate_many", max(1, min(max_concurrency, self.max_connections, len(requests))),
            lambda pools: self.agenerate_many(requests, max_concurrency=max_concurrency, pools=pools))

    def _run_sync(self, name: str, connections: int, fn: Callable[[_Pools], Awaitable[Any]]) -> Any:
        """Run ``await fn(pools)`` in a new event loop with its own pools of ``connections`` (closed after).

        Raises:
            RuntimeError: called from inside a running event loop (await the ``a``-prefixed method there).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(f"RolloutClient.{name}() cannot run inside an event loop; "
                               f"await RolloutClient.a{name}(...) instead")

        async def main():
            pools = self._new_pools(connections)
            try:
                return await fn(pools)
            finally:
                await pools.aclose()

        return asyncio.run(main())

    # ------------------------------------------------------------------ pause / continue (ONE server)

    async def apause_generation(self, mode: str = DEFAULT_PAUSE_MODE,
                                http: Optional["aiohttp.ClientSession"] = None) -> dict:
        """POST /pause_generation {"mode": mode} to this client's URL, which must be ONE server
        (sglang-router does not forward it; :meth:`RolloutCluster.pause_generation
        <moerl.rollout.launcher.RolloutCluster.pause_generation>` calls every server).

        Modes (SGLang PauseGenerationReqInput): "abort" (default) answers every running request with
        the tokens generated so far (finish_reason abort) and every queued one with none, then holds
        scheduling; "retract" / "in_place" hold scheduling ("in_place" suspends the running batch at its
        next step, in SGLang and the reference server alike; "retract": the reference server lets it
        finish first). New /generate requests wait until
        /continue_generation. The server answers once paused: returns its JSON ``{"message",
        "status": "ok"}``. Idempotent, so the retry policy of :meth:`post` applies.

        Raises:
            ValueError: ``mode`` not in PAUSE_MODES (before anything is sent).
            RolloutRequestError: refused or unreachable (see :meth:`post`).
        """
        return await self.post("/pause_generation", {"mode": check_pause_mode(mode)}, http=http)

    async def acontinue_generation(self, http: Optional["aiohttp.ClientSession"] = None) -> dict:
        """POST /continue_generation to this client's URL (ONE server): scheduling resumes and the
        requests that waited start. Returns the server's ``{"message", "status": "ok"}``.

        Raises:
            RolloutRequestError: refused or unreachable (see :meth:`post`).
        """
        return await self.post("/continue_generation", {}, http=http)

    def pause_generation(self, mode: str = DEFAULT_PAUSE_MODE) -> dict:
        """Synchronous :meth:`apause_generation` (own event loop; RuntimeError inside one)."""
        check_pause_mode(mode)
        return self._run_sync("pause_generation", 1, lambda pools: self.apause_generation(mode, http=pools.pick()))

    def continue_generation(self) -> dict:
        """Synchronous :meth:`acontinue_generation` (own event loop; RuntimeError inside one)."""
        return self._run_sync("continue_generation", 1, lambda pools: self.acontinue_generation(http=pools.pick()))


def check_result_ids(body: dict, out: Any) -> list:
    """The per-item results of a batched /generate ``body`` (``input_ids`` a list of prompts, ``rid`` a
    list of ids, SGLang's batch form): ``out`` must be a list of one result per prompt, in order, whose
    ``meta_info.id`` is that prompt's rid. Returns ``out``.

    Raises:
        RolloutRequestError: not a list of that length, or a result carries another request's id.
    """
    rids = body.get("rid")
    if not isinstance(out, list) or not isinstance(rids, list) or len(out) != len(rids):
        raise RolloutRequestError(f"/generate with {len(rids) if isinstance(rids, list) else '?'} prompts "
                                  f"returned {type(out).__name__} of {len(out) if isinstance(out, list) else '?'} "
                                  f"results")
    for rid, item in zip(rids, out):
        check_result_id({"rid": rid}, item)
    return out


def check_result_id(body: dict, out: Any) -> None:
    """A /generate body with a string ``rid`` must get back the result whose ``meta_info.id`` is that rid
    (a retried request, e.g. after failover, can then neither be lost nor counted twice).

    Raises:
        RolloutRequestError: the result carries another request's id.
    """
    rid = body.get("rid")
    if isinstance(rid, str) and isinstance(out, dict):
        got = (out.get("meta_info") or {}).get("id")
        if got != rid:
            raise RolloutRequestError(f"/generate for rid {rid!r} returned the result of {got!r}")


def run_generate_requests(router_url: str, requests: list[dict], *, max_concurrency: int = 256,
                          timeout_s: float = 600.0, max_retries: int = 3, cluster=None) -> list:
    """Run /generate bodies concurrently from synchronous code; results in order.

    Same as ``RolloutClient(router_url, timeout_s, max_retries, cluster).generate_many(requests)``.
    """
    return RolloutClient(router_url, timeout_s=timeout_s, max_retries=max_retries,
                         cluster=cluster).generate_many(requests, max_concurrency=max_concurrency)


def group_requests(prompt_ids: list[int], n_samples_per_prompt: int, sampling_params: dict, *,
                   seeds: Optional[list[int]] = None, rid: Optional[str] = None,
                   return_logprob: bool = True) -> list[dict]:
    """The /generate bodies for one prompt group: one request per sample, each with its own seed.

    sglang-router (0.3.x) parses a /generate body into its own struct: ``sampling_params`` must be
    ONE dict and ``rid`` ONE string (a list of either is refused with HTTP 422), and in SGLang the
    copies of a prompt that share a sampling_seed produce the same response. So a group of n
    samples is n requests with distinct seeds; the servers batch concurrent requests themselves.
    (Real SGLang honours sampling_seed only when launched with --enable-deterministic-inference.)
    Cheaper but not reproducible: ONE request per group, ``{"input_ids": prompt_ids,
    "sampling_params": {..., "n": n}}`` without a seed (returns a list of n distinct samples).

    Args:
        seeds: one sampling_seed per sample (len n_samples_per_prompt), or None for unseeded sampling.
        rid: request-id prefix; sample k gets f"{rid}-{k}".
    """
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    unknown = sorted(set(sampling_params) - SAMPLING_PARAM_FIELDS)
    if unknown:
        raise ValueError(f"sampling_params keys {unknown} are not in moerl's SGLang contract "
                         f"(moerl.rollout.client.SAMPLING_PARAM_FIELDS: {sorted(SAMPLING_PARAM_FIELDS)})")
    if "sampling_seed" in sampling_params:
        raise ValueError("pass per-sample seeds as seeds=[...], not sampling_params['sampling_seed']")
    if seeds is not None and len(seeds) != n_samples_per_prompt:
        raise ValueError(f"seeds has {len(seeds)} entries, expected n_samples_per_prompt={n_samples_per_prompt}")
    bodies = []
    for k in range(n_samples_per_prompt):
        sp = dict(sampling_params)
        if seeds is not None:
            sp["sampling_seed"] = int(seeds[k])
        body: dict = {"input_ids": list(prompt_ids), "sampling_params": sp, "return_logprob": return_logprob}
        if rid is not None:
            body["rid"] = f"{rid}-{k}"
        bodies.append(body)
    return bodies


def prompt_logprobs_request(prompt_ids: list[int], rid: Optional[str] = None) -> dict:
    """The /generate body that scores a prompt: no new tokens, the log-prob of every prompt token
    from the first on (SGLang: ``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len`` 0).
    Read the answer with :func:`parse_prompt_logprobs`."""
    body: dict = {"input_ids": list(prompt_ids), "sampling_params": {"max_new_tokens": 0},
                  "return_logprob": True, "logprob_start_len": 0}
    if rid is not None:
        body["rid"] = rid
    return body


def parse_prompt_logprobs(item: dict) -> list[Optional[float]]:
    """Per prompt token, log p(token | the tokens before it) from meta_info.input_token_logprobs
    (SGLang's [logprob, token_id, text] entries); the first is None (nothing predicts it).

    Raises:
        RolloutRequestError: the answer has no input_token_logprobs (send prompt_logprobs_request's body).
    """
    entries = (item.get("meta_info") or {}).get("input_token_logprobs")
    if entries is None:
        raise RolloutRequestError("input_token_logprobs missing: send return_logprob=True, logprob_start_len=0")
    return [e[0] for e in entries]


@dataclass
class GenerateItem:
    """One /generate response item in Sample terms (see moerl.types.Sample).

    response_ids: output_ids (include the stop token when status == "completed").
    rollout_log_probs: per response token, log_softmax(logits / temperature) of that token.
    status: "completed" (finish_reason stop), "truncated" (length) or "aborted" (abort).
    weight_version: meta_info weight_version (the version of the last token).
    token_versions: one weight_version per response token when the server reports them
        (meta_info ``output_token_weight_versions``: the reference server, for a response that spanned a
        weight update under an "in_place" pause), else None (every token has ``weight_version``).
    """

    response_ids: list[int]
    rollout_log_probs: list[float]
    status: str
    weight_version: Optional[str]
    finish_reason: dict
    prompt_tokens: int
    token_versions: Optional[list] = None


_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}


def parse_generate_item(item: dict) -> GenerateItem:
    """Convert one SGLang /generate response item into :class:`GenerateItem`.

    Raises:
        RolloutRequestError: the item lacks output_ids/meta_info, an unknown finish_reason type, or
            output_token_logprobs that do not match output_ids (request return_logprob=True).
    """
    try:
        ids = list(item["output_ids"])
        meta = item["meta_info"]
        fr = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"}
    except (KeyError, TypeError) as e:
        raise RolloutRequestError(f"malformed /generate item (missing {e}): {str(item)[:300]}") from None
    if fr.get("type") not in _STATUS:
        raise RolloutRequestError(f"unknown finish_reason {fr!r}")
    lps = meta.get("output_token_logprobs")
    if lps is None:
        raise RolloutRequestError("output_token_logprobs missing: send return_logprob=True")
    if len(lps) != len(ids) or any(int(e[1]) != t for e, t in zip(lps, ids)):
        raise RolloutRequestError(f"output_token_logprobs ({len(lps)}) do not match output_ids ({len(ids)})")
    tv = meta.get("output_token_weight_versions")
    if tv is not None and (not isinstance(tv, list) or len(tv) != len(ids)):
        raise RolloutRequestError(f"output_token_weight_versions ({len(tv) if isinstance(tv, list) else tv!r}) "
                                  f"do not match output_ids ({len(ids)})")
    return GenerateItem(response_ids=ids, rollout_log_probs=[float(e[0]) for e in lps],
                        status=_STATUS[fr["type"]], weight_version=meta.get("weight_version"),
                        finish_reason=fr, prompt_tokens=int(meta.get("prompt_tokens", 0)), token_versions=tv)
