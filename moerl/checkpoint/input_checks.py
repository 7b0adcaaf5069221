"""Start-up checks of checkpoint inputs, run before any model is built or file written.

* :func:`check_hf_model_dir`: an HF model directory (``model.init_from``, ``moerl serve --model-path``,
  ``convert_checkpoint.py --hf/--config``) exists, has a readable config.json of a registered model family
  (moerl.models.families; the error lists them).
* :func:`check_hf_tensors`: its safetensors hold exactly the tensors, with the shapes, that the config
  implies. Reference for the names and shapes: transformers' own model class for the config, built on
  the meta device (no memory), mapped to on-disk per-expert names by
  :func:`moerl.checkpoint.hf_convert.fused_experts_to_per_expert`. Only safetensors headers are read.
* :func:`checkpoint_model_shapes`: the model fields a Megatron torch_dist checkpoint was written for,
  from the global shapes in its ``.metadata`` (no tensor data read).

Every failure is a :class:`moerl.errors.ModelError` / :class:`moerl.errors.CheckpointError` naming the
key (recipe key or flag), the directory and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from moerl.errors import CheckpointError, ModelError

#: ``model_types`` default of :func:`check_hf_model_dir`: the model families moerl.models.families registers
REGISTERED = "registered"
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_SAFETENSORS_SINGLE = "model.safetensors"


def check_hf_model_dir(path: Any, key: str, model_types: Optional[tuple] | str = REGISTERED,
                       weights: bool = False) -> dict:
    """The parsed config.json of the HF model directory ``path`` given by ``key``.

    Args:
        model_types: accepted config.json ``model_type`` values: ``REGISTERED`` (default) the model families
            of moerl.models.families (qwen3_moe, mixtral, ...); None any (the reference rollout server serves
            any transformers causal LM); or a tuple.
        weights: also require safetensors weights (model.safetensors or its index).

    Raises:
        ModelError: ``path`` is not a directory, has no config.json, config.json is not a JSON object,
            its ``model_type`` is not in ``model_types``, or (``weights``) it holds no safetensors.
    """
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"{key}: no model directory at {path}", key=key, file=str(path),
                         hint=f"give {key} a local Hugging Face model directory (config.json + *.safetensors)")
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{key}: {path} has no config.json (not a Hugging Face model directory)", key=key,
                         file=str(cfg_path), hint=f"give {key} a directory written by save_pretrained")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{key}: {cfg_path} is not valid JSON ({e})", key=key, file=str(cfg_path),
                         hint="restore the checkpoint's config.json") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{key}: {cfg_path} is not a JSON object", key=key, file=str(cfg_path),
                         hint="restore the checkpoint's config.json")
    model_type = cfg.get("model_type")
    if model_types == REGISTERED:
        from moerl.models.families import supported_model_types, supported_summary

        model_types, summary = supported_model_types(), supported_summary()
    else:
        summary = ", ".join(model_types or ())
    if model_types is not None and model_type not in model_types:
        raise ModelError(
            f"{key}={path} is a {model_type!r} model (config.json model_type; architectures "
            f"{cfg.get('architectures')}); moerl builds these model families: {summary}",
            key=key, file=str(cfg_path), hint=f"point {key} at a checkpoint of a supported family")
    if weights and not any((p / n).is_file() for n in (_SAFETENSORS_SINGLE, _SAFETENSORS_INDEX)):
        raise ModelError(f"{key}: {path} has no {_SAFETENSORS_SINGLE} or {_SAFETENSORS_INDEX}", key=key,
                         file=str(path), hint="save the model with save_pretrained(safe_serialization=True)")
    return cfg


def hf_tensor_shapes(path: Any, key: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the safetensors of ``path`` (single file or index), headers only.

    Raises:
        ModelError: no safetensors weights, an index that is not JSON with a weight_map, or a file the
            index names is missing / unreadable.
    """
    from safetensors import safe_open

    p = Path(path)
    if (p / _SAFETENSORS_INDEX).is_file():
        try:
            files = sorted(set(json.loads((p / _SAFETENSORS_INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or no weight_map object
            raise ModelError(f"{key}: {p / _SAFETENSORS_INDEX} is not a safetensors index ({type(e).__name__}: {e})",
                             key=key, file=str(p / _SAFETENSORS_INDEX), hint="restore the checkpoint's index file") from None
    elif (p / _SAFETENSORS_SINGLE).is_file():
        files = [_SAFETENSORS_SINGLE]
    else:
        raise ModelError(f"{key}: {path} has no {_SAFETENSORS_SINGLE} or {_SAFETENSORS_INDEX}", key=key,
                         file=str(path), hint="save the model with save_pretrained(safe_serialization=True)")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        try:
            with safe_open(str(p / name), framework="pt") as f:
                for t in f.keys():
                    shapes[t] = tuple(f.get_slice(t).get_shape())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ModelError(f"{key}: cannot read {p / name} ({e})", key=key, file=str(p / name),
                             hint="restore the checkpoint's weight files") from None
    return shapes


def expected_hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """On-disk HF tensor name -> shape of the model of ``hf_config`` (a registered family), from transformers'
    model class built on the meta device, mapped to the family's on-disk names (a tied model's
    ``lm_head.weight`` left out), plus DeepSeek-V3's MTP layers (deepseek_v3.mtp_hf_shapes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from moerl.checkpoint.hf_convert import fused_experts_to_per_expert

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    sd = fused_experts_to_per_expert(model.state_dict(), hf_config)
    if getattr(hf_config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    if getattr(hf_config, "model_type", None) == "deepseek_v3":  # MTP layers: not in transformers' model class
        from moerl.models.families.deepseek_v3 import mtp_hf_shapes

        shapes.update(mtp_hf_shapes(hf_config))
    return shapes


def check_hf_tensors(path: Any, hf_config, key: str) -> None:
    """The safetensors in ``path`` must hold every tensor of ``hf_config``'s model with its shape, and
    nothing else (a tied ``lm_head.weight`` and the routers' ``e_score_correction_bias`` may be present).

    Raises:
        ModelError: listing missing tensors, unexpected tensors and shape mismatches (first 5 of each).
    """
    import torch

    from moerl.checkpoint.hf_convert import fused_experts_to_per_expert

    have = hf_tensor_shapes(path, key)
    try:
        have = {k: tuple(v.shape) for k, v in fused_experts_to_per_expert(
            {k: torch.empty(s, device="meta") for k, s in have.items()}, hf_config).items()}
    except ValueError as e:
        raise ModelError(f"{key}={path}: {e}", key=key, file=str(path),
                         hint="the tensors contradict the config: restore the checkpoint") from None
    want = expected_hf_shapes(hf_config)
    optional = {k for k in have if k.endswith("gate.e_score_correction_bias") or k == "lm_head.weight"}
    missing = sorted(set(want) - set(have))
    unexpected = sorted(set(have) - set(want) - optional)
    wrong = [f"{k} {list(have[k])} (config implies {list(want[k])})" for k in sorted(set(want) & set(have))
             if have[k] != want[k]]
    if missing or unexpected or wrong:
        parts = [f"{label} ({len(items)}): {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
                 for label, items in (("missing tensors", missing), ("unexpected tensors", unexpected),
                                      ("wrong shapes", wrong)) if items]
        raise ModelError(f"{key}={path}: the weights do not match the model config: " + "; ".join(parts),
                         key=key, file=str(path),
                         hint="the checkpoint is damaged or its config.json belongs to another model: "
                              "re-export it, or give the directory the weights were saved with")


def checkpoint_model_shapes(path: Any, key: str = "resume") -> dict[str, Any]:
    """The model fields a Megatron torch_dist checkpoint was written for, read from the global tensor
    shapes in its ``.metadata`` (torch.distributed.checkpoint; no tensor data is read). Layer- and
    expert-stacked keys carry the global layer count first, whatever TP/PP/EP layout saved them.

    Returns:
        a subset of {"vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "qkv_rows",
        "attention_width", "num_experts", "moe_intermediate_size", "tie_word_embeddings"} (those whose
        tensors the checkpoint holds); qkv_rows = (num_attention_heads + 2 num_key_value_heads) *
        head_dim, attention_width = num_attention_heads * head_dim.

    Raises:
        CheckpointError: ``path`` holds no readable torch_dist metadata (names ``key``).
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a missing or corrupt .metadata file
        raise CheckpointError(f"{key}: {path} is not a readable torch_dist checkpoint ({type(e).__name__}: {e})",
                              key=key, file=str(path),
                              hint="give a complete checkpoint directory (e.g. <output_dir>/checkpoints/step_N)") from None
    shapes = {k.removeprefix("model."): tuple(v.size) for k, v in meta.state_dict_metadata.items()
              if hasattr(v, "size") and not k.startswith("optimizer")}
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        if name == "embedding.word_embeddings.weight":
            out["vocab_size"], out["hidden_size"] = shape[0], shape[1]
        elif name == "decoder.layers.self_attention.linear_qkv.weight":
            out["num_hidden_layers"], out["qkv_rows"] = shape[0], shape[1]
        elif name == "decoder.layers.self_attention.q_layernorm.weight":
            out["head_dim"] = shape[-1]
        elif name == "decoder.layers.self_attention.linear_proj.weight":
            out["attention_width"] = shape[-1]
        elif name == "decoder.layers.mlp.router.weight":
            out["num_experts"] = shape[-2]
        elif ".mlp.experts." in name and name.endswith("linear_fc2.weight"):
            out["moe_intermediate_size"] = shape[-1]
    if "vocab_size" in out:
        out["tie_word_embeddings"] = "output_layer.weight" not in shapes
    return out


def check_checkpoint_shapes(path: Any, hf_config, key: str = "resume") -> None:
    """The torch_dist checkpoint at ``path`` must hold ``hf_config``'s model shape
    (:func:`checkpoint_model_shapes`), before any model is built.

    Raises:
        CheckpointError: listing each differing field with the checkpoint's and the config's value.
    """
    from moerl.models.families import get_family
    from moerl.models.families.common import hf_head_dim

    family = get_family(hf_config, key=key)
    hd, nh, nkv = hf_head_dim(hf_config), hf_config.num_attention_heads, hf_config.num_key_value_heads
    want = {"vocab_size": hf_config.vocab_size, "hidden_size": hf_config.hidden_size,
            "num_hidden_layers": hf_config.num_hidden_layers, "head_dim": hd, "qkv_rows": (nh + 2 * nkv) * hd,
            "attention_width": nh * hd, "num_experts": family.num_experts(hf_config),
            "moe_intermediate_size": family.expert_ffn_size(hf_config),
            "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False))}
    names = {"qkv_rows": "(num_attention_heads + 2 * num_key_value_heads) * head_dim",
             "attention_width": "num_attention_heads * head_dim"}
    diffs = [f"{names.get(k, k)}: checkpoint {v!r} vs model {want[k]!r}"
             for k, v in checkpoint_model_shapes(path, key).items() if v != want[k]]
    if diffs:
        raise CheckpointError(f"{key}: checkpoint {path} was written for another model shape: " + "; ".join(diffs),
                              key=key, file=str(path),
                              hint="set model.hf_config.* to the checkpoint's values, or start a new run "
                                   "(resume=none, another output_dir)")


__all__ = ["REGISTERED", "check_checkpoint_shapes", "check_hf_model_dir", "check_hf_tensors",
           "checkpoint_model_shapes", "expected_hf_shapes", "hf_tensor_shapes"]
