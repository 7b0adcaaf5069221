"""The Megatron-Core actor: log-probs and policy updates through Megatron's forward_backward_func.

The actor owns one GPTModel stage (wrapped in Megatron DDP), a Megatron optimizer (Adam, optionally
the distributed optimizer that shards its state over DP) and the schedule returned by
``get_forward_backward_func()``: no pipelining at pp_size == 1, 1F1B
(forward_backward_pipelining_without_interleaving) at pp_size > 1. It knows nothing about
rollouts: callers hand it this DP rank's MicroBatches (moerl.train.batching) and a loss.

Parallel layouts (whatever moerl.runtime.distributed.init_distributed set up):

* TP (+ sequence parallelism): logits stay vocabulary-parallel; log-probs and entropies are
  reduced over the TP group (moerl.train.vocab_parallel). With sequence parallelism every
  micro-batch is right-padded to a sequence length divisible by tp_size.
* PP: token ids enter on the first stage, the loss runs on the last stage only; activations move
  by P2P, so every micro-batch is right-padded to one common [B, S]. compute_log_probs results are
  broadcast from the last stage to every stage, train_step metrics too.
* EP: experts are local to each EP rank (Megatron's alltoall dispatcher); every DP rank must run
  the same number of micro-batches (checked).
* DP: each DP rank gets its own micro-batches; Megatron DDP reduces the gradients.
* Pipeline schedule ``pipeline_schedule="dualpipe" | "dualpipev"`` (pp_size > 1): the model is cut
  into stage chunks (moerl.pipeline.megatron_stages.build_chunk_modules: DualPipeV 2*PP stages, rank
  r holding stages r and 2PP-1-r; DualPipe two mirrored copies of PP stages), held by one container
  module (StageChunks) under ONE Megatron DDP and one optimizer, and run by moerl's interpreter
  (make_forward_backward_func) over the pipeline group. TP (with sequence parallelism) and EP work
  inside the stages: every (tp, ep, dp) position runs its own copy of the schedule and the ranks of
  one pp rank issue their TP collectives / MoE all-to-alls in the same action order; gradients are
  reduced as for 1F1B (dense over DP, experts over expert-DP, sequence-parallel and QK layer-norm
  gradients over TP; DualPipe's mirrored copies summed between ranks of the same tp/ep rank). With TP
  the log-probs use a vocab-parallel form whose backward can run twice (the interpreter's split
  B/W backward). Micro-batch results (losses, log-probs) come out on whichever ranks end a
  micro-batch's route (DualPipeV: pp rank 0) and are gathered over the pipeline group in
  micro-batch order. Steps with fewer than 2*PP micro-batches run GPipe order on the same chunks
  (build_schedule(..., fallback=True)).

Precision (``params_dtype``): float32, or bfloat16 through Megatron-Core's mixed precision (BF16
weights and compute in a Float16Module, FP32 DDP gradient buffers and reduction, FP32 main params /
grads / Adam moments in Float16OptimizerWithFloat16Params or the distributed optimizer, grad norm and
clipping in FP32; see MegatronActor). float16 is refused (no loss scaling).

Padding is right padding with a zero loss mask: with a causal mask it leaves every real token's
logits unchanged, and the padding mask (moerl.train.batching.padding_mask) keeps padded tokens out
of Megatron's per-micro-batch MoE aux / z losses.

Loss scaling (verified against megatron-core 0.16.1). Megatron divides each micro-batch loss by
the number of micro-batches (the legacy 2-tuple loss_func contract, schedules.py
forward_step_calc_loss) and DDP AVERAGES gradients over DP ranks (distributed_data_parallel.py:
gradient_scaling_factor = 1/dp_size before a sum reduction, for dense and expert parameters
alike, when calculate_per_token_loss is False). moerl's losses are already normalised by GLOBAL
denominators (moerl.algorithms.policy_loss.aggregate_loss), so the actor multiplies each
micro-batch loss by num_microbatches * dp_size to undo both: the summed gradient is then the
gradient of the global loss however the batch is cut (tests/test_parallel_layouts.py checks the
grad norm against one process). The MoE aux loss keeps Megatron's scaling (mean over
micro-batches and DP ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
)

from moerl.algorithms.logprobs import entropy_from_logits, token_log_probs_from_logits
from moerl.checkpoint.hf_convert import ShardLayout, gather_megatron_to_hf, hf_to_megatron, load_megatron_state_dict
from moerl.models.dtypes import params_torch_dtype
from moerl.models.gpt import build_gpt_model, hf_moe_layer_pattern, transformer_config_from_hf
from moerl.moe.balancing import install_balancing_losses, set_step_normalisers
from moerl.pipeline.megatron_stages import stage_model_args
from moerl.runtime.cpu_compat import fused_cpu_adam
from moerl.train.batching import MicroBatch, PackedMicroBatch, model_labels, response_rows, to_label_layout
from moerl.train.losses import MAX_METRIC_SUFFIX, combine_micro_batch_metrics
from moerl.train.vocab_parallel import skip_output_layer, vocab_parallel_entropy, vocab_parallel_log_probs

__all__ = ["LossFn", "MegatronActor", "RECOMPUTE_MODES", "actor_parallel_kwargs", "params_torch_dtype",
           "recompute_config"]

# loss_fn(log_probs [B,S], entropy [B,S], micro_batch) -> (scalar loss, metrics dict of floats); with the fused
# log-prob (train.fused_logprob) both are 0 outside the response rows (moerl.train.batching.response_rows)
LossFn = Callable[[torch.Tensor, torch.Tensor, MicroBatch], tuple[torch.Tensor, dict]]

RECOMPUTE_MODES = ("none", "full", "selective")


def _fp32_main_params(optimizer) -> list[torch.Tensor]:
    """The FP32 main parameters of a mixed-precision Megatron optimizer (a ChainedOptimizer is
    unrolled), in a fixed order: Float16OptimizerWithFloat16Params' ``fp32_from_float16_groups``, the
    DistributedOptimizer's ``shard_fp32_from_float16_groups`` (this DP rank's shards). Empty for FP32
    params (the optimizer steps the model parameters themselves)."""
    out: list[torch.Tensor] = []
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        groups = getattr(sub, "shard_fp32_from_float16_groups", None)
        if groups is None:
            groups = getattr(sub, "fp32_from_float16_groups", None)
        for g in groups or []:
            out.extend(p for p in g if p is not None)
    return out


def recompute_config(recompute: str) -> dict[str, Any]:
    """TransformerConfig fields for an activation-recomputation mode.

    * "none": keep every activation;
    * "full": recompute each transformer layer in backward (recompute_granularity="full",
      recompute_method="uniform", recompute_num_layers=1): only each layer's input is kept;
    * "selective": recompute the core attention only (Megatron's selective recompute,
      recompute_modules default ["core_attn"]; Korthikanti et al. 2022, arXiv 2205.05198).

    Raises:
        ValueError: an unknown mode.
    """
    if recompute == "none":
        return {}
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective")
    raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")


def actor_parallel_kwargs(parallel_cfg) -> dict[str, Any]:
    """MegatronActor keyword arguments from a recipe's ``parallel`` section
    (moerl.config.schema.ParallelConfig): use_distributed_optimizer, recompute, sequence_parallel
    and the uneven pipeline split."""
    overrides = {}
    for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        value = getattr(parallel_cfg, name, None)
        if value is not None:
            overrides[name] = value
    return dict(
        use_distributed_optimizer=bool(getattr(parallel_cfg, "use_distributed_optimizer", False)),
        recompute=getattr(parallel_cfg, "recompute", "none"),
        sequence_parallel=bool(getattr(parallel_cfg, "sequence_parallel", True)),
        config_overrides=overrides,
    )


@contextlib.contextmanager
def mtp_block_off(model):
    """Run a Megatron-Core GPTModel with MTP layers (``config.mtp_num_layers``) without them for the block:
    its forward then needs no labels and returns the main head's logits (the MTP layers' routers see no
    tokens, so their expert bias does not move)."""
    saved = (model.mtp_process, model.config.mtp_num_layers)
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        model.mtp_process, model.config.mtp_num_layers = saved


def _pad_micro_batch(mb: MicroBatch, batch_size: int, seq_len: int) -> MicroBatch:
    """Right-pad a micro-batch to [batch_size, seq_len]: token/label 0, loss mask 0, extras 0,
    advantage 0 for the added rows. sample_indices / response_starts / response_lengths are
    unchanged (they describe the real rows only)."""
    b, s = mb.tokens.shape
    if (b, s) == (batch_size, seq_len):
        return mb

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((batch_size, seq_len), dtype=t.dtype, device=t.device)
        out[:b, :s] = t
        return out

    adv = mb.advantages
    if adv.dim() == 1:
        adv_p = torch.zeros(batch_size, dtype=adv.dtype, device=adv.device)
        adv_p[:b] = adv
    else:
        adv_p = pad(adv)
    return dataclasses.replace(
        mb,
        tokens=pad(mb.tokens),
        labels=pad(mb.labels),
        loss_mask=pad(mb.loss_mask),
        advantages=adv_p,
        extras={k: pad(v) for k, v in mb.extras.items()},
    )


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """The micro-batch with its tensors on ``device`` (itself when they already are)."""
    if mb.tokens.device == device:
        return mb
    changes = {
        f.name: getattr(mb, f.name).to(device)
        for f in dataclasses.fields(mb)
        if isinstance(getattr(mb, f.name), torch.Tensor)
    }
    changes["extras"] = {k: v.to(device) for k, v in mb.extras.items()}
    return dataclasses.replace(mb, **changes)


class MegatronActor:
    """A trainable (or frozen, ``trainable=False``) Megatron-Core policy, one pipeline stage per rank.

    Args:
        hf_config: transformers Qwen3MoeConfig of the model.
        lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad: Adam settings (Megatron
            OptimizerConfig; clip_grad = 0 disables clipping).
        moe_aux_loss_coeff, moe_load_balancing_type: Megatron router balancing (REFERENCE.md sec. 2).
        trainable: False builds the model only (a reference policy): no DDP, no optimizer.
        use_distributed_optimizer: Megatron's distributed optimizer (Adam moments and main params
            sharded over the DP group, gradients reduce-scattered, parameters all-gathered).
        recompute: activation recomputation, "none" | "full" | "selective" (``recompute_config``).
        sequence_parallel: Megatron sequence parallelism when tp_size > 1 (required by Megatron
            for MoE with TP when training; ignored at tp_size == 1).
        config_overrides: extra TransformerConfig fields (e.g. num_layers_in_first_pipeline_stage).
        params_dtype: "float32" | "bfloat16" (``model.params_dtype``; or the torch dtype). bfloat16 is
            Megatron-Core's mixed precision: parameters and compute in BF16 (TransformerConfig
            bf16=True; the 1F1B model is wrapped in Megatron's Float16Module, which hands fp32 logits
            to the loss; DualPipe chunks' logits are cast to fp32 in the loss), DDP gradient buffers
            and their DP reduction in FP32 (grad_reduce_in_fp32=True), and the optimizer
            (OptimizerConfig bf16=True: Float16OptimizerWithFloat16Params, or the distributed
            optimizer) keeps FP32 main parameters, FP32 main grads and FP32 Adam moments; grad norm
            and clipping run on the FP32 main grads (Micikevicius et al. 2018, "Mixed Precision
            Training"; megatron-core 0.16.1 optimizer.py). Checkpoints hold the FP32 main params.
        pipeline_schedule: "1f1b" (Megatron's schedules) | "dualpipe" | "dualpipev" (moerl.pipeline;
            needs pp_size > 1 and an even layer split over the stages; any tp_size / ep_size).
        pipeline_overlap: DualPipe(V)'s F&B steps through Megatron's schedule plans on two CUDA streams
            (moerl.pipeline.overlap; needs CUDA, ep_size >= 2 and the alltoall/flex dispatcher).
        split_backward: how DualPipe(V)'s split backward computes weight gradients: "store" (the layer-level
            split of moerl.pipeline.wgrad_store), "retrace" or "torch" (graph re-traversal); see
            ``moerl.pipeline.interpreter.PipelineInterpreter``.  Unused with pipeline_schedule="1f1b".
        fused_logprob: log-probs and entropies straight from the final hidden states and the
            output-layer weight (``train.fused_logprob``; moerl.kernels.fused_logprob: no [tokens, vocab]
            logits, the output layer is skipped by moerl.train.vocab_parallel.skip_output_layer) for the
            old-log-prob, reference and update passes, padded or packed, any TP. True: on (the native
            csrc op when it builds, else its chunked torch reference, with a warning); None: on when
            the native op is available on this device; False: logits as before. 1F1B only (DualPipe(V)
            chunks keep the logits path).

    Raises:
        ValueError: an unknown pipeline_schedule or a layout it does not support; params_dtype
            float16 or another unsupported dtype (``params_torch_dtype``); fused_logprob=True with
            pipeline_schedule dualpipe / dualpipev.
        RuntimeError: pipeline_overlap without CUDA.

    Requires moerl.runtime.distributed.init_distributed() to have run (the layout comes from
    Megatron's parallel_state).
    """

    def __init__(
        self,
        hf_config,
        *,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-8,
        clip_grad: float = 1.0,
        moe_aux_loss_coeff: float = 1e-3,
        moe_load_balancing_type: str = "aux_loss",
        trainable: bool = True,
        use_distributed_optimizer: bool = False,
        recompute: str = "none",
        sequence_parallel: bool = True,
        config_overrides: Optional[Mapping[str, Any]] = None,
        pipeline_schedule: str = "1f1b",
        pipeline_overlap: bool = False,
        params_dtype="float32",
        split_backward: str = "store",
        fused_logprob: Optional[bool] = False,
    ):
        self.hf_config = hf_config
        self.params_dtype = params_torch_dtype(params_dtype)
        overrides = recompute_config(recompute)
        overrides.update(config_overrides or {})
        overrides["params_dtype"] = self.params_dtype  # bf16=True and pipeline_dtype follow (qwen3_moe)
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        if pipeline_schedule not in ("1f1b", "dualpipe", "dualpipev"):
            raise ValueError(f"pipeline_schedule must be 1f1b, dualpipe or dualpipev, got {pipeline_schedule!r}")
        self.pipeline_schedule = pipeline_schedule
        self.dual = pipeline_schedule != "1f1b"
        if pipeline_overlap and not self.dual:
            raise ValueError("pipeline_overlap=True overlaps DualPipe's F&B steps: it needs pipeline_schedule "
                             "dualpipe or dualpipev")
        self.pipeline_overlap = bool(pipeline_overlap)
        from moerl.pipeline.interpreter import SPLIT_BACKWARD

        if split_backward not in SPLIT_BACKWARD:
            raise ValueError(f"split_backward must be one of {SPLIT_BACKWARD}, got {split_backward!r}")
        self.split_backward = split_backward
        self._stages = None
        if self.dual:
            self._build_chunks(hf_config, overrides, moe_aux_loss_coeff, moe_load_balancing_type, sequence_parallel)
        else:
            self.tf_config = transformer_config_from_hf(
                hf_config,
                moe_aux_loss_coeff=moe_aux_loss_coeff,
                moe_router_load_balancing_type=moe_load_balancing_type,
                sequence_parallel=sequence_parallel,
                **overrides,
            )
            self.model = build_gpt_model(hf_config, self.tf_config)
            # BF16: Megatron's Float16Module (BF16 inputs on the first stage, FP32 logits on the last);
            # self.model stays the bare GPTModel (weights, hooks, checkpoints)
            self._module = self.model
            if self.tf_config.bf16:
                from megatron.core.transformer.module import Float16Module

                self._module = Float16Module(self.tf_config, self.model)
            self.layout = ShardLayout.from_parallel_state(self.tf_config)
            self._fwd_bwd = get_forward_backward_func()
        if self.dual and self.tf_config.bf16:
            self.model.bfloat16()  # as Float16Module does for 1F1B: the torch norms are built in fp32
        self.device = next(self.model.parameters()).device
        self.fused_logprob = self._resolve_fused_logprob(fused_logprob)
        # moerl's balancing losses (moerl.moe.balancing): per real sequence, independent of dp_size
        self._routers = install_balancing_losses(self.model)
        self.moe_load_balancing_type = moe_load_balancing_type
        self.moe_aux_loss_coeff = moe_aux_loss_coeff
        self.trainable = trainable
        # entropy bonus (algorithm.entropy_coef > 0): the training forward keeps the entropy's graph
        self.entropy_grad = False
        self.use_distributed_optimizer = bool(use_distributed_optimizer)
        if trainable:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=self.use_distributed_optimizer,
            )
            module = self.model if self.dual else self._module
            self.ddp_model = DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=module)
            if self.dual:
                # Megatron's finalize_model_grads without its pipeline embedding all-reduce (a tied
                # embedding is one parameter of one rank here; that all-reduce would hang): the DP
                # gradient sync (dense over DP, experts over expert-DP), the TP all-reduce of the
                # sequence-parallel / QK layer-norm gradients, the aux-loss-free expert-bias update and
                # the MoE temporaries' reset
                from megatron.core.distributed.finalize_model_grads import (
                    _allreduce_non_tensor_model_parallel_grads,
                    _update_router_expert_bias,
                    reset_model_temporary_tensors,
                )

                ddp = self.ddp_model

                def finalize(models, *_args, **_kwargs):
                    ddp.finish_grad_sync()
                    cfg = models[0].config
                    _allreduce_non_tensor_model_parallel_grads(
                        [ddp], cfg, parallel_state.get_tensor_model_parallel_group())
                    if cfg.moe_router_enable_expert_bias:
                        _update_router_expert_bias(models, cfg)
                    reset_model_temporary_tensors(cfg, models)

                for m in self.model.models():
                    m.config.finalize_model_grads_func = finalize
            else:
                self.tf_config.no_sync_func = self.ddp_model.no_sync
                self.tf_config.finalize_model_grads_func = finalize_model_grads
            self._opt_kwargs = dict(
                weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps,
                clip_grad=clip_grad,
            )
            self.set_lr(lr)
        else:
            self.ddp_model = self.model if self.dual else self._module
            self.optimizer = None
            for p in self.model.parameters():
                p.requires_grad_(False)

    def _build_chunks(self, hf_config, overrides: dict, moe_aux_loss_coeff: float, moe_load_balancing_type: str,
                      sequence_parallel: bool = True):
        """DualPipe(V): this pp rank's stage chunks (moerl.pipeline.megatron_stages) in one StageChunks.
        TP / EP inside the stages come from parallel_state (each (tp, ep, dp) position runs its own copy of
        the schedule over its pipeline group)."""
        from moerl.pipeline.megatron_stages import StageChunks, build_chunk_modules, make_forward_backward_func
        from moerl.pipeline.schedules import build_schedule

        name = self.pipeline_schedule
        if self.pp_size < 2:
            raise ValueError(f"pipeline_schedule={name} needs pp_size > 1 (got {self.pp_size}); use 1f1b")
        for key in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            if overrides.get(key) is not None:
                raise ValueError(f"pipeline_schedule={name} splits layers evenly: {key} is not supported")
        group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        # the chunk layout does not depend on the micro-batch count: build it for the smallest valid one
        self.schedule_layout = build_schedule(name, self.pp_size, 2 * self.pp_size)
        self._stages = build_chunk_modules(
            self.schedule_layout, self.pp_rank, hf_config, moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_router_load_balancing_type=moe_load_balancing_type, sequence_parallel=sequence_parallel,
            overrides=overrides)
        self.model = StageChunks(self._stages, self.schedule_layout, hf_config.num_hidden_layers,
                                 non_homogeneous_layers=not all(hf_moe_layer_pattern(hf_config)))
        self.tf_config = self.model.config
        self.layout = None
        if self.pipeline_overlap:  # CUDA, ep_size >= 2, alltoall/flex dispatcher, ...: checked before any work
            from moerl.pipeline.overlap import check_overlap_supported

            for st in self._stages.values():
                check_overlap_supported(st.model.config, last_stage=st.is_last)
        self._fwd_bwd = make_forward_backward_func(name, group=group, overlap=self.pipeline_overlap,
                                                   split_backward=self.split_backward)
        if name == "dualpipe":  # the two copies of a stage were initialised on different ranks: make them equal
            self.load_hf_state_dict(self.export_hf_state_dict())

    def _resolve_fused_logprob(self, fused_logprob: Optional[bool]) -> bool:
        """train.fused_logprob (True | None = auto | False) -> whether this actor uses the fused op."""
        if fused_logprob is False:
            return False
        if self.dual:
            if fused_logprob:
                raise ValueError(f"train.fused_logprob=true is not supported with train.pipeline_schedule="
                                 f"{self.pipeline_schedule} (its stage chunks keep the logits path): set "
                                 "train.fused_logprob=false or train.pipeline_schedule=1f1b")
            return False
        if fused_logprob is None:
            from moerl.kernels._build import load_native

            return load_native("cuda" if self.device.type == "cuda" else "cpu")
        return True

    def set_step_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group of the current optimizer to ``lr`` (from the next
        optimizer step on), keeping Adam's moments: one point of an lr schedule (:meth:`set_lr` builds a new
        optimizer instead).

        Raises:
            RuntimeError: the actor has no optimizer (trainable=False).
        """
        if getattr(self, "optimizer", None) is None:
            raise RuntimeError("set_step_lr on a frozen actor (trainable=False)")
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_lr(self, lr: float) -> None:
        """(Re)build the Megatron Adam optimizer at learning rate ``lr`` with fresh moments (used
        between the SFT warm start and RL, which run at different learning rates). With BF16 params
        the new optimizer takes the old one's FP32 main params (a fresh one would start from the
        BF16-rounded model weights). On CPU the Adam step runs torch's fused kernel (moerl.runtime.cpu_compat.fused_cpu_adam)."""
        if not self.trainable:
            raise RuntimeError("set_lr on a frozen actor (trainable=False)")
        old = getattr(self, "optimizer", None)
        bf16 = self.params_dtype == torch.bfloat16
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                min_lr=lr,
                bf16=bf16,
                fp16=False,
                params_dtype=self.params_dtype,
                use_distributed_optimizer=self.use_distributed_optimizer,
                **self._opt_kwargs,
            ),
            [self.ddp_model],
        )
        fused_cpu_adam(self.optimizer)
        if old is not None:
            with torch.no_grad():
                for new_p, old_p in zip(_fp32_main_params(self.optimizer), _fp32_main_params(old), strict=True):
                    new_p.copy_(old_p)

    # ----------------------------------------------------------------- weights
    def load_hf_state_dict(self, hf_state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (moerl.checkpoint.hf_convert naming) strictly into this rank's
        shard of the model (TP slices, local experts, this pipeline stage's layers), cast to the
        model's params_dtype; a trainable BF16 actor's FP32 main params are then set from the loaded
        (BF16) weights (Megatron's ``reload_model_params``)."""
        if self.dual:
            from moerl.pipeline.megatron_stages import load_hf_into_stages

            load_hf_into_stages(self._stages, hf_state_dict, self.hf_config)
        else:
            load_megatron_state_dict(self.model, hf_to_megatron(hf_state_dict, self.hf_config, self.layout))
        if getattr(self, "optimizer", None) is not None:  # BF16: the FP32 main params follow the new weights
            self.optimizer.reload_model_params()

    def export_hf_state_dict(self, dst: Optional[int] = None,
                             out_alloc: Optional[Callable[[str, tuple, torch.dtype], torch.Tensor]] = None,
                             ) -> dict[str, torch.Tensor]:
        """Full HF-named state dict of the current weights (CPU copies), for weight sync/export.

        Collective when world size > 1: every rank must call it. TP/EP/PP shards are gathered
        (moerl.checkpoint.hf_convert.gather_megatron_to_hf); ``dst=None`` returns the full dict
        on every rank, ``dst=r`` only on global rank r (an empty dict elsewhere). ``out_alloc``
        (gather_megatron_to_hf's: e.g. a shared-memory export arena slot's ``alloc``) receives the
        copies instead of private clones; the dual-pipeline export (``self.dual``) ignores it and
        returns private tensors.
        """
        if self.dual:
            from moerl.pipeline.megatron_stages import export_hf_from_stages, model_copy_group

            full = export_hf_from_stages(self._stages, self.hf_config, group=model_copy_group())
            return full if dst is None or dist.get_rank() == dst else {}
        return gather_megatron_to_hf(self.model.state_dict(), self.hf_config, self.layout, dst=dst,
                                     out_alloc=out_alloc)

    # ----------------------------------------------------------------- batching
    def _prepare(self, micro_batches: Sequence[MicroBatch]) -> list[MicroBatch]:
        """Pad micro-batches to the shapes the layout needs (see the module docstring) and check
        that every rank runs the same number of micro-batches."""
        if not micro_batches:
            raise ValueError("no micro-batches: every DP rank needs at least one")
        if dist.is_initialized() and dist.get_world_size() > 1:
            n = torch.tensor([len(micro_batches), -len(micro_batches)], dtype=torch.long, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            if int(n[0]) != -int(n[1]):
                raise ValueError(
                    f"ranks were given different numbers of micro-batches (this rank {len(micro_batches)}, "
                    f"max {int(n[0])}, min {-int(n[1])}); every DP rank must run the same number "
                    "(collectives in EP dispatch, PP and DDP)"
                )
        multiple = self.tp_size if self.tf_config.sequence_parallel else 1

        def round_up(x: int) -> int:
            return -(-x // multiple) * multiple

        packed = [isinstance(mb, PackedMicroBatch) for mb in micro_batches]
        if any(packed):
            if not all(packed) or self.pp_size > 1:
                raise ValueError(
                    "packed (THD) micro-batches need pp_size == 1 and must not be mixed with padded ones; "
                    "set train.pack=false for pipeline parallelism"
                )
            return [_to_device(mb, self.device) for mb in micro_batches]
        if self.pp_size > 1:
            b = max(mb.batch_size for mb in micro_batches)
            s = round_up(max(mb.tokens.shape[1] for mb in micro_batches))
            padded = [_pad_micro_batch(mb, b, s) for mb in micro_batches]
        else:
            padded = [_pad_micro_batch(mb, mb.batch_size, round_up(mb.tokens.shape[1])) for mb in micro_batches]
        return [_to_device(mb, self.device) for mb in padded]

    # ----------------------------------------------------------------- compute
    def _token_log_probs(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                         output_weight: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None):
        """(log_probs, entropy) [B,S] float32 of the labels under softmax(logits / T); the entropy is
        differentiable when ``self.entropy_grad`` (an entropy bonus in the loss) and grad is enabled.

        With ``output_weight`` (train.fused_logprob) ``logits`` are the final hidden states [B, S, H]
        and the output weight (or its vocab shard) [V/tp, H]: moerl.kernels.fused_linear_log_probs,
        its statistics reduced over the TP group. ``rows`` (int64 [R], flat positions of labels'
        shape, moerl.train.batching.response_rows) limits that computation to those positions; the
        others are 0 in both outputs and get no gradient."""
        grad = self.entropy_grad and torch.is_grad_enabled()
        if output_weight is not None:
            from moerl.kernels.fused_logprob import fused_linear_log_probs

            group = parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None
            if rows is None or rows.numel() == 0:
                log_probs, entropy = fused_linear_log_probs(logits, output_weight, labels, temperature, tp_group=group)
                return log_probs, (entropy if grad else entropy.detach())
            rows = rows.to(logits.device)
            hidden = logits.reshape(-1, logits.shape[-1]).index_select(0, rows)
            lp, ent = fused_linear_log_probs(hidden, output_weight, labels.reshape(-1).index_select(0, rows),
                                             temperature, tp_group=group)
            zeros = lp.new_zeros(labels.numel())
            log_probs = zeros.index_copy(0, rows, lp).view(labels.shape)
            entropy = zeros.index_copy(0, rows, ent if grad else ent.detach()).view(labels.shape)
            return log_probs, entropy
        logits = logits.float()  # BF16 DualPipe chunks hand BF16 logits (Float16Module already fp32: no-op)
        if self.tp_size > 1 and self.dual:
            # the interpreter's split backward traverses the loss twice: Megatron's vocab-parallel
            # cross entropy overwrites its saved softmax in backward, this one does not
            from moerl.pipeline.megatron_stages import vocab_parallel_log_probs_reentrant

            log_probs = vocab_parallel_log_probs_reentrant(logits, labels, temperature)
            entropy = vocab_parallel_entropy(logits.detach(), temperature)  # no entropy bonus here (schema)
        elif self.tp_size > 1:
            log_probs = vocab_parallel_log_probs(logits, labels, temperature)
            entropy = vocab_parallel_entropy(logits if grad else logits.detach(), temperature, grad=grad)
        else:
            log_probs = token_log_probs_from_logits(logits, labels, temperature)
            with torch.set_grad_enabled(grad):
                entropy = entropy_from_logits(logits if grad else logits.detach(), temperature)
        return log_probs, entropy

    def _forward_step(self, temperature: float, loss_fn: Optional[LossFn], num_microbatches: int,
                      index: Optional[dict] = None, response_only: bool = True):
        """Megatron ``forward_step_func``; with ``index`` (id(micro-batch) -> position, dual schedules)
        each loss_func result also carries ``"_mb"``, the micro-batch's position. ``response_only``: the
        fused log-prob (train.fused_logprob) only at the response rows (moerl.train.batching.response_rows;
        0 elsewhere)."""
        from megatron.core.utils import get_attr_wrapped_model

        first_stage = parallel_state.is_pipeline_first_stage()
        # MoE routing replay (moerl.moe.routing_replay.RoutingReplay, set by the RL loop when
        # moe.routing_replay is r2/r3): force mb.routed_experts, or record (r2 first pass)
        replay = getattr(self, "routing_replay", None)
        # multi-token prediction layers (DeepSeek-V3, tf_config.mtp_num_layers): a loss marked ``trains_mtp``
        # (moerl.train.losses.sft_loss) on padded micro-batches passes the labels, so Megatron-Core's GPTModel
        # returns the main head's per-token cross entropy (= -log-prob at temperature 1) and adds
        # mtp_loss_scaling_factor * the MTP loss to the gradient (MTPLossAutoScaler); every other forward
        # runs without the MTP block, which needs labels
        has_mtp = bool(getattr(self.tf_config, "mtp_num_layers", None)) and not self.dual
        train_mtp = has_mtp and bool(getattr(loss_fn, "trains_mtp", False))
        if train_mtp and temperature != 1.0:
            raise ValueError(f"training MTP layers needs temperature 1 (the SFT loss), got {temperature}")

        def forward_step(data_iterator, model, return_schedule_plan: bool = False):
            mb: MicroBatch = next(data_iterator)
            # padded [B,S] with a causal mask, or one packed THD row with cu_seqlens; token ids enter on
            # the first stage only (a dual schedule's chunk knows if it is one), later stages get their
            # sequence-parallel slice of the padding mask
            is_first = bool(get_attr_wrapped_model(model, "pre_process")) if self.dual else first_stage
            args, kwargs = stage_model_args(mb, is_first, self.tf_config)
            with_labels = train_mtp and not isinstance(mb, PackedMicroBatch) and not return_schedule_plan
            if return_schedule_plan:  # train.pipeline_overlap: Megatron's plan, run later by the executor
                if replay is not None:
                    raise ValueError("moe.routing_replay does not support train.pipeline_overlap")
                output = get_attr_wrapped_model(model, "build_schedule_plan")(*args, **kwargs)
            else:
                if replay is not None:
                    replay.before_forward(mb)
                if with_labels:  # [B, S] cross entropy of the main head; the MTP loss is in the graph
                    output = model(*args, **kwargs, labels=mb.labels, loss_mask=mb.loss_mask)
                else:
                    # train.fused_logprob: the model hands back hidden states, the loss forms the log-probs
                    with mtp_block_off(self.model) if has_mtp else contextlib.nullcontext(), \
                            skip_output_layer(self.model) if self.fused_logprob else contextlib.nullcontext() as skipped:
                        output = model(*args, **kwargs)
                if replay is not None:
                    replay.after_forward(mb)
            weight = skipped.weight if self.fused_logprob and not return_schedule_plan and not with_labels else None

            def loss_func(logits):  # runs on the last stage only
                if with_labels:
                    log_probs = -logits.float()
                    log_probs, entropy = log_probs, torch.zeros_like(log_probs)
                else:  # the fused log-prob at the response rows only: the losses read no others
                    rows = response_rows(mb) if weight is not None and response_only and mb.sample_indices else None
                    log_probs, entropy = self._token_log_probs(logits, model_labels(mb), temperature, weight, rows)
                log_probs, entropy = to_label_layout(mb, log_probs), to_label_layout(mb, entropy)
                tag = {} if index is None else {"_mb": index[id(mb)]}
                if loss_fn is None:
                    zero = logits.sum() * 0.0
                    return zero, {"log_probs": log_probs.detach(), "entropy": entropy.detach(), **tag}
                loss, metrics = loss_fn(log_probs, entropy, mb)
                metrics = dict(metrics)
                if not mb.sample_indices:
                    # an empty micro-batch (a packing plan with fewer samples than micro-batches): zero
                    # loss and zero metrics, but the same metric names as the other ranks' (collectives)
                    loss = log_probs.sum() * 0.0
                    metrics = {k: (v if k.endswith(MAX_METRIC_SUFFIX) and math.isfinite(float(v)) else 0.0)
                               for k, v in metrics.items()}
                return loss * num_microbatches * self.dp_size, {**metrics, **tag}

            return output, loss_func

        return forward_step

    def _index(self, padded: list[MicroBatch]) -> Optional[dict]:
        """id(micro-batch) -> position, for the dual schedules (None for 1F1B)."""
        return {id(mb): i for i, mb in enumerate(padded)} if self.dual else None

    def _gather_pipeline(self, out: list) -> list:
        """Dual schedules: the loss_func results of every pipeline rank, in micro-batch order, on
        every pipeline rank (all_gather_object over the pipeline group); ``_mb`` tags removed."""
        parts: list = [None] * self.pp_size
        dist.all_gather_object(parts, list(out), group=parallel_state.get_pipeline_model_parallel_group())
        merged = sorted((d for part in parts for d in part), key=lambda d: d["_mb"])
        return [{k: v for k, v in d.items() if k != "_mb"} for d in merged]

    def _run_schedule(self, padded: list[MicroBatch], forward_step, forward_only: bool):
        return self._fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=iter(padded),
            model=self.model.models() if self.dual else [self.ddp_model],
            num_microbatches=len(padded),
            seq_length=max(mb.tokens.shape[1] for mb in padded),
            micro_batch_size=max(mb.batch_size for mb in padded),
            forward_only=forward_only,
        )

    @torch.no_grad()
    def compute_log_probs(
        self, micro_batches: Sequence[MicroBatch], temperature: float, response_only: bool = True
    ) -> list[tuple[MicroBatch, torch.Tensor, torch.Tensor]]:
        """Per-token log-probs (and entropies) of ``labels`` under the current weights.

        Collective over the model-parallel ranks (every TP/PP/EP rank of this DP replica calls it
        with the same micro-batches; each DP rank with its own).

        Returns one (micro_batch, log_probs [B,S] float32, entropy [B,S] float32) per given
        micro-batch, with the micro-batch's own [B, S] (padding removed), on every rank (broadcast
        from the last pipeline stage; gathered from the ranks ending the routes with DualPipe(V)). Values are log_softmax(logits / temperature) at the label
        (REFERENCE.md sec. 1: the trainer must use the sampling temperature).

        ``response_only`` (default): with the fused log-prob (train.fused_logprob) only the rows whose
        label is a response token are computed, the others are 0, exactly as in :meth:`train_step`'s
        forward. The two then form the log-probs with the same GEMM shapes: CPU BLAS (and cuBLAS) pick
        kernels by the row count, so an old-log-prob pass over every row could differ from the update's
        forward by an ulp and break the step-0 check that the policy ratio is exactly 1. False: every row.

        Raises:
            ValueError: no micro-batches, or ranks given different numbers of micro-batches.
        """
        padded = self._prepare(micro_batches)
        self.ddp_model.eval()
        step = self._forward_step(temperature, None, len(padded), self._index(padded), response_only=response_only)
        out = self._run_schedule(padded, step, forward_only=True)
        if self.dual:
            out = self._gather_pipeline(out)
        elif self.pp_size > 1:
            b, s = padded[0].tokens.shape
            if parallel_state.is_pipeline_last_stage():
                stacked = torch.stack([torch.stack([d["log_probs"].float(), d["entropy"].float()]) for d in out])
            else:
                stacked = torch.empty((len(padded), 2, b, s), dtype=torch.float32, device=self.device)
            stacked = stacked.contiguous()
            dist.broadcast(
                stacked,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
            out = [{"log_probs": x[0], "entropy": x[1]} for x in stacked]
        results = []
        for mb, d in zip(micro_batches, out):
            b, s = mb.tokens.shape
            results.append((mb, d["log_probs"][:b, :s].contiguous(), d["entropy"][:b, :s].contiguous()))
        return results

    def train_step(
        self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, temperature: float
    ) -> dict[str, float]:
        """One optimizer step over this DP rank's ``micro_batches`` (gradients accumulated over
        micro-batches and reduced over DP, then Adam).

        ``loss_fn`` must normalise by global denominators (all micro-batches of all DP ranks).
        Returns, identical on every rank: loss metrics summed over micro-batches and DP ranks
        (those whose name ends in ``"_max"``, :data:`moerl.train.losses.MAX_METRIC_SUFFIX`, are
        local maxima and are reduced with max instead: see
        :func:`moerl.train.losses.combine_micro_batch_metrics`),
        grad_norm (global, after DP reduction, before clipping), aux_loss (mean per MoE layer of
        Megatron's load-balancing loss, before the coefficient, averaged over micro-batches and DP
        ranks) and update_successful. A model with multi-token prediction layers trains them on a loss
        marked ``trains_mtp`` (moerl.train.losses.sft_loss; padded micro-batches): the gradient gets
        ``mtp_loss_scaling_factor`` times Megatron-Core's MTP loss (its token mean per micro-batch,
        averaged over micro-batches and DP ranks) and ``mtp_loss`` reports this rank's value.

        Raises:
            RuntimeError: if called on a frozen actor.
            ValueError: no micro-batches, or ranks given different numbers of micro-batches.
        """
        if not self.trainable:
            raise RuntimeError("train_step on a frozen actor (trainable=False)")
        padded = self._prepare(micro_batches)
        self._set_balancing_normalisers(micro_batches)
        self.ddp_model.train()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        clear_aux_losses_tracker()
        train_mtp = bool(getattr(self.tf_config, "mtp_num_layers", None)) and getattr(loss_fn, "trains_mtp", False)
        if train_mtp and not self.dual:
            from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

            MTPLossLoggingHelper.tracker.pop("values", None)  # this step's MTP losses only
        n = len(padded)
        out = self._run_schedule(padded, self._forward_step(temperature, loss_fn, n, self._index(padded)),
                                 forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        if self.dual:
            out = self._gather_pipeline(out)
        # `out` is empty except on the last pipeline stage (every stage for dual schedules)
        metrics = self._reduce_metrics(combine_micro_batch_metrics(out))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_successful"] = float(bool(update_successful))
        metrics["aux_loss"] = self._aux_loss(n)
        if train_mtp and not self.dual:
            values = MTPLossLoggingHelper.tracker.pop("values", None)
            if values is not None:  # this rank's MTP loss, mean over the MTP layers and micro-batches
                metrics["mtp_loss"] = float(values.sum()) / (n * len(values))
        return metrics

    def _set_balancing_normalisers(self, micro_batches: Sequence[MicroBatch]) -> None:
        """The step's counts for the balancing losses (moerl.moe.balancing.set_step_normalisers):
        N real sequences and K non-empty micro-batches over all DP ranks (one all-reduce over the DP
        group), so that seq_aux_loss is the mean over the step's N sequences and aux_loss the mean
        over its K non-empty micro-batches, however the batch is cut.

        Raises:
            ValueError: seq_aux_loss on packed (THD) micro-batches (the router sees one row per
                micro-batch, not one per sequence; moerl.moe.config refuses the recipe).
        """
        lb = self.moe_load_balancing_type
        if not self._routers or not self.moe_aux_loss_coeff or lb not in ("aux_loss", "seq_aux_loss"):
            set_step_normalisers(self._routers)
            return
        if lb == "seq_aux_loss" and any(isinstance(mb, PackedMicroBatch) for mb in micro_batches):
            raise ValueError("seq_aux_loss needs padded micro-batches (one row per sequence): set train.pack=false "
                             "or use aux_loss / global_aux_loss")
        counts = torch.tensor([sum(len(mb.sample_indices) for mb in micro_batches),
                               sum(1 for mb in micro_batches if mb.sample_indices)],
                              dtype=torch.float64, device=self.device)
        if self.dp_size > 1:
            dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        n_seqs, n_nonempty = counts.tolist()
        slots = len(micro_batches) * self.dp_size
        set_step_normalisers(self._routers, sequences_per_micro_batch=n_seqs / slots if n_seqs > 0 else None,
                             aux_loss_scale=slots / n_nonempty if n_nonempty > 0 else 1.0)

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Sum the last stage's metrics over DP ranks ("*_max" metrics: max), then hand them to every
        pipeline stage."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return metrics
        if self.dual:  # every pipeline rank already holds all micro-batches' metrics
            if self.dp_size > 1:
                metrics = self._all_reduce_dp(metrics)
            return metrics
        if parallel_state.is_pipeline_last_stage() and self.dp_size > 1:
            metrics = self._all_reduce_dp(metrics)
        return self._from_last_stage(metrics)

    def _all_reduce_dp(self, metrics: dict[str, float]) -> dict[str, float]:
        """All-reduce metrics over the DP group: SUM, except names ending in "_max" (MAX). Every DP
        rank holds the same names (same recipe and micro-batch extras), so the collectives match."""
        out: dict[str, float] = {}
        for op, keys in (
            (dist.ReduceOp.SUM, sorted(k for k in metrics if not k.endswith(MAX_METRIC_SUFFIX))),
            (dist.ReduceOp.MAX, sorted(k for k in metrics if k.endswith(MAX_METRIC_SUFFIX))),
        ):
            if not keys:
                continue
            values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(values, op=op, group=parallel_state.get_data_parallel_group())
            out.update(zip(keys, values.tolist()))
        return out

    def _aux_loss(self, num_microbatches: int) -> float:
        """Mean over MoE layers of the load-balancing loss (without its coefficient), averaged
        over micro-batches and DP ranks, from Megatron's aux-loss tracker (reduced over PP, TP and
        DP with megatron's reduce_aux_losses_tracker_across_ranks; the last stage's value is
        broadcast to all stages)."""
        tracker = get_moe_layer_wise_logging_tracker()
        if self.dual:
            return self._aux_loss_chunks(num_microbatches)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # every rank must reduce the same names (a stage without MoE layers has none)
            names: list = [None] * dist.get_world_size()
            dist.all_gather_object(names, sorted(tracker))
            all_names = sorted({x for ns in names for x in ns})
            for name in all_names:
                if name not in tracker:
                    tracker[name] = {"values": torch.zeros(self.tf_config.num_layers, device=self.device)}
            reduce_aux_losses_tracker_across_ranks(track_names=all_names)  # same order on every rank
        total = 0.0
        for name, entry in tracker.items():
            values = entry["values"]
            if values.numel():
                total += float(values.sum()) / (num_microbatches * max(1, int((values != 0).sum())))
        clear_aux_losses_tracker()
        return self._from_last_stage(total)

    def _aux_loss_chunks(self, num_microbatches: int) -> float:
        """``_aux_loss`` for the dual schedules. The stage routers carry GLOBAL layer numbers and the
        whole model's num_layers (megatron_stages._global_router_numbers), so the tracker has one entry
        per model layer as under 1F1B; DualPipe's two copies of a stage each add their micro-batches.
        Reduced with Megatron's reduce_aux_losses_tracker_across_ranks (sum over the pipeline group,
        then the entry's reduce group -- TP x CP for aux_loss, whose per-rank values are partial under
        sequence parallelism -- and the DP average), then divided by num_microbatches * (MoE layers of
        the whole model)."""

        tracker = get_moe_layer_wise_logging_tracker()
        names: list = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(tracker))
        all_names = sorted({x for ns in names for x in ns})
        if not all_names:
            return 0.0
        for name in all_names:  # a rank whose stages hold no MoE layer reduces zeros
            if name not in tracker:
                tracker[name] = {"values": torch.zeros(self.hf_config.num_hidden_layers, device=self.device)}
        reduce_aux_losses_tracker_across_ranks(track_names=all_names)  # same order on every rank
        total = sum(float(tracker[k]["values"].sum()) for k in all_names)
        n_moe = max(1, sum(bool(x) for x in hf_moe_layer_pattern(self.hf_config)))
        clear_aux_losses_tracker()
        return total / (num_microbatches * n_moe)

    def _from_last_stage(self, obj):
        """``obj`` as the last pipeline stage holds it, on every stage (identity at pp_size 1)."""
        if self.pp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return box[0]
