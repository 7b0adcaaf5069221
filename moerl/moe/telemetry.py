"""Per-layer expert-load telemetry and routing-collapse alerts for a Megatron-Core MoE model.

:class:`MoETelemetry` installs a forward hook on every MoE router (Megatron's ``TopKRouter``) of
the model. The router returns ``(probs, routing_map)`` with ``routing_map`` a bool
``[num_tokens, num_experts]``; the hook adds ``routing_map.sum(0)`` (tokens per expert, padding
tokens removed when Megatron passes a padding mask) to a per-layer counter. :meth:`MoETelemetry.step_end`
reduces the counters over all ranks (see below), derives the statistics of REFERENCE.md sec. 2,
raises the alerts and appends one JSONL line per MoE layer (rank 0), then clears the counters.

Which forwards count (``mode``):

* ``"train"`` (default): only forwards with ``module.training`` and ``torch.is_grad_enabled()``,
  i.e. the update pass (``MegatronActor.train_step``). The log-prob passes (``compute_log_probs``
  runs in eval mode under ``torch.no_grad``), evaluation and generation are not counted. Under
  full activation recomputation Megatron runs the first forward without grad and the recompute with
  grad, so each token is counted once (the same rule Megatron uses for its expert-bias counts).
* ``"all"``: every router forward.
* ``enabled = False`` (or ``with telemetry.paused():``) counts nothing.

Reduction: every rank holds counts for the MoE layers of its pipeline stage, for the tokens it routed.
Tokens are split over DP ranks (EP ranks are DP ranks of the dense part) and, with sequence parallelism,
over TP ranks; so the sum over the whole world of a zero-padded ``[num_layers, num_experts]`` tensor is,
for each layer, the sum over the TP x DP (x EP) ranks of its stage: the global tokens_per_expert of the
step. ``step_end`` is therefore collective over the default process group (call it on every rank).
"""

from __future__ import annotations

import json
import logging
import math
import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("moerl.moe.telemetry")

MODES = ("train", "all")


def _routers(model) -> list:
    """The Megatron routers (modules with ``routing`` and ``layer_number``) under ``model`` (a module,
    a DDP wrapper or a list of model chunks), in module order."""
    from megatron.core.transformer.moe.router import Router

    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, Router):
                out.append(m)
    return out


def load_stats(counts: torch.Tensor) -> dict[str, float]:
    """Statistics of one layer's load ``counts`` (``[num_experts]``, tokens per expert, any dtype).

    Returns:
        tokens (sum of counts = routed token-slots, tokens * top-k), imbalance (max / mean count),
        entropy (H = -sum_i p_i ln p_i of p = counts / sum, nats), entropy_norm (H / ln num_experts,
        in [0, 1]), dead_experts (experts with 0 tokens). NaN statistics when the layer saw no tokens.
    """
    c = counts.double().flatten()
    total = float(c.sum())
    e = c.numel()
    if total <= 0:
        nan = float("nan")
        return dict(tokens=0.0, imbalance=nan, entropy=nan, entropy_norm=nan, dead_experts=float(e))
    p = c / total
    nz = p[p > 0]
    h = float(-(nz * nz.log()).sum())
    return dict(
        tokens=total,
        imbalance=float(c.max() / c.mean()),
        entropy=h,
        entropy_norm=h / math.log(e) if e > 1 else 1.0,
        dead_experts=float((c == 0).sum()),
    )


class MoETelemetry:
    """Expert-load telemetry of a Megatron MoE model (see the module docstring).

    Args:
        model: Megatron GPTModel, its DDP wrapper, a list of model chunks, or any module containing
            Megatron routers (``MegatronActor.model``).
        jsonl_path: file to append per-layer JSONL lines to (rank 0 only); None = no file. The run
            convention is ``<output_dir>/moe_telemetry.jsonl``. Each line:
            ``{"step", "layer" (0-based global layer index), "num_experts", "tokens_per_expert" [E] ints,
            "imbalance", "entropy", "entropy_norm", "dead_experts", "alerts" [str]}``.
        entropy_threshold: alert when a layer's normalised load entropy H / ln(E) falls below it
            (0 disables); recipe key moe.entropy_threshold.
        dead_expert_steps: alert when an expert receives no tokens for this many consecutive steps
            (0 disables); recipe key moe.dead_expert_steps.
        mode: "train" (count update-pass forwards only) or "all".
        enabled: initial on/off switch (attribute ``enabled``).

    Raises:
        ValueError: no Megatron router in ``model``, a bad mode, or negative thresholds.
    """

    def __init__(
        self,
        model,
        *,
        jsonl_path: Optional[str] = None,
        entropy_threshold: float = 0.5,
        dead_expert_steps: int = 10,
        mode: str = "train",
        enabled: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0 <= entropy_threshold <= 1:
            raise ValueError(f"entropy_threshold is a fraction of ln(num_experts) in [0, 1], got {entropy_threshold}")
        if isinstance(dead_expert_steps, bool) or not isinstance(dead_expert_steps, int) or dead_expert_steps < 0:
            raise ValueError(f"dead_expert_steps must be an int >= 0 (0 = off), got {dead_expert_steps!r}")
        routers = _routers(model)
        if not routers:
            raise ValueError("MoETelemetry: the model has no Megatron MoE router (num_moe_experts unset?)")
        cfg = routers[0].config
        self.num_experts = int(cfg.num_moe_experts)
        self.topk = int(cfg.moe_router_topk)
        self.num_layers = int(cfg.num_layers) + int(getattr(cfg, "mtp_num_layers", None) or 0)
        self.mode = mode
        self.enabled = bool(enabled)
        self.entropy_threshold = float(entropy_threshold)
        self.dead_expert_steps = int(dead_expert_steps)
        self.jsonl_path = jsonl_path
        self._counts: dict[int, torch.Tensor] = {}
        self._zero_streak = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)
        self._handles = []
        for i, r in enumerate(routers):
            if r.layer_number is None:
                raise ValueError(f"router #{i} has no layer_number (call set_layer_number)")
            self._handles.append(r.register_forward_hook(self._hook, with_kwargs=True))
        self._routers = routers
        if jsonl_path and self._is_rank0():
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)

    # ------------------------------------------------------------------ counting
    def _should_count(self, module) -> bool:
        if not self.enabled:
            return False
        if self.mode == "all":
            return True
        return bool(module.training and torch.is_grad_enabled())

    def _hook(self, module, args, kwargs, output) -> None:
        if not self._should_count(module):
            return
        routing_map = output[1]
        with torch.no_grad():
            padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
            if padding_mask is not None:  # Megatron convention in the router: True = padding
                routing_map = routing_map & ~padding_mask.reshape(-1, 1).bool()
            counts = routing_map.sum(0).to(torch.float64)
            layer = int(module.layer_number) - 1
            if layer in self._counts:
                self._counts[layer] += counts
            else:
                self._counts[layer] = counts.clone()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing inside the block (restores the previous ``enabled``)."""
        prev, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = prev

    def local_counts(self) -> dict[int, list[int]]:
        """This rank's unreduced counts since the last step_end: layer (0-based) -> [E] ints."""
        return {k: [int(x) for x in v.tolist()] for k, v in sorted(self._counts.items())}

    # ------------------------------------------------------------------ step
    @staticmethod
    def _is_rank0() -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def step_end(self, step: int) -> dict[str, Any]:
        """Reduce this step's counts over all ranks, compute statistics and alerts, append JSONL, reset.

        Collective over the default process group when torch.distributed is initialised.

        Returns (identical on every rank):
            ``{"tokens_per_expert": {layer: [E] ints}, "alerts": [str],
            "metrics": {name: float}}`` where metrics (for MetricsLogger, e.g. prefix "moe") are
            ``layer{l}/imbalance``, ``layer{l}/entropy``, ``layer{l}/entropy_norm``,
            ``layer{l}/dead_experts`` per MoE layer that saw tokens, and ``imbalance_max``,
            ``entropy_norm_min``, ``dead_experts`` (sum over layers), ``collapse_alert`` (1.0 if any
            layer's entropy_norm < entropy_threshold), ``dead_expert_alert`` (1.0 if an expert had no
            tokens for dead_expert_steps steps), ``alerts`` (count). Empty metrics when nothing was counted.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        device = next(iter(self._counts.values())).device if self._counts else torch.device("cpu")
        table = torch.zeros(self.num_layers + 1, self.num_experts, dtype=torch.float64, device=device)
        for layer, c in self._counts.items():
            table[layer] += c.to(device)
            table[self.num_layers, 0] = 1.0  # this rank counted something
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl" and table.device.type != "cuda":
                table = table.cuda()
            dist.all_reduce(table)
        table = table.cpu()
        self._counts = {}
        counted = bool(table[self.num_layers, 0] > 0)
        table = table[: self.num_layers]
        report: dict[str, Any] = {"tokens_per_expert": {}, "alerts": [], "metrics": {}}
        if not counted:
            return report
        moe_layers = sorted({int(r.layer_number) - 1 for r in self._routers})
        if dist.is_initialized() and dist.get_world_size() > 1:  # layers of every pipeline stage
            seen = (table.sum(1) > 0).nonzero().flatten().tolist()
            moe_layers = sorted(set(moe_layers) | set(seen))
        m = report["metrics"]
        lines = []
        imb, ent, dead_total, collapse, dead_alert = [], [], 0.0, False, False
        for layer in moe_layers:
            counts = table[layer]
            stats = load_stats(counts)
            alerts = []
            if stats["tokens"] > 0:
                zero = counts == 0
                self._zero_streak[layer] = torch.where(zero, self._zero_streak[layer] + 1, 0)
                if self.entropy_threshold > 0 and stats["entropy_norm"] < self.entropy_threshold:
                    collapse = True
                    alerts.append(
                        f"routing collapse: layer {layer} load entropy {stats['entropy_norm']:.3f} * ln(E) < "
                        f"moe.entropy_threshold {self.entropy_threshold} (tokens_per_expert "
                        f"{[int(x) for x in counts.tolist()]})"
                    )
                if self.dead_expert_steps > 0:
                    dead = (self._zero_streak[layer] >= self.dead_expert_steps).nonzero().flatten().tolist()
                    if dead:
                        dead_alert = True
                        alerts.append(
                            f"dead experts: layer {layer} experts {dead} received no tokens for >= "
                            f"{self.dead_expert_steps} consecutive steps (moe.dead_expert_steps)"
                        )
                m[f"layer{layer}/imbalance"] = stats["imbalance"]
                m[f"layer{layer}/entropy"] = stats["entropy"]
                m[f"layer{layer}/entropy_norm"] = stats["entropy_norm"]
                m[f"layer{layer}/dead_experts"] = stats["dead_experts"]
                imb.append(stats["imbalance"])
                ent.append(stats["entropy_norm"])
                dead_total += stats["dead_experts"]
            tpe = [int(round(x)) for x in counts.tolist()]
            report["tokens_per_expert"][layer] = tpe
            report["alerts"].extend(alerts)
            lines.append(dict(step=step, layer=layer, num_experts=self.num_experts, topk=self.topk,
                              tokens_per_expert=tpe, imbalance=stats["imbalance"], entropy=stats["entropy"],
                              entropy_norm=stats["entropy_norm"], dead_experts=int(stats["dead_experts"]),
                              alerts=alerts))
        if imb:
            m["imbalance_max"] = max(imb)
            m["entropy_norm_min"] = min(ent)
            m["dead_experts"] = dead_total
        m["collapse_alert"] = float(collapse)
        m["dead_expert_alert"] = float(dead_alert)
        m["alerts"] = float(len(report["alerts"]))
        if self._is_rank0():
            for a in report["alerts"]:
                logger.warning("step %d: %s", step, a)
            if self.jsonl_path:
                with open(self.jsonl_path, "a", encoding="utf-8") as f:
                    for line in lines:
                        f.write(json.dumps(line, allow_nan=True) + "\n")
        return report

    def close(self) -> None:
        """Remove the hooks (counts already reduced stay in the JSONL file)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "MoETelemetry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
