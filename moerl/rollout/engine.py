"""Generation engine of the CPU reference rollout server: SGLang /generate semantics on transformers.

Split out of moerl.rollout.server (the HTTP layer, which re-exports every name here): request
normalisation (:meth:`ReferenceEngine._normalize`, :func:`parse_sampling_params`), scheduling (one
FIFO queue, one scheduler thread), the decode loop (``model.generate`` with a KV cache) and sampling
(:class:`_RowSampler`). The weight-update handlers are inherited from
moerl.rollout.engine_weights.WeightUpdater.

/generate request: ``input_ids`` (list[int] or list[list[int]]) or ``text`` (str or list[str]);
``sampling_params`` (dict, or list of dicts, one per prompt) with temperature, top_p, top_k (-1 = off),
min_p, max_new_tokens, stop_token_ids, stop (str or list of str), frequency_penalty, presence_penalty,
repetition_penalty (validated, unused: sglang 0.5.9 has no penalizer for it), sampling_seed, ignore_eos,
n, skip_special_tokens, no_stop_trim, stream_interval; ``stream`` (server-sent events, see
:meth:`ReferenceEngine.stream_updates`); ``return_logprob`` with ``logprob_start_len``,
``top_logprobs_num``, ``token_ids_logprob`` (each a value or one per prompt);
``return_text_in_logprobs``, ``rid``, ``return_routed_experts`` (bool or one per
prompt; meta_info.routed_experts = base64 int32 [prompt_tokens + completion_tokens - 1, num_hidden_layers,
num_experts_per_tok], SGLang's format, see moerl.moe.routing_replay; always enabled here, real SGLang
needs --enable-return-routed-experts). Other SGLang fields are accepted only at their
no-op value (an error names the field otherwise). Batched input returns a list of results, in order
(with ``n`` > 1 each prompt is repeated n times in place, prompt-major, as SGLang does).

Response item: {text, output_ids, meta_info: {id, finish_reason, prompt_tokens, completion_tokens,
cached_tokens, weight_version, e2e_latency, routed_experts?, and with return_logprob:
input_token_logprobs, output_token_logprobs, input_top_logprobs? / output_top_logprobs? (top_logprobs_num
> 0), input_token_ids_logprobs? / output_token_ids_logprobs? (token_ids_logprob)}} (META_INFO_KEYS);
entries are [logprob, token_id, text or None]; the input lists cover prompt[logprob_start_len:]
(default: the last prompt token only) and start with None, as in SGLang. finish_reason is
{"type": "stop", "matched": token_id | stop string} | {"type": "length", "length": max_new_tokens} |
{"type": "abort", "message": str, "status_code": None, "err_type": None}, decided per step in SGLang's order (length, stop id, stop string).

Semantics the trainer relies on:
  * Log-probs: output_token_logprobs[t] = [log_softmax(logits_t / temperature)[y_t], y_t, None]
    where logits_t are the model's raw fp32 logits minus the frequency/presence penalties (none by
    default); plain log_softmax(logits_t) when greedy. Prompt log-probs use the raw logits only
    (temperature < 1e-6). They are taken BEFORE top-k / top-p / min-p filtering, so a trainer that
    divides its logits by the same temperature reproduces them exactly (up to fp rounding).
  * output_ids include the stop token when the response stopped on one (stop_token_ids, the
    tokenizer's eos and the model config's eos_token_id; none with ignore_eos, as in SGLang); tokens
    after it are cut. A stop string keeps every id up to the one that completed it; ``text`` is cut
    before the stop string (and before a stop token), unless no_stop_trim.
    prompt + max_new_tokens must stay below max_position_embeddings, else HTTP 400 (SGLang's check; a null
    or -1 max_new_tokens takes the room left).
  * Sampling: each item draws its uniforms from its own torch.Generator seeded by its sampling_seed
    (or a fresh random seed), inverse-CDF over the (filtered) distribution at that temperature. An
    item's tokens therefore depend only on (its prompt, its sampling params, the weights): not on the
    server instance, on earlier requests, or on its batch mates (batches share one prompt length, so
    there is no padding; a request's own list of differently long prompts is split into batches
    by length the same way). Items with the SAME sampling_seed and prompt produce the SAME response
    (as in SGLang), so give each of the n_samples_per_prompt samples its own seed.
  * Batching: all items (prompts) of all in-flight requests are queued; a scheduler thread runs the
    oldest item together with every queued item of the same prompt length (up to
    --max-batch-size rows) as one ``model.generate`` call (KV cache) under a lock around the model.
    So one request per sample (what sglang-router can carry: it accepts ONE sampling_params dict
    and a string rid per request) still runs in large batches, and equal lengths mean no padding.
  * weight_version: a string, "default" at start, set by successful update calls, returned in every
    /generate meta_info (the version that produced the response's last token). A response that
    spans a weight update (an "in_place" pause, below) also carries
    ``meta_info["output_token_weight_versions"]``: one version per output token (a moerl extension;
    SGLang reports only the one version).
  * abort: ``rid`` matches an item id or the ``rid`` a batched request was sent with; aborted
    running items return finish_reason abort with the tokens generated so far (and their log-probs).
  * pause / continue (SGLang /pause_generation {"mode": "abort" | "retract" | "in_place"},
    /continue_generation): no batch starts while paused; "abort" first aborts everything running or
    queued; "in_place" suspends the running batch at its next decode step (KV cache kept; weights may
    be updated meanwhile; after continue it goes on with the new weights, as in SGLang); "retract"
    lets the running batch finish (SGLang retracts it instead; see
    :meth:`ReferenceEngine.pause_generation`). New requests queue up meanwhile; weight updates run.
    A partial response (finish_reason abort, k tokens) is continued by sending prompt + its k tokens
    with max_new_tokens = the remaining budget; :meth:`ReferenceEngine.pause_after_steps` interrupts
    after exactly k decode steps (tests).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from moerl.rollout.common import DEFAULT_PAUSE_MODE, check_pause_mode
from moerl.rollout.common import is_int as _is_int
from moerl.rollout.common import is_num as _is_num
from moerl.rollout.engine_weights import WeightUpdater, load_causal_lm

logger = logging.getLogger("moerl.rollout.engine")

_GREEDY_EPS = 1e-6  # SGLang: 0 <= temperature < 1e-6 means greedy

# SGLang sampling_params keys this server implements, with SGLang's defaults.
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "stop_token_ids": None,
    "sampling_seed": None,
    "ignore_eos": False,
    "n": 1,
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "spaces_between_special_tokens": True,
    "stream_interval": None,
    "stop": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
# SGLang sampling_params keys accepted only at their no-op value (value -> predicate "is no-op").
_SAMPLING_NOOP: dict[str, Any] = {
    "stop_regex": lambda v: v in (None, "", []),
    "min_new_tokens": lambda v: v in (None, 0),
    "json_schema": lambda v: v is None,
    "regex": lambda v: v is None,
    "ebnf": lambda v: v is None,
    "structural_tag": lambda v: v is None,
    "logit_bias": lambda v: not v,
    "custom_params": lambda v: not v,
}
# Top-level GenerateReqInput keys accepted only at their no-op value.
_REQUEST_NOOP: dict[str, Any] = {
    "return_hidden_states": lambda v: not v,
    "input_embeds": lambda v: v is None,
    "image_data": lambda v: not v,
    "video_data": lambda v: not v,
    "audio_data": lambda v: not v,
    "lora_path": lambda v: not v,
    "custom_logit_processor": lambda v: not v,
    "session_params": lambda v: not v,
}
_REQUEST_IGNORED = {"log_metrics", "routed_dp_rank", "data_parallel_rank", "priority", "extra_key",
                    "custom_labels", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                    "return_entropy", "no_logs", "received_time", "routing_key", "conversation_id",
                    "background", "return_bytes", "model"}  # the last three are added by sglang-router
_REQUEST_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "return_text_in_logprobs",
                 "rid", "return_routed_experts", "stream", "logprob_start_len", "top_logprobs_num",
                 "token_ids_logprob"}
# meta_info keys a /generate answer (or stream chunk) can carry: every one is a key of SGLang's
# TokenizerManager meta_info (tests/test_sglang_contract.py checks both directions).
META_INFO_KEYS = frozenset({
    "id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
    "e2e_latency", "routed_experts", "input_token_logprobs", "output_token_logprobs",
    "input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"})


# ----------------------------------------------------------------------------- request parsing


@dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling parameters of one item (SGLang semantics).

    top_k = 0 and top_p = 1 and min_p = 0 mean no filtering; greedy = temperature < 1e-6.
    stop_ids: token ids that end the response (stop_token_ids plus eos; none at all with ignore_eos,
    as in SGLang's Req._check_token_based_finish).
    stop_strs: stop strings (sampling_params.stop); stop_str_max_len: the longest one in tokens
        (SGLang SamplingParams.normalize), which sizes the decoded tail they are searched in.
    frequency_penalty, presence_penalty: SGLang's penaltylib (subtracted from the logits of tokens
        already generated in this response: count * frequency_penalty + presence_penalty).
    repetition_penalty: validated ([0, 2]) and otherwise unused, exactly as in SGLang 0.5.9 (which
        has no repetition penalizer; only its OpenAI layer and gRPC server pass the field on).
    """

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    stop_ids: tuple[int, ...]
    seed: Optional[int]
    skip_special_tokens: bool
    greedy: bool
    stop_strs: tuple[str, ...] = ()
    stop_str_max_len: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    no_stop_trim: bool = False
    stream_interval: Optional[int] = None

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def abort_reason(message: str) -> dict:
    """SGLang's ``FINISH_ABORT(message).to_json()`` (managers/schedule_batch.py): the finish_reason of
    an aborted item, ``{"type": "abort", "message", "status_code": None, "err_type": None}``."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def parse_sampling_params(sp: Optional[dict], *, vocab_size: int, eos_ids: Iterable[int],
                          where: str = "sampling_params", tokenizer=None) -> SamplingSpec:
    """Validate one SGLang ``sampling_params`` dict and return a :class:`SamplingSpec`.

    Implements sglang.srt.sampling.sampling_params.SamplingParams (0.5.9): the same keys, defaults,
    ranges (frequency/presence_penalty in [-2, 2], repetition_penalty in [0, 2], ...) and ``stop``
    as a string or a list of strings. ``tokenizer`` (a transformers tokenizer, optional) measures the
    stop strings in tokens as SGLang does; without it their length in characters is used.

    Raises:
        ValueError: an unknown key, a key this server implements only at its no-op value, or a value
            out of range; the message names ``where.key`` and the accepted values.
    """
    sp = dict(sp or {})
    for key, value in sp.items():
        if key in _SAMPLING_DEFAULTS:
            continue
        if key in _SAMPLING_NOOP:
            if not _SAMPLING_NOOP[key](value):
                raise ValueError(f"{where}.{key}={value!r} is not supported by the moerl reference "
                                 f"server; leave it unset (supported: {sorted(_SAMPLING_DEFAULTS)})")
            continue
        raise ValueError(f"{where}.{key} is not a sampling parameter this server knows; "
                         f"supported: {sorted(_SAMPLING_DEFAULTS)}")
    get = lambda k: _SAMPLING_DEFAULTS[k] if sp.get(k) is None else sp[k]  # noqa: E731

    temperature = get("temperature")
    if not _is_num(temperature) or not (temperature >= 0.0) or temperature == float("inf"):
        raise ValueError(f"{where}.temperature must be a finite number >= 0, got {temperature!r}")
    top_p = get("top_p")
    if not _is_num(top_p) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"{where}.top_p must be in (0, 1], got {top_p!r}")
    top_k = get("top_k")
    if not _is_int(top_k) or (top_k < 1 and top_k != -1):
        raise ValueError(f"{where}.top_k must be -1 (off) or an integer >= 1, got {top_k!r}")
    min_p = get("min_p")
    if not _is_num(min_p) or not (0.0 <= min_p <= 1.0):
        raise ValueError(f"{where}.min_p must be in [0, 1], got {min_p!r}")
    penalties = {}
    for key, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0),
                        ("repetition_penalty", 0.0, 2.0)):
        v = get(key)
        if not _is_num(v) or not (lo <= v <= hi):
            raise ValueError(f"{where}.{key} must be in [{lo:g}, {hi:g}], got {v!r}")
        penalties[key] = float(v)
    max_new = sp.get("max_new_tokens", _SAMPLING_DEFAULTS["max_new_tokens"])
    if max_new is not None and (not _is_int(max_new) or max_new < 0):
        raise ValueError(f"{where}.max_new_tokens must be an integer >= 0 (or null = up to the "
                         f"context length), got {max_new!r}")
    stop_token_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, (list, tuple)) or not all(_is_int(t) for t in stop_token_ids):
        raise ValueError(f"{where}.stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
    for t in stop_token_ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"{where}.stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size})")
    stop = sp.get("stop")
    stop_strs = [stop] if isinstance(stop, str) else (stop if stop is not None else [])
    if not isinstance(stop_strs, (list, tuple)) or not all(isinstance(x, str) for x in stop_strs):
        raise ValueError(f"{where}.stop must be a string or a list of strings, got {stop!r}")
    if tokenizer is not None:
        stop_len = max((len(tokenizer.encode(x, add_special_tokens=False)) for x in stop_strs), default=0)
    else:
        stop_len = max((len(x) for x in stop_strs), default=0)
    stream_interval = sp.get("stream_interval")
    if stream_interval is not None and (not _is_int(stream_interval) or stream_interval < 1):
        raise ValueError(f"{where}.stream_interval must be an integer >= 1 or null, got {stream_interval!r}")
    seed = sp.get("sampling_seed")
    if seed is not None and not (_is_int(seed) and -2**63 <= seed < 2**63):
        raise ValueError(f"{where}.sampling_seed must be a 64-bit integer or null, got {seed!r}")
    ignore_eos = bool(get("ignore_eos"))
    stop_ids = set() if ignore_eos else set(int(t) for t in stop_token_ids) | set(int(t) for t in eos_ids)
    return SamplingSpec(
        max_new_tokens=-1 if max_new is None else int(max_new),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=0 if top_k == -1 or top_k >= vocab_size else int(top_k),
        min_p=float(min_p),
        stop_ids=tuple(sorted(stop_ids)),
        seed=None if seed is None else int(seed),
        skip_special_tokens=bool(get("skip_special_tokens")),
        greedy=float(temperature) < _GREEDY_EPS,
        stop_strs=tuple(stop_strs),
        stop_str_max_len=stop_len,
        no_stop_trim=bool(get("no_stop_trim")),
        stream_interval=None if stream_interval is None else int(stream_interval),
        **penalties,
    )


# ----------------------------------------------------------------------------- sampling inside generate


class _RowSampler:
    """transformers LogitsProcessor that samples every row itself and records its token and log-prob.

    Called by ``model.generate`` (greedy mode) with the raw fp32 logits ``scores`` [B, V] of each
    step; returns scores that are 0 at the chosen token and -inf elsewhere, so generate's argmax
    picks exactly that token. Row i uses temperature T_i, filters top-k / top-p / min-p (SGLang
    definitions) on softmax(logits / T_i), and inverts the CDF at uniform u[i, t] drawn in advance
    from torch.Generator(seed_i). Rows without filtering use the CDF in vocabulary order, rows with
    filtering the CDF in descending-probability order; the choice depends on the row only.
    Penalties (SGLang penaltylib, before temperature): logits_t - frequency_penalty_i * count_i(v)
    - presence_penalty_i * [count_i(v) > 0], count_i(v) = occurrences of v among row i's tokens
    0..t-1 of this response (the prompt does not count). Greedy rows take the argmax of these logits.
    Recorded: tokens [B, max_new] int64, logprobs [B, max_new] fp32 = log_softmax(penalized logits /
    T_i) (T_i = 1 when greedy) at the chosen token, before filtering (SGLang's Sampler); with
    ``top_n`` > 0 also top_vals / top_ids [B, max_new, top_n] (the top_n largest of that
    distribution, descending), and for each row i in ``token_ids`` (row -> list of ids) the
    log-probs of those ids per step, tokid_vals[i] [max_new, len(ids)].
    """

    def __init__(self, specs: list[SamplingSpec], seeds: list[int], prompt_len: int, max_new: int,
                 top_n: int = 0, token_ids: Optional[dict[int, list[int]]] = None):
        B = len(specs)
        self.freq = torch.tensor([s.frequency_penalty for s in specs], dtype=torch.float32)[:, None]
        self.pres = torch.tensor([s.presence_penalty for s in specs], dtype=torch.float32)[:, None]
        self.penalized = any(s.penalized for s in specs)
        self.counts: Optional[torch.Tensor] = None  # [B, V] fp32 once a step ran with penalties
        self.top_n = int(top_n)
        self.top_vals = torch.zeros(B, max_new, self.top_n, dtype=torch.float32)
        self.top_ids = torch.zeros(B, max_new, self.top_n, dtype=torch.long)
        self.token_ids = {i: torch.tensor(ids, dtype=torch.long) for i, ids in (token_ids or {}).items()}
        self.tokid_vals = {i: torch.zeros(max_new, len(ids), dtype=torch.float32) for i, ids in self.token_ids.items()}
        self.prompt_len = prompt_len
        self.steps = 0
        self.tokens = torch.zeros(B, max_new, dtype=torch.long)
        self.logprobs = torch.zeros(B, max_new, dtype=torch.float32)
        self.greedy = torch.tensor([s.greedy for s in specs], dtype=torch.bool)
        self.temps = torch.tensor([1.0 if s.greedy else s.temperature for s in specs],
                                  dtype=torch.float32)
        self.top_k = torch.tensor([s.top_k for s in specs], dtype=torch.long)
        self.top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float32)
        self.min_p = torch.tensor([s.min_p for s in specs], dtype=torch.float32)
        self.sorted_rows = torch.tensor([(not s.greedy) and s.filtered for s in specs])
        self.plain_rows = torch.tensor([(not s.greedy) and not s.filtered for s in specs])
        self.u = torch.zeros(B, max_new, dtype=torch.float64)
        for i, s in enumerate(specs):
            if not s.greedy:
                g = torch.Generator().manual_seed(seeds[i])
                self.u[i] = torch.rand(max_new, generator=g, dtype=torch.float64)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1] - self.prompt_len
        logits = scores.float()
        if self.penalized:
            if self.counts is None:
                self.counts = torch.zeros_like(logits)
            logits = logits - self.freq * self.counts - self.pres * (self.counts > 0).float()
        scaled = logits / self.temps[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
        if bool(self.plain_rows.any()):
            rows = self.plain_rows.nonzero().squeeze(1)
            cdf = torch.softmax(scaled[rows], dim=-1).double().cumsum(-1)
            tokens[rows] = self._invert(cdf, self.u[rows, t])
        if bool(self.sorted_rows.any()):
            rows = self.sorted_rows.nonzero().squeeze(1)
            probs = torch.softmax(scaled[rows], dim=-1)
            sp, idx = probs.sort(dim=-1, descending=True)
            V = sp.shape[1]
            rank = torch.arange(V)[None, :]
            k = torch.where(self.top_k[rows] > 0, self.top_k[rows], V)
            keep = rank < k[:, None]
            keep &= (sp.cumsum(-1) - sp) <= self.top_p[rows, None]  # SGLang top-p rule
            keep &= sp >= self.min_p[rows, None] * sp[:, :1]
            keep[:, 0] = True  # kept entries form a prefix of the sorted order
            cdf = (sp * keep).double().cumsum(-1)
            pos = self._invert(cdf, self.u[rows, t])
            pos = torch.minimum(pos, keep.sum(-1) - 1)
            tokens[rows] = idx.gather(1, pos[:, None]).squeeze(1)
        self.tokens[:, t] = tokens
        self.logprobs[:, t] = logp.gather(1, tokens[:, None]).squeeze(1)
        if self.penalized:
            self.counts[torch.arange(len(tokens)), tokens] += 1.0
        if self.top_n:
            vals, ids = logp.topk(min(self.top_n, logp.shape[1]), dim=-1)
            self.top_vals[:, t, : vals.shape[1]] = vals
            self.top_ids[:, t, : ids.shape[1]] = ids
        for i, ids in self.token_ids.items():
            self.tokid_vals[i][t] = logp[i, ids]
        self.steps = t + 1
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, tokens[:, None], 0.0)
        return out

    @staticmethod
    def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r = (u * cdf[:, -1]).unsqueeze(1)
        pos = torch.searchsorted(cdf, r, right=True).squeeze(1)
        return pos.clamp(max=cdf.shape[1] - 1)


class _RowStop:
    """transformers StoppingCriteria deciding, once per decode step, which rows are finished and why.

    Called by ``model.generate`` after each step's tokens were chosen; first ``on_step(step, rids)``
    runs (step = tokens generated per row so far, 1-based; rids = the batch's item ids), so an abort
    it makes (``ReferenceEngine.step_hook``) takes effect at this very step. Then, for every row still
    running, in SGLang's order (Req.check_finished, sglang 0.5.9): max_new_tokens reached ->
    {"type": "length", "length": max_new}; the new token is a stop id -> {"type": "stop", "matched":
    id}; a stop string occurs in the decoded tail (the last stop_str_max_len + 2 tokens, stop strings
    tried in the order given) -> {"type": "stop", "matched": the string}; the item was aborted ->
    {"type": "abort", "message": "Aborted"} (it keeps exactly its tokens so far). ``finish[i]`` =
    (tokens kept, finish_reason) once row i finished. Rows that go on and stream get
    ``on_partial(item, row, n_tokens)`` every stream_interval tokens (SGLang's rule), except while
    the decoded tail could be the start of a stop string (SGLang withholds those chunks).
    Returns a BoolTensor [B]: rows that are finished.
    """

    def __init__(self, sampler: _RowSampler, items: list["_Item"], tokenizer=None,
                 on_step: Optional[Callable[[int, list[str]], None]] = None,
                 on_partial: Optional[Callable[["_Item", int, int], None]] = None):
        self.sampler = sampler
        self.items = items
        self.tokenizer = tokenizer
        self.on_step = on_step
        self.on_partial = on_partial
        self.stop_sets = [frozenset(it.spec.stop_ids) for it in items]
        self.finish: list[Optional[tuple[int, dict]]] = [None] * len(items)

    def _tail(self, i: int, n: int, spec: SamplingSpec) -> str:
        k = min(spec.stop_str_max_len + 2, n)
        return self.tokenizer.decode(self.sampler.tokens[i, n - k: n].tolist())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        t = self.sampler.steps - 1
        n = t + 1
        if self.on_step is not None:
            self.on_step(n, [it.rid for it in self.items])
        last = self.sampler.tokens[:, t].tolist()
        for i, it in enumerate(self.items):
            if self.finish[i] is not None:
                continue
            spec = it.spec
            tail = self._tail(i, n, spec) if spec.stop_strs else ""
            if n >= it.max_new:
                self.finish[i] = (n, {"type": "length", "length": it.max_new})
            elif last[i] in self.stop_sets[i]:
                self.finish[i] = (n, {"type": "stop", "matched": last[i]})
            elif spec.stop_strs and any(x in tail for x in spec.stop_strs):
                self.finish[i] = (n, {"type": "stop", "matched": next(x for x in spec.stop_strs if x in tail)})
            elif it.aborted:
                self.finish[i] = (n, abort_reason("Aborted"))  # SGLang FINISH_ABORT()
            elif it.request.stream and self.on_partial is not None:
                interval = spec.stream_interval or 1
                due = (n % interval == 1) if interval > 1 else True
                if due and not _stop_prefix_pending(tail, spec.stop_strs):
                    self.on_partial(it, i, n)
        return torch.tensor([f is not None for f in self.finish])


def _stop_prefix_pending(tail: str, stop_strs: tuple[str, ...]) -> bool:
    """SGLang's Req.check_match_stop_str_prefix: the decoded tail contains a stop string or ends
    with the beginning of one (a streamed chunk then waits)."""
    if not tail:
        return False
    for x in stop_strs:
        if not x:
            continue
        if x in tail or any(tail[-j:] == x[:j] for j in range(1, min(len(tail), len(x)) + 1)):
            return True
    return False


@dataclass(frozen=True)
class LogprobSpec:
    """What one item asks for besides its output log-probs (SGLang GenerateReqInput, per item).

    start: the resolved logprob_start_len (absolute position in the prompt, 0 <= start <= prompt
        length; -1 in the request means prompt length - 1, SGLang's default).
    top_n: top_logprobs_num (0 = no top log-probs).
    token_ids: token_ids_logprob (None = not asked).
    """

    start: int
    top_n: int = 0
    token_ids: Optional[tuple[int, ...]] = None


@dataclass
class _Row:
    """What one item produced: tokens, their log-probs, finish_reason, and the optional extras."""

    tokens: list[int]
    logprobs: list[float]
    finish: Optional[dict]
    top: Optional[list] = None  # per token: [(logprob, id)] * top_n
    tokid: Optional[list] = None  # per token: [(logprob, id)] for token_ids_logprob
    versions: Optional[list] = None  # per token: weight_version (only when the row spans several)


@dataclass(eq=False)
class _Item:
    """One prompt of a /generate request, as scheduled (a row of some generate batch)."""

    prompt: list[int]
    spec: SamplingSpec
    max_new: int  # max_new_tokens clipped to the context
    rid: str
    base_rid: Optional[str]  # the rid the request was sent with (abort matches it too)
    request: "_Request"
    aborted: bool = False
    result: Optional[tuple] = None  # (_Row, weight_version)
    return_routed_experts: bool = False
    routed_experts: Optional[Any] = None  # int32 [prompt + completion - 1, num_layers, topk] once run
    index: int = 0  # position in the request's list of items
    lp: Optional[LogprobSpec] = None  # None: return_logprob is off for this item
    input_lp: Optional[tuple] = None  # (vals [P-1], top [P-1] or None, tokid [P-1] or None), P = prompt - start


class _Request:
    """A submitted /generate request: its items and a future resolved when all of them are done.

    Streaming (``stream``): the scheduler thread appends ("partial", item index, _Row) events to
    ``updates`` and calls ``notify`` (set by the HTTP layer) after each event and each finished item.
    """

    def __init__(self, single: bool, return_lp: list[bool], text_in_lp: bool, stream: bool = False):
        self.single = single
        self.return_lp = return_lp
        self.text_in_lp = text_in_lp
        self.stream = stream
        self.items: list[_Item] = []
        self.t0 = time.time()
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.updates: collections.deque = collections.deque()
        self.notify: Optional[Callable[[], None]] = None
        self.sent_final: set[int] = set()
        self._left = 0
        self._lock = threading.Lock()

    def push(self, event: tuple) -> None:
        self.updates.append(event)
        self._wake()

    def _wake(self) -> None:
        notify = self.notify
        if notify is not None:
            notify()

    def item_done(self, error: Optional[BaseException] = None) -> None:
        with self._lock:
            self._left -= 1
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(RuntimeError(f"generation failed: {error!r}"))
                elif self._left == 0:
                    self.future.set_result(None)
        self._wake()


# ----------------------------------------------------------------------------- the engine


class ReferenceEngine(WeightUpdater):
    """One transformers causal LM behind SGLang's request semantics (no HTTP here).

    Args:
        model_path: HF directory (config.json, *.safetensors, tokenizer files unless tokenizer_path).
        tokenizer_path: tokenizer directory; defaults to model_path.
        max_batch_size: most rows (items) in one generate batch.
        batch_wait_s, max_batch_wait_s: before forming a batch, wait until no request arrived for
            batch_wait_s seconds (at most max_batch_wait_s), so that a burst of concurrent requests
            lands in one batch.
        step_hook: optional ``f(step, rids)`` (also settable later as :attr:`step_hook`), a test hook
            called from the scheduler thread after every decode step of every batch: ``step`` =
            tokens generated per row so far (1, 2, ...), ``rids`` = item ids of the batch's rows
            (rows that already stopped included). An :meth:`abort` or :meth:`pause_generation` it
            calls takes effect at this step (aborted rows keep exactly ``step`` tokens); an exception
            it raises fails the batch. :meth:`pause_after_steps` arms a one-shot pause this way.
        dtype: "float32" | "bfloat16" (or the torch dtype; ``rollout.dtype``, ``moerl serve --dtype``
            as SGLang's --dtype): the model is loaded in it (a checkpoint of another dtype is cast) and
            every weight update is cast to it (WeightMapper.apply copies into the served tensors).
    The model is loaded in ``dtype``, eval mode, without gradients, on CPU.

    Raises:
        ValueError: an unknown dtype (names rollout.dtype).

    Scheduling: every prompt of every /generate request becomes an item in one FIFO queue. A
    scheduler thread repeatedly takes the oldest item and all queued items whose prompt has the
    same length (up to max_batch_size) and runs them as one ``model.generate`` batch under the model
    lock; weight updates (inherited from moerl.rollout.engine_weights.WeightUpdater) take the same
    lock between batches. Equal prompt lengths mean no padding, so a row's numerics (and hence its
    tokens, given its seed) do not depend on its batch mates. :meth:`pause_generation` /
    :meth:`continue_generation` hold / resume the scheduler (SGLang's RL pause, see there).
    """

    def __init__(self, model_path: str, tokenizer_path: Optional[str] = None, max_batch_size: int = 256,
                 batch_wait_s: float = 0.01, max_batch_wait_s: float = 0.2,
                 step_hook: Optional[Callable[[int, list[str]], None]] = None, dtype="float32"):
        from transformers import AutoTokenizer, GenerationConfig

        from moerl.models.dtypes import serving_torch_dtype

        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.dtype = serving_torch_dtype(dtype)  # rollout.dtype; weight updates are cast to it
        model = load_causal_lm(model_path, dtype=self.dtype)  # block-FP8 checkpoints dequantised
        model.eval().requires_grad_(False)
        eos: set[int] = set()
        for src in (self.tokenizer.eos_token_id, model.config.eos_token_id,
                    getattr(model.generation_config, "eos_token_id", None)):
            if src is None:
                continue
            eos.update([src] if isinstance(src, int) else list(src))
        self.eos_ids = tuple(sorted(eos))
        # Hub generation defaults (top_k=50, ...) must not leak into generate(): sampling is ours.
        model.generation_config = GenerationConfig()
        self.model = model
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max_batch_wait_s
        self._model_lock = threading.Lock()
        self._init_weight_state()  # mapper, weight_version, update groups (engine_weights.WeightUpdater)
        self._cv = threading.Condition()
        self._pending: list[_Item] = []
        self._running: list[_Item] = []
        self._closed = False
        self._paused = False  # pause_generation() .. continue_generation(): no batch starts
        # "in_place" pause: the running batch parks at its next decode step (model lock released) until
        # continue_generation; _marks = [(tokens generated before, weight_version)] of the running batch
        self._suspend = False
        self._parked = False
        self._marks: list[tuple[int, str]] = []
        self.step_hook = step_hook
        self._sysrand = secrets.SystemRandom()
        self._warned_fields: set[str] = set()
        self._scheduler = threading.Thread(target=self._schedule_loop, name="moerl-batcher", daemon=True)
        self._scheduler.start()

    # ------------------------------------------------------------------ generate

    def _normalize(self, body: dict):
        if not isinstance(body, dict):
            raise ValueError("the /generate body must be a JSON object")
        for key, value in body.items():
            if key in _REQUEST_KEYS or key in _REQUEST_IGNORED:
                continue
            if key in _REQUEST_NOOP:
                if not _REQUEST_NOOP[key](value):
                    raise ValueError(f"{key}={value!r} is not supported by the moerl reference server; "
                                     f"leave it unset")
                continue
            # SGLang ignores fields it does not know (sglang-router adds e.g. "model"); so do we.
            if key not in self._warned_fields:
                self._warned_fields.add(key)
                logger.warning("ignoring /generate field %r (not used by the reference server)", key)
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of 'input_ids' (list[int] or list[list[int]]) or 'text'")
        if input_ids is not None:
            if not isinstance(input_ids, list) or not input_ids:
                raise ValueError("input_ids must be a non-empty list[int] or list[list[int]]")
            single = not isinstance(input_ids[0], list)
            prompts = [input_ids] if single else input_ids
            for i, p in enumerate(prompts):
                if not isinstance(p, list) or not p or not all(_is_int(t) for t in p):
                    raise ValueError(f"input_ids[{i}] must be a non-empty list of token ids")
                bad = [t for t in p if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"input_ids[{i}] has token ids {bad[:5]} outside the "
                                     f"vocabulary [0, {self.vocab_size})")
        else:
            single = isinstance(text, str)
            texts = [text] if single else text
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ValueError("text must be a string or a list of strings")
            prompts = [self.tokenizer.encode(t) for t in texts]
            for i, p in enumerate(prompts):
                if not p:
                    raise ValueError(f"text[{i}] tokenizes to no tokens")
        bs = len(prompts)
        sp = body.get("sampling_params")
        if sp is None or isinstance(sp, dict):
            sps = [sp or {}] * bs
        elif isinstance(sp, list) and all(isinstance(s, dict) for s in sp):
            if len(sp) != bs:
                raise ValueError(f"sampling_params is a list of {len(sp)} dicts but the batch has {bs} "
                                 f"prompts; give one dict, or one per prompt")
            sps = sp
        else:
            raise ValueError("sampling_params must be a dict or a list of dicts")
        ns = [s.get("n", 1) or 1 for s in sps]
        if not all(_is_int(n) and n >= 1 for n in ns) or len(set(ns)) != 1:
            raise ValueError(f"sampling_params.n must be the same integer >= 1 for all items, got {ns[:8]}")
        n = ns[0]
        rid = body.get("rid")
        total = bs * n
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(bs)]
        elif isinstance(rid, str):  # SGLang: a batch's string rid becomes f"{rid}_{i}" per item
            rids = [rid] if (single and n == 1) else [f"{rid}_{i}" for i in range(total)]
        elif isinstance(rid, list) and all(isinstance(r, str) for r in rid) and len(rid) == bs:
            if len(set(rid)) != len(rid):
                raise ValueError(f"rid has duplicates: {sorted(r for r in set(rid) if rid.count(r) > 1)}")
            rids = list(rid)
        else:
            raise ValueError(f"rid must be a string or a list of {bs} strings")
        rl = body.get("return_logprob")
        rls = rl if isinstance(rl, list) else [bool(rl)] * bs
        if len(rls) != bs:
            raise ValueError(f"return_logprob is a list of {len(rls)} but the batch has {bs} prompts")
        lps = self._logprob_specs(body, prompts, rls, n)
        if n > 1:  # SGLang parallel sampling (TokenizerManager._handle_batch_request): prompt-major,
            single = False  # the n samples of prompt 0, then those of prompt 1, ...
            prompts, sps, rls, lps = ([x for x in xs for _ in range(n)] for xs in (prompts, sps, rls, lps))
            if len(rids) == bs:
                rids = [f"{r}_{k}" for r in rids for k in range(n)]
        specs = [parse_sampling_params(s, vocab_size=self.vocab_size, eos_ids=self.eos_ids,
                                       where="sampling_params" if isinstance(sp, dict) or sp is None
                                       else f"sampling_params[{i // n}]", tokenizer=self.tokenizer)
                 for i, s in enumerate(sps)]
        return single, prompts, specs, rids, [bool(x) for x in rls], lps

    def _logprob_specs(self, body: dict, prompts: list[list[int]], rls: list, n: int) -> list[Optional[LogprobSpec]]:
        """Per prompt: the :class:`LogprobSpec` of ``logprob_start_len``, ``top_logprobs_num`` and
        ``token_ids_logprob`` (each a value for all prompts or a list of one per prompt, as in
        SGLang's GenerateReqInput), or None where return_logprob is off (SGLang then ignores them).

        Raises:
            ValueError: a wrong type, a list of the wrong length, token ids outside the vocabulary,
                or logprob_start_len beyond the prompt (SGLang's message; it answers 400 too).
        """
        bs = len(prompts)

        def per_prompt(key: str, default, check) -> list:
            v = body.get(key)
            vs = v if isinstance(v, list) and (key != "token_ids_logprob" or (v and isinstance(v[0], list))) \
                else [v] * bs
            if len(vs) != bs:
                raise ValueError(f"{key} is a list of {len(vs)} but the batch has {bs} prompts")
            out = []
            for i, x in enumerate(vs):
                x = default if x is None else x
                if not check(x):
                    raise ValueError(f"{key}{'' if len(vs) == 1 else f'[{i}]'} = {x!r} is invalid: " + check.__doc__)
                out.append(x)
            return out

        def start_ok(x):
            """logprob_start_len must be -1 (default: logprobs of the output tokens only) or an integer >= 0"""
            return _is_int(x) and x >= -1

        def top_ok(x):
            """top_logprobs_num must be an integer >= 0 (0 = off)"""
            return _is_int(x) and 0 <= x

        def ids_ok(x):
            """token_ids_logprob must be a list of token ids in the vocabulary"""
            return isinstance(x, list) and all(_is_int(t) and 0 <= t < self.vocab_size for t in x)

        tl = body.get("token_ids_logprob")
        if n > 1 and isinstance(tl, list) and tl and isinstance(tl[0], list):
            raise ValueError("Cannot use list token_ids_logprob with parallel_sample_num > 1")
        starts = per_prompt("logprob_start_len", -1, start_ok)
        tops = per_prompt("top_logprobs_num", 0, top_ok)
        ids = per_prompt("token_ids_logprob", [], ids_ok)
        out: list[Optional[LogprobSpec]] = []
        for i, p in enumerate(prompts):
            if not rls[i]:
                out.append(None)
                continue
            start = len(p) - 1 if starts[i] == -1 else starts[i]
            if start > len(p):
                raise ValueError(f"logprob_start_len={start} is higher than the number of input tokens "
                                 f"{len(p)} (input {i}). Please use a smaller logprob_start_len.")
            top_n = min(int(tops[i]), self.vocab_size)
            out.append(LogprobSpec(start=start, top_n=top_n, token_ids=tuple(ids[i]) if ids[i] else None))
        return out

    def submit(self, body: dict) -> _Request:
        """Validate a /generate body and queue its items; returns at once (see :meth:`response`).

        Raises:
            ValueError: malformed request (the message names the field).
            RuntimeError: the engine is closed.
        """
        single, prompts, specs, rids, return_lp, lps = self._normalize(body)
        base_rid = body.get("rid") if isinstance(body.get("rid"), str) else None
        req = _Request(single, return_lp, bool(body.get("return_text_in_logprobs", False)),
                       stream=bool(body.get("stream", False)))
        req.items = [_Item(p, s, self._clip_max_new(p, s, i), r, base_rid, req, index=i, lp=lp)
                     for i, (p, s, r, lp) in enumerate(zip(prompts, specs, rids, lps))]
        for it, flag in zip(req.items, self._routed_flags(body, len(req.items))):
            it.return_routed_experts = flag
        req._left = len(req.items)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._pending.extend(req.items)
            self._cv.notify_all()
        return req

    def _routed_flags(self, body: dict, total: int) -> list[bool]:
        """Per-item ``return_routed_experts`` (a bool, or one per prompt like return_logprob; with
        ``n`` > 1 the list repeats with the batch). Builds the router hooks on first use.

        Raises:
            ValueError: a list of the wrong length, or routing asked of a model without MoE routers.
        """
        flag = body.get("return_routed_experts")
        if isinstance(flag, list):
            if not flag or total % len(flag) or not all(isinstance(f, bool) for f in flag):
                raise ValueError(f"return_routed_experts must be a bool or a list of one bool per prompt, "
                                 f"got {flag!r} for {total} items")
            flags = list(flag) * (total // len(flag))
        else:
            flags = [bool(flag)] * total
        if any(flags):
            self._routing_recorder()
        return flags

    def _routing_recorder(self):
        """The HFRoutingRecorder hooked on the current model (re-made if the model object changed)."""
        from moerl.moe.routing_replay import HFRoutingRecorder

        rec = getattr(self, "_routing", None)
        if rec is None or rec.model is not self.model:
            if rec is not None:
                rec.remove()
            rec = self._routing = HFRoutingRecorder(self.model)
        return rec

    def response(self, req: _Request):
        """The SGLang-shaped result of a finished request: a dict, or a list for batched input.

        Item: {"text", "output_ids", "meta_info"} (see the module docstring for meta_info).
        Raises:
            RuntimeError: generation failed.
        """
        req.future.result()
        latency = time.time() - req.t0
        results = [self._item_dict(it, *it.result, latency=latency) for it in req.items]
        return results[0] if req.single else results

    def stream_updates(self, req: _Request) -> tuple[list[dict], bool]:
        """The stream chunks of ``req`` that are new since the last call, and whether it is done.

        SGLang 0.5.9 (TokenizerManager._handle_batch_output without --stream-output): every chunk
        is a whole result so far: cumulative "text" (incomplete UTF-8 at the end held back),
        cumulative "output_ids", meta_info with the log-prob lists so far and finish_reason None;
        the last chunk of an item is its full result (exactly what the non-streamed answer holds
        for it). Batched input (a list, or n > 1): chunks of all items interleave as they come and
        each carries "index", the item's position in the answer list.
        Raises:
            RuntimeError: generation failed (the HTTP layer sends it as an error event).
        """
        chunks = []
        while req.updates:
            _, i, row = req.updates.popleft()
            if i in req.sent_final:
                continue
            it = req.items[i]
            chunks.append(self._item_dict(it, row, self.weight_version, latency=None))
        for it in req.items:
            if it.result is not None and it.index not in req.sent_final:
                req.sent_final.add(it.index)
                chunks.append(self._item_dict(it, *it.result, latency=time.time() - req.t0))
        if req.future.done() and req.future.exception() is not None:
            raise req.future.exception()
        return chunks, req.future.done() and len(req.sent_final) == len(req.items)

    def _item_dict(self, it: _Item, row: _Row, version: str, latency: Optional[float]) -> dict:
        """One SGLang result item from ``row`` (``row.finish`` None: a partial stream chunk)."""
        tokens, finish = row.tokens, row.finish
        meta = {
            "id": it.rid,
            "finish_reason": finish,
            "prompt_tokens": len(it.prompt),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": version,
        }
        if latency is not None:
            meta["e2e_latency"] = latency
        if row.versions is not None and finish is not None:
            meta["output_token_weight_versions"] = list(row.versions)
        if it.return_routed_experts and finish is not None:
            from moerl.moe.routing_replay import encode_routed_experts

            routed = it.routed_experts
            if routed is None:  # never run (aborted in the queue / max_new_tokens 0): no positions
                cfg = self.model.config
                routed = torch.zeros((0, cfg.num_hidden_layers, cfg.num_experts_per_tok), dtype=torch.int32)
            meta["routed_experts"] = encode_routed_experts(routed)
        if it.lp is not None:
            meta.update(self._logprob_meta(it, row))
        text = self._text(it.spec, tokens, finish)
        out = {"text": text, "output_ids": list(tokens), "meta_info": meta}
        if it.request.stream and not it.request.single:
            out["index"] = it.index
        return out

    def _text(self, spec: SamplingSpec, tokens: list[int], finish: Optional[dict]) -> str:
        """SGLang's detokenization: decode, then (unless no_stop_trim) cut a matched stop token
        (the last id) or everything from the first occurrence of a matched stop string; a partial
        chunk's text (finish None) holds back an incomplete UTF-8 character at its end."""
        matched = (finish or {}).get("matched") if not spec.no_stop_trim else None
        ids = tokens[:-1] if isinstance(matched, int) and not isinstance(matched, bool) and tokens else tokens
        text = self.tokenizer.decode(ids, skip_special_tokens=spec.skip_special_tokens)
        if isinstance(matched, str) and matched:
            pos = text.find(matched)
            text = text[:pos] if pos != -1 else text
        if finish is None:
            text = text.rstrip("\ufffd")
        return text

    def _logprob_meta(self, it: _Item, row: _Row) -> dict:
        """SGLang's log-prob meta_info (TokenizerManager.add_logprob_to_meta_info): entries are
        [logprob, token_id, text or None] (text with return_text_in_logprobs); input lists cover
        prompt[start:] and their first entry has no log-prob (None, as in SGLang); top / token-id
        lists hold one list of entries per position (None at the first input position)."""
        text_on = it.request.text_in_lp
        dec = (lambda t: self.tokenizer.decode([t])) if text_on else (lambda t: None)  # noqa: E731
        entries = lambda pairs: [[lp, t, dec(t)] for lp, t in pairs]  # noqa: E731
        lp = it.lp
        ids = it.prompt[lp.start:]
        meta: dict = {}
        inp = it.input_lp
        if ids:
            vals = [None] + (list(inp[0]) if inp is not None else [None] * (len(ids) - 1))
        else:
            vals = []
        meta["input_token_logprobs"] = [[v, t, dec(t)] for v, t in zip(vals, ids)]
        meta["output_token_logprobs"] = entries(zip(row.logprobs, row.tokens))
        if lp.top_n > 0:
            top_in = (inp[1] if inp is not None and inp[1] is not None else [[]] * (len(ids) - 1)) if ids else []
            meta["input_top_logprobs"] = ([None] + [entries(x) or None for x in top_in]) if ids else []
            meta["output_top_logprobs"] = [entries(x) for x in (row.top or [])]
        if lp.token_ids is not None:
            tok_in = (inp[2] if inp is not None and inp[2] is not None else [[]] * (len(ids) - 1)) if ids else []
            meta["input_token_ids_logprobs"] = ([None] + [entries(x) or None for x in tok_in]) if ids else []
            meta["output_token_ids_logprobs"] = [entries(x) for x in (row.tokid or [])]
        return meta

    def generate(self, body: dict):
        """Serve one /generate body (SGLang GenerateReqInput shape); blocks until it is done.

        Returns a result dict for a single prompt, a list of them for a batch (order preserved).
        Raises:
            ValueError: malformed request (the message names the field).
            RuntimeError: the engine is closed or generation failed.
        """
        return self.response(self.submit(body))

    def _clip_max_new(self, prompt: list[int], spec: SamplingSpec, i: int) -> int:
        """max_new_tokens of item ``i``, checked as SGLang's TokenizerManager._validate_one_request does
        (context = max_position_embeddings, no --allow-auto-truncate): the prompt must be shorter than the
        context and prompt + max_new_tokens must stay below it (ValueError -> HTTP 400 with SGLang's
        message); no limit given (null / -1): whatever room the context leaves."""
        ctx = self.max_positions
        if ctx and len(prompt) >= ctx:
            raise ValueError(f"The input ({len(prompt)} tokens) is longer than the model's context length "
                             f"({ctx} tokens). (input {i})")
        m = spec.max_new_tokens
        if m < 0:
            return ctx - len(prompt) - 1 if ctx else 2048
        if ctx and m + len(prompt) >= ctx:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
                f"a total of {m + len(prompt)} tokens: {len(prompt)} tokens from the input messages and {m} tokens "
                f"for the completion. Please reduce the number of tokens in the input messages or the completion to "
                f"fit within the limit. (input {i})")
        return m

    def _schedule_loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    while (not self._pending or self._paused) and not self._closed:
                        self._cv.wait()
                    if self._closed:
                        return
                    # Let a burst of concurrent requests arrive before forming the batch: wait until
                    # no item arrived for batch_wait_s (at most max_batch_wait_s, or a full batch).
                    t_first = time.monotonic()
                    while len(self._pending) < self.max_batch_size and not (self._paused or self._closed):
                        n = len(self._pending)
                        self._cv.wait(self.batch_wait_s)
                        if len(self._pending) == n or time.monotonic() - t_first > self.max_batch_wait_s:
                            break
                    if self._pending and not (self._paused or self._closed):
                        break
                    # paused, closed or every queued item aborted meanwhile: wait again
                length = len(self._pending[0].prompt)
                batch = [it for it in self._pending if len(it.prompt) == length][: self.max_batch_size]
                taken = set(map(id, batch))
                self._pending = [it for it in self._pending if id(it) not in taken]
                self._running = batch
            error: Optional[BaseException] = None
            try:
                t_batch = time.monotonic()
                with self._model_lock:
                    self._marks = [(0, self.weight_version)]
                    rows = self._generate_rows(batch)
                logger.debug("batch of %d rows (prompt length %d, %d queued) in %.1f ms", len(batch), length,
                             len(self._pending), 1000 * (time.monotonic() - t_batch))
                for it, row in zip(batch, rows):
                    it.result = (row, self._versions_of(row))
            except BaseException as e:  # report to the waiting requests, keep serving
                logger.exception("generate batch failed")
                error = e
            finally:
                try:
                    for it in batch:
                        it.request.item_done(error)
                finally:
                    # after the answers: pause_generation() returns once the batch is answered
                    with self._cv:
                        self._running = []
                        self._cv.notify_all()

    def _versions_of(self, row: _Row) -> str:
        """The weight_version of ``row``'s last token (the batch's first version for an empty row); sets
        ``row.versions`` (one per token) when the row's tokens come from more than one version (the batch
        was suspended by an "in_place" pause and the weights were updated meanwhile)."""
        marks = self._marks
        n = len(row.tokens)
        live = [(k, v) for k, v in marks if k < n] or marks[:1]  # the versions that made some token
        if len({v for _, v in live}) > 1:
            ends = [k for k, _ in live[1:]] + [n]
            row.versions = [v for (k, v), end in zip(live, ends) for _ in range(end - k)]
        return live[-1][1]

    def _park(self, step: int) -> None:
        """Scheduler thread, inside a generate batch after decode step ``step``: an "in_place" pause is
        pending, so release the model lock (weight updates may run), wait for continue_generation (or
        close, or a later "abort" / "retract" pause, which let the batch go on), take the lock back and
        note the weight_version the tokens after ``step`` come from."""
        with self._cv:
            if not self._suspend or self._closed:
                return
            self._model_lock.release()
            self._parked = True
            self._cv.notify_all()
            try:
                self._cv.wait_for(lambda: not self._suspend or self._closed)
            finally:
                self._parked = False
        self._model_lock.acquire()
        if self.weight_version != self._marks[-1][1]:
            self._marks.append((step, self.weight_version))

    def close(self) -> None:
        """Stop the scheduler thread (queued requests fail with RuntimeError)."""
        with self._cv:
            self._closed = True
            pending, self._pending = self._pending, []
            self._cv.notify_all()
        for it in pending:
            it.request.item_done(RuntimeError("the engine was closed"))

    @staticmethod
    def _empty_row(it: _Item, finish: dict) -> _Row:
        lp = it.lp
        return _Row([], [], finish, top=[] if lp is not None and lp.top_n else None,
                    tokid=[] if lp is not None and lp.token_ids is not None else None)

    def _generate_rows(self, items: list[_Item]) -> list[_Row]:
        """Run one generate batch (items of one prompt length); returns one :class:`_Row` per item."""
        rows: dict[int, _Row] = {}
        for it in items:
            if it.aborted:
                rows[id(it)] = self._empty_row(it, abort_reason("Abort in waiting queue"))
        self._input_logprobs([it for it in items if not it.aborted])
        for it in items:
            if not it.aborted and it.max_new == 0:
                rows[id(it)] = self._empty_row(it, {"type": "length", "length": 0})
        live = [it for it in items if not it.aborted and it.max_new > 0]
        if live:
            for it, row in zip(live, self._run_generate(live)):
                rows[id(it)] = row
        return [rows[id(it)] for it in items]

    def _input_logprobs(self, items: list[_Item]) -> None:
        """Prompt log-probs (SGLang's input_token_logprobs and friends) of the items that ask for
        positions before the prompt's last token (logprob_start_len <= prompt length - 2), from one
        forward of those prompts (equal lengths: no padding). Sets ``it.input_lp`` = (vals, top,
        tokid), one entry per token prompt[start + 1:], taken from log_softmax of the raw fp32 logits
        at the position before it: no temperature, no penalties (SGLang's logits processor)."""
        need = [it for it in items if it.lp is not None and it.lp.start <= len(it.prompt) - 2]
        if not need:
            return
        with torch.inference_mode():
            ids = torch.tensor([it.prompt for it in need], dtype=torch.long)
            logits = self.model(input_ids=ids).logits.float()  # [b, L, V]
        for j, it in enumerate(need):
            s = it.lp.start
            logp = torch.log_softmax(logits[j, s: len(it.prompt) - 1], dim=-1)  # predicts prompt[s+1:]
            nxt = torch.tensor(it.prompt[s + 1:], dtype=torch.long)
            vals = logp.gather(1, nxt[:, None]).squeeze(1).tolist()
            top = None
            if it.lp.top_n:
                v, x = logp.topk(it.lp.top_n, dim=-1)
                top = [list(zip(a, b)) for a, b in zip(v.tolist(), x.tolist())]
            tokid = None
            if it.lp.token_ids is not None:
                want = list(it.lp.token_ids)
                tokid = [list(zip(r, want)) for r in logp[:, want].tolist()]
            it.input_lp = (vals, top, tokid)

    def _on_partial(self, sampler: _RowSampler):
        """The _RowStop callback that queues a stream chunk of row i after n tokens."""
        def push(it: _Item, i: int, n: int) -> None:
            it.request.push(("partial", it.index, self._row_of(sampler, i, n, it, None)))
        return push

    @staticmethod
    def _row_of(sampler: _RowSampler, i: int, n: int, it: _Item, finish: Optional[dict]) -> _Row:
        row = _Row(sampler.tokens[i, :n].tolist(), sampler.logprobs[i, :n].tolist(), finish)
        if it.lp is not None and it.lp.top_n:
            k = it.lp.top_n
            row.top = [list(zip(v, x)) for v, x in zip(sampler.top_vals[i, :n, :k].tolist(),
                                                        sampler.top_ids[i, :n, :k].tolist())]
        if it.lp is not None and it.lp.token_ids is not None:
            want = list(it.lp.token_ids)
            row.tokid = [list(zip(r, want)) for r in sampler.tokid_vals[i][:n].tolist()]
        return row

    def _run_generate(self, items: list[_Item]) -> list[_Row]:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        B = len(items)
        L = max(len(it.prompt) for it in items)
        max_new = max(it.max_new for it in items)
        specs = [it.spec for it in items]
        seeds = [s.seed if s.seed is not None else self._sysrand.getrandbits(63) for s in specs]
        input_ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.long)
        for i, it in enumerate(items):
            n = len(it.prompt)
            input_ids[i, L - n:] = torch.tensor(it.prompt, dtype=torch.long)
            attention_mask[i, L - n:] = 1
        top_n = max((it.lp.top_n for it in items if it.lp is not None), default=0)
        token_ids = {i: list(it.lp.token_ids) for i, it in enumerate(items)
                     if it.lp is not None and it.lp.token_ids is not None}
        sampler = _RowSampler(specs, seeds, prompt_len=L, max_new=max_new, top_n=top_n, token_ids=token_ids)
        stopper = _RowStop(sampler, items, self.tokenizer, on_step=self._on_decode_step,
                           on_partial=self._on_partial(sampler))
        gen_cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new,
                                   pad_token_id=self.pad_id, use_cache=True)
        # return_routed_experts: forward hooks on the MoE gates record every call's top-k ids
        recorder = self._routing_recorder() if any(it.return_routed_experts for it in items) else None
        record = recorder.recording() if recorder is not None else contextlib.nullcontext()
        with torch.inference_mode(), record:
            self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                generation_config=gen_cfg,
                                logits_processor=LogitsProcessorList([sampler]),
                                stopping_criteria=StoppingCriteriaList([stopper]))
        routes = recorder.collect(B) if recorder is not None else None  # [B, L + decode calls, layers, k]
        rows = []
        for i, it in enumerate(items):
            n, finish = stopper.finish[i] or (min(it.max_new, sampler.steps), {"type": "length", "length": it.max_new})
            rows.append(self._row_of(sampler, i, n, it, finish))
            if routes is not None and it.return_routed_experts:
                # SGLang: prompt + completion - 1 positions (the last token is never fed back)
                m = len(it.prompt)
                it.routed_experts = routes[i, L - m: L + n - 1].clone()
        return rows

    def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> None:
        """Abort queued or running items: ``rid`` is an item id or the rid a request was sent with.

        Queued items are answered at once (no tokens, finish_reason {"type": "abort", "message":
        "Abort in waiting queue"}, as SGLang's scheduler pops them from its waiting queue); running
        items stop after their next decode step and return the tokens generated so far with their
        log-probs (finish_reason {"type": "abort", "message": "Aborted"}). Also while paused.
        """
        with self._cv:
            queued = self._abort_locked(lambda it: abort_all or (rid is not None and rid in (it.rid, it.base_rid)))
        self._answer_aborted_in_queue(queued)

    def _abort_locked(self, match: Callable[[_Item], bool]) -> list[_Item]:
        """Under ``self._cv``: flag the matching running items aborted and take the matching queued
        items out of the queue; returns the latter (answer them with _answer_aborted_in_queue)."""
        for it in self._running:
            if match(it):
                it.aborted = True
        queued = [it for it in self._pending if match(it)]
        if queued:
            gone = set(map(id, queued))
            self._pending = [it for it in self._pending if id(it) not in gone]
            self._cv.notify_all()
        return queued

    def _answer_aborted_in_queue(self, items: list[_Item]) -> None:
        for it in items:
            it.aborted = True
            it.result = (self._empty_row(it, abort_reason("Abort in waiting queue")),
                         self.weight_version)
            it.request.item_done()

    # ------------------------------------------------------------------ pause / continue (SGLang RL API)

    @property
    def paused(self) -> bool:
        """True between :meth:`pause_generation` and :meth:`continue_generation`."""
        return self._paused

    def pause_generation(self, mode: str = DEFAULT_PAUSE_MODE) -> None:
        """SGLang's /pause_generation: stop scheduling generate batches until :meth:`continue_generation`.

        Modes (SGLang PauseGenerationReqInput.mode; TokenizerManager.pause_generation and
        Scheduler.pause_generation of sglang 0.5.9):
          * "abort" (default): every running item stops at its next decode step and is answered with
            the tokens generated so far, their log-probs and finish_reason {"type": "abort",
            "message": "Aborted"}; every queued item is answered at once with no tokens and
            finish_reason {"type": "abort", "message": "Abort in waiting queue"}. Then scheduling
            stays held. (SGLang: abort_all repeatedly until no request is in flight.)
          * "in_place": no new batch starts; queued items wait; the running batch is suspended at its
            next decode step with its KV cache, as in SGLang: the model lock is released, so weight
            updates run, and after :meth:`continue_generation` the batch goes on under the new
            weights (its KV cache from the old ones). Each response then reports one
            weight_version per token (``output_token_weight_versions``, see the module docstring);
            its log-probs are those of the weights that sampled each token.
          * "retract": no new batch starts; queued items wait. DIFFERENCE FROM SGLANG: SGLang moves
            the running requests back to the waiting queue and recomputes their KV cache after
            continue; this engine lets the running batch run to its end (with the weights it started
            with) and answers it before this returns.
        While paused, new /generate requests are accepted and queued (SGLang holds them before its
        scheduler), :meth:`abort` answers queued items at once, and weight updates run (nothing holds
        the model lock). Idempotent: pausing a paused engine is allowed ("abort" then aborts what is
        queued; "retract" / "in_place" change nothing).

        Returns once no batch is running or the running one is suspended ("in_place"; for "abort":
        after the aborted items were answered), so a weight update right after it cannot race a
        decode step. A later "abort" or "retract" pause lets a suspended batch go on (abort: its rows
        end at the next step). Called from the scheduler thread itself (a :attr:`step_hook`), it
        returns at once and the running batch stops (abort) or is suspended (in_place) at this step.

        Raises:
            ValueError: ``mode`` is not one of PAUSE_MODES (the message names ``mode`` and them).
        """
        check_pause_mode(mode)
        with self._cv:
            self._paused = True
            self._suspend = mode == "in_place"
            queued = self._abort_locked(lambda it: True) if mode == "abort" else []
            self._cv.notify_all()
        self._answer_aborted_in_queue(queued)
        if threading.current_thread() is self._scheduler:
            return
        with self._cv:
            self._cv.wait_for(lambda: not self._running or self._closed or (self._suspend and self._parked))

    def continue_generation(self) -> None:
        """SGLang's /continue_generation: resume scheduling (queued items start); no-op when not paused."""
        with self._cv:
            self._paused = False
            self._suspend = False
            self._cv.notify_all()

    def pause_after_steps(self, k: int, mode: str = DEFAULT_PAUSE_MODE) -> None:
        """Test hook: deterministic interruption. Arms a one-shot :attr:`step_hook` that calls
        ``pause_generation(mode)`` when a generate batch has just done decode step ``k``, i.e.
        exactly as if /pause_generation had arrived then. With "abort" every row of that batch
        that was still generating returns exactly its first ``k`` tokens (finish_reason abort, with
        their log-probs), queued items are aborted, and the engine stays paused until
        :meth:`continue_generation`. Rows that stop earlier (stop token, max_new_tokens) are
        unaffected; batches shorter than ``k`` steps do not fire it (it stays armed). When it fires
        it puts back the step_hook that was set before.

        Raises:
            ValueError: ``k`` < 1 or a bad ``mode``.
        """
        if not _is_int(k) or k < 1:
            raise ValueError(f"k must be an integer >= 1 (decode steps), got {k!r}")
        check_pause_mode(mode)
        previous = self.step_hook

        def hook(step: int, rids: list[str]) -> None:
            if previous is not None:
                previous(step, rids)
            if step == k and self.step_hook is hook:
                self.step_hook = previous
                self.pause_generation(mode)

        self.step_hook = hook

    def _on_decode_step(self, step: int, rids: list[str]) -> None:
        hook = self.step_hook
        if hook is not None:
            hook(step, rids)
        if self._suspend:  # an "in_place" pause: suspend here until continue_generation
            self._park(step)

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict:
        cfg = self.model.config
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path,
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.weight_version, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None)}

