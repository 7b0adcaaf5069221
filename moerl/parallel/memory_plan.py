"""Per-rank memory planner for a recipe's parallel layout (``moerl plan RECIPE.yaml``).

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

The estimate leaves out framework buffers (NCCL, CUDA context ~0.5-1 GiB, allocator
fragmentation) and the rollout engine; keep 10-20 % headroom.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from moerl.parallel.layout import pipeline_layer_range

__all__ = [
    "MLAShape",
    "ModelShape",
    "MemoryPlan",
    "StagePlan",
    "rank_param_counts",
    "plan_memory",
    "plan_from_recipe",
    "format_plan",
    "main",
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

    @classmethod
    def from_hf_config(cls, hf_config, shared_expert_intermediate_size: int = 0, mla: Optional[MLAShape] = None):
        """From a transformers Qwen3MoeConfig (or any object with the same fields)."""
        from moerl.models.qwen3_moe import hf_head_dim, hf_moe_layer_pattern, hf_num_experts

        return cls(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_key_value_heads=hf_config.num_key_value_heads,
            head_dim=hf_head_dim(hf_config),
            vocab_size=hf_config.vocab_size,
            num_experts=hf_num_experts(hf_config),
            num_experts_per_tok=hf_config.num_experts_per_tok,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            intermediate_size=getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size,
            moe_layers=tuple(bool(x) for x in hf_moe_layer_pattern(hf_config)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            shared_expert_intermediate_size=shared_expert_intermediate_size,
            mla=mla,
        )

    @classmethod
    def from_recipe(cls, cfg, vocab_size: int):
        """From a RecipeConfig's model section (vocab_size resolved by the caller)."""
        hf = cfg.model.hf_config
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
        return (nh + 2 * nkv) * d * h // tp + nh * d * h // tp + h + 2 * d
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
    """Bytes per rank of one pipeline stage (all ranks of a stage are alike)."""

    pp_rank: int
    layers: int
    params_dense: int
    params_expert: int
    weights: float
    grads: float
    optimizer: float
    activations: dict[str, float]  # recompute mode -> bytes
    in_flight: int

    @property
    def params(self) -> int:
        return self.params_dense + self.params_expert

    def total(self, recompute: str) -> float:
        return self.weights + self.grads + self.optimizer + self.activations[recompute]


@dataclass
class MemoryPlan:
    """The planner's result (``plan_memory``); ``stages`` has one entry per pipeline stage."""

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

    def worst(self, recompute: Optional[str] = None) -> StagePlan:
        mode = recompute or self.recompute
        return max(self.stages, key=lambda st: st.total(mode))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for st, sd in zip(self.stages, d["stages"]):
            sd["total"] = {m: st.total(m) for m in st.activations}
        return d


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
        num_microbatches: per optimizer step and DP rank (bounds the 1F1B micro-batches in flight);
            default pp_size.
        flash_attention: no S x S softmax kept (Transformer Engine / flash attention on GPU).
        num_layers_in_first/last_pipeline_stage: uneven pipeline split.

    Returns:
        MemoryPlan (bytes per rank, per pipeline stage).

    Raises:
        ValueError: an impossible layout (same rules as the recipe's check_world_size) or an
            unknown recompute mode / dtype.
    """
    from types import SimpleNamespace

    s = _as_shape(model)
    etp = tp_size if etp_size is None else etp_size
    if recompute not in ("none", "full", "selective"):
        raise ValueError(f"recompute must be 'none', 'full' or 'selective', got {recompute!r}")
    if params_dtype not in _DTYPE_BYTES:
        raise ValueError(f"params_dtype must be one of {sorted(_DTYPE_BYTES)}, got {params_dtype!r}")
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
    plan = MemoryPlan(
        world_size=world_size, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, etp_size=etp, dp_size=dp,
        expert_dp_size=edp, sequence_parallel=sp, use_distributed_optimizer=use_distributed_optimizer,
        recompute=recompute, params_dtype=params_dtype, seq_length=seq_length, micro_batch_size=micro_batch_size,
        num_microbatches=nmb, flash_attention=flash_attention, model_params=total_params(s),
    )
    for rank in range(pp_size):
        layout = SimpleNamespace(
            tp_size=tp_size, pp_size=pp_size, pp_rank=rank, ep_size=ep_size, etp_size=etp,
            num_layers_in_first_pipeline_stage=num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=num_layers_in_last_pipeline_stage,
        )
        counts = rank_param_counts(s, layout)
        layers = pipeline_layer_range(s.num_layers, pp_size, rank, num_layers_in_first_pipeline_stage,
                                      num_layers_in_last_pipeline_stage)
        opt_per_param = 8 + (4 if pbytes != 4 else 0)
        if use_distributed_optimizer:
            optimizer = opt_per_param * (counts["dense"] / dp + counts["expert"] / edp)
        else:
            optimizer = opt_per_param * counts["total"]
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
        in_flight = max(1, min(pp_size - rank, nmb))
        acts = {}
        for mode, elems in per_mb.items():
            b = elems * tokens * pbytes * in_flight
            if mode == "full":
                b += biggest * tokens * pbytes  # the layer being recomputed
            if rank == pp_size - 1:
                b += tokens * s.vocab_size / tp_size * (pbytes + 8)
            acts[mode] = b
        plan.stages.append(
            StagePlan(
                pp_rank=rank, layers=len(layers), params_dense=counts["dense"], params_expert=counts["expert"],
                weights=counts["total"] * pbytes, grads=counts["total"] * 4.0, optimizer=optimizer,
                activations=acts, in_flight=in_flight,
            )
        )
    return plan


# --------------------------------------------------------------------------------------------
# recipe + CLI
# --------------------------------------------------------------------------------------------


def _recipe_vocab_size(cfg) -> int:
    hf = cfg.model.hf_config
    if hf.vocab_size is not None:
        return hf.vocab_size
    import tempfile

    from moerl.data.tokenizer import build_tokenizer, load_tokenizer

    if cfg.data.tokenizer_path:
        return hf.resolve_vocab_size(len(load_tokenizer(cfg.data.tokenizer_path)))
    with tempfile.TemporaryDirectory() as tmp:
        return hf.resolve_vocab_size(len(build_tokenizer(tmp)))


def plan_from_recipe(cfg, world_size: Optional[int] = None, seq_length: Optional[int] = None,
                     flash_attention: bool = True) -> MemoryPlan:
    """``plan_memory`` for a RecipeConfig.

    world_size: default parallel.world_size, else the smallest world the layout tiles
    (lcm(tp*pp, etp*ep*pp)). seq_length: default model.hf_config.max_position_embeddings (the
    longest prompt + response the model accepts). micro_batch_size and the micro-batches per step
    come from the train section (global_batch_size / (micro_batch_size * dp_size)).

    Raises:
        moerl.config.ConfigError: the layout does not tile world_size.
    """
    p = cfg.parallel
    if world_size is None:
        world_size = p.world_size or math.lcm(p.tp_size * p.pp_size, p.expert_tp_size * p.ep_size * p.pp_size)
    dp = cfg.layout_dp_size(world_size)
    t = cfg.train
    return plan_memory(
        ModelShape.from_recipe(cfg, _recipe_vocab_size(cfg)),
        world_size=world_size, tp_size=p.tp_size, pp_size=p.pp_size, ep_size=p.ep_size, etp_size=p.etp_size,
        sequence_parallel=p.sequence_parallel, use_distributed_optimizer=p.use_distributed_optimizer,
        recompute=p.recompute, params_dtype=cfg.model.params_dtype,
        seq_length=seq_length or cfg.model.hf_config.max_position_embeddings,
        micro_batch_size=t.micro_batch_size,
        num_microbatches=max(1, t.global_batch_size // (t.micro_batch_size * dp)),
        flash_attention=flash_attention,
        num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage,
    )


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def format_plan(plan: MemoryPlan, title: str = "") -> str:
    """Human-readable table of a MemoryPlan (GiB per rank)."""
    mp = plan.model_params
    opts = [f"params {plan.params_dtype}", "sequence parallel" if plan.sequence_parallel else "no sequence parallel",
            "distributed optimizer" if plan.use_distributed_optimizer else "replicated optimizer",
            "flash attention" if plan.flash_attention else "S x S attention probs kept"]
    lines = [
        f"moerl plan{': ' + title if title else ''}",
        f"model: {_count(mp['total'])} parameters ({_count(mp['active'])} active per token; experts {_count(mp['expert'])})",
        f"layout: world_size {plan.world_size} = tp {plan.tp_size} x pp {plan.pp_size} x dp {plan.dp_size}; "
        f"ep {plan.ep_size}, etp {plan.etp_size} (expert dp {plan.expert_dp_size}); " + ", ".join(opts),
        f"micro-batch: seq_length {plan.seq_length} x micro_batch_size {plan.micro_batch_size}, "
        f"{plan.num_microbatches} micro-batches per step per DP rank"
        + (" (1F1B: stage r holds min(pp - r, micro-batches) in flight)" if plan.pp_size > 1 else ""),
        "",
        "per rank, GiB  layers  params   weights    grads optimizer | activations: none selective     full"
        f" | total (recompute={plan.recompute})",
    ]
    for st in plan.stages:
        a = st.activations
        lines.append(
            f"pp stage {st.pp_rank:<4d} {st.layers:6d} {_count(st.params):>8s} {_gib(st.weights)} {_gib(st.grads)} "
            f"{_gib(st.optimizer)}  |       {_gib(a['none'])} {_gib(a['selective'])} {_gib(a['full'])} | "
            f"{_gib(st.total(plan.recompute))}"
        )
    worst = plan.worst()
    lines.append(f"peak: {worst.total(plan.recompute) / GIB:.2f} GiB per GPU (pp stage {worst.pp_rank}, "
                 f"{worst.in_flight} micro-batch(es) in flight); add ~10-20 % for buffers and fragmentation")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """``moerl plan RECIPE.yaml [key=value ...] [--world-size N] [--seq-length S] [--json]``."""
    parser = argparse.ArgumentParser(
        prog="moerl plan",
        description="Per-GPU memory (weights, gradients, Adam state, activations with/without recompute) of "
        "a recipe's parallel layout; dotted key=value pairs override recipe keys (e.g. parallel.tp_size=4).",
    )
    parser.add_argument("recipe", help="path to a recipe YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, key=value")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of GPUs (default: parallel.world_size, else the smallest the layout tiles)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="tokens per sequence (default: model.hf_config.max_position_embeddings)")
    parser.add_argument("--no-flash-attention", action="store_true",
                        help="count the S x S attention probabilities (local attention, as on CPU)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_intermixed_args(argv)
    from moerl.config.loader import ConfigError, load_config

    try:
        cfg = load_config(args.recipe, args.overrides)
        plan = plan_from_recipe(cfg, args.world_size, args.seq_length, flash_attention=not args.no_flash_attention)
    except (ConfigError, ValueError) as e:
        print(f"moerl plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan, args.recipe))
    return 0
