"""The Megatron-Core actor: log-probs and policy updates through Megatron's forward_backward_func.

The actor owns one GPTModel (wrapped in Megatron DDP), a Megatron optimizer (Adam) and the
schedule returned by ``get_forward_backward_func()`` (no pipelining at pp_size == 1). It knows
nothing about rollouts: callers hand it MicroBatches (moerl.train.batching) and a loss.

Loss scaling. Megatron divides each micro-batch loss by the number of micro-batches (the legacy
2-tuple loss_func contract, megatron/core/pipeline_parallel/schedules.py forward_step_calc_loss),
and DDP averages gradients over DP ranks. moerl's losses are already normalised by GLOBAL
denominators (moerl.algorithms.policy_loss.aggregate_loss), so the actor multiplies each
micro-batch loss by num_microbatches * dp_size to undo both: the summed gradient is then the
gradient of the global loss however the batch is cut.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

from moerl.algorithms.logprobs import entropy_from_logits, token_log_probs_from_logits
from moerl.checkpoint.hf_convert import hf_to_megatron, load_megatron_state_dict, megatron_to_hf
from moerl.models.qwen3_moe import build_gpt_model, causal_attention_mask, transformer_config_from_hf
from moerl.train.batching import MicroBatch

# loss_fn(log_probs [B,S], entropy [B,S], micro_batch) -> (scalar loss, metrics dict of floats)
LossFn = Callable[[torch.Tensor, torch.Tensor, MicroBatch], tuple[torch.Tensor, dict]]


class MegatronActor:
    """A trainable (or frozen, ``trainable=False``) Megatron-Core policy.

    Args:
        hf_config: transformers Qwen3MoeConfig of the model.
        lr, weight_decay, adam_beta1, adam_beta2, clip_grad: Adam settings (Megatron OptimizerConfig).
        moe_aux_loss_coeff, moe_load_balancing_type: Megatron router balancing (REFERENCE.md sec. 2).
        trainable: False builds the model only (a reference policy): no DDP, no optimizer.

    Requires moerl.runtime.distributed.init_distributed() to have run.
    """

    def __init__(
        self,
        hf_config,
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        clip_grad: float = 1.0,
        moe_aux_loss_coeff: float = 1e-3,
        moe_load_balancing_type: str = "aux_loss",
        trainable: bool = True,
    ):
        self.hf_config = hf_config
        self.tf_config = transformer_config_from_hf(
            hf_config,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_router_load_balancing_type=moe_load_balancing_type,
        )
        self.model = build_gpt_model(hf_config, self.tf_config)
        self.trainable = trainable
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self._fwd_bwd = get_forward_backward_func()
        if trainable:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            )
            self.ddp_model = DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=self.model)
            self.tf_config.no_sync_func = self.ddp_model.no_sync
            self.tf_config.finalize_model_grads_func = finalize_model_grads
            self._opt_kwargs = dict(
                weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2, clip_grad=clip_grad
            )
            self.set_lr(lr)
        else:
            self.ddp_model = self.model
            self.optimizer = None
            for p in self.model.parameters():
                p.requires_grad_(False)

    def set_lr(self, lr: float) -> None:
        """(Re)build the Megatron Adam optimizer at learning rate ``lr`` with fresh moments (used
        between the SFT warm start and RL, which run at different learning rates)."""
        if not self.trainable:
            raise RuntimeError("set_lr on a frozen actor (trainable=False)")
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                min_lr=lr,
                bf16=False,
                fp16=False,
                params_dtype=torch.float32,
                use_distributed_optimizer=False,
                **self._opt_kwargs,
            ),
            [self.ddp_model],
        )

    # ----------------------------------------------------------------- weights
    def load_hf_state_dict(self, hf_state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (moerl.checkpoint.hf_convert naming) strictly into the model."""
        load_megatron_state_dict(self.model, hf_to_megatron(hf_state_dict, self.hf_config))

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named state dict of the current weights (fp32 copies), for weight sync/export."""
        sd = {k: v.detach().clone() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        return megatron_to_hf(sd, self.hf_config)

    # ----------------------------------------------------------------- compute
    def _forward_step(self, temperature: float, loss_fn: Optional[LossFn], num_microbatches: int):
        def forward_step(data_iterator, model):
            mb: MicroBatch = next(data_iterator)
            seq_len = mb.tokens.shape[1]
            position_ids = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand_as(mb.tokens)
            logits = model(mb.tokens, position_ids, causal_attention_mask(seq_len))

            def loss_func(output):
                log_probs = token_log_probs_from_logits(output, mb.labels, temperature)
                with torch.no_grad():
                    entropy = entropy_from_logits(output.detach(), temperature)
                if loss_fn is None:
                    zero = output.sum() * 0.0
                    return zero, {"log_probs": log_probs.detach(), "entropy": entropy, "mb": mb}
                loss, metrics = loss_fn(log_probs, entropy, mb)
                metrics = dict(metrics)
                metrics["mb"] = mb
                return loss * num_microbatches * self.dp_size, metrics

            return logits, loss_func

        return forward_step

    @torch.no_grad()
    def compute_log_probs(
        self, micro_batches: Sequence[MicroBatch], temperature: float
    ) -> list[tuple[MicroBatch, torch.Tensor, torch.Tensor]]:
        """Per-token log-probs (and entropies) of ``labels`` under the current weights.

        Returns one (micro_batch, log_probs [B,S] float32, entropy [B,S] float32) per micro-batch;
        values are log_softmax(logits / temperature) at the label (REFERENCE.md sec. 1: the trainer
        must use the sampling temperature).
        """
        self.ddp_model.eval()
        out = self._fwd_bwd(
            forward_step_func=self._forward_step(temperature, None, len(micro_batches)),
            data_iterator=iter(micro_batches),
            model=[self.ddp_model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.batch_size for mb in micro_batches),
            forward_only=True,
        )
        return [(d["mb"], d["log_probs"], d["entropy"]) for d in out]

    def train_step(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, temperature: float
    ) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` (gradients accumulated, then Adam).

        ``loss_fn`` must normalise by global denominators (the whole list of micro-batches and all
        DP ranks). Returns summed loss metrics over micro-batches plus grad_norm, aux_loss (mean
        per MoE layer, before the coefficient) and update_successful.

        Raises:
            RuntimeError: if called on a frozen actor.
        """
        if not self.trainable:
            raise RuntimeError("train_step on a frozen actor (trainable=False)")
        self.ddp_model.train()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        clear_aux_losses_tracker()
        n = len(micro_batches)
        out = self._fwd_bwd(
            forward_step_func=self._forward_step(temperature, loss_fn, n),
            data_iterator=iter(micro_batches),
            model=[self.ddp_model],
            num_microbatches=n,
            seq_length=max(mb.tokens.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.batch_size for mb in micro_batches),
            forward_only=False,
        )
        update_successful, grad_norm, _ = self.optimizer.step()
        metrics: dict[str, float] = {}
        for d in out:
            for k, v in d.items():
                if k == "mb":
                    continue
                metrics[k] = metrics.get(k, 0.0) + float(v)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_successful"] = float(bool(update_successful))
        metrics["aux_loss"] = self._aux_loss(n)
        return metrics

    def _aux_loss(self, num_microbatches: int) -> float:
        """Mean over MoE layers of the load-balancing loss (without its coefficient), averaged
        over micro-batches, from Megatron's aux-loss tracker."""
        tracker = get_moe_layer_wise_logging_tracker()
        total = 0.0
        for name, entry in tracker.items():
            values = entry["values"]
            if values.numel():
                total += float(values.sum()) / (num_microbatches * max(1, int((values != 0).sum())))
        clear_aux_losses_tracker()
        return total
