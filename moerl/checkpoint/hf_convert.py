"""Qwen3-MoE weights: Hugging Face (on-disk / SGLang naming) <-> Megatron-Core GPTModel.

HF side (what ``save_pretrained`` writes and SGLang loads)::

    model.embed_tokens.weight                               [V, H]
    model.layers.{l}.input_layernorm.weight                 [H]
    model.layers.{l}.self_attn.{q,k,v,o}_proj.weight        [nh*d, H] [nkv*d, H] [nkv*d, H] [H, nh*d]
    model.layers.{l}.self_attn.{q,k}_norm.weight            [d]
    model.layers.{l}.post_attention_layernorm.weight        [H]
    model.layers.{l}.mlp.gate.weight                        [E, H]           (router)
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
    decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight  = [gate; up]  [2I, H]
    decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc2.weight  = down        [H, I]
    decoder.layers.{l}.mlp.linear_fc1 / linear_fc2 (dense layers), decoder.final_layernorm.weight

The conversion is a table of ``ParamRule`` (one per Megatron parameter) whose ``kind`` selects
a pair of pure functions (``_PACKERS``): HF tensors -> Megatron tensor and back. Each rule also
records how the tensor shards (``tp_dim``: the tensor-parallel split dim, ``expert``: the global
expert index for expert parallelism, ``layer``: the global layer for pipeline stages), so that
TP/EP/PP slicing can be added per kind later. Only tp = ep = pp = 1 is implemented now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import torch

from moerl.models.qwen3_moe import hf_head_dim, hf_moe_layer_pattern, hf_num_experts

__all__ = [
    "ParamRule",
    "conversion_rules",
    "fused_experts_to_per_expert",
    "hf_to_megatron",
    "iter_hf_names",
    "load_megatron_state_dict",
    "megatron_to_hf",
    "strip_wrapper_prefix",
]

_EXTRA_STATE = "_extra_state"


@dataclass(frozen=True)
class ParamRule:
    """One Megatron parameter and the HF tensors it is made of.

    Attributes:
        mcore_key: Megatron state-dict key (unsharded, global layer/expert numbering).
        hf_keys: HF keys (on-disk naming) in the order the packer takes them.
        kind: "copy" | "qkv" | "gate_up" (selects the packer pair).
        tp_dim: dim split across TP ranks (0 column-parallel, 1 row-parallel, None replicated).
        layer: global decoder layer index (None outside the decoder).
        expert: global expert index (None for non-expert parameters).
    """

    mcore_key: str
    hf_keys: tuple[str, ...]
    kind: str
    tp_dim: Optional[int] = None
    layer: Optional[int] = None
    expert: Optional[int] = None


def _attn_dims(hf_config) -> tuple[int, int, int]:
    nh, nkv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if nh % nkv != 0:
        raise ValueError(f"num_attention_heads={nh} must be a multiple of num_key_value_heads={nkv}")
    return nh, nkv, hf_head_dim(hf_config)


def _pack_qkv(tensors: list[torch.Tensor], hf_config) -> torch.Tensor:
    """[q (nh*d, H), k (nkv*d, H), v (nkv*d, H)] -> Megatron linear_qkv ((nh + 2 nkv) d, H),
    packed per query group: [q heads of group g; k_g; v_g] for g = 0..nkv-1."""
    q, k, v = tensors
    nh, nkv, d = _attn_dims(hf_config)
    hidden = q.shape[-1]
    per = nh // nkv
    _expect_shape("q_proj", q, (nh * d, hidden))
    _expect_shape("k_proj", k, (nkv * d, hidden))
    _expect_shape("v_proj", v, (nkv * d, hidden))
    packed = torch.cat(
        [q.reshape(nkv, per * d, hidden), k.reshape(nkv, d, hidden), v.reshape(nkv, d, hidden)], dim=1
    )
    return packed.reshape(nkv * (per + 2) * d, hidden)


def _unpack_qkv(packed: torch.Tensor, hf_config) -> list[torch.Tensor]:
    """Inverse of ``_pack_qkv``: Megatron linear_qkv -> [q, k, v] (HF q_proj/k_proj/v_proj)."""
    nh, nkv, d = _attn_dims(hf_config)
    per = nh // nkv
    hidden = packed.shape[-1]
    _expect_shape("linear_qkv", packed, ((nh + 2 * nkv) * d, hidden))
    grouped = packed.reshape(nkv, (per + 2) * d, hidden)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return [
        q.reshape(nh * d, hidden).contiguous(),
        k.reshape(nkv * d, hidden).contiguous(),
        v.reshape(nkv * d, hidden).contiguous(),
    ]


def _pack_gate_up(tensors: list[torch.Tensor], hf_config) -> torch.Tensor:
    """[gate (I, H), up (I, H)] -> Megatron SwiGLU linear_fc1 [gate; up] (2I, H)."""
    gate, up = tensors
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} differ in shape")
    return torch.cat([gate, up], dim=0)


def _unpack_gate_up(fc1: torch.Tensor, hf_config) -> list[torch.Tensor]:
    """Inverse of ``_pack_gate_up``: linear_fc1 (2I, H) -> [gate (I, H), up (I, H)]."""
    if fc1.shape[0] % 2 != 0:
        raise ValueError(f"linear_fc1 has an odd number of rows {fc1.shape[0]}; expected [gate; up]")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return [gate.contiguous(), up.contiguous()]


def _copy_in(tensors: list[torch.Tensor], hf_config) -> torch.Tensor:
    return tensors[0]


def _copy_out(tensor: torch.Tensor, hf_config) -> list[torch.Tensor]:
    return [tensor]


# kind -> (HF tensors -> Megatron tensor, Megatron tensor -> HF tensors)
_PACKERS: dict[str, tuple[Callable, Callable]] = {
    "copy": (_copy_in, _copy_out),
    "qkv": (_pack_qkv, _unpack_qkv),
    "gate_up": (_pack_gate_up, _unpack_gate_up),
}


def _expect_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} from the HF config")


def conversion_rules(hf_config) -> list[ParamRule]:
    """All parameter rules for an unsharded Qwen3-MoE model (tp = ep = pp = 1), in model order."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    pattern = hf_moe_layer_pattern(hf_config)
    num_experts = hf_num_experts(hf_config)
    rules = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", tp_dim=0)]
    for l, is_moe in enumerate(pattern):
        hf = f"model.layers.{l}."
        mc = f"decoder.layers.{l}."
        rules += [
            ParamRule(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "copy", layer=l),
            ParamRule(
                mc + "self_attention.linear_qkv.weight",
                tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
                "qkv",
                tp_dim=0,
                layer=l,
            ),
            ParamRule(mc + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",), "copy", layer=l),
            ParamRule(mc + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",), "copy", layer=l),
            ParamRule(mc + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "copy", tp_dim=1, layer=l),
            ParamRule(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "copy", layer=l),
        ]
        if is_moe:
            rules.append(ParamRule(mc + "mlp.router.weight", (hf + "mlp.gate.weight",), "copy", layer=l))
            for e in range(num_experts):
                he = hf + f"mlp.experts.{e}."
                me = mc + f"mlp.experts.local_experts.{e}."
                rules += [
                    ParamRule(
                        me + "linear_fc1.weight",
                        (he + "gate_proj.weight", he + "up_proj.weight"),
                        "gate_up",
                        tp_dim=0,
                        layer=l,
                        expert=e,
                    ),
                    ParamRule(me + "linear_fc2.weight", (he + "down_proj.weight",), "copy", tp_dim=1, layer=l, expert=e),
                ]
        else:
            rules += [
                ParamRule(
                    mc + "mlp.linear_fc1.weight",
                    (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                    "gate_up",
                    tp_dim=0,
                    layer=l,
                ),
                ParamRule(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "copy", tp_dim=1, layer=l),
            ]
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
    if not tied:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "copy", tp_dim=0))
    return rules


_FUSED_GATE_UP = ".mlp.experts.gate_up_proj"
_FUSED_DOWN = ".mlp.experts.down_proj"


def fused_experts_to_per_expert(hf_state_dict: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """Rewrite transformers 5's fused in-memory expert tensors into on-disk per-expert keys.

    ``model.layers.{l}.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first, then up) ->
    ``...experts.{e}.gate_proj.weight`` [I, H] and ``...experts.{e}.up_proj.weight`` [I, H];
    ``model.layers.{l}.mlp.experts.down_proj`` [E, H, I] -> ``...experts.{e}.down_proj.weight``.
    Other keys pass through. The results are views of the inputs (no copy).

    Raises:
        ValueError: a fused tensor's expert dimension differs from the config's num_experts.
    """
    num_experts = hf_num_experts(hf_config)
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if key.endswith(_FUSED_GATE_UP):
            prefix = key[: -len("gate_up_proj")]
            if value.dim() != 3 or value.shape[0] != num_experts or value.shape[1] % 2:
                raise ValueError(f"{key} has shape {tuple(value.shape)}, expected [{num_experts}, 2I, H]")
            gate, up = torch.chunk(value, 2, dim=1)
            for e in range(num_experts):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif key.endswith(_FUSED_DOWN):
            prefix = key[: -len("down_proj")]
            if value.dim() != 3 or value.shape[0] != num_experts:
                raise ValueError(f"{key} has shape {tuple(value.shape)}, expected [{num_experts}, H, I]")
            for e in range(num_experts):
                out[f"{prefix}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """Convert a Qwen3-MoE HF state dict to an unsharded Megatron GPTModel state dict.

    Args:
        hf_state_dict: HF tensors, on-disk per-expert keys or transformers 5 fused in-memory keys
            (``model.state_dict()``); a tied model's ``lm_head.weight`` may be present and must
            equal the embedding.
        hf_config: the model's Qwen3MoeConfig.

    Returns:
        dict mcore_key -> tensor (no ``_extra_state`` entries); load it with
        ``load_megatron_state_dict``. Tensors keep the input dtype; QKV and fc1 are new tensors,
        the rest may share storage with the input.

    Raises:
        ValueError: missing or unexpected HF keys (listed), or shapes that contradict the config.
    """
    sd = fused_experts_to_per_expert(hf_state_dict, hf_config)
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" in sd:
        lm_head = sd.pop("lm_head.weight")
        embed = sd.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(lm_head, embed):
            raise ValueError("tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight")
    rules = conversion_rules(hf_config)
    needed = {k for r in rules for k in r.hf_keys}
    missing = sorted(needed - set(sd))
    unexpected = sorted(set(sd) - needed)
    if missing or unexpected:
        raise ValueError(
            f"HF state dict does not match the Qwen3-MoE config: missing {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''} ({len(missing)}), unexpected {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''} ({len(unexpected)})"
        )
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        to_mcore, _ = _PACKERS[rule.kind]
        out[rule.mcore_key] = to_mcore([sd[k] for k in rule.hf_keys], hf_config)
    return out


def strip_wrapper_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop leading ``module.`` prefixes added by Megatron DDP / Float16Module wrappers."""
    out = {}
    for key, value in state_dict.items():
        while key.startswith("module."):
            key = key[len("module."):]
        out[key] = value
    return out


def megatron_to_hf(mcore_state_dict: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """Convert an unsharded Megatron GPTModel state dict to HF on-disk / SGLang names.

    Args:
        mcore_state_dict: ``model.state_dict()`` of the GPTModel (``module.`` wrapper prefixes and
            ``_extra_state`` entries are ignored).
        hf_config: the model's Qwen3MoeConfig.

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
    rules = conversion_rules(hf_config)
    needed = {r.mcore_key for r in rules}
    missing = sorted(needed - set(sd))
    unexpected = sorted(set(sd) - needed)
    if missing or unexpected:
        raise ValueError(
            f"Megatron state dict does not match the Qwen3-MoE config: missing {missing[:20]} "
            f"({len(missing)}), unexpected {unexpected[:20]} ({len(unexpected)}); only unsharded "
            "(tp=ep=pp=1) state dicts are supported"
        )
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        _, to_hf = _PACKERS[rule.kind]
        for key, tensor in zip(rule.hf_keys, to_hf(sd[rule.mcore_key], hf_config)):
            out[key] = tensor.contiguous()
    return out


def load_megatron_state_dict(model: torch.nn.Module, mcore_state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a converted state dict into a GPTModel strictly.

    Every model key must be provided except Megatron's ``_extra_state`` entries, and no extra
    key is accepted. Values are copied into the existing parameters (dtype/device of the model).

    Raises:
        ValueError: missing or unexpected keys (listed) or shape mismatches.
    """
    model_sd = model.state_dict()
    wanted = {k for k in model_sd if not k.endswith(_EXTRA_STATE)}
    given = {k for k in mcore_state_dict if not k.endswith(_EXTRA_STATE)}
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
    bad_missing = [k for k in result.missing_keys if not k.endswith(_EXTRA_STATE)]
    if bad_missing or result.unexpected_keys:
        raise ValueError(
            f"load_state_dict reported missing {bad_missing}, unexpected {result.unexpected_keys}"
        )


def iter_hf_names(hf_config) -> Iterable[str]:
    """HF (on-disk) tensor names of the model in conversion order (for weight-sync buckets)."""
    for rule in conversion_rules(hf_config):
        yield from rule.hf_keys
