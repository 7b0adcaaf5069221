"""Routing replay for MoE RL: R3 (replay the rollout engine's routing) and R2 (replay the trainer's
own first-pass routing).

Why (REFERENCE.md sec. 2): the rollout engine and the trainer compute the router logits with
different kernels / precisions, so near-tied tokens pick different experts on the two sides and the
train-vs-rollout log-prob mismatch of an MoE is much larger than a dense model's.

* R3 ("rollout routing replay"): the rollout server returns, for every token position and every MoE
  layer, the top-k expert ids its router chose (SGLang's ``return_routed_experts``); the trainer
  forces exactly those experts in the old-log-prob and the update passes.
* R2: the trainer records its own routing in the first (old-log-prob) pass and forces it in the
  later (update) passes, so the policy ratio is not perturbed by routing flips caused by the update.

Wire format (SGLang, ``sglang.srt.layers.moe.routed_experts_capturer``): a /generate request with
``"return_routed_experts": true`` gets ``meta_info["routed_experts"]`` = base64 of the int32 bytes of
an array ``[num_positions, num_layers, topk]`` (C order), num_positions = prompt_tokens +
completion_tokens - 1 (every position the engine ran through the model: the last generated token
is never fed back), num_layers = ``num_hidden_layers`` of the HF config (a dense layer holds -1
here; SGLang leaves it undefined), topk = ``num_experts_per_tok``. Position p's routing is the
routing of token p (the input at p, which predicts token p + 1). :func:`encode_routed_experts` /
:func:`decode_routed_experts` implement it.

Trainer side: Megatron-Core 0.16.1's ``RouterReplay`` (``megatron.core.transformer.moe.router_replay``)
is the hook point (``TopKRouter.routing`` calls ``router_replay.get_replay_topk`` inside
``topk_routing_with_score_function``). :class:`RoutingReplay` attaches its own subclass
(:class:`PartialRouterReplay`) to every TopKRouter of a model, without Megatron's
``moe_enable_routing_replay`` config flag or its process-global instance list: rows whose target is
-1 (positions the rollout did not record, padding) keep the router's own choice, the other rows use
the target experts. Gates at forced experts are the router's probabilities there, normalised as the
router's config says (Megatron computes them from the gathered scores): softmax over the k forced
logits for softmax routing without pre-softmax (= Qwen3's norm_topk_prob), the softmax scores for
pre-softmax, sigmoid scores / their sum for sigmoid routing (the aux-free expert bias only chooses
experts, so it is ignored when forcing), times moe_router_topk_scaling_factor. They are
differentiable, so the router keeps learning.

Token order at the router: Megatron runs sequence-first; a padded micro-batch [B, S] reaches the
router as [S, B, H] (row s * B + b), a packed one as [T, 1, H]; with sequence parallelism each TP rank
holds a contiguous slice of the sequence axis (rank r: rows r * S/tp .. (r + 1) * S/tp - 1). A
forward pre-hook on each router picks the slice matching its input.

Limits (checked by :func:`validate_routing_replay`): pipeline parallelism with full activation
recomputation is refused (the recomputation of micro-batch k runs after the forward of k + 1 has
replaced the targets); Megatron's fused router (``moe_router_fusion``, TE) and sinkhorn routing
bypass ``RouterReplay`` and are refused by :class:`RoutingReplay`.
"""

from __future__ import annotations

import base64
from typing import Any, Optional, Sequence

ROUTING_REPLAY_MODES = ("none", "r2", "r3")

__all__ = [
    "ROUTING_REPLAY_MODES",
    "HFRoutingRecorder",
    "PartialRouterReplay",
    "RoutingReplay",
    "decode_routed_experts",
    "encode_routed_experts",
    "gather_recorded_routing",
    "model_layout_routing",
    "validate_routing_replay",
]


# ----------------------------------------------------------------------------- recipe rules


def validate_routing_replay(mode: str, *, pp_size: int = 1, recompute: str = "none") -> None:
    """Check ``moe.routing_replay`` against the parallel keys (no torch import).

    Rules: mode in ROUTING_REPLAY_MODES; r2/r3 with parallel.pp_size > 1 need
    parallel.recompute != "full" (1F1B recomputes micro-batch k after the forward of k + 1 replaced
    the replay targets). Packed (THD) and padded micro-batches, TP with sequence parallelism, EP
    and DP are supported.

    Raises:
        ValueError: naming the keys and the fix.
    """
    if mode not in ROUTING_REPLAY_MODES:
        raise ValueError(f"moe.routing_replay must be one of {ROUTING_REPLAY_MODES}, got {mode!r}")
    if mode != "none" and pp_size > 1 and recompute == "full":
        raise ValueError(
            f"moe.routing_replay={mode} with parallel.pp_size={pp_size} and parallel.recompute=full is not "
            "supported (the 1F1B schedule recomputes a micro-batch after the next one replaced the replay "
            "targets); set parallel.recompute to none or selective, or pp_size=1"
        )


# ----------------------------------------------------------------------------- wire format


def encode_routed_experts(ids) -> str:
    """SGLang's ``meta_info["routed_experts"]``: base64 of the int32 C-order bytes of ``ids``.

    Args:
        ids: integer tensor / array [num_positions, num_layers, topk].
    """
    import numpy as np
    import torch

    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int32))
    if arr.ndim != 3:
        raise ValueError(f"routed experts must be [num_positions, num_layers, topk], got shape {arr.shape}")
    return base64.b64encode(arr.tobytes()).decode("ascii")


def decode_routed_experts(payload: str, num_layers: int, topk: int):
    """Inverse of :func:`encode_routed_experts` (SGLang ``extract_routed_experts_from_meta_info`` +
    reshape).

    Returns:
        torch.int32 tensor [num_positions, num_layers, topk].

    Raises:
        ValueError: payload not a string, bad base64, or a length not a multiple of
            num_layers * topk int32 values.
    """
    import numpy as np
    import torch

    if not isinstance(payload, str):
        raise ValueError(f"meta_info.routed_experts must be a base64 string, got {type(payload).__name__}")
    try:
        raw = base64.b64decode(payload.encode("ascii"), validate=True)
    except Exception as e:
        raise ValueError(f"meta_info.routed_experts is not valid base64: {e}") from None
    per = 4 * num_layers * topk
    if len(raw) % per:
        raise ValueError(
            f"meta_info.routed_experts has {len(raw)} bytes, not a multiple of num_layers ({num_layers}) * "
            f"topk ({topk}) int32 values; the server's model does not match the trainer's config"
        )
    arr = np.frombuffer(raw, dtype=np.int32).reshape(-1, num_layers, topk)
    return torch.from_numpy(arr.copy())


# ----------------------------------------------------------------------------- rollout side (HF)


class HFRoutingRecorder:
    """Records the top-k expert ids chosen by a transformers MoE model's routers (forward hooks).

    Hooks every module named ``...layers.{l}.mlp.gate`` whose forward returns
    ``(router_logits, routing_weights, selected_experts)`` (transformers 5 Qwen3MoeTopKRouter:
    ``selected_experts`` [B * S, topk] int64 for an input [B * S, H]). Inside :meth:`recording`,
    every forward call of every MoE layer appends its ids; :meth:`collect` then assembles them for
    ``model.generate`` (one prefill call of [B, L] then one [B, 1] call per fed-back token).

    Args:
        model: a transformers causal LM (``model.config.num_hidden_layers``, ``num_experts_per_tok``).

    Raises:
        ValueError: the model has no such gate modules (not an MoE model this recorder knows).
    """

    def __init__(self, model):
        import re

        self.model = model
        self.num_layers = int(model.config.num_hidden_layers)
        self.topk = int(model.config.num_experts_per_tok)
        self._calls: dict[int, list] = {}
        self._on = False
        self._handles = []
        pat = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
        for name, mod in model.named_modules():
            m = pat.search(name)
            if m is not None:
                self._handles.append(mod.register_forward_hook(self._hook(int(m.group(1)))))
        if not self._handles:
            raise ValueError("return_routed_experts: the served model has no MoE router modules "
                             "(layers.{l}.mlp.gate); it is not an MoE model")

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self._on:
                ids = output[-1] if isinstance(output, (tuple, list)) else output
                self._calls.setdefault(layer, []).append(ids.detach().to("cpu", copy=True))

        return hook

    def recording(self):
        """Context manager: record the routers' choices of the forward calls inside it."""
        import contextlib

        @contextlib.contextmanager
        def cm():
            self._calls, self._on = {}, True
            try:
                yield self
            finally:
                self._on = False

        return cm()

    def collect(self, batch_size: int):
        """The routing of one ``generate`` batch: int32 [B, P, num_layers, topk], P = prompt length
        (padded) + number of decode calls; dense layers -1.

        Raises:
            RuntimeError: nothing was recorded or the calls' shapes do not fit a generate batch.
        """
        import torch

        if not self._calls:
            raise RuntimeError("no routing was recorded (no forward call inside recording())")
        per_layer = {}
        for layer, calls in self._calls.items():
            parts = []
            for ids in calls:
                if ids.shape[0] % batch_size:
                    raise RuntimeError(f"router call of {ids.shape[0]} tokens does not fit batch {batch_size}")
                parts.append(ids.reshape(batch_size, -1, ids.shape[-1]))
            per_layer[layer] = torch.cat(parts, dim=1)
        positions = next(iter(per_layer.values())).shape[1]
        out = torch.full((batch_size, positions, self.num_layers, self.topk), -1, dtype=torch.int32)
        for layer, ids in per_layer.items():
            out[:, :, layer, :] = ids.to(torch.int32)
        self._calls = {}
        return out

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


# ----------------------------------------------------------------------------- trainer side (Megatron)


def _partial_replay_cls():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class _PartialRouterReplay(RouterReplay):
        """Megatron RouterReplay whose targets may hold -1 (= keep the router's own choice).

        ``target_topk_idx`` [num_tokens, topk] int64 (set by :class:`RoutingReplay`'s pre-hook);
        actions: REPLAY_FORWARD (force targets), RECORD (keep ``recorded_topk_idx``), None (plain).
        ``last_topk_idx`` keeps the indices actually used by the last call when ``capture`` is set.
        Not added to Megatron's process-global instance list.
        """

        def __init__(self):  # noqa: D401 - no global registration
            self.target_topk_idx = None
            self.recorded_topk_idx = None
            self.router_replay_action = None
            self.replay_backward_list = []
            self.capture = False
            self.last_topk_idx = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            import torch

            action = self.router_replay_action
            if action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD) \
                    and self.target_topk_idx is not None:
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                target = self.target_topk_idx.to(device=scores.device, dtype=torch.long)
                if target.shape != own.shape:
                    raise ValueError(f"routing replay target {tuple(target.shape)} does not match the router's "
                                     f"top-k {tuple(own.shape)}")
                forced = target >= 0
                if bool((forced.any(1) != forced.all(1)).any()):
                    raise ValueError("routing replay target rows must be all -1 or all >= 0")
                idx = torch.where(forced, target, own)
                probs = scores.gather(1, idx)
            else:
                probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                if action == RouterReplayAction.RECORD:
                    self.recorded_topk_idx = idx.detach()
            if self.capture:
                self.last_topk_idx = idx.detach()
            return probs, idx

    return _PartialRouterReplay


def PartialRouterReplay():
    """A new Megatron ``RouterReplay`` whose targets may contain -1 rows (router's own choice); see
    :class:`RoutingReplay`. (A factory: the class is built on first use so that importing this module
    does not import megatron.)"""
    return _partial_replay_cls()()


def model_layout_routing(mb):
    """A micro-batch's routing in the order the model's routers see tokens.

    Args:
        mb: moerl.train.batching MicroBatch / PackedMicroBatch with ``routed_experts``
            [b, s, L, K] int32 (position-aligned with ``tokens``; -1 = free), possibly smaller than the
            padded ``tokens`` [B, S] (extra rows / positions are free).

    Returns:
        None when ``mb.routed_experts`` is None; else int64 [S, B, L, K] for a padded micro-batch, or
        [T, 1, L, K] for a packed one (sequence-first, Megatron's layout).
    """
    import torch

    r = getattr(mb, "routed_experts", None)
    if r is None:
        return None
    b, s, n_layers, k = r.shape
    if getattr(mb, "packed_tokens", None) is not None:
        t = mb.packed_tokens.shape[1]
        out = torch.full((t + 1, n_layers, k), -1, dtype=torch.long, device=r.device)
        index = mb.unpack_index.to(r.device)[:b, :s]
        flat, rows = index.reshape(-1), r.reshape(b * s, n_layers, k).long()
        real = flat < t  # padding positions of the [b, s] layout map to t (dropped)
        out[flat[real]] = rows[real]
        return out[:t].unsqueeze(1)
    bb, ss = mb.tokens.shape
    out = torch.full((ss, bb, n_layers, k), -1, dtype=torch.long, device=r.device)
    out[:s, :b] = r.transpose(0, 1).long()
    return out


class RoutingReplay:
    """R2 / R3 routing replay on a Megatron GPTModel (see the module docstring).

    Args:
        model: the GPTModel (or a wrapper; every TopKRouter inside is used; its global layer index is
            ``router.layer_number - 1``).
        mode: "r2" | "r3" | "none" (none attaches nothing and does nothing).

    Use around each model call (moerl.train.actor does, when ``actor.routing_replay`` is set)::

        replay.before_forward(mb)   # mb.routed_experts set -> force; else (r2) record
        out = model(...)
        replay.after_forward(mb)    # r2: keep this pass's routing per sample index

    then (R2, after the old-log-prob pass) :func:`gather_recorded_routing` copies the recorded routing
    into ``Sample.routed_experts`` for the update passes.

    Raises:
        ValueError: unknown mode, no TopKRouter in the model, or a router config that bypasses
            RouterReplay (moe_router_fusion, sinkhorn).
    """

    def __init__(self, model, mode: str = "r3"):
        from megatron.core.transformer.moe.router import TopKRouter

        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing replay mode must be one of {ROUTING_REPLAY_MODES}, got {mode!r}")
        self.mode = mode
        self.routers: dict[int, Any] = {}
        self._targets = None  # [S, B | 1, L, K] model layout, or None
        self.recorded: dict[int, Any] = {}  # sample index -> int32 [len, L, K], -1 = unknown
        self._hooks = []
        if mode == "none":
            return
        for mod in model.modules():
            if isinstance(mod, TopKRouter):
                cfg = mod.config
                if getattr(cfg, "moe_router_fusion", False):
                    raise ValueError("moe.routing_replay needs moe_router_fusion=False (the fused TE router "
                                     "bypasses Megatron's RouterReplay)")
                if getattr(mod, "routing_type", None) == "sinkhorn":
                    raise ValueError("moe.routing_replay does not support sinkhorn routing")
                mod.router_replay = PartialRouterReplay()
                self.routers[int(mod.layer_number) - 1] = mod
                self._hooks.append(mod.register_forward_pre_hook(self._pre_hook))
        if not self.routers:
            raise ValueError("moe.routing_replay: the model has no Megatron TopKRouter (no MoE layer)")
        self.config = next(iter(self.routers.values())).config

    # -- per micro-batch
    def before_forward(self, mb) -> None:
        """Set every router's action for the coming forward of ``mb``: force ``mb.routed_experts``
        (rows of -1 stay free) when it is set, else record (r2) or route freely (r3)."""
        if self.mode == "none":
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._targets = model_layout_routing(mb)
        if self._targets is not None:
            action = RouterReplayAction.REPLAY_FORWARD
        elif self.mode == "r2":
            action = RouterReplayAction.RECORD
        else:
            action = None
        for r in self.routers.values():
            r.router_replay.router_replay_action = action
            r.router_replay.recorded_topk_idx = None
            r.router_replay.target_topk_idx = None

    def _local_rows(self, router, num_rows: int, full_rows: int) -> slice:
        """The slice of the sequence axis this rank's router sees (sequence parallelism)."""
        if num_rows == full_rows:
            return slice(0, full_rows)
        from megatron.core import parallel_state

        r = parallel_state.get_tensor_model_parallel_rank()
        if num_rows * parallel_state.get_tensor_model_parallel_world_size() != full_rows:
            raise ValueError(f"router input has {num_rows} sequence rows, the micro-batch {full_rows}: "
                             "cannot map the replay targets (unsupported layout, e.g. context parallelism)")
        return slice(r * num_rows, (r + 1) * num_rows)

    def _pre_hook(self, router, args):
        hidden = args[0]
        if self._targets is None or router.router_replay.router_replay_action is None:
            return None
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if router.router_replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return None
        layer = int(router.layer_number) - 1
        s_local, bsz = hidden.shape[0], hidden.shape[1]
        full = self._targets
        if full.shape[1] != bsz:
            raise ValueError(f"replay targets have batch {full.shape[1]}, the router input {bsz}")
        if layer >= full.shape[2]:
            raise ValueError(f"replay targets have {full.shape[2]} layers, router of layer {layer} has none")
        rows = self._local_rows(router, s_local, full.shape[0])
        router.router_replay.target_topk_idx = full[rows, :, layer, :].reshape(s_local * bsz, -1)
        return None

    def after_forward(self, mb) -> None:
        """R2: store this forward's recorded routing per sample (``self.recorded``, merged with what
        other slices / stages already recorded: elementwise max, -1 = unknown). No-op otherwise."""
        if self.mode != "r2":
            return
        import torch

        recs = {layer: r.router_replay.recorded_topk_idx for layer, r in self.routers.items()
                if r.router_replay.recorded_topk_idx is not None}
        for r in self.routers.values():
            r.router_replay.recorded_topk_idx = None
        if not recs:
            return
        packed = getattr(mb, "packed_tokens", None) is not None
        seq, bsz = (mb.packed_tokens.shape[1], 1) if packed else (mb.tokens.shape[1], mb.tokens.shape[0])
        any_idx = next(iter(recs.values()))
        n_layers = max(max(self.routers) + 1, int(getattr(self.config, "num_layers", 0)))
        buf = torch.full((seq, bsz, n_layers, any_idx.shape[-1]), -1, dtype=torch.int32)
        for layer, idx in recs.items():
            s_local = idx.shape[0] // bsz
            rows = self._local_rows(self.routers[layer], s_local, seq)
            buf[rows, :, layer, :] = idx.reshape(s_local, bsz, -1).to("cpu", torch.int32)
        for i, (start, n_resp) in enumerate(zip(mb.response_starts, mb.response_lengths)):
            length = start + 1 + n_resp
            if packed:
                rows_i = buf[mb.unpack_index[i, :length].cpu(), 0]
            else:
                rows_i = buf[:length, i]
            key = int(mb.sample_indices[i])
            prev = self.recorded.get(key)
            self.recorded[key] = rows_i.clone() if prev is None else torch.maximum(prev, rows_i)

    def clear(self) -> None:
        """Forget targets and recorded routing; routers back to free routing."""
        self._targets = None
        self.recorded = {}
        for r in self.routers.values():
            r.router_replay.router_replay_action = None
            r.router_replay.target_topk_idx = None
            r.router_replay.recorded_topk_idx = None

    def remove(self) -> None:
        """Detach: remove the hooks and the routers' replay objects."""
        self.clear()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for r in self.routers.values():
            r.router_replay = None


def gather_recorded_routing(replay: Optional[RoutingReplay], samples: Sequence[Any]) -> int:
    """R2: put the routing recorded by ``replay`` (its ``recorded`` dict, indices into ``samples``) into
    ``samples[i].routed_experts`` on every rank, then clear it.

    Collective when torch.distributed is initialised with world size > 1 (every rank calls it): the
    per-rank records (each DP rank holds its share, each PP stage its layers, each TP rank its
    sequence slice under sequence parallelism) are all-gathered and merged elementwise by max (-1 =
    not recorded here). Returns the number of samples that received routing.
    """
    import torch
    import torch.distributed as dist

    local = dict(replay.recorded) if replay is not None else {}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    else:
        parts = [local]
    merged: dict[int, Any] = {}
    for part in parts:
        for i, t in part.items():
            merged[i] = t if i not in merged else torch.maximum(merged[i], t)
    for i, t in merged.items():
        samples[i].routed_experts = t.to(torch.int32)
    if replay is not None:
        replay.recorded = {}
    return len(merged)
