"""Megatron-Core GPT-MoE (Qwen3-MoE) cut into pipeline stages for :mod:`moerl.pipeline.interpreter`.

A model of ``L`` decoder layers is cut into ``num_stages`` stages of ``L / num_stages`` consecutive layers
(``moerl.parallel.layout.pipeline_layer_range``): stage 0 also holds the embedding, the last stage the final
norm and the output layer; the RL policy loss is the criterion (:class:`PolicyCriterion`).  Each stage is a
``GPTModel`` built with ``pre_process``/``post_process`` and its own layer count (its TransformerConfig says
``pipeline_model_parallel_size=1`` whatever parallel_state's pp size): the pipelining is done by moerl's
interpreter, so one process can
hold two non-adjacent stages (DualPipe: ``r`` and ``PP-1-r``; DualPipeV: ``r`` and ``2PP-1-r``), which
Megatron's virtual-pipeline layout (stage ``v*PP + r``) cannot express.  Tied embeddings only where the
first and last stage share a rank (:func:`build_chunk_modules`).

Expert and tensor parallelism inside a stage: the stage's MoE layers and TP linears take their groups
from parallel_state, as ``build_gpt_model`` does for 1F1B.  The interpreter's group is Megatron's pipeline
group (ranks that differ only in pp rank), so every (tp, ep, dp) position runs its own copy of the
schedule; the ranks of one pp rank execute identical action lists, so their TP collectives and MoE
all-to-alls (forward, B and W) are issued in the same order.  DualPipe's mirrored-gradient sum pairs
ranks of the same tp/ep rank (same shards).  With TP the activations sent between stages are the
sequence-parallel shards ``[S/tp, B, H]`` and the last stage's logits are vocabulary-parallel
``[B, S, V/tp]``.  Tested on gloo with pp=2 x ep=2 and pp=2 x tp=2 (sequence parallel) against a single
process (tests/test_pipeline_ep.py).

Weights: :func:`load_hf_into_stages` cuts a full HF state dict into the stages with the converter of
``moerl.checkpoint.hf_convert`` (a stage = one pipeline rank of an even ``num_stages``-way split, with this
rank's TP slices and local experts); :func:`export_hf_from_stages` gathers the stages (and their TP/EP
shards) back into the full HF state dict.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from moerl.checkpoint.hf_convert import ShardLayout, hf_to_megatron, load_megatron_state_dict, merge_megatron_shards
from moerl.models.gpt import build_gpt_model, hf_moe_layer_pattern, transformer_config_from_hf
from moerl.parallel.layout import pipeline_layer_range
from moerl.pipeline.schedules import Schedule
from moerl.pipeline.stage_args import sequence_parallel_kwargs, stage_model_args  # re-exported (see __all__)

__all__ = [
    "MegatronStage",
    "StageChunks",
    "PolicyCriterion",
    "build_stage",
    "build_chunk_modules",
    "load_hf_into_stages",
    "export_hf_from_stages",
    "megatron_stage_fn",
    "make_forward_backward_func",
    "model_copy_group",
    "sequence_parallel_kwargs",
    "stage_model_args",
    "vocab_parallel_log_probs_reentrant",
]


class MegatronStage(torch.nn.Module):
    """One pipeline stage: a ``GPTModel`` with this stage's layers.

    ``forward(x, mb)``: ``mb`` is the micro-batch (``moerl.train.batching.MicroBatch`` or
    ``PackedMicroBatch``); on stage 0 ``x`` is ignored and the tokens come from ``mb``; on later stages ``x``
    is the previous stage's hidden states, float ``[S, B, H]`` (Megatron's sequence-first layout).  Returns
    hidden states ``[S, B, H]``, or logits ``[B, S, V]`` on the last stage.
    """

    def __init__(self, model: torch.nn.Module, stage: int, num_stages: int):
        super().__init__()
        self.model = model
        self.stage, self.num_stages = stage, num_stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def forward(self, x, mb):
        if not self.is_first:
            self.model.set_input_tensor(x)
        args, kwargs = stage_model_args(mb, self.is_first, self.model.config)
        return self.model(*args, **kwargs)


def _stage_config(hf_config, stage: int, num_stages: int, **config_kw):
    layers = pipeline_layer_range(hf_config.num_hidden_layers, num_stages, stage)
    pattern = hf_moe_layer_pattern(hf_config)[layers.start:layers.stop]
    overrides = dict(config_kw.pop("overrides", None) or {})
    overrides.update(num_layers=len(layers), moe_layer_freq=1 if all(pattern) else list(pattern),
                     pipeline_model_parallel_size=1)
    return transformer_config_from_hf(hf_config, pp_size=1, **config_kw, **overrides)


def build_stage(hf_config, stage: int, num_stages: int, **config_kw) -> MegatronStage:
    """Build stage ``stage`` of ``num_stages``.  Megatron parallel_state must be initialised; its pp_size may
    be 1 or the pipeline size (the stage's TransformerConfig says pipeline_model_parallel_size=1, so Megatron
    builds exactly this stage's layers with no offset whatever the pp rank).

    Args:
        hf_config: Qwen3MoeConfig; ``num_hidden_layers`` must be divisible by ``num_stages``.
        stage, num_stages: which stage.
        **config_kw: ``transformer_config_from_hf`` arguments (moe_aux_loss_coeff, params_dtype, ...);
            ``overrides=`` a dict of extra TransformerConfig fields.

    Raises:
        ValueError: tied embeddings, layers not divisible, or stage out of range.
    """
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError("build_stage: tie_word_embeddings=True is not supported for a lone stage; use "
                         "build_chunk_modules (ties the first and last stage when one rank holds both)")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    cfg = _stage_config(hf_config, stage, num_stages, **config_kw)
    model = build_gpt_model(hf_config, cfg, pre_process=stage == 0, post_process=stage == num_stages - 1)
    _global_router_numbers(model, pipeline_layer_range(hf_config.num_hidden_layers, num_stages, stage).start,
                           hf_config.num_hidden_layers)
    return MegatronStage(model, stage, num_stages)


def _global_router_numbers(model: torch.nn.Module, offset: int, num_layers: int) -> None:
    """Give every MoE router of a stage its GLOBAL layer number (stage-local number + ``offset``) and a
    config copy with the whole model's ``num_layers``, so Megatron's aux-loss tracker (indexed by
    ``router.layer_number - 1``, sized by ``router.config.num_layers``), moerl's MoE telemetry and routing
    replay see the model's layer indices.  The transformer layers keep their stage-local numbers (their
    state-dict / sharded-state-dict keys are stage-local; :class:`StageChunks` shifts them)."""
    import copy

    from megatron.core.transformer.moe.router import Router

    for m in model.modules():
        if isinstance(m, Router) and m.layer_number is not None:
            cfg = copy.copy(m.config)
            cfg.num_layers = num_layers
            m.config = cfg
            m.set_layer_number(int(m.layer_number) + offset)


def build_chunk_modules(schedule: Schedule, pp_rank: int, hf_config, **config_kw) -> dict[int, MegatronStage]:
    """The chunk id -> :class:`MegatronStage` dict that ``PipelineInterpreter`` needs on ``pp_rank``
    (one stage module per chunk, ``schedule.num_stages`` stages in all).

    Tied embeddings (``tie_word_embeddings``) are supported when the first and the last stage live on the
    same rank as chunks of one model copy (DualPipeV's rank 0, or a single stage): the last stage's
    ``output_layer.weight`` *is* the first stage's embedding Parameter, so both chunks' gradients accumulate
    into it.  Other schedules with tied embeddings raise ValueError.
    """
    import copy

    chunks = schedule.chunks_of_rank(pp_rank)
    S = schedule.num_stages
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if tied:
        holders = {schedule.chunk_rank[c] for c in range(schedule.num_chunks) if schedule.chunk_stage[c] in (0, S - 1)}
        if schedule.name == "dualpipe" or len(holders) != 1:
            raise ValueError(
                f"tie_word_embeddings=True needs the first and last stage on one rank (schedule dualpipev, or "
                f"pp_size 1); schedule {schedule.name} puts them on ranks {sorted(holders)}: set "
                "model.hf_config.tie_word_embeddings=false or use dualpipev")
        build_cfg = copy.deepcopy(hf_config)
        build_cfg.tie_word_embeddings = False
    else:
        build_cfg = hf_config
    out = {c: build_stage(build_cfg, schedule.chunk_stage[c], S, **config_kw) for c in chunks}
    if tied:
        first = [m for m in out.values() if m.is_first]
        last = [m for m in out.values() if m.is_last]
        if first and last and first[0] is not last[0]:
            last[0].model.output_layer.weight = first[0].model.embedding.word_embeddings.weight
    return out


def _layout(stage: MegatronStage) -> ShardLayout:
    base = ShardLayout.from_parallel_state()
    return ShardLayout(tp_size=base.tp_size, tp_rank=base.tp_rank, pp_size=stage.num_stages, pp_rank=stage.stage,
                       ep_size=base.ep_size, ep_rank=base.ep_rank, etp_size=base.etp_size, etp_rank=base.etp_rank)


def model_copy_group() -> Optional[dist.ProcessGroup]:
    """The process group whose ranks together hold one copy of the model under parallel_state: every
    pp, ep and tp (etp) rank of one expert-data-parallel position (Megatron's
    ``get_expert_tensor_model_pipeline_parallel_group``: etp x ep x pp ranks) when etp_size = tp_size, else
    ``None`` (the world).  What :func:`export_hf_from_stages` must gather over when the stages are also
    cut by TP/EP; plain DP replicas stay out of it."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    if ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size():
        return None
    return ps.get_expert_tensor_model_pipeline_parallel_group()


def load_hf_into_stages(stages: Sequence[MegatronStage] | Mapping[Any, MegatronStage],
                        hf_state_dict: Mapping[str, torch.Tensor], hf_config) -> None:
    """Load each stage's part of a full HF state dict strictly (hf_convert naming): the stage's layers,
    this rank's TP slices (expert-TP slices for experts) and its local experts
    ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` (renumbered from 0), all from parallel_state.

    Raises:
        ValueError: the model does not divide into the layout (heads / vocabulary by tp, experts by ep),
            or a key is missing (``hf_to_megatron`` / ``load_megatron_state_dict``)."""
    for st in (stages.values() if isinstance(stages, Mapping) else stages):
        load_megatron_state_dict(st.model, hf_to_megatron(hf_state_dict, hf_config, _layout(st)))


def export_hf_from_stages(stages: Sequence[MegatronStage] | Mapping[Any, MegatronStage], hf_config, *,
                          group: Optional[dist.ProcessGroup] = None,
                          tensors: str = "weights") -> dict[str, torch.Tensor]:
    """Full HF state dict from the stages spread over ``group`` (an ``all_gather_object`` collective over
    ``group`` when torch.distributed is initialised: every rank of it must call).

    Each rank contributes its stages keyed by their :class:`ShardLayout` (stage, tp/ep/etp rank); shards
    with equal layouts (DualPipe's mirrored copies, DP replicas) are taken once, TP slices are merged
    and experts of every EP rank put back at their global index (``merge_megatron_shards``).

    Args:
        stages: this rank's stages; mirrored copies (DualPipe) are taken once.
        group: ranks that together hold every stage and every TP/EP shard; None = the world.  With
            parallel_state pp = PP (the actor) pass :func:`model_copy_group` (or the pipeline group when
            tp = ep = 1).
        tensors: ``"weights"`` or ``"grads"`` (``param.main_grad`` under Megatron DDP, else ``param.grad``,
            zeros where None) -- the latter maps gradients to HF names, for checks.

    Returns:
        dict HF key -> CPU tensor, as ``megatron_to_hf`` of the whole model.
    """
    if tensors not in ("weights", "grads"):
        raise ValueError(f"tensors must be 'weights' or 'grads', got {tensors!r}")
    local = {}
    for st in (stages.values() if isinstance(stages, Mapping) else stages):
        if st.stage in local:
            continue
        if tensors == "weights":
            sd = {k: v.detach().cpu() for k, v in st.model.state_dict().items() if isinstance(v, torch.Tensor)}
        else:
            sd = {}
            params = dict(st.model.named_parameters())
            for k, v in st.model.state_dict().items():
                if k in params:
                    g = getattr(params[k], "main_grad", None)  # Megatron DDP's buffer
                    g = params[k].grad if g is None else g
                    sd[k] = (g if g is not None else torch.zeros_like(params[k])).detach().cpu()
                elif isinstance(v, torch.Tensor):
                    sd[k] = v.detach().cpu()
        local[st.stage] = (st.num_stages, _layout(st), sd)
    gathered = [local]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
    shards = {}
    for part in gathered:
        for _, (_, layout, sd) in part.items():
            shards.setdefault(layout, sd)
    return merge_megatron_shards(shards, hf_config)


class StageChunks(torch.nn.Module):
    """This rank's stage chunks as ONE module, for one Megatron DDP, one optimizer and one checkpoint.

    A tied embedding (DualPipeV's rank 0 holds stage 0 and the last stage) is then one parameter in one
    DDP buffer.  ``chunks`` is a ``ModuleDict`` chunk id -> ``GPTModel`` (state-dict keys
    ``chunks.<id>.<GPTModel key>``); ``config`` is the first chunk's TransformerConfig (what Megatron's
    ``get_model_config`` reads); ``forward`` is not defined (the interpreter calls the chunks).  The
    parameters of DualPipe's second model copy are marked ``shared`` so that Megatron's optimizer counts
    every stage once in the gradient norm.

    Args:
        stages: chunk id -> :class:`MegatronStage` (``build_chunk_modules``).
        schedule: the schedule the chunks were built for (any micro-batch count: only its chunk layout is
            used).
        num_layers: decoder layers of the whole model (``hf_config.num_hidden_layers``).
        non_homogeneous_layers: the whole model mixes dense and MoE layers (Megatron then checkpoints layers
            under per-layer keys); default: any held stage does (pass it from the HF config: a stage can be
            all-MoE in a mixed model).
    """

    def __init__(self, stages: Mapping[int, MegatronStage], schedule: Schedule, num_layers: int,
                 non_homogeneous_layers: Optional[bool] = None):
        super().__init__()
        self.chunk_ids = sorted(stages)
        self.chunks = torch.nn.ModuleDict({str(c): stages[c].model for c in self.chunk_ids})
        self.stages = {c: stages[c] for c in self.chunk_ids}  # plain dict: not registered twice
        self.config = stages[self.chunk_ids[0]].model.config
        self.num_layers = int(num_layers)
        if non_homogeneous_layers is None:
            freqs = [st.model.config.moe_layer_freq for st in self.stages.values()]
            non_homogeneous_layers = any(isinstance(f, list) or f > 1 for f in freqs)
        self.non_homogeneous_layers = bool(non_homogeneous_layers)
        # tied embeddings held here: the last stage's output_layer.weight IS the first stage's embedding
        emb = {id(st.model.embedding.word_embeddings.weight): c for c, st in self.stages.items() if st.is_first}
        self._tied_aliases = {
            f"chunks.{c}.output_layer.weight": f"chunks.{emb[id(st.model.output_layer.weight)]}.embedding.word_embeddings.weight"
            for c, st in self.stages.items()
            if st.is_last and id(getattr(st.model.output_layer, "weight", None)) in emb}
        # DualPipe's copy-1 chunk runs a stage whose copy-0 chunk is saved by another rank
        self.mirrors = {c for c in self.chunk_ids
                        if any(schedule.chunk_stage[t] == schedule.chunk_stage[c] for t in range(c))}
        # Megatron's grad norm skips parameters marked ``shared`` (megatron.core.transformer.module.
        # param_is_not_shared): count each stage once, from its first copy (both copies hold the summed
        # gradient after sync_mirrored_grads; clipping still scales both)
        for c in self.mirrors:
            for p in self.chunks[str(c)].parameters():
                p.shared = True

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a tied output layer's entry (not checkpointed, see
        :meth:`sharded_state_dict`) is taken from the embedding's."""
        state_dict = dict(state_dict)
        for out_key, emb_key in self._tied_aliases.items():
            if out_key not in state_dict and emb_key in state_dict:
                state_dict[out_key] = state_dict[emb_key]
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def models(self) -> list[torch.nn.Module]:
        """The chunk GPTModels in chunk-id order (``schedule.chunks_of_rank`` order)."""
        return [self.chunks[str(c)] for c in self.chunk_ids]

    def forward(self, *args, **kwargs):
        raise RuntimeError("StageChunks is a container: run its chunks (models()) through the pipeline schedule")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron dist-checkpointing state of every chunk, in exactly the form a 1F1B ``GPTModel`` of the
        whole model saves: checkpoints move between schedules (1F1B, DualPipe, DualPipeV) and pipeline
        sizes like between TP/PP/EP layouts (model weights reshard; moerl.train.loop loads the optimizer
        only when the layout and schedule are unchanged).

        Sharded keys carry no chunk id: ``embedding.*``, ``output_layer.*``, ``decoder.final_layernorm.*``
        and the decoder layers in Megatron's own layer format -- homogeneous layers stacked along a
        prepended layer axis of size ``num_layers`` at the layer's GLOBAL index, or (models mixing dense
        and MoE layers, where Megatron switches to it) ``decoder.layers.<global index>.`` keys.  Each layer
        is passed through Megatron's ``TransformerLayer.sharded_state_dict`` with that global offset, as
        ``TransformerBlock.sharded_state_dict`` does for a pipeline rank.  The chunks of DualPipe's second
        model copy are non-main replicas (the first copy saves them); a last stage whose output layer IS
        the first stage's embedding (tied, DualPipeV rank 0) saves only the embedding, as a tied 1F1B model
        does (:meth:`load_state_dict` fills the output layer's entry from it).  State-dict (local) keys are ``chunks.<id>.<GPTModel key>``.
        """
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        if sharded_offsets:
            raise ValueError("StageChunks.sharded_state_dict: unexpected sharded_offsets")
        md = dict(metadata or {})
        out = {}
        for c in self.chunk_ids:
            st = self.stages[c]
            off = pipeline_layer_range(self.num_layers, st.num_stages, st.stage).start
            sd = {k: v for k, v in st.model.sharded_state_dict(prefix="", metadata=md).items()
                  if not k.startswith("decoder.layers.")}
            if f"chunks.{c}.output_layer.weight" in self._tied_aliases:
                sd.pop("output_layer.weight")  # tied: the embedding entry saves and loads it
            for layer in st.model.decoder.layers:
                local = layer.layer_number - 1  # stage-local numbers (see _global_router_numbers)
                local_prefix = f"decoder.layers.{local}."
                if self.non_homogeneous_layers:
                    sharded_prefix, offsets = f"decoder.layers.{off + local}.", []
                else:
                    sharded_prefix, offsets = "decoder.layers.", [(0, off + local, self.num_layers)]
                lsd = layer.sharded_state_dict(local_prefix, offsets, md)
                replace_prefix_for_sharding(lsd, local_prefix, sharded_prefix)
                sd.update(lsd)
            if c in self.mirrors:
                for v in nested_values(sd):
                    if hasattr(v, "replica_id"):
                        rid = v.replica_id
                        v.replica_id = (1, *rid) if isinstance(rid, tuple) else (1, rid)
            out.update({f"{prefix}chunks.{c}.{k}": v for k, v in sd.items()})
        return out


def megatron_stage_fn(micro_batches: Sequence[Any]) -> Callable:
    """``stage_fn`` for ``PipelineInterpreter``: calls ``stage(x, micro_batches[m])``."""

    def stage_fn(chunk, module, x, m):
        return module(x, micro_batches[m])

    return stage_fn


def vocab_parallel_log_probs_reentrant(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)[label]`` for vocabulary-parallel logits, with a backward that may run
    more than once over a retained graph.

    Same values as ``moerl.train.vocab_parallel.vocab_parallel_log_probs`` (up to float32 rounding), but
    built from differentiable ops: ``x_label - max - log(sum exp(x - max))`` with the sum and the label
    logit all-reduced over the TP group by Megatron's ``reduce_from_tensor_model_parallel_region``
    (backward = identity: every TP rank holds the same loss and back-propagates into its own slice).
    Megatron's ``vocab_parallel_cross_entropy`` overwrites its saved softmax in its backward, so the
    interpreter's split backward (B, then W re-traversing the graph, ``split_backward="retrace"``)
    cannot go through it twice.

    Args:
        logits: float [B, S, V/tp], this TP rank's vocabulary slice (rank r holds ids
            ``[r*V/tp, (r+1)*V/tp)``; the maths runs in float32).
        labels: long [B, S], global token ids in [0, V).
        temperature: sampling temperature (> 0).

    Returns:
        float32 [B, S], identical on every TP rank.

    Raises:
        ValueError: labels / logits shapes differ, or a bad temperature.
    """
    import math

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite float > 0 (the sampling temperature), got {temperature}")
    if logits.dim() < 2 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(logits.shape)} without the vocab dim")
    group = ps.get_tensor_model_parallel_group()
    x = logits.float() / t
    with torch.no_grad():
        m = x.max(dim=-1).values
        if group.size() > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    n = x.shape[-1]
    local = labels.long() - ps.get_tensor_model_parallel_rank() * n
    inside = (local >= 0) & (local < n)
    picked = x.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * inside
    sum_exp = torch.exp(x - m.unsqueeze(-1)).sum(-1)
    picked = reduce_from_tensor_model_parallel_region(picked.contiguous())
    sum_exp = reduce_from_tensor_model_parallel_region(sum_exp.contiguous())
    return picked - m - torch.log(sum_exp)


class PolicyCriterion:
    """Criterion of the last stage: the actor's ``loss_fn(log_probs, entropy, mb) -> (loss, metrics)``
    (``moerl.train.losses.policy_loss`` / ``sft_loss``) applied to ``token_log_probs_from_logits(logits
    [B,S,V], labels, temperature)``; the loss is multiplied by ``loss_scale``.  Metrics of each micro-batch
    are appended to ``self.metrics``.  With tp_size > 1 (parallel_state) the logits are this TP rank's
    vocabulary slice ``[B, S, V/tp]`` and the log-probs / entropies are reduced over the TP group
    (:func:`vocab_parallel_log_probs_reentrant`, ``moerl.train.vocab_parallel.vocab_parallel_entropy``)."""

    def __init__(self, loss_fn, temperature: float = 1.0, loss_scale: float = 1.0):
        self.loss_fn, self.temperature, self.loss_scale = loss_fn, float(temperature), float(loss_scale)
        self.metrics: list[dict] = []

    def __call__(self, logits: torch.Tensor, mb) -> torch.Tensor:
        from moerl.algorithms.logprobs import entropy_from_logits, token_log_probs_from_logits
        from moerl.train.batching import model_labels, to_label_layout

        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
            from moerl.train.vocab_parallel import vocab_parallel_entropy

            log_probs = vocab_parallel_log_probs_reentrant(logits, model_labels(mb), self.temperature)
            entropy = vocab_parallel_entropy(logits.detach(), self.temperature)
        else:
            log_probs = token_log_probs_from_logits(logits, model_labels(mb), self.temperature)
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach(), self.temperature)
        log_probs, entropy = to_label_layout(mb, log_probs), to_label_layout(mb, entropy)
        loss, metrics = self.loss_fn(log_probs, entropy, mb)
        self.metrics.append(dict(metrics))
        return loss * self.loss_scale


def make_forward_backward_func(schedule: Schedule | str, *, group: Optional[dist.ProcessGroup] = None,
                               split_backward: str = "store", p2p: Any = None, overlap: bool = False,
                               overlap_require_cuda: bool = True) -> Callable:
    """A drop-in for Megatron-Core's ``get_forward_backward_func()`` that runs ``schedule`` with the
    interpreter (what ``MegatronActor._run_schedule`` calls).

    ``schedule`` is a built :class:`Schedule` (its micro-batch count must match every call) or a schedule
    name: then each call builds ``build_schedule(name, pp size of group, num_microbatches, fallback=True)``,
    i.e. DualPipe(V) when there are enough micro-batches and GPipe order on the same chunk layout otherwise.

    The returned function takes Megatron's keyword arguments ``forward_step_func, data_iterator, model,
    num_microbatches, forward_only`` (others, e.g. seq_length / micro_batch_size, are accepted and ignored:
    shapes travel with the tensors):

    - ``model``: list of this rank's chunk models (GPTModel, optionally Megatron-DDP wrapped) in
      ``schedule.chunks_of_rank(pp_rank)`` order;
    - ``forward_step_func(data_iterator, model) -> (output, loss_func)`` as for Megatron; on a non-first chunk
      the input activation is set with ``set_input_tensor`` before the call (so the step may pass
      ``input_ids=None`` there; a pre_process chunk needs the tokens);
    - ``loss_func(output) -> (loss, reduced)`` or ``(loss, num_tokens, reduced)`` runs on the chunk ending a
      micro-batch's route; the loss is divided by ``num_microbatches`` (by ``num_tokens`` too for the 3-tuple,
      unless ``config.calculate_per_token_loss``), and the MoE aux-loss scale set to ``1/num_microbatches``,
      exactly as Megatron's ``forward_step_calc_loss`` does.

    After a training step it sums DualPipe's mirrored gradients and calls ``config.finalize_model_grads_func``
    (when set) on the model list, as Megatron's schedules do.  Returns the ``reduced`` values in
    micro-batch order on the ranks that computed losses, ``[]`` elsewhere.

    ``split_backward`` is the interpreter's B/W split (``"store"``: layer-level, :mod:`moerl.pipeline.wgrad_store`;
    ``"retrace"`` / ``"torch"``: graph re-traversal, for modules the store cannot split).

    ``p2p`` is :class:`~moerl.pipeline.interpreter.PipelineInterpreter`'s transport: ``"directed"`` (default on
    NCCL), ``"shared"`` (default otherwise) or prebuilt ``P2PChannels``.  Directed channels are created HERE,
    once, by :func:`~moerl.pipeline.interpreter.make_p2p_channels` on the schedule's chunk layout: with
    ``p2p="directed"`` (or NCCL) this call is collective over the whole world (every rank, same point).

    ``overlap=True`` runs every training step through :class:`moerl.pipeline.overlap.MegatronOverlapExecutor`
    (DualPipe's F&B overlapped on two CUDA streams by Megatron's schedule plans): ``forward_step_func`` is then
    also called as ``forward_step_func(data_iterator, model, return_schedule_plan=True) -> (plan, loss_func)``,
    Megatron's own convention for ``combined_1f1b`` (return ``model.build_schedule_plan(...)`` with the
    forward's arguments).  ``overlap_require_cuda=False`` only for CPU dry checks inside
    :func:`moerl.pipeline.overlap.cpu_dry_run`.

    Raises:
        ValueError: ``p2p`` is not ``None``, ``"directed"``, ``"shared"`` or ``P2PChannels``; with ``overlap``,
            a model Megatron's plans cannot overlap (see :func:`moerl.pipeline.overlap.check_overlap_supported`).
        RuntimeError: ``overlap`` without CUDA.
    """
    import functools

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    from moerl.pipeline.interpreter import (P2PChannels, PipelineInterpreter, make_p2p_channels, sync_mirrored_grads,
                                            uses_nccl)
    from moerl.pipeline.overlap import MegatronOverlapExecutor, check_overlap_supported

    from moerl.pipeline.schedules import build_schedule

    if not (p2p is None or p2p in ("directed", "shared") or isinstance(p2p, P2PChannels)):
        raise ValueError(f"p2p must be None, 'directed', 'shared' or P2PChannels, got {p2p!r}")
    if p2p is None:
        p2p = "directed" if uses_nccl(group) else "shared"
    if p2p == "directed" and dist.is_initialized():  # the channels depend on the chunk layout only
        layout = (build_schedule(schedule, dist.get_world_size(group), 2, fallback=True)
                  if isinstance(schedule, str) else schedule)
        p2p = make_p2p_channels(layout, group)

    def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches: int,
                         forward_only: bool = False, **_ignored):
        if isinstance(schedule, str):
            pp = dist.get_world_size(group) if dist.is_initialized() else 1
            sched = build_schedule(schedule, pp, num_microbatches, fallback=True)
        else:
            sched = schedule
        if num_microbatches != sched.num_microbatches:
            raise ValueError(f"num_microbatches={num_microbatches} but the {sched.name} schedule was built for "
                             f"{sched.num_microbatches}; rebuild it (make_forward_backward_func(build_schedule(...)))")
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        pp_rank = dist.get_rank(group) if dist.is_initialized() else 0
        chunks = sched.chunks_of_rank(pp_rank)
        if len(models) != len(chunks):
            raise ValueError(f"model: pp rank {pp_rank} holds chunks {chunks} of {sched.name}; got {len(models)} "
                             "model chunks")
        by_chunk = dict(zip(chunks, models))
        config = get_model_config(models[0])
        mbs = [next(data_iterator) for _ in range(num_microbatches)]
        loss_funcs: dict[int, Callable] = {}
        reduced: dict[int, Any] = {}

        def stage_fn(c, module, x, m, **step_kw):
            """One forward step of chunk c on micro-batch m (``return_schedule_plan=True``: its plan)."""
            if not sched.is_first(c, m):
                get_attr_wrapped_model(module, "set_input_tensor")(x)
            out, loss_func = forward_step_func(iter([mbs[m]]), module, **step_kw)
            if sched.is_last(c, m):
                loss_funcs[m] = loss_func
            return out

        executor = None
        if overlap and not forward_only:
            for c, mod in by_chunk.items():
                check_overlap_supported(get_model_config(mod), require_cuda=overlap_require_cuda,
                                        last_stage=sched.chunk_stage[c] == sched.num_stages - 1)

            executor = MegatronOverlapExecutor(functools.partial(stage_fn, return_schedule_plan=True),
                                               require_cuda=overlap_require_cuda)

        def criterion(out, m):
            res = loss_funcs.pop(m)(out)
            if len(res) == 3:
                loss, num_tokens, red = res
                if not config.calculate_per_token_loss:
                    loss = loss / torch.clamp(num_tokens, min=1) / num_microbatches
            else:
                loss, red = res
                loss = loss / num_microbatches
            reduced[m] = red
            return loss

        if getattr(config, "num_moe_experts", None) and not forward_only:
            scale = (config.grad_scale_func(torch.ones(1)) if config.grad_scale_func is not None else torch.ones(1))
            MoEAuxLossAutoScaler.set_loss_scale(scale if config.calculate_per_token_loss else scale / num_microbatches)
        interp = PipelineInterpreter(sched, by_chunk, criterion, pp_rank=pp_rank, group=group, stage_fn=stage_fn,
                                     split_backward=split_backward, p2p=p2p, executor=executor)
        idx = list(range(num_microbatches))
        interp.run(idx, idx, forward_only=forward_only)
        if not forward_only:
            uses_main_grad = any(getattr(p, "main_grad", None) is not None for m in models for p in m.parameters())
            sync_mirrored_grads(sched, by_chunk, pp_rank=pp_rank, group=group,
                                grad_attr="main_grad" if uses_main_grad else "grad", channels=interp.channels)
            if config.finalize_model_grads_func is not None:
                config.finalize_model_grads_func(models)
        return [reduced[m] for m in sorted(reduced)]

    return forward_backward
