"""Push trainer weights (HF names) to every rollout server and check they took effect.

Two paths, both ending with every server reporting the new ``weight_version`` on /get_model_info:
  * disk:   write an HF safetensors directory per version (atomically), POST
            /update_weights_from_disk {model_path, weight_version} to each server, keep only the
            new and the previous version directories.
  * tensor: POST /update_weights_from_tensor in buckets of about ``bucket_bytes``; each element of
            serialized_named_tensors is base64 text of safetensors bytes (the moerl reference
            server's wire format; real SGLang expects its own serializer and needs another sender).
            weight_version rides on the last bucket only; the reference server then checks that the
            buckets covered every parameter.

hf_state_dict: {HF on-disk name: tensor}, per-expert names for MoE experts
(``model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` ...), any dtype, any device.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Optional, Sequence

import httpx
import torch

from moerl.rollout.errors import WeightSyncError

_MANIFEST = "rollout_weight_versions.json"


def _cpu_tensors(hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU tensors; tensors sharing storage are cloned (safetensors refuses them)."""
    out, seen = {}, set()
    for name, t in hf_state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"hf_state_dict[{name!r}] is a {type(t).__name__}, expected a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        if key is not None and (key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            t = t.clone()
        if key is not None:
            seen.add(key)
        out[name] = t
    return out


def _post_all(server_urls: Sequence[str], path: str, payload: dict, timeout_s: float,
              http_client: Optional[httpx.Client]) -> None:
    """POST payload to every server (in parallel); raise WeightSyncError naming each failure."""

    def one(url: str) -> Optional[str]:
        try:
            client = http_client or httpx.Client(timeout=timeout_s, trust_env=False)
            try:
                r = client.post(url.rstrip("/") + path, json=payload)
            finally:
                if http_client is None:
                    client.close()
        except httpx.HTTPError as e:
            return f"{url}: {type(e).__name__}: {e}"
        try:
            body = r.json()
        except ValueError:
            body = {}
        if r.status_code != 200 or not body.get("success", False):
            return f"{url}: HTTP {r.status_code}: {body.get('message', r.text[:500])}"
        return None

    with ThreadPoolExecutor(max_workers=max(1, len(server_urls))) as pool:
        errors = [e for e in pool.map(one, server_urls) if e]
    if errors:
        raise WeightSyncError(f"{path} failed on {len(errors)} of {len(server_urls)} servers:\n" + "\n".join(errors))


def verify_weight_version(server_urls: Sequence[str], weight_version: str, *, timeout_s: float = 30.0,
                          http_client: Optional[httpx.Client] = None) -> None:
    """Raise WeightSyncError unless every server's /get_model_info reports ``weight_version``."""
    bad = []
    client = http_client or httpx.Client(timeout=timeout_s, trust_env=False)
    try:
        for url in server_urls:
            try:
                got = client.get(url.rstrip("/") + "/get_model_info").json().get("weight_version")
            except (httpx.HTTPError, ValueError) as e:
                got = f"<error {type(e).__name__}: {e}>"
            if got != weight_version:
                bad.append(f"{url} reports weight_version {got!r}")
    finally:
        if http_client is None:
            client.close()
    if bad:
        raise WeightSyncError(f"expected weight_version {weight_version!r}: " + "; ".join(bad))


def _version_dirname(weight_version: str) -> str:
    return "weights_" + re.sub(r"[^A-Za-z0-9._-]", "_", weight_version)


def write_hf_version_dir(hf_state_dict: Mapping[str, torch.Tensor], hf_config, out_root, weight_version: str) -> str:
    """Write ``out_root/weights_<version>`` (model.safetensors + config.json) atomically; returns it.

    Written to a temporary sibling directory first and renamed with os.replace, so a server never
    sees a half-written version. Uses moerl.checkpoint.hf_io.save_hf_checkpoint when available.
    """
    out_root = os.fspath(out_root)
    os.makedirs(out_root, exist_ok=True)
    final = os.path.join(out_root, _version_dirname(weight_version))
    tmp = os.path.join(out_root, f".tmp_{_version_dirname(weight_version)}_{uuid.uuid4().hex[:8]}")
    tensors = _cpu_tensors(hf_state_dict)
    try:
        try:
            from moerl.checkpoint.hf_io import save_hf_checkpoint  # type: ignore
        except ImportError:
            save_hf_checkpoint = None
        if save_hf_checkpoint is not None:
            save_hf_checkpoint(tensors, hf_config, tmp)
        else:
            from safetensors.torch import save_file

            os.makedirs(tmp)
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            hf_config.save_pretrained(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _record_and_prune(out_root: str, new_dir: str, keep: int) -> None:
    """Append new_dir to the manifest of version dirs written here; delete all but the last ``keep``."""
    path = os.path.join(out_root, _MANIFEST)
    try:
        with open(path) as f:
            dirs = [d for d in json.load(f) if isinstance(d, str)]
    except (OSError, ValueError):
        dirs = []
    name = os.path.basename(new_dir)
    dirs = [d for d in dirs if d != name] + [name]
    for d in dirs[:-keep]:
        shutil.rmtree(os.path.join(out_root, d), ignore_errors=True)
    dirs = dirs[-keep:]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dirs, f)
    os.replace(tmp, path)


def sync_weights_from_disk(server_urls: Sequence[str], hf_state_dict: Mapping[str, torch.Tensor], hf_config,
                           out_root, weight_version: str, *, timeout_s: float = 600.0,
                           keep_versions: int = 2, http_client: Optional[httpx.Client] = None) -> str:
    """Write the weights as an HF checkpoint and make every server load it (SGLang /update_weights_from_disk).

    Args:
        server_urls: base URL of each server (not the router).
        hf_state_dict: {HF on-disk name: tensor} covering every model parameter.
        hf_config: transformers config of the served model (written as config.json).
        out_root: directory holding one ``weights_<version>`` subdirectory per version.
        weight_version: new version string (servers report it on /generate and /get_model_info).
        keep_versions: version directories written by this function to keep (new + previous).
        http_client: optional httpx.Client to use (e.g. a FastAPI TestClient).
    Returns: the version directory.
    Raises:
        WeightSyncError: a server refused the update or reports another weight_version.
    """
    if not isinstance(weight_version, str) or not weight_version:
        raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")
    if keep_versions < 1:
        raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
    path = write_hf_version_dir(hf_state_dict, hf_config, out_root, weight_version)
    _post_all(server_urls, "/update_weights_from_disk",
              {"model_path": os.path.abspath(path), "weight_version": weight_version}, timeout_s, http_client)
    verify_weight_version(server_urls, weight_version, http_client=http_client)
    _record_and_prune(os.fspath(out_root), path, keep_versions)
    return path


def serialize_bucket(named_tensors: Mapping[str, torch.Tensor]) -> str:
    """base64 text of ``safetensors.torch.save(named_tensors)`` (reference-server wire format)."""
    from safetensors.torch import save

    return base64.b64encode(save(dict(named_tensors))).decode("ascii")


def make_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split into consecutive buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[dict[str, torch.Tensor]] = []
    cur: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += n
    if cur:
        buckets.append(cur)
    return buckets


def sync_weights_from_tensor(server_urls: Sequence[str], hf_state_dict: Mapping[str, torch.Tensor],
                             weight_version: str, bucket_bytes: int = 64 << 20, *, timeout_s: float = 600.0,
                             http_client: Optional[httpx.Client] = None) -> int:
    """Send the weights in buckets via /update_weights_from_tensor (reference-server format).

    Every bucket goes to every server before the next one; the last bucket carries weight_version
    and flush_cache=True. Returns the number of buckets.
    Raises:
        WeightSyncError: a server refused a bucket (e.g. unknown name, or the buckets did not cover
            every parameter) or reports another weight_version afterwards.
    """
    if not isinstance(weight_version, str) or not weight_version:
        raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")
    buckets = make_buckets(_cpu_tensors(hf_state_dict), bucket_bytes)
    if not buckets:
        raise ValueError("hf_state_dict is empty")
    for k, bucket in enumerate(buckets):
        last = k == len(buckets) - 1
        payload = {"serialized_named_tensors": [serialize_bucket(bucket)], "load_format": None,
                   "flush_cache": last, "weight_version": weight_version if last else None}
        _post_all(server_urls, "/update_weights_from_tensor", payload, timeout_s, http_client)
    verify_weight_version(server_urls, weight_version, http_client=http_client)
    return len(buckets)
