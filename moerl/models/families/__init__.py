"""Model-family registry: one module per Hugging Face ``model_type`` (issue #16).

A :class:`ModelFamily` bundles everything moerl needs to know about one architecture, in the manner of
Megatron-Bridge's model bridges (one bridge per HF architecture: config mapping, layer spec, weight
mapping): the HF config class, the Megatron-Core ``TransformerConfig`` and layer spec it maps to, the
weight mapping both ways with its TP / EP / PP shard rules (a list of :class:`ParamRule`), the layer
pattern (dense / MoE), and the router facts of the rollout reference (what transformers' forward of
that architecture computes). The converter (moerl.checkpoint.hf_convert, tools/convert_checkpoint.py),
the model builder (moerl.models.gpt.build_gpt_model, used by the actor), the memory planner
(moerl.parallel.memory_model) and the reference rollout server (moerl.rollout.engine_weights) look the
family up here by ``model_type``.

Registered families (each module registers itself when imported; :func:`get_family` imports the
built-in ones on first use):

==============  ==================================  ============================================
model_type      module                              router
==============  ==================================  ============================================
qwen3_moe       moerl.models.families.qwen3_moe     softmax top-k (norm_topk_prob), QK RMSNorm
mixtral         moerl.models.families.mixtral       softmax top-k renormalised, no QK-norm
deepseek_v3     moerl.models.families.deepseek_v3   (another engineer's module; registered when present)
==============  ==================================  ============================================

Adding a family: write ``moerl/models/families/<model_type>.py`` that builds a ``ModelFamily`` and calls
:func:`register` at import, and add the module name to ``_BUILTIN_MODULES``. Shared building blocks
(GQA attention rules, the GPT block spec, the common ``TransformerConfig`` fields, the packers) are in
:mod:`moerl.models.families.common`.

Interface extensions beyond the first sketch (all documented on :class:`ModelFamily`):
``hf_disk_names`` (on-disk <-> transformers names, for the reference server's weight updates and for
transformers 5's fused in-memory experts), ``shard_checks`` (the sizes tp / ep / etp must divide),
``check_hf_config`` (features the family's builder does not map), ``gpt_model_kwargs`` (GPTModel
arguments such as the RoPE base), ``planner_shape`` (moerl.parallel.memory_model.ModelShape fields),
``value_head_arch`` (the transformers class of a critic's HF export).

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from moerl.errors import ModelError

__all__ = [
    "ModelFamily",
    "NameMap",
    "ParamRule",
    "RouterFacts",
    "check_divisible",
    "get_family",
    "model_type_of",
    "register",
    "supported_model_types",
    "supported_summary",
]


@dataclass(frozen=True)
class ParamRule:
    """One Megatron parameter and the HF tensors it is made of.

    Attributes:
        mcore_key: Megatron state-dict key (unsharded, global layer/expert numbering).
        hf_keys: HF keys (on-disk naming) in the order the packer takes them.
        kind: the packer pair (moerl.models.families.common.PACKERS): "copy" | "qkv" | "gate_up" or one a
            family registered with ``common.register_packer``.
        tp_dim: dim split across TP ranks (0 column-parallel, 1 row-parallel, None replicated).
        layer: global decoder layer index (None outside the decoder).
        expert: global expert index (None for non-expert parameters; expert parallelism places expert
            ``e`` on EP rank ``e // (E / ep)`` and splits it over the expert-TP group).
        tied_copy: True for ``output_layer.weight`` on the last pipeline stage of a model with
            tied embeddings and pp > 1 (a copy of the embedding, skipped when exporting).
    """

    mcore_key: str
    hf_keys: tuple[str, ...]
    kind: str
    tp_dim: Optional[int] = None
    layer: Optional[int] = None
    expert: Optional[int] = None
    tied_copy: bool = False  # the last stage's copy of a tied embedding (pp > 1); not exported


@dataclass(frozen=True)
class RouterFacts:
    """What a family's router computes, as the rollout reference (transformers' forward) implements it.

    Attributes:
        score_function: "softmax" or "sigmoid" (scores of all E experts from the router logits).
        topk: experts per token.
        normalize_topk: the k selected scores are renormalised to sum to 1 (Qwen3 ``norm_topk_prob``,
            Mixtral always, DeepSeek-V3 ``norm_topk_prob``). With softmax scores this equals a softmax
            over the top-k logits (Megatron ``moe_router_pre_softmax=False``).
        expert_bias: a per-expert bias (``e_score_correction_bias``) is added to the scores for the
            selection only (aux-loss-free balancing, arXiv 2408.15664).
        num_groups, group_topk: group-limited routing (DeepSeek-V3 ``n_group`` / ``topk_group``); None
            when not used.
        scaling_factor: the routing weights are multiplied by it (DeepSeek-V3 ``routed_scaling_factor``);
            None = 1.
        reference_implements: the reference rollout server (transformers) computes exactly this router,
            so RL may use it (the trainer and the servers agree on routing).
    """

    score_function: str
    topk: int
    normalize_topk: bool
    expert_bias: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None
    reference_implements: bool = True


@dataclass(frozen=True)
class NameMap:
    """HF on-disk tensor names <-> the names transformers' module tree uses in memory, per expert.

    transformers 5 keeps the experts of an MoE layer fused in memory (``mlp.experts.gate_up_proj``
    [E, 2I, H], gate rows first; ``mlp.experts.down_proj`` [E, H, I]) and renames some modules on load
    (Mixtral: on disk ``block_sparse_moe.*`` with experts ``w1`` / ``w3`` / ``w2``, in memory ``mlp.*``).
    The *canonical* per-expert names are the in-memory prefix with ``experts.{e}.{gate,up,down}_proj.weight``.

    Attributes:
        to_canonical: ``(regex, replacement)`` pairs applied in order (``re.sub``) to turn an on-disk name
            into the canonical one; empty = identical names (Qwen3-MoE).
        to_disk: the inverse pairs (canonical -> on-disk).
    """

    to_canonical: tuple[tuple[str, str], ...] = ()
    to_disk: tuple[tuple[str, str], ...] = ()

    def canonical(self, name: str) -> str:
        """The canonical (transformers in-memory, per-expert) name of on-disk ``name``."""
        for pattern, repl in self.to_canonical:
            name = re.sub(pattern, repl, name)
        return name

    def disk(self, name: str) -> str:
        """The on-disk name of canonical ``name`` (inverse of :meth:`canonical`)."""
        for pattern, repl in self.to_disk:
            name = re.sub(pattern, repl, name)
        return name


def _no_check(hf_config) -> None:
    return None


@dataclass(frozen=True)
class ModelFamily:
    """One model architecture (HF ``model_type``) and how moerl trains, converts, plans and serves it.

    Every callable takes the family's transformers config object (``hf_config``).

    Attributes:
        model_type: HF ``config.json`` ``model_type`` (registry key), e.g. "qwen3_moe".
        name: display name, e.g. "Qwen3-MoE".
        hf_config_cls: ``() -> type``: the transformers config class (imported lazily).
        make_hf_config: ``(fields: Mapping) -> config``: the HF config from recipe fields; raises ValueError
            naming the field.
        transformer_config_from_hf: ``(hf_config, *, moe_aux_loss_coeff, moe_router_load_balancing_type,
            params_dtype, tp_size, pp_size, ep_size, etp_size, sequence_parallel, layer_spec, **overrides)
            -> megatron.core.transformer.TransformerConfig``.
        layer_spec: ``(hf_config, transformer_config, layer_spec_kind: "local" | "transformer_engine",
            vp_stage=None) -> ModuleSpec`` (a TransformerBlockSubmodules block spec for GPTModel).
        conversion_rules: ``(hf_config, expert_bias=False, head="lm", layer_spec="local") ->
            list[ParamRule]``: the unsharded model's parameters in model order (HF on-disk names <->
            Megatron names, packer kind, TP split dim, global layer and expert).
        moe_layer_pattern: ``(hf_config) -> list[int]``, one per decoder layer: 1 = MoE, 0 = dense MLP.
        num_experts: ``(hf_config) -> int`` routed experts per MoE layer.
        router: ``(hf_config) -> RouterFacts``.
        shard_checks: ``(hf_config) -> list[(field, value, size_name)]``: each ``value`` must be divisible
            by the layout's ``size_name`` ("tp_size" | "ep_size" | "etp_size") to shard the model.
        expert_ffn_size: ``(hf_config) -> int`` width I of one routed expert.
        dense_ffn_size: ``(hf_config) -> int`` width of the dense MLP layers (== expert width when the
            family has none).
        hf_disk_names: :class:`NameMap` on-disk <-> canonical per-expert names.
        check_hf_config: ``(hf_config) -> None``; raises ValueError naming a config field whose feature
            the family's builder does not map (before any model is built).
        gpt_model_kwargs: ``(hf_config, transformer_config) -> dict`` extra GPTModel arguments
            (position_embedding_type, rotary_base, ...), see moerl.models.gpt.build_gpt_model.
        planner_shape: ``(hf_config) -> dict`` of moerl.parallel.memory_model.ModelShape fields.
        value_head_arch: transformers class name of a value model (critic) export
            (``<Family>ForTokenClassification`` with num_labels=1); None = no value head.
    """

    model_type: str
    name: str
    hf_config_cls: Callable[[], type]
    make_hf_config: Callable[[Mapping[str, Any]], Any]
    transformer_config_from_hf: Callable[..., Any]
    layer_spec: Callable[..., Any]
    conversion_rules: Callable[..., list]
    moe_layer_pattern: Callable[[Any], list]
    num_experts: Callable[[Any], int]
    router: Callable[[Any], RouterFacts]
    shard_checks: Callable[[Any], list]
    expert_ffn_size: Callable[[Any], int]
    dense_ffn_size: Callable[[Any], int]
    gpt_model_kwargs: Callable[[Any, Any], dict]
    planner_shape: Callable[[Any], dict]
    hf_disk_names: NameMap = field(default_factory=NameMap)
    check_hf_config: Callable[[Any], None] = _no_check
    value_head_arch: Optional[str] = None


_REGISTRY: dict[str, ModelFamily] = {}
# built-in family modules, imported by get_family on first use (a missing module is skipped)
_BUILTIN_MODULES = ("qwen3_moe", "mixtral", "deepseek_v3")
_loaded = False


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the registry under ``family.model_type`` (replacing an earlier one of that type).

    Raises:
        TypeError: ``family`` is not a ModelFamily.
        ValueError: an empty model_type.
    """
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register expects a ModelFamily, got {type(family).__name__}")
    if not family.model_type:
        raise ValueError("ModelFamily.model_type is empty")
    _REGISTRY[family.model_type] = family
    return family


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN_MODULES:
        name = f"{__name__}.{mod}"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def supported_model_types() -> tuple[str, ...]:
    """The registered HF ``model_type`` values, sorted."""
    _load_builtins()
    return tuple(sorted(_REGISTRY))


def supported_summary() -> str:
    """``"mixtral (Mixtral), qwen3_moe (Qwen3-MoE)"``: the supported families for error messages."""
    _load_builtins()
    return ", ".join(f"{t} ({_REGISTRY[t].name})" for t in sorted(_REGISTRY))


def model_type_of(hf_config_or_model_type: Any) -> Optional[str]:
    """The ``model_type`` of a transformers config, a ``config.json`` mapping, or a string (itself)."""
    x = hf_config_or_model_type
    if isinstance(x, str):
        return x
    if isinstance(x, Mapping):
        return x.get("model_type")
    return getattr(x, "model_type", None)


def get_family(hf_config_or_model_type: Any, key: Optional[str] = None, file: Optional[str] = None) -> ModelFamily:
    """The registered family of a transformers config, a config.json mapping or a ``model_type`` string.

    Args:
        hf_config_or_model_type: what to look up.
        key: the recipe key / flag the model came from, named in the error (e.g. ``"--hf"``).
        file: the file it came from (e.g. the config.json path), named in the error.

    Raises:
        moerl.errors.ModelError (exit 2 at every entry point): the model_type is not registered; the
            message lists the supported model types.
    """
    _load_builtins()
    model_type = model_type_of(hf_config_or_model_type)
    family = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        where = f"{key}: " if key else ""
        raise ModelError(
            f"{where}model_type {model_type!r} is not supported; moerl builds these model families: "
            f"{supported_summary()}",
            key=key, file=file,
            hint="use a checkpoint / config of a supported family (config.json model_type), or add a family "
                 "module under moerl/models/families/")
    return family


def check_divisible(checks: Sequence[tuple[str, int, str]], sizes: Mapping[str, int]) -> None:
    """Raise ValueError for the first ``(field, value, size_name)`` whose value ``sizes[size_name]`` does
    not divide (the model cannot be cut into that layout)."""
    for name, value, size_name in checks:
        size = sizes[size_name]
        if value % size:
            raise ValueError(f"{name}={value} is not divisible by {size_name}={size}; cannot shard the model")
