"""The Megatron-Core critic of PPO: the policy's architecture with a scalar value head.

``MegatronCritic`` is a :class:`moerl.train.actor.MegatronActor` whose LM head is replaced by
:class:`moerl.models.value_head.ValueHead` (one value per token position) and whose loss sees
values instead of log-probs. Everything else is the actor's, reused rather than copied, so the two
models train the same way in every layout:

* the GPTModel stage (same hf_config: layers, MoE, attention, recompute, uneven pipeline split),
  Megatron DDP, ``finalize_model_grads`` and the Megatron Adam optimizer (its own lr: ``set_lr``);
* the actor's forward step (padding mask, sequence-parallel padding slices; the critic only swaps
  the ``loss_func`` Megatron calls on the last stage), micro-batch preparation (right padding for
  TP sequence parallelism and PP, packed THD micro-batches at pp_size 1, equal micro-batch counts
  over DP), the schedule (no pipelining at pp_size 1, 1F1B at pp_size > 1) and ``train_step``:
  loss scaling by num_microbatches * dp_size (losses use GLOBAL denominators), metrics summed over
  micro-batches and DP ranks, grad_norm, and the MoE balancing loss exactly as the actor applies and
  reports it (``aux_loss``);
* TP / PP / EP / DP layouts as the actor runs them. DualPipe / DualPipeV are not supported for the
  critic (a clear ValueError naming train.pipeline_schedule).

Values are LABEL-aligned, like the actor's log-probs (moerl.train.batching): ``values[b, t]`` is the
value head on the hidden state at position t, i.e. V(s_t) of the state made of tokens[b, :t+1],
the state in which labels[b, t] = tokens[b, t+1] is generated. At a response token's label
position (``loss_mask``) it is the value of the state before that token, which is what GAE needs.
Entries outside a sample's real tokens are meaningless (mask them).

Weights: a policy's HF state dict (Qwen3MoeForCausalLM names; ``lm_head.weight`` is dropped) or a
``Qwen3MoeForTokenClassification(num_labels=1)`` one (its ``score`` layer is the value head); the
critic exports the latter (``value_model_hf_config`` gives the config to save it with). The
embeddings are never tied in the critic (a tied policy's embedding is copied; there is no LM head
to tie it to). Checkpoints are Megatron distributed checkpoints (moerl.checkpoint.dist_ckpt:
model + optimizer, atomic).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

from moerl.checkpoint.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint
from moerl.checkpoint.hf_convert import gather_megatron_to_hf, hf_to_megatron, load_megatron_state_dict
from moerl.models.value_head import ValueHead, value_model_hf_config
from moerl.train.actor import MegatronActor
from moerl.train.batching import MicroBatch, to_label_layout

__all__ = ["ValueLossFn", "MegatronCritic", "value_model_hf_config"]

# loss_fn(values [B,S] float32 with grad, micro_batch) -> (scalar loss, metrics dict of floats)
ValueLossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict]]

_SCORE_W, _SCORE_B = "score.weight", "score.bias"


class _Remember:
    """An iterator that remembers the last item it handed out (the micro-batch the actor's forward
    step took, for the critic's loss_func)."""

    def __init__(self, it):
        self._it, self.item = it, None

    def __iter__(self):
        return self

    def __next__(self):
        self.item = next(self._it)
        return self.item


class MegatronCritic(MegatronActor):
    """A trainable Megatron-Core value model, one pipeline stage per rank (see the module docstring).

    Args:
        hf_config: transformers Qwen3MoeConfig of the POLICY (the critic has its architecture).
        lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad: the critic's own Adam
            (Megatron OptimizerConfig; clip_grad = 0 disables clipping).
        moe_aux_loss_coeff, moe_load_balancing_type: Megatron router balancing, as for the actor.
        use_distributed_optimizer, recompute, sequence_parallel, config_overrides: as
            :class:`MegatronActor` (``moerl.train.actor.actor_parallel_kwargs``).
        pipeline_schedule: "1f1b" only.
        pipeline_overlap: must be False (it belongs to the DualPipe schedules).

    The value head starts at zero (:class:`moerl.models.value_head.ValueHead`) until
    :meth:`load_hf_state_dict` gives it weights; the trunk starts from Megatron's random init.

    Raises:
        ValueError: pipeline_schedule other than "1f1b" (the recipe's train.pipeline_schedule), or
            anything :class:`MegatronActor` refuses.

    Requires moerl.runtime.distributed.init_distributed() to have run.
    """

    def __init__(
        self,
        hf_config,
        *,
        lr: float,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-8,
        clip_grad: float = 1.0,
        moe_aux_loss_coeff: float = 1e-3,
        moe_load_balancing_type: str = "aux_loss",
        use_distributed_optimizer: bool = False,
        recompute: str = "none",
        sequence_parallel: bool = True,
        config_overrides: Optional[Mapping[str, Any]] = None,
        pipeline_schedule: str = "1f1b",
        pipeline_overlap: bool = False,
    ):
        if pipeline_schedule != "1f1b":
            raise ValueError(
                f"the critic (PPO value model) runs Megatron's 1F1B schedule only; train.pipeline_schedule="
                f"{pipeline_schedule!r} (DualPipe / DualPipeV) is not supported with a critic: set "
                "train.pipeline_schedule=1f1b or use an advantage estimator without a critic"
            )
        # the actor's model, built frozen (no DDP / optimizer yet) and with untied embeddings: the LM
        # head it builds is replaced below, and a tied head would make Megatron all-reduce the value
        # head's gradient with the embedding's between the first and last pipeline stages
        untied = copy.deepcopy(hf_config)
        untied.tie_word_embeddings = False
        super().__init__(
            untied, lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
            adam_eps=adam_eps, clip_grad=clip_grad, moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_load_balancing_type=moe_load_balancing_type, trainable=False,
            use_distributed_optimizer=use_distributed_optimizer, recompute=recompute,
            sequence_parallel=sequence_parallel, config_overrides=config_overrides,
            pipeline_schedule="1f1b", pipeline_overlap=pipeline_overlap,
        )
        self.hf_config = hf_config
        if self.model.post_process:  # the last pipeline stage holds the head
            self.model.output_layer = ValueHead(
                hf_config.hidden_size, sequence_parallel=self.tf_config.sequence_parallel,
                tp_group=parallel_state.get_tensor_model_parallel_group(), dtype=self.tf_config.params_dtype,
                device=self.device,
            )
        for p in self.model.parameters():
            p.requires_grad_(True)
        # what MegatronActor does for trainable=True (1F1B): DDP, gradient finalisation, Adam
        self.trainable = True
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        self.ddp_model = DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=self.model)
        self.tf_config.no_sync_func = self.ddp_model.no_sync
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        self._opt_kwargs = dict(weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
                                adam_eps=adam_eps, clip_grad=clip_grad)
        self.set_lr(lr)

    # ----------------------------------------------------------------- weights
    def load_hf_state_dict(self, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named weights into this rank's shard (TP slices, local experts, this stage's layers).

        Accepts either

        * a policy's state dict (Qwen3MoeForCausalLM names; ``lm_head.weight`` optional and
          ignored): every transformer weight is copied and the value head is set to ZERO (weight
          and bias; deterministic, the same in every layout), or
        * a ``Qwen3MoeForTokenClassification(num_labels=1)`` state dict: ``score.weight`` [1, H]
          (and ``score.bias`` [1]; zero when absent, ``token_classification_bias=False``) is the
          value head.

        Transformers 5's fused in-memory expert tensors are accepted as well as per-expert keys.

        Raises:
            ValueError: a score layer with num_labels != 1, or keys/shapes that do not match the
                config (listed).
        """
        sd = {k: v for k, v in hf_state_dict.items() if k != "lm_head.weight"}
        hidden = self.hf_config.hidden_size
        if _SCORE_W in sd:
            w = sd[_SCORE_W]
            if tuple(w.shape) != (1, hidden):
                raise ValueError(f"score.weight has shape {tuple(w.shape)}; a critic's value head is "
                                 f"[1, {hidden}] (Qwen3MoeForTokenClassification with num_labels=1)")
            if _SCORE_B in sd and tuple(sd[_SCORE_B].shape) != (1,):
                raise ValueError(f"score.bias has shape {tuple(sd[_SCORE_B].shape)}, expected [1] (num_labels=1)")
            sd.setdefault(_SCORE_B, torch.zeros(1, dtype=w.dtype))
        else:
            if _SCORE_B in sd:
                raise ValueError("score.bias without score.weight")
            dtype = self.tf_config.params_dtype
            sd[_SCORE_W] = torch.zeros(1, hidden, dtype=dtype)
            sd[_SCORE_B] = torch.zeros(1, dtype=dtype)
        load_megatron_state_dict(self.model, hf_to_megatron(sd, self.hf_config, self.layout, head="value"))

    def export_hf_state_dict(self, dst: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Full ``Qwen3MoeForTokenClassification(num_labels=1)``-named state dict (``model.*``
        per-expert on-disk keys, ``score.weight`` [1, H], ``score.bias`` [1]; CPU copies).

        Collective when world size > 1: every rank must call it. ``dst=None`` returns the dict on
        every rank, ``dst=r`` only on global rank r (an empty dict elsewhere). Save it with
        ``save_hf_checkpoint(sd, value_model_hf_config(hf_config), path)``.
        """
        return gather_megatron_to_hf(self.model.state_dict(), self.hf_config, self.layout, dst=dst, head="value")

    # ----------------------------------------------------------------- compute
    def _forward_step(self, temperature: float, loss_fn: Optional[ValueLossFn], num_microbatches: int,
                      *args, **kwargs):
        """The actor's Megatron ``forward_step_func`` with the critic's ``loss_func``: values
        [B, S] (label layout, float32) to ``loss_fn`` (training) or back to the caller (forward only)."""
        model_step = super()._forward_step(temperature, None, num_microbatches, *args, **kwargs)
        scale = num_microbatches * self.dp_size  # undo Megatron's 1/num_microbatches and DDP's 1/dp

        def forward_step(data_iterator, model):
            seen = _Remember(data_iterator)
            output, _ = model_step(seen, model)
            mb = seen.item

            def loss_func(output):  # last stage only: values [B, S, 1] (padded) / [1, T, 1] (packed THD)
                values = to_label_layout(mb, output[..., 0].float())
                if loss_fn is None:
                    return output.sum() * 0.0, {"values": values.detach()}
                loss, metrics = loss_fn(values, mb)
                if not mb.sample_indices:  # an empty micro-batch of a packing plan: nothing to learn or log
                    loss, metrics = values.sum() * 0.0, {k: 0.0 for k in metrics}
                return loss * scale, dict(metrics)

            return output, loss_func

        return forward_step

    @torch.no_grad()
    def compute_values(self, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """V(s_t) under the current weights, forward only.

        Collective over the model-parallel ranks (every TP/PP/EP rank of this DP replica calls it
        with the same micro-batches; each DP rank with its own).

        Returns:
            one float32 [B, S] tensor per micro-batch, in order, with the micro-batch's own shape
            (padding removed), label-aligned (module docstring), on every rank (broadcast from the
            last pipeline stage).

        Raises:
            ValueError: no micro-batches, or ranks given different numbers of micro-batches.
        """
        padded = self._prepare(micro_batches)
        self.ddp_model.eval()
        out = self._run_schedule(padded, self._forward_step(1.0, None, len(padded), self._index(padded)),
                                 forward_only=True)
        values = [d["values"] for d in out]
        if self.pp_size > 1:
            b, s = padded[0].loss_mask.shape
            if parallel_state.is_pipeline_last_stage():
                stacked = torch.stack([v.float() for v in values]).contiguous()
            else:
                stacked = torch.empty((len(padded), b, s), dtype=torch.float32, device=self.device)
            dist.broadcast(stacked, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
            values = list(stacked)
        return [v[: mb.loss_mask.shape[0], : mb.loss_mask.shape[1]].contiguous()
                for v, mb in zip(values, micro_batches)]

    def compute_log_probs(self, micro_batches, temperature):
        """Not defined for a value model.

        Raises:
            TypeError: always (use :meth:`compute_values`).
        """
        raise TypeError("MegatronCritic has a value head, not an LM head: use compute_values")

    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: ValueLossFn,
                   temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step of the critic over this DP rank's ``micro_batches``.

        ``loss_fn(values [B, S] float32 with grad, micro_batch) -> (loss, metrics)`` must normalise
        by GLOBAL denominators (all micro-batches of all DP ranks), e.g.
        ``moerl.algorithms.value.value_loss(values, mb.extras["old_values"], mb.extras["returns"],
        mb.loss_mask, ...)``. Returns what :meth:`MegatronActor.train_step` returns, identical on
        every rank: the loss metrics summed over micro-batches and DP ranks ("*_max": max),
        grad_norm, aux_loss (the MoE balancing loss, which is part of the objective as in the
        actor) and update_successful. ``temperature`` is unused (the actor's signature).

        Raises:
            ValueError: no micro-batches, or ranks given different numbers of micro-batches.
        """
        return super().train_step(micro_batches, loss_fn, temperature)

    # ----------------------------------------------------------------- checkpoints
    def save(self, path: Union[str, os.PathLike], extra: Optional[dict] = None) -> Path:
        """Collective: model + optimizer as a Megatron distributed checkpoint at ``path``, atomically
        (moerl.checkpoint.dist_ckpt.save_dist_checkpoint; ``extra``: picklable rank-independent values
        returned by :meth:`load`)."""
        return save_dist_checkpoint(self.model, self.optimizer, path, extra=extra)

    def load(self, path: Union[str, os.PathLike], *, load_optimizer: bool = True) -> dict:
        """Collective: restore a checkpoint written by :meth:`save`. Weights reshard to this layout;
        the optimizer state reshards over DP only, so after a TP/PP/EP change pass
        ``load_optimizer=False`` (fresh Adam moments). Call :meth:`set_lr` BEFORE this, not after (it
        rebuilds the optimizer with fresh moments).

        Returns:
            the ``extra`` dict given to :meth:`save`.

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
        """
        return load_dist_checkpoint(self.model, self.optimizer if load_optimizer else None, path)
