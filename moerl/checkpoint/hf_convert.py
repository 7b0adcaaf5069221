"""Model weights: Hugging Face (on-disk / SGLang naming) <-> Megatron-Core GPTModel, for every registered
model family (moerl.models.families; each family's ``conversion_rules`` gives the table, looked up by
``hf_config.model_type``: an unsupported model_type raises moerl.errors.ModelError listing the supported
ones). The names below are Qwen3-MoE's; Mixtral's differ in the MoE block (on disk
``model.layers.{l}.block_sparse_moe.gate.weight`` and ``...block_sparse_moe.experts.{e}.w1`` / ``w3`` /
``w2.weight`` = gate / up / down) and have no q/k norms.

HF side (what ``save_pretrained`` writes and SGLang loads)::

    model.embed_tokens.weight                               [V, H]
    model.layers.{l}.input_layernorm.weight                 [H]
    model.layers.{l}.self_attn.{q,k,v,o}_proj.weight        [nh*d, H] [nkv*d, H] [nkv*d, H] [H, nh*d]
    model.layers.{l}.self_attn.{q,k}_norm.weight            [d]
    model.layers.{l}.post_attention_layernorm.weight        [H]
    model.layers.{l}.mlp.gate.weight                        [E, H]           (router)
    model.layers.{l}.mlp.gate.e_score_correction_bias       [E] fp32 (only with the aux-loss-free
                                                            expert bias; DeepSeek-V3's HF name)
    model.layers.{l}.mlp.experts.{e}.{gate,up}_proj.weight  [I, H]
    model.layers.{l}.mlp.experts.{e}.down_proj.weight       [H, I]
    model.layers.{l}.mlp.{gate,up,down}_proj.weight         dense layers (mlp_only_layers)
    model.norm.weight                                       [H]
    lm_head.weight                                          [V, H]  (absent when tied)

transformers 5 keeps experts fused in memory (``model.state_dict()``):
``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``mlp.experts.down_proj`` [E, H, I];
``hf_to_megatron`` accepts both forms.

Megatron side (local layer spec)::

    embedding.word_embeddings.weight, output_layer.weight (absent when tied),
    decoder.layers.{l}.input_layernorm.weight,
    decoder.layers.{l}.self_attention.linear_qkv.weight   QKV packed per query group:
        for each of the nkv groups: [its nh/nkv query heads, its k head, its v head] x d rows
    decoder.layers.{l}.self_attention.{q,k}_layernorm.weight, .linear_proj.weight,
    decoder.layers.{l}.pre_mlp_layernorm.weight, .mlp.router.weight,
    decoder.layers.{l}.mlp.router.expert_bias  (a buffer; only with moe_router_enable_expert_bias)
    decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight  = [gate; up]  [2I, H]
    decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc2.weight  = down        [H, I]
    decoder.layers.{l}.mlp.linear_fc1 / linear_fc2 (dense layers), decoder.final_layernorm.weight

Megatron side (Transformer Engine spec, ``layer_spec="transformer_engine"``; see ``TE_NAMES``): the same
except ``decoder.layers.{l}.self_attention.linear_qkv.layer_norm_weight`` (the input RMSNorm, fused
into QKV) instead of ``input_layernorm.weight``; dense layers' ``mlp.linear_fc1.layer_norm_weight``
instead of ``pre_mlp_layernorm.weight`` (MoE layers keep it); TEGroupedMLP experts
``mlp.experts.linear_fc1.weight{e}`` / ``mlp.experts.linear_fc2.weight{e}`` (same tensors and TP
splits as ``local_experts.{e}``). Megatron -> HF functions read the spec from the keys.

The conversion is a table of ``ParamRule`` (one per Megatron parameter) whose ``kind`` selects
a pair of pure functions (``_PACKERS``): HF tensors -> Megatron tensor and back. Each rule also
records how the tensor shards (``tp_dim``: the tensor-parallel split dim, ``expert``: the global
expert index for expert parallelism, ``layer``: the global layer for pipeline stages).

Sharded models (``ShardLayout``: this rank's TP / expert-TP / EP / PP position). A rank's
GPTModel holds, with *local* numbering:

* ``embedding.word_embeddings.weight`` on the first pipeline stage only, rows
  ``[tp_rank * V/tp, (tp_rank + 1) * V/tp)`` (Megatron's VocabParallelEmbedding);
* ``output_layer.weight`` on the last stage only, the same vocabulary rows (ColumnParallelLinear);
  with tied embeddings and pp > 1 the last stage keeps a copy of the embedding under this name
  (Megatron keeps the two copies equal by all-reducing their gradients);
* ``decoder.layers.{i}`` for global layers ``offset + i`` of this stage (``pipeline_layer_range``:
  an even split, or Megatron's num_layers_in_first/last_pipeline_stage), and
  ``decoder.final_layernorm.weight`` on the last stage;
* ``mlp.experts.local_experts.{j}`` for global experts ``ep_rank * E/ep + j``;
* tensor-parallel slices: QKV (packed per query group) split on dim 0, so each rank holds whole
  query groups (nkv % tp == 0); SwiGLU fc1 = [gate_r; up_r] with gate and up each split on dim 0
  (not a split of the concatenation); linear_proj / fc2 split on dim 1; norms and the router are
  replicated. Expert weights split over the expert-TP group (etp) instead of TP.

Value models (``head="value"``, moerl.train.critic): the LM head is replaced by a scalar value head,
``output_layer.weight`` [1, H] and ``output_layer.bias`` [1] <-> HF ``score.weight`` / ``score.bias``
(``Qwen3MoeForTokenClassification`` with num_labels=1), replicated over TP, on the last pipeline
stage, never tied to the embedding. Every function below takes ``head`` ("lm" by default).

``hf_to_megatron(..., layout=...)`` cuts this rank's shard out of a full HF state dict;
``merge_megatron_shards`` (offline, all shards in one process) and ``gather_megatron_to_hf``
(collective, one shard per rank) put the full HF state dict back together bit for bit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from moerl.models.families import ParamRule, check_divisible, get_family
from moerl.models.families.common import HF_EXPERT_BIAS, MC_EXPERT_BIAS, PACKERS, TE_NAMES, unfuse_experts
from moerl.parallel.layout import pipeline_layer_range

__all__ = [
    "HEADS",
    "ParamRule",
    "check_head_and_spec",
    "ShardLayout",
    "LAYER_SPECS",
    "TE_NAMES",
    "conversion_rules",
    "detect_layer_spec",
    "fused_experts_to_per_expert",
    "gather_megatron_to_hf",
    "hf_to_megatron",
    "iter_hf_names",
    "load_megatron_state_dict",
    "megatron_to_hf",
    "merge_megatron_shards",
    "model_layer_spec",
    "rename_layer_spec",
    "pipeline_layer_range",
    "shard_rules",
    "strip_wrapper_prefix",
]

_EXTRA_STATE = "_extra_state"

# output heads of the converted model: "lm" (Qwen3MoeForCausalLM's lm_head) | "value" (the scalar head of a
# critic: Qwen3MoeForTokenClassification(num_labels=1)'s score layer)
HEADS = ("lm", "value")


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")


# kind -> (HF tensors -> Megatron tensor, Megatron tensor -> HF tensors): the same dict as
# moerl.models.families.common.PACKERS (families add kinds with common.register_packer)
_PACKERS = PACKERS


#: Megatron parameter names of the layer specs moerl builds (moerl.models.gpt.build_gpt_model, per model family)
LAYER_SPECS = ("local", "transformer_engine")

def _check_layer_spec(layer_spec: str) -> str:
    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"layer_spec must be one of {LAYER_SPECS}, got {layer_spec!r}")
    return layer_spec


def detect_layer_spec(keys: Iterable[str]) -> str:
    """The layer spec a Megatron state dict was written by: "transformer_engine" when any key is a TE
    fused norm (``...linear_qkv.layer_norm_weight``) or a TEGroupedMLP weight, else "local" (also for a
    pipeline stage without decoder layers, whose names are the same under both specs)."""
    for k in keys:
        if k.endswith(".self_attention.linear_qkv.layer_norm_weight") or ".mlp.experts.linear_fc1.weight" in k:
            return "transformer_engine"
    return "local"


def model_layer_spec(model: torch.nn.Module) -> str:
    """:func:`detect_layer_spec` of a built GPTModel's parameter names."""
    return detect_layer_spec(name for name, _ in model.named_parameters())


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)$")


def rename_layer_spec(state_dict: Mapping[str, torch.Tensor], dst: str) -> dict[str, torch.Tensor]:
    """The same state dict (whole or one rank's, any numbering) with its keys in layer spec ``dst``'s
    names (see :func:`conversion_rules`); tensors untouched (shared), other keys (``_extra_state``,
    wrapper prefixes) kept. Local -> TE: ``input_layernorm.weight`` ->
    ``self_attention.linear_qkv.layer_norm_weight``; ``pre_mlp_layernorm.weight`` of a dense layer (one
    with ``mlp.linear_fc1.weight``) -> ``mlp.linear_fc1.layer_norm_weight``;
    ``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`` -> ``mlp.experts.linear_fc{1,2}.weight{j}``;
    TE -> local is the inverse.

    Raises: ValueError for an unknown ``dst``."""
    _check_layer_spec(dst)
    out: dict[str, torch.Tensor] = {}
    ln_local, ln_te = ".input_layernorm.weight", "." + TE_NAMES["input_layernorm"]
    mlp_local, mlp_te = ".pre_mlp_layernorm.weight", "." + TE_NAMES["dense_pre_mlp_layernorm"]
    for key, value in state_dict.items():
        if dst == "transformer_engine":
            m = _LOCAL_EXPERT.match(key)
            if m:
                key = f"{m.group(1)}{m.group(3)}.weight{m.group(2)}"
            elif key.endswith(ln_local):
                key = key[: -len(ln_local)] + ln_te
            elif key.endswith(mlp_local) and key[: -len(mlp_local)] + ".mlp.linear_fc1.weight" in state_dict:
                key = key[: -len(mlp_local)] + mlp_te
        else:
            m = _TE_EXPERT.match(key)
            if m:
                key = f"{m.group(1)}local_experts.{m.group(3)}.{m.group(2)}.weight"
            elif key.endswith(ln_te):
                key = key[: -len(ln_te)] + ln_local
            elif key.endswith(mlp_te):
                key = key[: -len(mlp_te)] + mlp_local
        out[key] = value
    return out


def check_head_and_spec(head: str, layer_spec: str) -> str:
    """Validate a conversion's ``head`` ("lm" | "value") and ``layer_spec`` ("local" |
    "transformer_engine"); returns ``layer_spec``. Raises ValueError naming the allowed values."""
    _check_head(head)
    return _check_layer_spec(layer_spec)


def conversion_rules(hf_config, expert_bias: bool = False, head: str = "lm",
                     layer_spec: str = "local") -> list[ParamRule]:
    """All parameter rules for an unsharded model of ``hf_config``'s family (tp = ep = pp = 1), in model order:
    ``get_family(hf_config).conversion_rules`` (e.g. moerl.models.families.qwen3_moe.conversion_rules).

    ``layer_spec``: "local" | "transformer_engine" (Megatron names of that spec, :data:`TE_NAMES`);
    ``head``: "lm" | "value" (a value model's ``score`` head); ``expert_bias``: the routers' aux-loss-free
    bias ``mlp.router.expert_bias`` <-> HF ``...gate.e_score_correction_bias``.

    Raises:
        moerl.errors.ModelError: an unsupported model_type (lists the supported ones).
        ValueError: an unknown head or layer_spec.
    """
    check_head_and_spec(head, layer_spec)
    return get_family(hf_config).conversion_rules(hf_config, expert_bias=expert_bias, head=head,
                                                   layer_spec=layer_spec)


_MC_BIAS = MC_EXPERT_BIAS
_HF_BIAS = "gate." + HF_EXPERT_BIAS  # Qwen3 / DeepSeek mlp.gate..., Mixtral block_sparse_moe.gate...


def _has_bias(keys: Iterable[str], suffix: str) -> bool:
    """True when any key ends with ``suffix`` (the expert-bias tensors are present)."""
    return any(k.endswith(suffix) for k in keys)


def fused_experts_to_per_expert(hf_state_dict: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """Rewrite transformers' in-memory state dict (``model.state_dict()``) into on-disk per-expert keys.

    transformers 5 fuses the experts in memory: ``model.layers.{l}.mlp.experts.gate_up_proj`` [E, 2I, H]
    (gate rows first, then up) -> ``...experts.{e}.gate_proj.weight`` [I, H] and ``...experts.{e}.up_proj.weight``
    [I, H]; ``model.layers.{l}.mlp.experts.down_proj`` [E, H, I] -> ``...experts.{e}.down_proj.weight``
    (common.unfuse_experts); then the family's on-disk names are applied (``ModelFamily.hf_disk_names``:
    Qwen3-MoE none; Mixtral ``mlp.`` -> ``block_sparse_moe.``, gate / up / down -> ``w1`` / ``w3`` / ``w2``).
    Keys already in on-disk form pass through. The results are views of the inputs (no copy).

    Raises:
        moerl.errors.ModelError: an unsupported model_type.
        ValueError: a fused tensor's expert dimension differs from the config's num_experts.
    """
    family = get_family(hf_config)
    out = unfuse_experts(hf_state_dict, family.num_experts(hf_config))
    if not family.hf_disk_names.to_disk:
        return out
    return {family.hf_disk_names.disk(k): v for k, v in out.items()}


def hf_to_megatron(
    hf_state_dict: Mapping[str, torch.Tensor], hf_config, layout: Optional["ShardLayout"] = None, *,
    head: str = "lm", layer_spec: str = "local",
) -> dict[str, torch.Tensor]:
    """Convert an HF state dict (any registered family) to a Megatron GPTModel state dict (whole, or one rank's shard).

    Args:
        hf_state_dict: HF tensors, on-disk per-expert keys or transformers 5 fused in-memory keys
            (``model.state_dict()``); a tied model's ``lm_head.weight`` may be present and must
            equal the embedding.
        hf_config: the model's transformers config (a registered family, e.g. Qwen3MoeConfig).
        layout: this rank's ShardLayout (``ShardLayout.from_parallel_state()`` inside a job);
            None (or tp = ep = pp = 1) gives the unsharded state dict.
        head: "lm" | "value" (``score.weight`` / ``score.bias`` instead of ``lm_head.weight``; see
            :func:`conversion_rules`).
        layer_spec: "local" | "transformer_engine": the Megatron names to produce (see
            :func:`conversion_rules`; ``load_megatron_state_dict`` also renames local names for a TE model).

    Returns:
        dict mcore_key -> tensor (no ``_extra_state`` entries) with this rank's *local* keys
        (local layer and expert numbers, see the module docstring); load it with
        ``load_megatron_state_dict``. Tensors keep the input dtype; QKV, fc1 and TP slices are new
        tensors, the rest may share storage with the input.

    Raises:
        ValueError: missing or unexpected HF keys (listed), shapes that contradict the config, or
            a layout the model cannot be cut into (sizes not dividing heads/experts/layers/vocab).
    """
    _check_head(head)
    sd = fused_experts_to_per_expert(hf_state_dict, hf_config)
    if head == "lm" and getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" in sd:
        lm_head = sd.pop("lm_head.weight")
        embed = sd.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(lm_head, embed):
            raise ValueError("tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight")
    bias = _has_bias(sd, _HF_BIAS)  # expert bias given -> converted (see conversion_rules)
    rules = conversion_rules(hf_config, expert_bias=bias, head=head, layer_spec=layer_spec)
    known = {k for r in rules for k in r.hf_keys}
    if layout is None or layout.is_trivial:
        needed = known
    else:  # a shard needs only its own tensors; the others may be absent
        needed = {k for _, r, _, _ in shard_rules(hf_config, layout, expert_bias=bias, head=head,
                                                  layer_spec=layer_spec) for k in r.hf_keys}
    missing = sorted(needed - set(sd))
    unexpected = sorted(set(sd) - known)
    if missing or unexpected:
        raise ValueError(
            f"HF state dict does not match the {get_family(hf_config).name} config: missing {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''} ({len(missing)}), unexpected {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''} ({len(unexpected)})"
        )
    out: dict[str, torch.Tensor] = {}
    if layout is None or layout.is_trivial:
        for rule in rules:
            to_mcore, _ = _PACKERS[rule.kind]
            out[rule.mcore_key] = to_mcore([sd[k] for k in rule.hf_keys], hf_config)
        return out
    for local_key, rule, size, rank in shard_rules(hf_config, layout, expert_bias=bias, head=head,
                                                   layer_spec=layer_spec):
        to_mcore, _ = _PACKERS[rule.kind]
        full = to_mcore([sd[k] for k in rule.hf_keys], hf_config)
        out[local_key] = _tp_split(rule, full, size, rank)
    return out


def strip_wrapper_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop leading ``module.`` prefixes added by Megatron DDP / Float16Module wrappers."""
    out = {}
    for key, value in state_dict.items():
        while key.startswith("module."):
            key = key[len("module."):]
        out[key] = value
    return out


def megatron_to_hf(
    mcore_state_dict: Mapping[str, torch.Tensor], hf_config, *, head: str = "lm",
    layer_spec: Optional[str] = None,
) -> dict[str, torch.Tensor]:
    """Convert an unsharded Megatron GPTModel state dict to HF on-disk / SGLang names.

    Args:
        mcore_state_dict: ``model.state_dict()`` of the GPTModel (``module.`` wrapper prefixes and
            ``_extra_state`` entries are ignored).
        hf_config: the model's transformers config (a registered family, e.g. Qwen3MoeConfig).
        head: "lm" | "value" (see :func:`conversion_rules`).
        layer_spec: the names of ``mcore_state_dict``: "local" | "transformer_engine" | None (read
            from the keys, :func:`detect_layer_spec`).

    Returns:
        dict HF key -> tensor with per-expert keys ``mlp.experts.{e}.{gate,up,down}_proj.weight``
        and no ``lm_head.weight`` when embeddings are tied. Tensors are contiguous and detached
        but may share storage with the input (``save_hf_checkpoint`` copies when needed).

    Raises:
        ValueError: missing or unexpected Megatron keys (listed).
    """
    sd = {
        k: v.detach() if isinstance(v, torch.Tensor) else v
        for k, v in strip_wrapper_prefix(mcore_state_dict).items()
        if not k.endswith(_EXTRA_STATE)
    }
    spec = detect_layer_spec(sd) if layer_spec is None else layer_spec
    rules = conversion_rules(hf_config, expert_bias=_has_bias(sd, _MC_BIAS), head=head, layer_spec=spec)
    needed = {r.mcore_key for r in rules}
    missing = sorted(needed - set(sd))
    unexpected = sorted(set(sd) - needed)
    if missing or unexpected:
        raise ValueError(
            f"Megatron state dict does not match the {get_family(hf_config).name} config: missing {missing[:20]} "
            f"({len(missing)}), unexpected {unexpected[:20]} ({len(unexpected)}); this function takes an "
            "unsharded (tp=ep=pp=1) state dict: use gather_megatron_to_hf (in a job) or "
            "merge_megatron_shards (offline) for sharded ones"
        )
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        _, to_hf = _PACKERS[rule.kind]
        for key, tensor in zip(rule.hf_keys, to_hf(sd[rule.mcore_key], hf_config)):
            out[key] = tensor.contiguous()
    return out


def load_megatron_state_dict(model: torch.nn.Module, mcore_state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a converted state dict into a GPTModel strictly.

    A state dict in the other layer spec's names than the model's (:func:`detect_layer_spec`, e.g.
    ``hf_to_megatron``'s default local names for a Transformer Engine model) is renamed first
    (:func:`rename_layer_spec`).

    Every model key must be provided except Megatron's ``_extra_state`` entries and the routers'
    ``expert_bias`` buffers (a checkpoint without them, e.g. a Qwen3 HF model, leaves the bias at
    the model's value: zeros when built), and no extra key is accepted. Values are copied into the
    existing parameters (dtype/device of the model).

    Raises:
        ValueError: missing or unexpected keys (listed) or shape mismatches.
    """
    model_sd = model.state_dict()
    wanted = {k for k in model_sd if not k.endswith(_EXTRA_STATE)}
    spec = detect_layer_spec(wanted)
    if detect_layer_spec(mcore_state_dict) != spec:
        mcore_state_dict = rename_layer_spec(mcore_state_dict, spec)
    given = {k for k in mcore_state_dict if not k.endswith(_EXTRA_STATE)}
    wanted -= {k for k in wanted - given if k.endswith(_MC_BIAS)}  # optional: keep the model's bias
    missing, unexpected = sorted(wanted - given), sorted(given - wanted)
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for key in wanted:
        if tuple(model_sd[key].shape) != tuple(mcore_state_dict[key].shape):
            raise ValueError(
                f"{key}: checkpoint shape {tuple(mcore_state_dict[key].shape)} != model shape "
                f"{tuple(model_sd[key].shape)}"
            )
    result = model.load_state_dict({k: mcore_state_dict[k] for k in given}, strict=False)
    bad_missing = [k for k in result.missing_keys if not k.endswith(_EXTRA_STATE) and k in wanted]
    if bad_missing or result.unexpected_keys:
        raise ValueError(
            f"load_state_dict reported missing {bad_missing}, unexpected {result.unexpected_keys}"
        )


def iter_hf_names(hf_config, expert_bias: bool = False, head: str = "lm") -> Iterable[str]:
    """HF (on-disk) tensor names of the model in conversion order (for weight-sync buckets);
    ``expert_bias`` includes the routers' ``mlp.gate.e_score_correction_bias``; ``head``: see
    :func:`conversion_rules`."""
    for rule in conversion_rules(hf_config, expert_bias=expert_bias, head=head):
        yield from rule.hf_keys


# --------------------------------------------------------------------------------------------
# Sharded (TP / EP / PP) conversion
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """One rank's position in a Megatron-Core parallel layout (what its GPTModel holds).

    Attributes:
        tp_size, tp_rank: tensor parallelism of the dense (non-expert) weights.
        pp_size, pp_rank: pipeline stage.
        ep_size, ep_rank: expert parallelism (this rank holds experts
            ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``).
        etp_size, etp_rank: expert tensor parallelism (Megatron's expert_tensor_parallel_size;
            None means etp_size = tp_size and etp_rank = tp_rank, Megatron's default).
        num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage: Megatron's uneven
            pipeline split (None = even split), see ``pipeline_layer_range``.
    """

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: Optional[int] = None
    etp_rank: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None

    def __post_init__(self):
        if self.etp_size is None:
            object.__setattr__(self, "etp_size", self.tp_size)
        if self.etp_rank is None:
            object.__setattr__(self, "etp_rank", self.tp_rank if self.etp_size == self.tp_size else 0)
        for name in ("tp", "pp", "ep", "etp"):
            size, rank = getattr(self, f"{name}_size"), getattr(self, f"{name}_rank")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ShardLayout.{name}_size must be an int >= 1, got {size!r}")
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(f"ShardLayout.{name}_rank must be an int in [0, {size}), got {rank!r}")

    @property
    def is_trivial(self) -> bool:
        """True when nothing is split (tp = pp = ep = etp = 1)."""
        return self.tp_size == self.pp_size == self.ep_size == self.etp_size == 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def from_parallel_state(cls, config=None) -> "ShardLayout":
        """This process's layout from megatron ``parallel_state`` (1s when it is not initialised).

        Args:
            config: the model's TransformerConfig, to read an uneven pipeline split
                (num_layers_in_first/last_pipeline_stage); None = even split.
        """
        from megatron.core import parallel_state as ps

        first = getattr(config, "num_layers_in_first_pipeline_stage", None) if config is not None else None
        last = getattr(config, "num_layers_in_last_pipeline_stage", None) if config is not None else None
        if not ps.model_parallel_is_initialized():
            return cls(num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
        return cls(
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
        )


def _check_divisible(hf_config, layout: ShardLayout) -> None:
    check_divisible(get_family(hf_config).shard_checks(hf_config),
                    {"tp_size": layout.tp_size, "ep_size": layout.ep_size, "etp_size": layout.etp_size})


def shard_rules(hf_config, layout: ShardLayout, expert_bias: bool = False,
                head: str = "lm", layer_spec: str = "local") -> list[tuple[str, ParamRule, int, int]]:
    """The parameters one rank holds: ``(local mcore key, global rule, split size, split rank)``
    (``expert_bias``, ``head``, ``layer_spec``: see :func:`conversion_rules`; a value head lives on the
    last stage, replicated over TP; TEGroupedMLP's ``weight{e}`` is renumbered locally as
    ``local_experts.{e}`` is).

    The split size/rank are the TP ones for dense weights and the expert-TP ones for expert
    weights (1/0 for a replicated tensor). See the module docstring for the local numbering.

    Raises:
        ValueError: the model does not divide into ``layout`` (heads, vocabulary, experts,
            expert FFN width by tp/ep/etp; layers by pp).
    """
    _check_divisible(hf_config, layout)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    layers = pipeline_layer_range(
        hf_config.num_hidden_layers, layout.pp_size, layout.pp_rank,
        layout.num_layers_in_first_pipeline_stage, layout.num_layers_in_last_pipeline_stage,
    )
    per_rank = get_family(hf_config).num_experts(hf_config) // layout.ep_size
    experts = range(layout.ep_rank * per_rank, (layout.ep_rank + 1) * per_rank)
    out: list[tuple[str, ParamRule, int, int]] = []
    for rule in conversion_rules(hf_config, expert_bias=expert_bias, head=head, layer_spec=layer_spec):
        key = rule.mcore_key
        if rule.layer is None:
            if key.startswith("embedding.") and not layout.is_first_stage:
                continue
            if (key.startswith("output_layer.") or key.startswith("decoder.final_layernorm")) and not layout.is_last_stage:
                continue
        else:
            if rule.layer not in layers:
                continue
            key = key.replace(f"decoder.layers.{rule.layer}.", f"decoder.layers.{rule.layer - layers.start}.", 1)
        if rule.expert is not None:
            if rule.expert not in experts:
                continue
            if key.endswith(f".weight{rule.expert}"):  # TEGroupedMLP: mlp.experts.linear_fc{1,2}.weight{e}
                key = key[: -len(str(rule.expert))] + str(rule.expert - experts.start)
            else:
                key = key.replace(
                    f"local_experts.{rule.expert}.", f"local_experts.{rule.expert - experts.start}.", 1
                )
        if rule.tp_dim is None:
            size, rank = 1, 0
        elif rule.expert is not None:
            size, rank = layout.etp_size, layout.etp_rank
        else:
            size, rank = layout.tp_size, layout.tp_rank
        out.append((key, rule, size, rank))
    if head == "lm" and tied and layout.pp_size > 1 and layout.is_last_stage:
        copy = ParamRule("output_layer.weight", ("model.embed_tokens.weight",), "copy", tp_dim=0, tied_copy=True)
        out.append(("output_layer.weight", copy, layout.tp_size, layout.tp_rank))
    return out


def _tp_split(rule: ParamRule, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of a whole Megatron tensor (see the module docstring)."""
    if size == 1:
        return full
    if rule.kind == "gate_up":  # [gate; up] -> [gate_r; up_r]
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, dim=0)[rank], torch.chunk(up, size, dim=0)[rank]], dim=0)
    # QKV is packed per query group, so a dim-0 split hands each rank whole groups.
    return torch.chunk(full, size, dim=rule.tp_dim)[rank].clone()


def _tp_merge(rule: ParamRule, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``_tp_split``: the whole Megatron tensor from the slices in TP-rank order."""
    if len(pieces) == 1:
        return pieces[0]
    if rule.kind == "gate_up":
        halves = [torch.chunk(p, 2, dim=0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(pieces), dim=rule.tp_dim)


def merge_megatron_shards(shards: Mapping[ShardLayout, Mapping[str, torch.Tensor]], hf_config, *,
                          head: str = "lm") -> dict[str, torch.Tensor]:
    """Put the local state dicts of every rank of a layout back together as one HF state dict.

    Offline counterpart of ``gather_megatron_to_hf`` (all shards in one process, e.g. for a
    conversion tool or a test). Replicas (data-parallel copies, replicated tensors) are read from
    the first shard that has them.

    Args:
        shards: ShardLayout -> that rank's ``model.state_dict()`` (wrapper prefixes and
            ``_extra_state`` entries are ignored). Every tensor of the model must be covered.
        hf_config: the model's transformers config (a registered family, e.g. Qwen3MoeConfig).
        head: "lm" | "value" (see :func:`conversion_rules`).

    Returns:
        dict HF key -> tensor, as ``megatron_to_hf`` of the unsharded model.

    Raises:
        ValueError: a shard lacks a key its layout implies, or a tensor is not covered.
    """
    whole: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    rules: dict[str, ParamRule] = {}
    sizes: dict[str, int] = {}
    bias = any(_has_bias(sd, _MC_BIAS) for sd in shards.values())
    spec = "transformer_engine" if any(detect_layer_spec(sd) == "transformer_engine" for sd in shards.values()) \
        else "local"
    for layout, sd in shards.items():
        sd = strip_wrapper_prefix({k: v for k, v in sd.items() if not k.endswith(_EXTRA_STATE)})
        for local_key, rule, size, rank in shard_rules(hf_config, layout, expert_bias=bias, head=head,
                                                       layer_spec=spec):
            if rule.tied_copy:
                continue
            if local_key not in sd:
                raise ValueError(f"shard {layout} has no {local_key} (global {rule.mcore_key})")
            rules[rule.mcore_key], sizes[rule.mcore_key] = rule, size
            pieces.setdefault(rule.mcore_key, {}).setdefault(rank, sd[local_key].detach())
    for rule in conversion_rules(hf_config, expert_bias=bias, head=head, layer_spec=spec):
        got = pieces.get(rule.mcore_key, {})
        if sorted(got) != list(range(sizes.get(rule.mcore_key, 1))) or not got:
            raise ValueError(f"{rule.mcore_key}: shards cover TP ranks {sorted(got)} only")
        whole[rule.mcore_key] = _tp_merge(rule, [got[r] for r in range(len(got))])
    return megatron_to_hf(whole, hf_config, head=head, layer_spec=spec)


def gather_megatron_to_hf(
    mcore_state_dict: Mapping[str, torch.Tensor],
    hf_config,
    layout: Optional[ShardLayout] = None,
    *,
    dst: Optional[int] = None,
    head: str = "lm",
    out_alloc: Optional[Callable[[str, tuple, torch.dtype], torch.Tensor]] = None,
) -> dict[str, torch.Tensor]:
    """Collective: gather every rank's shard into the full HF state dict (weight sync / export).

    Every rank of the job must call it. Tensor-parallel slices are all-gathered in the TP group
    (expert slices in the expert-TP group) and unpacked to HF tensors (QKV per query group,
    fc1 -> gate/up); then each HF tensor is sent from the lowest global rank that holds it
    (pipeline stages, expert-parallel ranks) to every rank (``dst=None``, a broadcast over the
    world group) or only to global rank ``dst`` (point-to-point).

    Args:
        mcore_state_dict: this rank's ``model.state_dict()`` (local keys; wrapper prefixes and
            ``_extra_state`` entries are ignored).
        hf_config: the model's transformers config (a registered family, e.g. Qwen3MoeConfig).
        layout: this rank's ShardLayout; default ``ShardLayout.from_parallel_state()`` (even
            pipeline split).
        dst: None (every rank gets the result) or the global rank that does.
        head: "lm" | "value" (see :func:`conversion_rules`).
        out_alloc: where the returned tensors live: ``out_alloc(hf_key, shape, dtype)`` returns an
            uninitialised CPU tensor of that shape and dtype (e.g. moerl.rollout.shm_arena.ArenaSlot.alloc,
            shared memory) that the export copies the tensor into, instead of a private clone (the
            same one copy, bitwise the same values); called once per key, in conversion order, only on
            ranks that return tensors. None: private clones.

    Returns:
        dict HF key -> detached CPU tensor (a copy; ``out_alloc``'s when given), equal to
        ``megatron_to_hf`` of the unsharded model, in conversion order; an empty dict on ranks other
        than ``dst``.

    Raises:
        ValueError: a local key the layout implies is missing, or ``dst`` is out of range.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    layout = layout or ShardLayout.from_parallel_state()
    sd = strip_wrapper_prefix({k: v for k, v in mcore_state_dict.items() if not k.endswith(_EXTRA_STATE)})
    if not dist.is_initialized():
        if not layout.is_trivial:
            raise ValueError("a sharded layout needs torch.distributed to be initialised")
        return {k: _exported(k, v, out_alloc) for k, v in megatron_to_hf(sd, hf_config, head=head).items()}
    spec = detect_layer_spec(sd)  # a stage without decoder layers has the same names under both specs
    world, me = dist.get_world_size(), dist.get_rank()
    if dst is not None and not 0 <= dst < world:
        raise ValueError(f"dst={dst} is not a rank of the world of {world}")

    # 1. tensor-parallel all-gather, then HF names for what this rank holds
    owned: dict[str, torch.Tensor] = {}
    flags: list = [None] * world  # expert bias anywhere (a stage may hold no MoE layer)
    dist.all_gather_object(flags, _has_bias(sd, _MC_BIAS))
    bias = any(flags)
    for local_key, rule, size, _ in shard_rules(hf_config, layout, expert_bias=bias, head=head, layer_spec=spec):
        if rule.tied_copy:
            continue
        if local_key not in sd:
            raise ValueError(f"state dict has no {local_key} (global {rule.mcore_key}) for layout {layout}")
        t = sd[local_key].detach().contiguous()
        if size > 1:
            group = (
                ps.get_expert_tensor_parallel_group() if rule.expert is not None
                else ps.get_tensor_model_parallel_group()
            )
            bufs = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(bufs, t, group=group)
            t = _tp_merge(rule, bufs)
        _, to_hf = _PACKERS[rule.kind]
        for key, tensor in zip(rule.hf_keys, to_hf(t, hf_config)):
            owned[key] = tensor.contiguous()

    # 2. who owns what (name, shape, dtype), then move each tensor from its owner
    meta = {k: (tuple(v.shape), v.dtype) for k, v in owned.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, meta)
    device = next(iter(owned.values())).device if owned else torch.device("cpu")
    out: dict[str, torch.Tensor] = {}
    for key in iter_hf_names(hf_config, expert_bias=bias, head=head):
        src = next((r for r in range(world) if key in everyone[r]), None)
        if src is None:
            raise ValueError(f"no rank holds {key}; the shards do not cover the model")
        shape, dtype = everyone[src][key]
        if dst is None:
            buf = owned[key] if me == src else _recv_buffer(key, shape, dtype, device, out_alloc)
            dist.broadcast(buf, src=src)
            out[key] = _exported(key, buf, out_alloc) if me == src or buf.device.type != "cpu" else buf.cpu()
        elif src == dst:
            if me == dst:
                out[key] = _exported(key, owned[key], out_alloc)
        elif me == src:
            dist.send(owned[key], dst=dst)
        elif me == dst:
            buf = _recv_buffer(key, shape, dtype, device, out_alloc)
            dist.recv(buf, src=src)
            out[key] = _exported(key, buf, out_alloc) if buf.device.type != "cpu" else buf
    return out


def _exported(key: str, t: torch.Tensor, out_alloc) -> torch.Tensor:
    """The exported copy of ``t``: a private CPU clone, or ``out_alloc``'s tensor filled with it."""
    if out_alloc is None:
        return t.detach().cpu().clone() if t.device.type == "cpu" else t.detach().cpu()
    dst = out_alloc(key, tuple(t.shape), t.dtype)
    with torch.no_grad():
        dst.copy_(t.detach())
    return dst


def _recv_buffer(key: str, shape, dtype, device: torch.device, out_alloc) -> torch.Tensor:
    """Where rank ``dst`` receives ``key``: ``out_alloc``'s tensor when the group's device is the CPU
    (gloo receives straight into it: no second copy), else a fresh tensor on ``device``."""
    if out_alloc is not None and device.type == "cpu":
        return out_alloc(key, tuple(shape), dtype)
    return torch.empty(shape, dtype=dtype, device=device)
