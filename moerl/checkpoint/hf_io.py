"""Hugging Face checkpoint directories (safetensors + config.json [+ tokenizer]) written atomically.

``save_hf_checkpoint`` writes into a temporary directory next to ``out_dir``, fsyncs every file
and the directory, then renames it into place, so a reader (an SGLang server reloading weights,
``AutoModelForCausalLM.from_pretrained``) never sees a half-written checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

__all__ = ["save_hf_checkpoint", "load_hf_state_dict"]

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _independent_cpu_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that share no storage (safetensors refuses shared storage,
    and huggingface_hub would silently drop the duplicates)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict value for {key!r} is a {type(value).__name__}, not a tensor")
        t = value.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        whole = t.storage_offset() == 0 and t.numel() * t.element_size() == storage.nbytes()
        if storage.data_ptr() in seen or not whole:
            t = t.clone()
            storage = t.untyped_storage()
        seen.add(storage.data_ptr())
        out[key] = t
    return out


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_hf_checkpoint(
    hf_state_dict: Mapping[str, torch.Tensor],
    hf_config,
    out_dir: Union[str, os.PathLike],
    tokenizer=None,
    *,
    max_shard_size: Union[int, str] = "5GB",
    dtype: Optional[torch.dtype] = None,
) -> Path:
    """Write an HF checkpoint directory atomically.

    Args:
        hf_state_dict: HF on-disk names -> tensors (e.g. ``megatron_to_hf(model.state_dict(), cfg)``);
            tensors are written in their own dtype.
        hf_config: a transformers PretrainedConfig; written as config.json (``architectures``
            defaults to ``["<ConfigClass minus Config>ForCausalLM"]``, e.g. Qwen3MoeForCausalLM,
            and ``dtype`` to the tensors' dtype).
        out_dir: destination directory; an existing one is replaced.
        tokenizer: optional transformers tokenizer; its files are saved alongside.
        max_shard_size: safetensors shard size (bytes or "5GB"); one file
            ``model.safetensors`` when everything fits, else shards plus
            ``model.safetensors.index.json``.
        dtype: None writes every tensor in its own dtype; a floating dtype (torch.float32 /
            torch.bfloat16: ``model.export_dtype``) casts every floating tensor to it (integer
            tensors are kept) and config.json's ``dtype`` names it.

    Returns:
        Path of ``out_dir``.

    Raises:
        TypeError: a state-dict value is not a tensor.
        ValueError: the state dict is empty, or ``dtype`` is not float32 / bfloat16 / float16.
    """
    from huggingface_hub import save_torch_state_dict

    if not hf_state_dict:
        raise ValueError("hf_state_dict is empty; nothing to save")
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tensors = _independent_cpu_tensors(hf_state_dict)
    if dtype is not None:
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES.values())} (model.export_dtype), got {dtype}")
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}

    config = copy.deepcopy(hf_config)
    if not getattr(config, "architectures", None):
        name = type(config).__name__
        config.architectures = [(name[: -len("Config")] if name.endswith("Config") else name) + "ForCausalLM"]
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1 and next(iter(dtypes)) in _DTYPE_NAMES:
        config.dtype = _DTYPE_NAMES[next(iter(dtypes))]

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_torch_state_dict(tensors, tmp, max_shard_size=max_shard_size, metadata={"format": "pt"})
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _fsync_tree(tmp)
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "ckpt")
        os.replace(tmp, out_dir)
        _fsync_dir(out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_hf_state_dict(path: Union[str, os.PathLike], device: Optional[str] = "cpu") -> dict[str, torch.Tensor]:
    """Read every tensor of an HF safetensors checkpoint directory (single file or sharded).

    Args:
        path: directory with model.safetensors or model.safetensors.index.json.
        device: where to load the tensors.

    Returns:
        dict HF name -> tensor (on-disk naming, e.g. per-expert keys for Qwen3-MoE).

    Raises:
        FileNotFoundError: no safetensors weights in ``path``.
    """
    from safetensors.torch import load_file

    path = Path(path)
    index = path / _INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            out.update(load_file(path / shard, device=device))
        return out
    single = path / _SINGLE_FILE
    if single.exists():
        return load_file(single, device=device)
    raise FileNotFoundError(f"no {_SINGLE_FILE} or {_INDEX_FILE} in {path}")
