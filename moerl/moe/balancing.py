"""Load-balancing losses that do not depend on how a batch is padded or cut over DP ranks.

Megatron-Core 0.16.1's ``TopKRouter`` computes three balancing losses (REFERENCE.md sec. 2); moerl
installs its own versions of the router methods on every router of a model it trains
(:func:`install_balancing_losses`), because two of Megatron's depend on the batch layout:

* ``seq_aux_loss`` (DeepSeek-V3, arXiv 2412.19437 eq. 17-20): per sequence b with L_b real tokens,
  ``l_b = E / (k L_b^2) * sum_i count_{b,i} * sum_{t in b} s_{t,i}``, and the loss is the MEAN OVER
  REAL SEQUENCES of l_b. Megatron divides every sequence's term by the squared MEAN valid length of
  the micro-batch and by the number of rows B, counting all-padding rows (pipeline padding) as
  sequences: two sequences of 4 and 12 tokens gave +27.6%, one sample padded to [2, 16] twice the
  value. Here each sequence uses its own length, all-padding rows are left out, and the sum over a
  micro-batch's sequences is divided by ``sequences_per_micro_batch`` = N / (M * dp) (N real
  sequences in the whole step, M micro-batches per rank, dp ranks; set by the actor with
  :func:`set_step_normalisers`), so that after Megatron's 1/M micro-batch scaling and DDP's
  1/dp gradient average the objective is ``(1/N) sum_b l_b`` over the global batch, however it is
  cut. Left unset (None), the divisor is this micro-batch's number of real sequences (a
  per-micro-batch mean, Megatron's value when nothing is padded).
* ``global_aux_loss`` (arXiv 2501.11873): the expert counts and the token count T are reduced over
  the TP x DP x CP group, so the per-rank losses SUM to the global-batch loss; DDP then AVERAGES the
  router gradients over the dp x cp ranks, which left an effective coefficient of coeff / dp. Here
  the attached loss is multiplied by the size of that average (tp_dp_cp / tp_cp group sizes); the
  logged value is unchanged (the global-batch loss, summed by Megatron's tracker). The token
  count T is counted from the routing maps on every rank (Megatron assumes ``local * group size``
  when no padding mask is given, wrong when DP ranks hold sequences of different lengths).
* ``aux_loss`` (Switch Transformer, arXiv 2101.03961): per micro-batch by definition (f and P over
  the micro-batch's tokens, averaged over micro-batches and DP ranks): unchanged, except that a
  micro-batch without any real token (an empty micro-batch of a packing plan) contributes 0 instead
  of 0/0 = NaN, and the mean runs over the step's NON-EMPTY micro-batches: each micro-batch's
  loss is multiplied by ``aux_loss_scale`` = M * dp / K (K non-empty micro-batches in the step; 1
  when none is empty), set with :func:`set_step_normalisers`. The 0/0 guard holds for the two
  others as well.

The formulas and the Megatron fields they read (``self.topk``, ``tp_cp_group``, ``tp_dp_cp_group``,
``global_tokens_per_expert``/``ga_steps``, ``attach_and_log_load_balancing_loss``) are those of
megatron-core 0.16.1 ``megatron/core/transformer/moe/router.py``; padding tokens are masked by
Megatron's ``compute_routing_scores_for_aux_loss`` before these functions run (scores and routing
map are zero there).
"""

from __future__ import annotations

import types
from typing import Optional

import torch

__all__ = [
    "install_balancing_losses",
    "per_sequence_aux_loss",
    "set_step_normalisers",
]


def per_sequence_aux_loss(
    scores: torch.Tensor, counts: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence load-balancing losses (without the coefficient).

    Args:
        scores: [S, B, E] routing scores of this rank's tokens (0 at padding); with sequence
            parallelism the rank's slice of the sequence.
        counts: [B, E] tokens of each sequence routed to each expert, over the WHOLE sequence (all
            TP / CP ranks), padding excluded.
        topk: experts per token.

    Returns:
        (loss [B], real [B] bool): ``loss_b = E / (k L_b^2) * sum_i counts_{b,i} * sum_t scores_{t,b,i}``
        with ``L_b = sum_i counts_{b,i} / k`` (this rank's share of it under sequence parallelism; the
        shares sum to the sequence's loss), 0 for rows without any real token (``real`` False).
    """
    num_experts = scores.shape[-1]
    lengths = counts.sum(-1) / topk
    real = lengths > 0
    denom = topk * lengths.clamp_min(1.0) ** 2
    loss = (scores.sum(0) * counts).sum(-1) * (num_experts / denom)
    return torch.where(real, loss, torch.zeros_like(loss)), real


# --------------------------------------------------------------------------------------------
# router methods (bound to each TopKRouter instance by install_balancing_losses)
# --------------------------------------------------------------------------------------------


def _token_counts(routing_map: torch.Tensor, group, topk: int):
    """(counts [E] over ``group``, local tokens, total tokens over ``group``), the token numbers
    always counted from the routing map (k entries per real token). Megatron counts them so only
    with a padding mask; without one it takes ``local * group.size()``, which is wrong for
    global_aux_loss when DP ranks run micro-batches of different lengths (an unpadded sample of
    4 tokens on one rank, 9 on the other)."""
    from megatron.core.transformer.moe.moe_utils import get_tokens_per_expert_and_token_count

    counts, local_num_tokens, total_num_tokens = get_tokens_per_expert_and_token_count(
        routing_map=routing_map, reduce_group=group, topk=topk, with_padding_mask=True)
    if isinstance(total_num_tokens, torch.Tensor):
        total_num_tokens = total_num_tokens.clamp_min(1.0)  # no real token: counts are 0, the loss 0
    else:
        total_num_tokens = max(total_num_tokens, 1)
    return counts, local_num_tokens, total_num_tokens


def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask: bool = False):
    """Megatron's per-micro-batch aux_loss, 0 (not NaN) for a micro-batch without real tokens."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    coeff = self.get_aux_loss_coeff("aux_loss")
    if coeff == 0:
        return probs
    counts, local_num_tokens, total_num_tokens = _token_counts(
        routing_map, self.tp_cp_group, self.topk)
    aux_loss = switch_load_balancing_loss_func(
        probs=scores_for_aux_loss, tokens_per_expert=counts, total_num_tokens=total_num_tokens, topk=self.topk,
        num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff, fused=self.config.moe_router_fusion)
    if self.moerl_aux_loss_scale != 1.0:
        aux_loss = aux_loss * self.moerl_aux_loss_scale
    return self.attach_and_log_load_balancing_loss(
        probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group, valid_token_count=local_num_tokens)


def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length: int, bsz: int,
                        with_padding_mask: bool = False):
    """Per-sequence aux loss: the sum of the real sequences' own losses over
    ``sequences_per_micro_batch`` (module docstring)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    coeff = self.get_aux_loss_coeff("seq_aux_loss")
    if coeff == 0:
        return probs
    num_experts = self.config.num_moe_experts
    scores = scores_for_aux_loss.reshape(seq_length, bsz, num_experts)
    local_map = routing_map.reshape(seq_length, bsz, num_experts)
    with torch.no_grad():
        counts = reduce_from_tensor_model_parallel_region(local_map.sum(0).float(), self.tp_cp_group)
    per_seq, real = per_sequence_aux_loss(scores, counts, self.topk)
    n = self.moerl_sequences_per_micro_batch
    if n is None:
        n = int(real.sum())
    aux_loss = per_seq.sum() * (coeff / n) if n > 0 else scores.sum() * 0.0
    local_num_tokens = local_map.sum() / self.topk
    return self.attach_and_log_load_balancing_loss(
        probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group, valid_token_count=local_num_tokens)


def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask: bool = False):
    """Megatron's global_aux_loss (counts averaged over this step's micro-batches and reduced over
    TP x DP x CP) with the gradient multiplied by the DP x CP size that DDP averages over."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    coeff = self.get_aux_loss_coeff("global_aux_loss")
    if coeff == 0:
        return probs
    counts, local_num_tokens, total_num_tokens = _token_counts(
        routing_map, self.tp_dp_cp_group, self.topk)
    self.global_tokens_per_expert += counts
    self.ga_steps += 1
    aux_loss = switch_load_balancing_loss_func(
        probs=scores_for_aux_loss, tokens_per_expert=self.global_tokens_per_expert / self.ga_steps,
        total_num_tokens=total_num_tokens, topk=self.topk, num_experts=self.config.num_moe_experts,
        moe_aux_loss_coeff=coeff, fused=self.config.moe_router_fusion)
    dp = self.tp_dp_cp_group.size() // self.tp_cp_group.size()
    # attach dp * loss (undoes DDP's 1/dp average); the tracker logs loss / coeff = (dp*loss) / (dp*coeff)
    return self.attach_and_log_load_balancing_loss(
        probs, coeff * dp, aux_loss * dp, "global_load_balancing_loss", self.tp_dp_cp_group,
        reduce_group_has_dp=True, valid_token_count=local_num_tokens)


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
    """Count the tokens routed to each expert for the aux-loss-free bias update (arXiv 2408.15664), padding
    tokens left out. Megatron-Core 0.16.1's ``TopKRouter._apply_expert_bias`` masks with
    ``routing_map & ~padding_mask``: a [T, E] map against a [T] mask fails ("The size of tensor a (E) must
    match the size of tensor b (T)") whenever a padding mask is given; here the mask is broadcast over the
    experts. routing_map: bool [T, E]; padding_mask: bool [T] (or [S, B]), True = padding. Counts only with
    grad enabled (not in evaluation or recomputation), as upstream."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def _routers(model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def install_balancing_losses(model) -> list:
    """Replace the balancing-loss methods of every Megatron ``TopKRouter`` inside ``model`` (a
    GPTModel, a DDP wrapper or any module holding routers) with moerl's (module docstring), and its
    expert-bias token count with :func:`_apply_expert_bias` (padding masked correctly).

    Idempotent. Megatron's fused aux-loss kernels (``moe_router_fusion``, Transformer Engine) keep
    the seq_aux_loss path unfused here; aux_loss / global_aux_loss pass ``fused`` through.

    Returns:
        the routers (in module order).
    """
    routers = _routers(model)
    for r in routers:
        r._apply_aux_loss = types.MethodType(_apply_aux_loss, r)
        r._apply_seq_aux_loss = types.MethodType(_apply_seq_aux_loss, r)
        r._apply_global_aux_loss = types.MethodType(_apply_global_aux_loss, r)
        r._apply_expert_bias = types.MethodType(_apply_expert_bias, r)  # padding-masked expert-bias counts
        if not hasattr(r, "moerl_sequences_per_micro_batch"):
            set_step_normalisers([r])
    return routers


def set_step_normalisers(routers, *, sequences_per_micro_batch: Optional[float] = None,
                         aux_loss_scale: float = 1.0) -> None:
    """Set the per-step normalisers of ``routers`` (from :func:`install_balancing_losses`).

    Args:
        routers: the routers.
        sequences_per_micro_batch: seq_aux_loss divisor N / (M * dp) (N real sequences of the
            step over all DP ranks, M micro-batches per rank); None: each micro-batch's own count.
        aux_loss_scale: aux_loss multiplier M * dp / K (K non-empty micro-batches of the step).

    Raises:
        ValueError: a value <= 0.
    """
    if sequences_per_micro_batch is not None and not sequences_per_micro_batch > 0:
        raise ValueError(f"sequences_per_micro_batch must be > 0, got {sequences_per_micro_batch!r}")
    if not aux_loss_scale > 0:
        raise ValueError(f"aux_loss_scale must be > 0, got {aux_loss_scale!r}")
    for r in routers:
        r.moerl_sequences_per_micro_batch = (
            None if sequences_per_micro_batch is None else float(sequences_per_micro_batch))
        r.moerl_aux_loss_scale = float(aux_loss_scale)
