"""Recipe dtype names -> torch dtypes: ``model.params_dtype``, ``model.export_dtype`` and ``rollout.dtype``.

Light (torch only) so that ``moerl train`` can check a recipe's dtypes before importing Megatron.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["DTYPES", "export_torch_dtype", "params_torch_dtype", "rollout_serving_dtype", "serving_torch_dtype"]

# the floating dtypes moerl trains, exports and serves in (names as the recipe and SGLang's --dtype spell them)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _by_name(value, key: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if value not in DTYPES:
        raise ValueError(f"{key} must be one of {sorted(DTYPES)}, got {value!r}")
    return DTYPES[value]


def params_torch_dtype(params_dtype) -> torch.dtype:
    """The torch dtype of ``model.params_dtype`` ("float32" | "bfloat16", or that torch dtype).

    bfloat16 is Megatron-Core's mixed precision (BF16 weights and compute, FP32 main params, grads
    and Adam moments: moerl.train.actor.MegatronActor).

    Raises:
        ValueError: float16 (it needs dynamic loss scaling, which moerl does not wire up: use
            bfloat16, same memory and no loss scale) or any other dtype; the message names the key.
    """
    if params_dtype in ("float16", torch.float16):
        raise ValueError("model.params_dtype=float16 needs dynamic loss scaling, which moerl does not do; "
                         "set model.params_dtype=bfloat16 (same memory, FP32 main params, no loss scale) "
                         "or float32")
    return _by_name(params_dtype, "model.params_dtype")


def export_torch_dtype(export_dtype: Optional[str], params_dtype) -> torch.dtype:
    """The dtype HF exports are written in: ``model.export_dtype``, or ``model.params_dtype`` when it is
    None (the trained weights as they are; bfloat16 -> float32 is exact).

    Raises:
        ValueError: an unknown name (names the key).
    """
    if export_dtype is None:
        return params_torch_dtype(params_dtype)
    return _by_name(export_dtype, "model.export_dtype")


def rollout_serving_dtype(rollout_cfg) -> Optional[str]:
    """The ``--dtype`` a recipe's rollout section passes to the servers it launches: ``rollout.dtype``
    when set ("float32" | "bfloat16"); for "auto" the reference server's default "float32", and None
    for SGLang (no --dtype: SGLang's own auto, the checkpoint's dtype with FP32 served as BF16)."""
    dtype = getattr(rollout_cfg, "dtype", "auto")
    if dtype != "auto":
        return dtype
    return "float32" if getattr(rollout_cfg, "backend", "reference") == "reference" else None


def serving_torch_dtype(dtype) -> torch.dtype:
    """The dtype a reference rollout server loads and serves the model in (``rollout.dtype``,
    ``moerl serve --dtype``; SGLang's --dtype names).

    Raises:
        ValueError: an unknown name (names the key).
    """
    return _by_name(dtype, "rollout.dtype (moerl serve --dtype)")
