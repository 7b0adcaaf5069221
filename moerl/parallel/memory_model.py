"""The memory model of ``moerl plan RECIPE.yaml`` (output and CLI: moerl.parallel.memory_plan): does the recipe
fit its GPUs (``hardware.gpu``, moerl.parallel.hardware), and if not, which layout does
(``--search``, moerl.parallel.plan_search).

Sequence lengths come from the recipe (``recipe_workload``): the longest sample is
hardware.max_prompt_tokens + rollout.max_new_tokens (or ``--seq-length``), a training micro-batch is
train.max_tokens_per_micro_batch packed tokens (train.pack at pp 1; a longer sample gets its own) or
train.micro_batch_size samples of that length; never max_position_embeddings.

For every pipeline stage (the ranks of one stage hold the same amounts) it reports:

* parameters on the rank, split into dense (non-expert) and expert parameters, counted exactly as
  the Megatron-Core GPTModel that moerl builds holds them (``rank_param_counts``; tested against
  ``sum(p.numel() for p in model.parameters())`` in every layout of tests/test_parallel_layouts.py);
* weights = params x bytes(params_dtype);
* gradients = params x 4: moerl's actor reduces gradients in fp32 (Megatron DDP
  ``grad_reduce_in_fp32=True``), one full-size buffer even with the distributed optimizer;
* optimizer state (Adam) = 8 bytes per parameter for the two fp32 moments, plus 4 bytes for the fp32
  master copy when params are bf16/fp16 (fp32 params are their own master); with the distributed
  optimizer dense state is divided by dp_size and expert state by the expert data-parallel size
  world / (etp * ep * pp) (ZeRO-1 style sharding, Rajbhandari et al. 2020);
* activations kept for backward, per micro-batch of ``seq_length x micro_batch_size`` tokens, with
  no recompute, selective recompute (core attention) and full recompute (each layer's input only,
  plus one layer recomputed at a time), times the micro-batches a 1F1B stage holds in flight
  (``pp_size - pp_rank``, at most the number of micro-batches), plus the last stage's logits.

Activation model (elements per token of one layer, before the TP split; bytes = elements x
bytes(params_dtype) for bf16/fp16 training, x 4 for fp32), in the spirit of Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198) but for
Qwen3/DeepSeek layers (RMSNorm, no dropout, SwiGLU, MoE):

* attention (GQA): input-norm input H, QKV input H, q/k/v (nh + 2 nkv) d, q/k-norm inputs
  (nh + nkv) d, attention output nh d; softmax probabilities nh * S unless flash attention
  (Transformer Engine on GPU keeps only a [nh] log-sum-exp per token; the CPU local attention
  materialises them). MLA: H + q_lora + kv_lora + rope (down-projections), q (nh (dn + dr)),
  k (nh (dn + dr)), v (nh dv), output nh dv (+ nh * S without flash).
* MLP norm input H; dense SwiGLU: fc1 input H + fc1 output 2F + activation F;
  MoE: router input H, router logits/probs 2E (fp32), and per routed token copy H + 3I (k copies
  per token); shared experts: 3 S_shared (their input is the norm output, counted once).
* With sequence parallelism (tp > 1) everything divides by tp; expert copies per rank are
  k * T * etp / tp (balanced routing) with width I / etp.
* Full recompute stores each layer's input (H per token) and recomputes one layer at a time.
* Last pipeline stage: logits T x V / tp in the activation dtype + two fp32 copies (the scaled
  logits and the softmax the vocab-parallel cross entropy keeps).

Beside the actor, on the same ranks: the reference policy's weights (algorithm.reference_policy; a
frozen copy, no gradients or optimizer) and, for algorithm.advantage_estimator=gae, the critic
(``critic_param_counts``: weights, FP32 gradients, Adam state; its activations are bounded by the
actor's, whose update runs first). DualPipe holds two mirrored stages per rank (2x parameters),
DualPipeV two half-stage chunks (1x); both keep pp + 1 micro-batches of one chunk in flight
(DualPipe README's memory table).

Colocated rollout engines (rollout.placement=colocated, ``plan_rollout``): per GPU, the weights /
rollout.server_tp_size plus the KV cache of rollout_batch_size x n_samples_per_prompt full-length
samples spread over the replicas must fit SGLang's rollout.mem_fraction_static share of the GPU. The
trainer is offloaded while the engines run, so the two sides are checked separately.

Verdict: a rank FITS when its total is at most the GPU's memory less hardware.reserved_fraction
(default 10 %: CUDA context ~0.5-1 GiB, NCCL buffers, allocator fragmentation, which the estimate
leaves out). Not modelled: Transformer Engine's FP8 weight copies and transposes (precision.fp8), the
multi-token-prediction module, optimizer CPU offload (moerl has none).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from moerl.parallel.layout import pipeline_layer_range

__all__ = [
    "MLAShape",
    "ModelShape",
    "MemoryPlan",
    "StagePlan",
    "Workload",
    "Hardware",
    "RolloutPlan",
    "RecipePlan",
    "rank_param_counts",
    "critic_param_counts",
    "total_params",
    "plan_memory",
    "recipe_workload",
    "hardware_from_recipe",
    "kv_bytes_per_token",
    "plan_rollout",
    "plan_recipe",
    "plan_from_recipe",
    "recipe_vocab",
    "check_fp8_gpu",
]

GIB = 1024**3
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention dimensions (DeepSeek-V2/V3 config names)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    """The shapes that decide parameter counts and activations.

    Attributes:
        moe_layers: per layer, True for an MoE MLP, False for a dense MLP (width intermediate_size).
        shared_expert_intermediate_size: total width of the shared experts of an MoE layer (0 = none).
        mla: multi-head latent attention instead of grouped-query attention (num_key_value_heads and
            head_dim are then unused).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[bool, ...]
    tie_word_embeddings: bool
    shared_expert_intermediate_size: int = 0
    mla: Optional[MLAShape] = None
    qk_layernorm: bool = True  # RMSNorm on q and k per head (Qwen3-MoE); Mixtral has none

    @classmethod
    def from_hf_config(cls, hf_config, shared_expert_intermediate_size: Optional[int] = None,
                       mla: Optional[MLAShape] = None):
        """From a transformers config of a registered model family (moerl.models.families: the family's
        ``planner_shape``, e.g. Mixtral's expert width ``intermediate_size``, DeepSeek-V3's MLA and shared
        experts). ``shared_expert_intermediate_size`` / ``mla``, when given, replace the family's values.

        Raises:
            moerl.errors.ModelError: an unsupported model_type (lists the supported ones).
        """
        from moerl.models.families import get_family

        fields = dict(get_family(hf_config).planner_shape(hf_config))
        if shared_expert_intermediate_size is not None:
            fields["shared_expert_intermediate_size"] = shared_expert_intermediate_size
        if mla is not None:
            fields["mla"] = mla
        return cls(**fields)

    @classmethod
    def from_recipe(cls, cfg, vocab_size: int):
        """From a RecipeConfig's model section (vocab_size resolved by the caller). A model family other than
        Qwen3-MoE (``model.hf_config.model_type``, e.g. deepseek_v3) is sized from its HF config through the
        family's ``planner_shape`` (:meth:`from_hf_config`)."""
        hf = cfg.model.hf_config
        if getattr(hf, "model_type", "qwen3_moe") != "qwen3_moe":
            from moerl.models.families import get_family

            fields = dict(hf.family_fields(), vocab_size=vocab_size)
            return cls.from_hf_config(get_family(hf.model_type, key="model.hf_config.model_type").make_hf_config(fields))
        extras = cfg.model.planner_extras
        mla = None
        if extras is not None and extras.mla is not None:
            m = extras.mla
            mla = MLAShape(m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
        dense = set(hf.mlp_only_layers)
        return cls(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=hf.head_dim,
            vocab_size=vocab_size,
            num_experts=hf.num_experts,
            num_experts_per_tok=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size,
            intermediate_size=hf.intermediate_size,
            moe_layers=tuple(i not in dense for i in range(hf.num_hidden_layers)),
            tie_word_embeddings=hf.tie_word_embeddings,
            shared_expert_intermediate_size=extras.shared_expert_intermediate_size if extras else 0,
            mla=mla,
        )


def _as_shape(model) -> ModelShape:
    return model if isinstance(model, ModelShape) else ModelShape.from_hf_config(model)


def _attention_params(s: ModelShape, tp: int) -> int:
    """Attention block of one layer on one TP rank, input norm included."""
    h = s.hidden_size
    if s.mla is None:
        nh, nkv, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        # linear_qkv and linear_proj split over TP; input norm and q/k norms replicated
        return (nh + 2 * nkv) * d * h // tp + nh * d * h // tp + h + (2 * d if s.qk_layernorm else 0)
    m, nh = s.mla, s.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    # Megatron MLA: down-projections and their norms replicated, up-projections / proj split over TP
    if m.q_lora_rank is None:
        q = h * nh * qk // tp
    else:
        q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * qk // tp
    kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    kv += m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim) // tp
    return h + q + kv + nh * m.v_head_dim * h // tp


def rank_param_counts(model, layout) -> dict[str, int]:
    """Parameters one rank's GPTModel holds (``sum(p.numel() for p in model.parameters())``).

    Args:
        model: a ModelShape or a transformers Qwen3MoeConfig.
        layout: a moerl.checkpoint.hf_convert.ShardLayout (any object with tp_size, pp_size,
            pp_rank, ep_size, etp_size and num_layers_in_first/last_pipeline_stage).

    Returns:
        {"dense": non-expert parameters (TP-sharded), "expert": routed-expert parameters of the local
        experts (expert-TP-sharded), "total": their sum}. With tied embeddings and pp > 1 the last
        stage's copy of the embedding counts (Megatron allocates it).

    Raises:
        ValueError: the layers do not split over the pipeline stages.
    """
    s = _as_shape(model)
    tp, pp, ep = layout.tp_size, layout.pp_size, layout.ep_size
    etp = layout.etp_size if layout.etp_size is not None else tp
    h = s.hidden_size
    layers = pipeline_layer_range(
        s.num_layers, pp, layout.pp_rank,
        getattr(layout, "num_layers_in_first_pipeline_stage", None),
        getattr(layout, "num_layers_in_last_pipeline_stage", None),
    )
    first, last = layout.pp_rank == 0, layout.pp_rank == pp - 1
    dense = expert = 0
    if first:
        dense += s.vocab_size * h // tp
    if last:
        dense += h  # final norm
        if not s.tie_word_embeddings or not first:  # untied, or the last stage's copy of a tied embedding
            dense += s.vocab_size * h // tp
    for layer in layers:
        dense += _attention_params(s, tp) + h  # + pre-MLP norm
        if s.moe_layers[layer]:
            dense += s.num_experts * h  # router, replicated
            dense += 3 * h * s.shared_expert_intermediate_size // tp
            expert += (s.num_experts // ep) * 3 * h * s.moe_intermediate_size // etp
        else:
            dense += 3 * h * s.intermediate_size // tp
    return {"dense": dense, "expert": expert, "total": dense + expert}


def total_params(model) -> dict[str, int]:
    """Unique parameters of the whole model and the parameters active per token (top-k routed
    experts + shared experts + everything else; embeddings counted once when tied)."""
    from types import SimpleNamespace

    s = _as_shape(model)
    c = rank_param_counts(s, SimpleNamespace(tp_size=1, pp_size=1, pp_rank=0, ep_size=1, etp_size=1))
    per_expert = 3 * s.hidden_size * s.moe_intermediate_size
    active = c["dense"] + sum(s.moe_layers) * s.num_experts_per_tok * per_expert
    return {"total": c["total"], "active": active, "expert": c["expert"], "dense": c["dense"]}


# --------------------------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------------------------


def _layer_activation_elements(s: ModelShape, is_moe: bool, seq_length: int, flash_attention: bool,
                               tp: int, etp: int, sp: bool, pbytes: int) -> tuple[float, float]:
    """(elements of the activation dtype kept per token by one layer with no recompute, of which
    the core-attention softmax) on one rank; see the module docstring for the list."""
    h, nh = s.hidden_size, s.num_attention_heads
    # H-wide tensors (norm inputs, QKV / fc1 / router inputs): split over TP only with sequence parallelism
    hsized = 4.0 * h
    if s.mla is None:
        d, nkv = s.head_dim, s.num_key_value_heads
        split = (nh + 2 * nkv) * d + (nh + nkv) * d + nh * d  # q,k,v + q/k-norm inputs + attention output
    else:
        m = s.mla
        hsized += (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim  # down-projection outputs
        split = 2 * nh * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 2 * nh * m.v_head_dim
    softmax = 0.0 if flash_attention else float(nh * seq_length)
    split += softmax
    experts = 0.0
    if is_moe:
        hsized += 2 * s.num_experts * 4 / pbytes  # router logits and probabilities in fp32
        split += 3 * s.shared_expert_intermediate_size
        # k copies per token over the expert ranks: k * etp / tp copies per rank, each H + 3 I / etp wide
        experts = s.num_experts_per_tok * (h * etp + 3 * s.moe_intermediate_size) / tp
    else:
        split += 3 * s.intermediate_size  # SwiGLU fc1 output (2F) and activation (F)
    total = split / tp + experts + (hsized / tp if sp else hsized)
    return total, softmax / tp


@dataclass
class StagePlan:
    """Bytes per rank of one pipeline stage (all ranks of a stage are alike).

    ``weights``, ``grads``, ``optimizer`` and ``activations`` are the actor's; ``reference`` the frozen
    reference policy's weights (same layout, no gradients or optimizer) and ``critic`` the PPO critic's
    weights + gradients + optimizer state (its activations are the actor's without the logits, and the
    critic update runs after the actor's, so the actor's activations bound both).
    """

    pp_rank: int
    layers: int
    params_dense: int
    params_expert: int
    weights: float
    grads: float
    optimizer: float
    activations: dict[str, float]  # recompute mode -> bytes
    in_flight: float
    reference: float = 0.0
    critic: float = 0.0

    @property
    def params(self) -> int:
        return self.params_dense + self.params_expert

    def total(self, recompute: str) -> float:
        """Bytes of this stage's rank under recompute mode ``recompute``."""
        return self.weights + self.grads + self.optimizer + self.reference + self.critic + self.activations[recompute]


@dataclass
class MemoryPlan:
    """The planner's result (``plan_memory``); ``stages`` has one entry per pipeline rank."""

    world_size: int
    tp_size: int
    pp_size: int
    ep_size: int
    etp_size: int
    dp_size: int
    expert_dp_size: int
    sequence_parallel: bool
    use_distributed_optimizer: bool
    recompute: str
    params_dtype: str
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    flash_attention: bool
    model_params: dict[str, int]
    stages: list[StagePlan] = field(default_factory=list)
    pipeline_schedule: str = "1f1b"
    reference_policy: bool = False
    critic: bool = False

    def worst(self, recompute: Optional[str] = None) -> StagePlan:
        """The pipeline rank with the most bytes."""
        mode = recompute or self.recompute
        return max(self.stages, key=lambda st: st.total(mode))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict, with each stage's ``total`` per recompute mode."""
        d = asdict(self)
        for st, sd in zip(self.stages, d["stages"]):
            sd["total"] = {m: st.total(m) for m in st.activations}
        return d


def _rank_chunks(pp_size: int, rank: int, schedule: str) -> list[tuple[int, int]]:
    """(stages the model is cut into, stage index) of the model chunks pipeline rank ``rank`` holds:
    1F1B one stage; DualPipe stage r and its mirror pp-1-r (two model copies); DualPipeV chunks r
    and 2pp-1-r of a 2pp-way cut (moerl.pipeline.schedules)."""
    if schedule == "1f1b" or pp_size == 1:
        return [(pp_size, rank)]
    if schedule == "dualpipe":
        return [(pp_size, rank), (pp_size, pp_size - 1 - rank)]
    if schedule == "dualpipev":
        return [(2 * pp_size, rank), (2 * pp_size, 2 * pp_size - 1 - rank)]
    raise ValueError(f"pipeline_schedule must be 1f1b, dualpipe or dualpipev, got {schedule!r}")


def critic_param_counts(model, layout) -> dict[str, int]:
    """Parameters of one rank of moerl's critic (moerl.train.critic): the policy's GPTModel with
    untied embeddings and the vocabulary-parallel output layer replaced by the replicated scalar
    value head (weight [1, H] + bias [1]) on the last pipeline stage. Same keys as rank_param_counts."""
    s = _as_shape(model)
    if s.tie_word_embeddings:
        s = replace(s, tie_word_embeddings=False)
    c = rank_param_counts(s, layout)
    if layout.pp_rank == layout.pp_size - 1:
        c["dense"] += s.hidden_size + 1 - s.vocab_size * s.hidden_size // layout.tp_size
        c["total"] = c["dense"] + c["expert"]
    return c


def plan_memory(
    model,
    *,
    world_size: int,
    tp_size: int = 1,
    pp_size: int = 1,
    ep_size: int = 1,
    etp_size: Optional[int] = None,
    sequence_parallel: bool = True,
    use_distributed_optimizer: bool = False,
    recompute: str = "none",
    params_dtype: str = "bfloat16",
    seq_length: int = 4096,
    micro_batch_size: int = 1,
    num_microbatches: Optional[int] = None,
    flash_attention: bool = True,
    num_layers_in_first_pipeline_stage: Optional[int] = None,
    num_layers_in_last_pipeline_stage: Optional[int] = None,
    pipeline_schedule: str = "1f1b",
    reference_policy: bool = False,
    critic: bool = False,
) -> MemoryPlan:
    """Per-rank memory of training ``model`` in a Megatron-Core layout (see the module docstring).

    Args:
        model: ModelShape or transformers Qwen3MoeConfig.
        world_size, tp_size, pp_size, ep_size, etp_size (None = tp_size): the layout.
        sequence_parallel: Megatron sequence parallelism (tp_size > 1).
        use_distributed_optimizer: shard optimizer state over DP.
        recompute: the mode the ``total`` columns use ("none" | "full" | "selective"); all three
            activation figures are reported anyway.
        params_dtype: "bfloat16" | "float16" | "float32" (also the activation dtype).
        seq_length, micro_batch_size: tokens of one micro-batch = seq_length * micro_batch_size.
        num_microbatches: per optimizer step and DP rank (bounds the micro-batches in flight);
            default pp_size.
        flash_attention: no S x S softmax kept (Transformer Engine / flash attention on GPU).
        num_layers_in_first/last_pipeline_stage: uneven pipeline split.
        pipeline_schedule: "1f1b" (stage r keeps min(pp - r, micro-batches) micro-batches in flight),
            "dualpipe" (each rank holds stage r and its mirror pp-1-r: 2x parameters; pp + 1
            micro-batches of one stage's activations in flight) or "dualpipev" (chunks r and 2pp-1-r
            of a 2pp-way cut: 1x parameters; pp + 1 micro-batches of one chunk in flight), the
            DualPipe README's memory table (deepseek-ai/DualPipe).
        reference_policy: add a frozen copy of the weights (algorithm.reference_policy).
        critic: add PPO's critic (critic_param_counts) with gradients and optimizer state.

    Returns:
        MemoryPlan (bytes per rank, per pipeline rank).

    Raises:
        ValueError: an impossible layout (same rules as the recipe's check_world_size), layers that
            do not split over the schedule's stages, or an unknown recompute mode / dtype / schedule.
    """
    from types import SimpleNamespace

    s = _as_shape(model)
    etp = tp_size if etp_size is None else etp_size
    if recompute not in ("none", "full", "selective"):
        raise ValueError(f"recompute must be 'none', 'full' or 'selective', got {recompute!r}")
    if params_dtype not in _DTYPE_BYTES:
        raise ValueError(f"params_dtype must be one of {sorted(_DTYPE_BYTES)}, got {params_dtype!r}")
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if world_size % (tp_size * pp_size) or world_size % (etp * ep_size * pp_size):
        raise ValueError(
            f"world_size {world_size} must be divisible by tp*pp ({tp_size * pp_size}) and by etp*ep*pp "
            f"({etp * ep_size * pp_size})"
        )
    if s.num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide num_experts {s.num_experts}")
    dp = world_size // (tp_size * pp_size)
    edp = world_size // (etp * ep_size * pp_size)
    sp = sequence_parallel and tp_size > 1
    nmb = pp_size if num_microbatches is None else num_microbatches
    pbytes = _DTYPE_BYTES[params_dtype]
    tokens = seq_length * micro_batch_size
    opt_per_param = 8 + (4 if pbytes != 4 else 0)
    plan = MemoryPlan(
        world_size=world_size, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, etp_size=etp, dp_size=dp,
        expert_dp_size=edp, sequence_parallel=sp, use_distributed_optimizer=use_distributed_optimizer,
        recompute=recompute, params_dtype=params_dtype, seq_length=seq_length, micro_batch_size=micro_batch_size,
        num_microbatches=nmb, flash_attention=flash_attention, model_params=total_params(s),
        pipeline_schedule=pipeline_schedule, reference_policy=reference_policy, critic=critic,
    )

    def optimizer_bytes(c: dict[str, int]) -> float:
        if use_distributed_optimizer:
            return opt_per_param * (c["dense"] / dp + c["expert"] / edp)
        return float(opt_per_param * c["total"])

    for rank in range(pp_size):
        counts = {"dense": 0, "expert": 0, "total": 0}
        crit = {"dense": 0, "expert": 0, "total": 0}
        layers: list[int] = []
        last_chunk = False
        for stages, idx in _rank_chunks(pp_size, rank, pipeline_schedule):
            even = stages != pp_size  # DualPipeV's 2pp-way cut is even (the recipe refuses first/last with it)
            layout = SimpleNamespace(
                tp_size=tp_size, pp_size=stages, pp_rank=idx, ep_size=ep_size, etp_size=etp,
                num_layers_in_first_pipeline_stage=None if even else num_layers_in_first_pipeline_stage,
                num_layers_in_last_pipeline_stage=None if even else num_layers_in_last_pipeline_stage,
            )
            for k, v in rank_param_counts(s, layout).items():
                counts[k] += v
            if critic:
                for k, v in critic_param_counts(s, layout).items():
                    crit[k] += v
            layers += list(pipeline_layer_range(s.num_layers, stages, idx, layout.num_layers_in_first_pipeline_stage,
                                                layout.num_layers_in_last_pipeline_stage))
            last_chunk = last_chunk or idx == stages - 1
        per_layer = [_layer_activation_elements(s, s.moe_layers[i], seq_length, flash_attention, tp_size, etp, sp,
                                                pbytes) for i in layers]
        full_layer_elems = sum(e for e, _ in per_layer)
        softmax_elems = sum(sm for _, sm in per_layer)
        layer_input = s.hidden_size / (tp_size if sp else 1)
        biggest = max((e for e, _ in per_layer), default=0.0)
        per_mb = {
            "none": full_layer_elems,
            "selective": full_layer_elems - softmax_elems,
            "full": layer_input * len(per_layer),
        }
        if pipeline_schedule == "1f1b" or pp_size == 1:
            in_flight = float(max(1, min(pp_size - rank, nmb)))
        else:  # pp + 1 micro-batches of one chunk (the two chunks' mean), at most every micro-batch
            in_flight = min(pp_size + 1, 2 * nmb) / 2.0
        acts = {}
        for mode, elems in per_mb.items():
            b = elems * tokens * pbytes * in_flight
            if mode == "full":
                b += biggest * tokens * pbytes  # the layer being recomputed
            if last_chunk:
                b += tokens * s.vocab_size / tp_size * (pbytes + 8)
            acts[mode] = b
        plan.stages.append(
            StagePlan(
                pp_rank=rank, layers=len(layers), params_dense=counts["dense"], params_expert=counts["expert"],
                weights=counts["total"] * pbytes, grads=counts["total"] * 4.0, optimizer=optimizer_bytes(counts),
                activations=acts, in_flight=in_flight,
                reference=float(counts["total"] * pbytes) if reference_policy else 0.0,
                critic=crit["total"] * (pbytes + 4.0) + optimizer_bytes(crit) if critic else 0.0,
            )
        )
    return plan


# --------------------------------------------------------------------------------------------
# recipe: sequence lengths, hardware, rollout engines, verdicts
# --------------------------------------------------------------------------------------------


def recipe_vocab(cfg) -> tuple[int, str]:
    """(embedding rows, where they come from) of the recipe's model: model.hf_config.vocab_size when set,
    else the tokenizer's length (data.tokenizer_path, or moerl's built-in byte tokenizer when that is unset
    too) rounded up as moerl's trainer does (``HFConfig.resolve_vocab_size``). The source is printed, since
    a default vocabulary (the byte tokenizer's 260 tokens -> 320 rows) understates a real model's
    embedding and logits."""
    hf = cfg.model.hf_config
    if hf.vocab_size is not None:
        return hf.vocab_size, "model.hf_config.vocab_size"
    import tempfile

    from moerl.data.tokenizer import build_tokenizer, load_tokenizer

    if cfg.data.tokenizer_path:
        n = len(load_tokenizer(cfg.data.tokenizer_path))
        return hf.resolve_vocab_size(n), (f"the tokenizer at data.tokenizer_path {cfg.data.tokenizer_path} ({n} "
                                          "tokens, rounded up; model.hf_config.vocab_size is null)")
    with tempfile.TemporaryDirectory() as tmp:
        n = len(build_tokenizer(tmp))
    return hf.resolve_vocab_size(n), (f"DEFAULT: moerl's built-in byte tokenizer ({n} tokens, rounded up), because "
                                      "model.hf_config.vocab_size is null and data.tokenizer_path is unset; set "
                                      "model.hf_config.vocab_size to the real model's vocabulary")


def recipe_vocab_is_default(source: str) -> bool:
    """Whether ``recipe_vocab``'s source is the built-in byte tokenizer (not the recipe's model)."""
    return source.startswith("DEFAULT:")


def _recipe_vocab_size(cfg) -> int:
    return recipe_vocab(cfg)[0]


#: lowest CUDA compute capability per precision.fp8_recipe (moerl.precision.te_fp8._GPU_NEED; mxfp8 Blackwell)
FP8_MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


def check_fp8_gpu(cfg) -> None:
    """precision.fp8 on hardware.gpu: refuse a GPU of the table that cannot run the recipe's FP8 GEMMs
    (A100: no FP8 tensor cores; blockwise needs Hopper 9.0+, mxfp8 Blackwell 10.x), rather than plan BF16.
    No check without hardware.gpu (a custom GPU) or without precision.fp8.

    Raises:
        moerl.config.ConfigError: naming precision.fp8 / precision.fp8_recipe and hardware.gpu.
    """
    prec = getattr(cfg, "precision", None)
    if prec is None or not prec.fp8 or cfg.hardware.gpu is None:
        return
    from moerl.config.errors import ConfigError
    from moerl.parallel.hardware import GPUS, gpu_spec

    spec = gpu_spec(cfg.hardware.gpu)
    need = FP8_MIN_CAPABILITY[prec.fp8_recipe]
    if spec.fp8_tflops is None or spec.capability < need:
        why = "has no FP8 tensor cores" if spec.fp8_tflops is None else \
            f"is compute capability {spec.capability[0]}.{spec.capability[1]}"
        able = [g.name for g in GPUS.values() if g.fp8_tflops is not None and g.capability >= need]
        raise ConfigError(
            f"precision.fp8={prec.fp8} (precision.fp8_recipe={prec.fp8_recipe}, needs compute capability "
            f"{need[0]}.{need[1]}+) cannot run on hardware.gpu={spec.name}, which {why}",
            key="precision.fp8",
            hint=f"set precision.fp8=null to plan BF16 on {spec.name}, or pick hardware.gpu from {', '.join(able)}"
            + ("" if prec.fp8_recipe in ("delayed", "tensorwise") else
               ", or precision.fp8_recipe=tensorwise" if spec.fp8_tflops is not None else ""))


@dataclass(frozen=True)
class Workload:
    """The token counts of one RL step (``recipe_workload``).

    Attributes:
        sample_tokens: the longest sample, prompt + response (tokens).
        seq_length, micro_batch_size: one training micro-batch is seq_length x micro_batch_size tokens.
        packed: train.pack at pp_size 1 (best-fit packed micro-batches of max_tokens_per_micro_batch).
        num_microbatches: per optimizer step and DP rank, every sample at its longest.
        step_tokens: tokens of one optimizer step over all DP ranks (global_batch_size x sample_tokens).
        source: how sample_tokens was found (printed).
    """

    sample_tokens: int
    seq_length: int
    micro_batch_size: int
    packed: bool
    num_microbatches: int
    step_tokens: int
    source: str


def recipe_workload(cfg, dp_size: int, seq_length: Optional[int] = None) -> Workload:
    """Token counts of ``cfg``'s RL step on ``dp_size`` data-parallel ranks.

    The longest sample is ``seq_length`` when given (``--seq-length``), else
    ``hardware.max_prompt_tokens + rollout.max_new_tokens``; never max_position_embeddings. A training
    micro-batch is, with train.pack at pp_size 1 (moerl.train.micro_batches.build_micro_batches),
    ``max(train.max_tokens_per_micro_batch, longest sample)`` tokens (a sample longer than the cap gets
    a micro-batch of its own), else ``train.micro_batch_size`` samples padded to the longest.
    Micro-batches per DP rank: ceil(global_batch_size x sample / (dp x micro-batch tokens)).

    Raises:
        moerl.config.ConfigError: no prompt length (names hardware.max_prompt_tokens and
            --seq-length), a sample that reaches model.hf_config.max_position_embeddings (SGLang
            refuses it).
        moerl.errors.CLIError: a non-positive seq_length, or one reaching max_position_embeddings.
    """
    from moerl.config.errors import ConfigError

    r, t, hf = cfg.rollout, cfg.train, cfg.model.hf_config
    if seq_length is not None:
        from moerl.errors import CLIError

        if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
            raise CLIError(f"--seq-length must be a positive number of tokens, got {seq_length!r}",
                           key="--seq-length", hint="give the longest sample (prompt + response) in tokens, >= 1")
        if seq_length >= hf.max_position_embeddings:
            raise CLIError(
                f"--seq-length {seq_length} must be < model.hf_config.max_position_embeddings "
                f"({hf.max_position_embeddings}): SGLang refuses a sample that long",
                key="--seq-length", hint=f"give --seq-length below {hf.max_position_embeddings}, or raise "
                "model.hf_config.max_position_embeddings if the model supports longer contexts")
        sample, source = seq_length, f"--seq-length {seq_length}"
    else:
        prompt = cfg.hardware.max_prompt_tokens
        if prompt is None:
            raise ConfigError(
                "hardware.max_prompt_tokens is not set: the planner needs the longest prompt in tokens",
                key="hardware.max_prompt_tokens",
                hint="give hardware.max_prompt_tokens=N (samples are N + rollout.max_new_tokens long) or --seq-length")
        sample = prompt + r.max_new_tokens
        source = f"hardware.max_prompt_tokens {prompt} + rollout.max_new_tokens {r.max_new_tokens}"
        if sample >= hf.max_position_embeddings:
            raise ConfigError(
                f"hardware.max_prompt_tokens + rollout.max_new_tokens ({prompt} + {r.max_new_tokens} = {sample}) must "
                f"be < model.hf_config.max_position_embeddings ({hf.max_position_embeddings})",
                key="hardware.max_prompt_tokens", hint="lower hardware.max_prompt_tokens or rollout.max_new_tokens")
    packed = t.pack and cfg.parallel.pp_size == 1
    if packed:
        seq, mbs = max(t.max_tokens_per_micro_batch, sample), 1
    else:
        seq, mbs = sample, t.micro_batch_size
    step_tokens = t.global_batch_size * sample
    nmb = max(1, math.ceil(step_tokens / (dp_size * seq * mbs)))
    return Workload(sample, seq, mbs, packed, nmb, step_tokens, source)


@dataclass(frozen=True)
class Hardware:
    """The GPU the plan is for (``hardware_from_recipe``). Units: GiB, dense TFLOP/s, GB/s per direction."""

    name: str
    memory_gib: Optional[float]
    bf16_tflops: Optional[float]
    nvlink_gbs: float
    inter_node_gbs: float
    gpus_per_node: int
    mfu: float
    reserved_fraction: float
    fp8_tflops: Optional[float] = None

    @property
    def usable_bytes(self) -> Optional[float]:
        """GPU memory less hardware.reserved_fraction (CUDA context, NCCL buffers, fragmentation)."""
        return None if self.memory_gib is None else self.memory_gib * GIB * (1 - self.reserved_fraction)


def hardware_from_recipe(cfg) -> Hardware:
    """The ``hardware`` section resolved against moerl.parallel.hardware.GPUS (overrides win).
    Without ``hardware.gpu`` and ``hardware.gpu_memory_gib`` memory is unknown (no verdict)."""
    from moerl.parallel.hardware import gpu_spec

    hw = cfg.hardware
    spec = gpu_spec(hw.gpu) if hw.gpu is not None else None
    return Hardware(
        name=spec.name if spec else ("custom" if hw.gpu_memory_gib else "unknown"),
        memory_gib=hw.gpu_memory_gib or (spec.memory_gib if spec else None),
        bf16_tflops=hw.peak_bf16_tflops or (spec.bf16_tflops if spec else None),
        nvlink_gbs=hw.nvlink_gbs or (spec.nvlink_gbs if spec else 450.0),
        inter_node_gbs=hw.inter_node_gbs, gpus_per_node=hw.gpus_per_node, mfu=hw.mfu,
        reserved_fraction=hw.reserved_fraction, fp8_tflops=spec.fp8_tflops if spec else None,
    )


@dataclass
class RolloutPlan:
    """Per-GPU memory of the SGLang rollout engines (``plan_rollout``), bytes.

    Attributes:
        replicas: engine replicas (world GPUs / rollout.server_tp_size when colocated).
        sequences: concurrent sequences per replica (rollout_batch_size x n_samples_per_prompt spread
            over the replicas), each sample_tokens long.
        weights: weight bytes per GPU (all parameters / server_tp_size, in params_dtype).
        kv_per_token: KV-cache bytes per token on one GPU.
        kv_needed: sequences x sample_tokens x kv_per_token.
        static_budget: rollout.mem_fraction_static x GPU memory (SGLang's weights + KV pool).
    """

    replicas: int
    sequences: int
    sample_tokens: int
    weights: float
    kv_per_token: float
    kv_needed: float
    static_budget: Optional[float]
    mem_fraction_static: float

    @property
    def kv_pool(self) -> Optional[float]:
        """Bytes per GPU left for the KV cache (static budget - weights); None without a GPU memory."""
        return None if self.static_budget is None else self.static_budget - self.weights

    @property
    def fits(self) -> Optional[bool]:
        """Every sequence of the rollout batch at full length fits the KV pool at once; None without a GPU."""
        return None if self.kv_pool is None else self.kv_needed <= self.kv_pool

    @property
    def sequences_held(self) -> Optional[int]:
        """Full-length sequences the KV pool of one replica holds at once."""
        if self.kv_pool is None:
            return None
        return max(0, int(self.kv_pool // max(1.0, self.sample_tokens * self.kv_per_token)))


def kv_bytes_per_token(shape: ModelShape, server_tp: int, kv_bytes: int = 2) -> float:
    """KV-cache bytes of one token on one GPU of an SGLang server with tensor parallelism ``server_tp``.

    GQA: K and V of every layer, num_key_value_heads / server_tp heads per GPU (SGLang replicates a
    KV head when server_tp > num_key_value_heads): 2 x layers x max(1, nkv // tp) x head_dim x bytes.
    MLA (DeepSeek): the compressed latent and the rope key, replicated on every TP rank:
    layers x (kv_lora_rank + qk_rope_head_dim) x bytes (DeepSeek-V2 paper, sec. 2.1; SGLang's
    MLATokenToKVPool). kv_bytes: 2 for the default bf16 cache (--kv-cache-dtype auto)."""
    if shape.mla is not None:
        return float(shape.num_layers * (shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim) * kv_bytes)
    heads = max(1, shape.num_key_value_heads // server_tp)
    return float(2 * shape.num_layers * heads * shape.head_dim * kv_bytes)


def plan_rollout(cfg, shape: ModelShape, world_size: int, sample_tokens: int, hw: Hardware) -> RolloutPlan:
    """SGLang engines colocated with the trainer on ``world_size`` GPUs: each replica of
    rollout.server_tp_size GPUs holds all weights / server_tp_size per GPU and the KV cache of its
    share of rollout_batch_size x n_samples_per_prompt sequences at full length (sample_tokens). SGLang
    gives weights + KV pool rollout.mem_fraction_static of the GPU's memory (--mem-fraction-static);
    the rest is for its activations and CUDA graphs. The trainer is offloaded while the engines run
    (moerl.rollout.placement), so the two sides do not add.

    Raises:
        moerl.config.ConfigError: world_size not a multiple of rollout.server_tp_size.
    """
    from moerl.config.errors import ConfigError

    r = cfg.rollout
    tp = r.server_tp_size
    if world_size % tp:
        raise ConfigError(f"world_size ({world_size}) must be a multiple of rollout.server_tp_size ({tp}) for "
                          "colocated engines", key="rollout.server_tp_size",
                          hint="pick a rollout.server_tp_size dividing the world size, or another --world-size")
    replicas = world_size // tp
    seqs = math.ceil(r.rollout_batch_size * r.n_samples_per_prompt / replicas)
    wbytes = _DTYPE_BYTES[cfg.model.params_dtype]
    kv = kv_bytes_per_token(shape, tp, 4 if wbytes == 4 else 2)
    weights = total_params(shape)["total"] * wbytes / tp
    budget = None if hw.memory_gib is None else r.mem_fraction_static * hw.memory_gib * GIB
    return RolloutPlan(replicas, seqs, sample_tokens, weights, kv, seqs * sample_tokens * kv, budget,
                       r.mem_fraction_static)


@dataclass
class RecipePlan:
    """``plan_recipe``'s answer: the training plan, the workload, the GPU, the rollout engines."""

    recipe: str
    memory: MemoryPlan
    workload: Workload
    hardware: Hardware
    rollout: Optional[RolloutPlan]
    placement: str
    vocab_size: int = 0
    vocab_source: str = ""  # recipe_vocab's source (printed; "DEFAULT: ..." for the byte tokenizer)
    fp8: str = ""  # "" (BF16) or e.g. "e4m3 (tensorwise)": precision.fp8 (precision.fp8_recipe)

    def fits(self) -> Optional[bool]:
        """True when every pipeline rank (and colocated engines) fit; None without a GPU memory."""
        usable = self.hardware.usable_bytes
        if usable is None:
            return None
        train = self.memory.worst().total(self.memory.recompute) <= usable
        return train and (self.rollout is None or bool(self.rollout.fits))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of everything."""
        d = {"recipe": self.recipe, "memory": self.memory.to_dict(), "workload": asdict(self.workload),
             "hardware": asdict(self.hardware), "placement": self.placement, "fits": self.fits(),
             "vocab_size": self.vocab_size, "vocab_source": self.vocab_source, "fp8": self.fp8 or None}
        if self.rollout is not None:
            d["rollout"] = {**asdict(self.rollout), "kv_pool": self.rollout.kv_pool, "fits": self.rollout.fits,
                            "sequences_held": self.rollout.sequences_held}
        return d


def plan_from_recipe(cfg, world_size: Optional[int] = None, seq_length: Optional[int] = None,
                     flash_attention: bool = True) -> MemoryPlan:
    """``plan_memory`` for a RecipeConfig (``plan_recipe(...).memory``)."""
    return plan_recipe(cfg, world_size, seq_length, flash_attention).memory


def plan_recipe(cfg, world_size: Optional[int] = None, seq_length: Optional[int] = None,
                flash_attention: bool = True, recipe: str = "") -> RecipePlan:
    """The whole answer of ``moerl plan`` for a RecipeConfig.

    world_size: default parallel.world_size, else the smallest world the layout tiles
    (lcm(tp*pp, etp*ep*pp)). Sequence lengths and micro-batches: ``recipe_workload``. The actor is
    planned with the reference policy (algorithm.reference_policy) and, for
    algorithm.advantage_estimator=gae, the critic on the same ranks; colocated rollout engines
    (rollout.placement=colocated) with ``plan_rollout``.

    Raises:
        moerl.config.ConfigError: the layout does not tile world_size (the recipe's check_world_size
            rules, batch divisibility included), no prompt length, too long a sample, precision.fp8 on a
            hardware.gpu without the FP8 recipe's tensor cores (``check_fp8_gpu``).
        moerl.errors.CLIError: a bad seq_length (--seq-length).
    """
    p = cfg.parallel
    if world_size is None:
        world_size = p.world_size or math.lcm(p.tp_size * p.pp_size, p.expert_tp_size * p.ep_size * p.pp_size)
    from moerl.config.errors import ConfigError

    try:
        dp = cfg.check_world_size(world_size, trainable=False)
    except ConfigError as e:  # the schema's tiling rules: give them the fix line run_entry prints
        if e.hint:
            raise
        raise ConfigError(" ".join(line.strip() for line in str(e).splitlines() if line.strip()),
                          key=e.key or "parallel.world_size",
                          hint=f"plan a world size this layout tiles (--world-size N or parallel.world_size=N; "
                          f"{world_size} given), or change the parallel.* sizes the message names") from e
    work = recipe_workload(cfg, dp, seq_length)
    check_fp8_gpu(cfg)
    hw = hardware_from_recipe(cfg)
    vocab, vocab_source = recipe_vocab(cfg)
    shape = ModelShape.from_recipe(cfg, vocab)
    memory = plan_memory(
        shape,
        world_size=world_size, tp_size=p.tp_size, pp_size=p.pp_size, ep_size=p.ep_size, etp_size=p.etp_size,
        sequence_parallel=p.sequence_parallel, use_distributed_optimizer=p.use_distributed_optimizer,
        recompute=p.recompute, params_dtype=cfg.model.params_dtype,
        seq_length=work.seq_length, micro_batch_size=work.micro_batch_size, num_microbatches=work.num_microbatches,
        flash_attention=flash_attention,
        num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage,
        pipeline_schedule=cfg.train.pipeline_schedule if p.pp_size > 1 else "1f1b",
        reference_policy=cfg.algorithm.reference_policy,
        critic=cfg.algorithm.advantage_estimator == "gae",
    )
    colocated = cfg.rollout.placement == "colocated"
    rollout = plan_rollout(cfg, shape, world_size, work.sample_tokens, hw) if colocated else None
    prec = getattr(cfg, "precision", None)
    fp8 = f"{prec.fp8} ({prec.fp8_recipe})" if prec is not None and prec.fp8 else ""
    return RecipePlan(recipe, memory, work, hw, rollout, cfg.rollout.placement, vocab, vocab_source, fp8)
