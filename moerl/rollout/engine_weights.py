"""Weight updates of the CPU reference server: HF names -> live parameters, and SGLang's update endpoints.

Split out of moerl.rollout.server (which re-exports every name here). The engine
(moerl.rollout.engine.ReferenceEngine) inherits :class:`WeightUpdater`; the HTTP layer
(moerl.rollout.server.create_app) calls its methods, which return SGLang's ``(success, message)``.

Semantics (SGLang io_struct names):
  * update_weights_from_disk (UpdateWeightFromDiskReqInput) reads the HF safetensors in model_path
    (HF on-disk names; per-expert ``...mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` /
    ``down_proj`` are mapped onto transformers' fused ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate
    rows first) and ``mlp.experts.down_proj`` [E, H, I]); it must cover every parameter, else nothing
    is changed.
  * update_weights_from_tensor (UpdateWeightsFromTensorReqInput): SGLang's wire format
    (moerl.rollout.tensor_serde): ``serialized_named_tensors`` holds one MultiprocessingSerializer
    payload per TP rank and this server (one TP rank) reads element 0, as SGLang's TP rank 0 does;
    load_format null / "direct" (a list of (name, tensor)) or "flattened_bucket". Tensors are inline
    bytes or, from a trainer on this host, shared-memory handles, whose mappings are kept until
    the end of the next complete sync (reused buffers are not mapped again). The earlier
    moerl format (base64 safetensors bytes) is still read. Trust: payloads are pickles, see
    moerl.rollout.tensor_serde (listen only on trusted addresses, as SGLang must).
  * weight_version (every update endpoint): as SGLang's TokenizerManager, a successful call that
    carries ``weight_version`` sets it, whatever the call covered (slime and AReaL send it with every
    bucket); the success message says how many weights the updates since the last version left
    untouched, which is the sender's business (moerl's senders send full state dicts).
  * update_weights_from_disk also makes /get_model_info report the new ``model_path`` (SGLang
    ``_update_model_path_info``).
  * init_weights_update_group / update_weights_from_distributed / destroy_weights_update_group: the
    trainer broadcasts each bucket from rank 0 of a gloo group this server joined (CPU only).
  * FP8 weights (rollout.weight_dtype=fp8, moerl.precision.fp8_checkpoint): in every endpoint a
    ``<m>.weight`` float8_e4m3fn and its ``<m>.weight_scale_inv`` are folded into one weight
    (``weight * weight_scale_inv`` per 128 x 128 block in float32, then cast to the serving dtype); a
    pair split over two buckets waits for its other half (a half pair still waiting when a version is
    set is named in the message). Block size: the served checkpoint's quantization_config, else 128 x 128.
Every update takes the engine's model lock, so it runs between generate batches, never during one.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import re
import threading
from typing import Any, Optional

import torch

from moerl.rollout.common import DEFAULT_WEIGHT_VERSION, is_int

__all__ = ["DEFAULT_WEIGHT_VERSION", "WeightMapper", "WeightUpdater", "load_safetensors_dir"]


# ----------------------------------------------------------------------------- weight mapping


_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class WeightMapper:
    """Maps HF on-disk tensor names onto the live transformers model's parameters.

    Direct names (``model.layers.0.self_attn.q_proj.weight``, fused names, tied aliases such as
    ``lm_head.weight`` when tied to ``model.embed_tokens.weight``) copy the whole parameter.
    Per-expert names ``<prefix>.experts.{e}.gate_proj.weight`` [I, H] / ``up_proj`` [I, H] /
    ``down_proj`` [H, I] copy into ``<prefix>.experts.gate_up_proj[e, :I]`` / ``[e, I:]`` (gate rows
    first, transformers 5 layout [E, 2I, H]) / ``<prefix>.experts.down_proj[e]`` ([E, H, I]).
    Coverage is tracked in pieces: one per plain parameter, one per (expert, gate|up|down) slice. The
    routers' ``e_score_correction_bias`` buffers (DeepSeek-V3) count as parameters.

    Names of a registered model family (moerl.models.families, by ``model.config.model_type``) are first
    mapped to transformers' in-memory names by the family's ``hf_disk_names`` (Mixtral:
    ``block_sparse_moe.gate`` -> ``mlp.gate``, ``block_sparse_moe.experts.{e}.w1 / w3 / w2`` ->
    ``mlp.experts.{e}.gate_proj / up_proj / down_proj``), and :meth:`missing` reports on-disk names; any
    other model's names are taken as they are.
    """

    def __init__(self, model: torch.nn.Module):
        from moerl.models.families import NameMap, get_family, supported_model_types

        model_type = getattr(getattr(model, "config", None), "model_type", None)
        self.names = get_family(model_type).hf_disk_names if model_type in supported_model_types() else NameMap()
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        by_id = {id(p): n for n, p in self.params.items()}
        self.alias = {n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        # routers' expert bias (DeepSeek-V3 ``mlp.gate.e_score_correction_bias``): a buffer in transformers,
        # a weight on disk and at every sync (aux-loss-free balancing moves it during training)
        for name, b in model.named_buffers():
            if name.endswith(".e_score_correction_bias"):
                self.params[name] = b
                self.alias[name] = name
        self.all_pieces: set[tuple] = set()
        self.piece_to_hf: dict[tuple, str] = {}
        for name, p in self.params.items():
            for piece, hf in self._pieces_of(name, p):
                self.all_pieces.add(piece)
                self.piece_to_hf[piece] = hf

    @staticmethod
    def _fused_kind(name: str, p: torch.Tensor) -> Optional[str]:
        if p.dim() == 3 and name.endswith(".experts.gate_up_proj"):
            return "gate_up"
        if p.dim() == 3 and name.endswith(".experts.down_proj"):
            return "down"
        return None

    def _pieces_of(self, name: str, p: torch.Tensor):
        kind = self._fused_kind(name, p)
        prefix = name.rsplit(".", 1)[0]
        if kind == "gate_up":
            for e in range(p.shape[0]):
                yield (name, e, "gate"), f"{prefix}.{e}.gate_proj.weight"
                yield (name, e, "up"), f"{prefix}.{e}.up_proj.weight"
        elif kind == "down":
            for e in range(p.shape[0]):
                yield (name, e, "down"), f"{prefix}.{e}.down_proj.weight"
        else:
            yield (name, None, None), name

    def resolve(self, hf_name: str, tensor: torch.Tensor):
        """Return (target view, pieces covered) for one incoming tensor.

        Raises:
            ValueError: unknown name or shape mismatch (message names both).
        """
        hf_name = self.names.canonical(hf_name)
        if hf_name in self.alias:
            name = self.alias[hf_name]
            p = self.params[name]
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"weight {hf_name!r}: shape {tuple(tensor.shape)} does not match the "
                                 f"model's {name} {tuple(p.shape)}")
            return p, [piece for piece, _ in self._pieces_of(name, p)]
        m = _EXPERT_RE.match(hf_name)
        if m is not None:
            prefix, e, proj = m.group("prefix"), int(m.group("e")), m.group("proj")
            fused = f"{prefix}.down_proj" if proj == "down_proj" else f"{prefix}.gate_up_proj"
            p = self.params.get(fused)
            if p is not None and self._fused_kind(fused, p) is not None:
                if not 0 <= e < p.shape[0]:
                    raise ValueError(f"weight {hf_name!r}: expert {e} out of range, the model has "
                                     f"{p.shape[0]} experts in {fused}")
                if proj == "down_proj":
                    view, part = p[e], "down"
                else:
                    inter = p.shape[1] // 2
                    view, part = (p[e, :inter], "gate") if proj == "gate_proj" else (p[e, inter:], "up")
                if tuple(tensor.shape) != tuple(view.shape):
                    raise ValueError(f"weight {hf_name!r}: shape {tuple(tensor.shape)} does not match "
                                     f"the slice of {fused} it maps to {tuple(view.shape)}")
                return view, [(fused, e, part)]
        raise ValueError(f"weight {hf_name!r} matches no parameter of the served model "
                         f"(expected HF names such as {next(iter(self.params))!r})")

    def missing(self, covered: set) -> list[str]:
        """HF names of the pieces not in ``covered`` (sorted)."""
        return sorted(self.names.disk(self.piece_to_hf[p]) for p in self.all_pieces - covered)

    def apply(self, named_tensors: list[tuple[str, torch.Tensor]]) -> set:
        """Validate every tensor first, then copy all of them in place; returns the pieces covered.

        Raises:
            ValueError: as :meth:`resolve`; nothing is written in that case.
        """
        plan = [(self.resolve(n, t), t) for n, t in named_tensors]
        covered: set = set()
        with torch.no_grad():
            for (view, pieces), t in plan:
                view.copy_(t.to(dtype=view.dtype))
                covered.update(pieces)
        return covered


def load_safetensors_dir(path: str) -> list[tuple[str, torch.Tensor]]:
    """Read every tensor of an HF safetensors checkpoint directory (index json or *.safetensors).

    Raises:
        FileNotFoundError: no such directory or no .safetensors file in it.
    """
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, f) for f in files]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model_path {path!r} holds no *.safetensors file (only safetensors "
                                f"checkpoints are supported)")
    out: list[tuple[str, torch.Tensor]] = []
    for f in files:
        out.extend(load_file(f).items())
    return out


def checkpoint_fp8_block_size(path: str) -> Optional[tuple[int, int]]:
    """``weight_block_size`` of the block-FP8 ``quantization_config`` in ``path``/config.json (None
    when there is none or no config.json). Raises ValueError for FP8 without a block size."""
    from moerl.precision.fp8_checkpoint import fp8_block_size

    cfg = os.path.join(path, "config.json")
    if not os.path.exists(cfg):
        return None
    with open(cfg) as f:
        return fp8_block_size(json.load(f))


def dequantized_checkpoint(path: str, block_size: Optional[tuple[int, int]] = None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the HF checkpoint in ``path`` with its FP8 (weight, weight_scale_inv) pairs
    folded back to float32 weights (moerl.precision.fp8_checkpoint.Fp8Dequantizer; block size from
    its config.json, else ``block_size``, else 128 x 128); a full-precision checkpoint comes back as is.

    Raises:
        FileNotFoundError: as :func:`load_safetensors_dir`.
        ValueError: an FP8 weight without its scale (or the reverse), or a scale of the wrong shape.
    """
    from moerl.precision.fp8_checkpoint import Fp8Dequantizer

    deq = Fp8Dequantizer(checkpoint_fp8_block_size(path) or block_size or (128, 128))
    named = deq.feed(load_safetensors_dir(path))
    if deq.pending:
        raise ValueError(f"checkpoint {path} holds FP8 weights without their weight_scale_inv (or the reverse): "
                         f"{deq.pending_names()[:8]}")
    return named


def load_causal_lm(model_path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers causal LM of an HF checkpoint directory in ``dtype`` (CPU).

    A block-FP8 checkpoint (config.json ``quantization_config`` quant_method fp8 with
    weight_block_size, as moerl writes for rollout.weight_dtype=fp8) is built from its config without
    the quantization config and its weights dequantised (``weight * weight_scale_inv`` blockwise, in
    float32, then cast to ``dtype``): transformers' FineGrainedFP8 loader needs ``accelerate`` and a
    GPU to keep FP8, and on CPU derives the block size from the scale grid, which is wrong for ragged
    dims. Any other checkpoint goes through ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        ValueError: the FP8 checkpoint misses or has unknown weights, or mis-shaped scales.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    block = checkpoint_fp8_block_size(model_path)
    if block is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    config = AutoConfig.from_pretrained(model_path)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    mapper = WeightMapper(model)
    named = dequantized_checkpoint(model_path, block)
    covered = mapper.apply(named)
    missing = mapper.missing(covered)
    if missing:
        raise ValueError(f"FP8 checkpoint {model_path} does not cover {len(missing)} model weights, e.g. {missing[:8]}")
    return model


# ----------------------------------------------------------------------------- update handlers


class WeightUpdater:
    """SGLang's weight-update handlers, mixed into the reference engine (no HTTP here).

    State (made by :meth:`_init_weight_state`): ``mapper`` (a :class:`WeightMapper` of ``model``),
    ``weight_version`` (str, :data:`DEFAULT_WEIGHT_VERSION` at start), the coverage of the buckets
    received since the last published version, and the weight update groups by name. The class
    that mixes it in provides ``model`` (the live torch module) and ``_model_lock`` (a
    threading.Lock held around every generate batch); every update holds that lock while it writes.
    All methods return SGLang's ``(success, message)``; none raises for a bad request.
    """

    model: torch.nn.Module
    _model_lock: threading.Lock

    def _init_weight_state(self) -> None:
        """Set up the update state for ``self.model`` (call once the model is loaded)."""
        from moerl.precision.fp8_checkpoint import Fp8Dequantizer

        self.mapper = WeightMapper(self.model)
        # FP8 updates (rollout.weight_dtype=fp8): (weight, weight_scale_inv) pairs are dequantised into
        # the serving dtype; a pair split over two buckets waits here for its other half. Block size:
        # the served checkpoint's quantization_config, else DeepSeek-V3's 128 x 128.
        path = getattr(self, "model_path", None)
        self._fp8_block = (checkpoint_fp8_block_size(path) if isinstance(path, str) and os.path.isdir(path)
                           else None) or (128, 128)
        self._fp8 = Fp8Dequantizer(self._fp8_block)
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self._pending_cover: set = set()
        self._update_groups: dict[str, Any] = {}  # group_name -> process group (distributed weight sync)
        self._shm_lock = threading.Lock()  # the shared-memory mappings kept (not the model lock: no wait on an apply)

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Load a full HF safetensors checkpoint into the live model (all-or-nothing; SGLang
        UpdateWeightFromDiskReqInput). On success ``model_path`` becomes the served model path
        (/get_model_info, /model_info, /v1/models report it, as SGLang's ``_update_model_path_info``)
        and ``weight_version``, when given, the version.

        Returns (success, message); the message names missing / unknown / mis-shaped weights.
        """
        if load_format not in (None, "auto", "safetensors"):
            return False, (f"load_format={load_format!r} is not supported by the reference server "
                           f"(use null, 'auto' or 'safetensors')")
        try:
            named = dequantized_checkpoint(model_path, self._fp8_block)  # FP8 pairs -> float32 weights
            with self._model_lock:
                plan = [(self.mapper.resolve(n, t), t) for n, t in named]
                covered = set()
                for (_, pieces), _t in plan:
                    covered.update(pieces)
                missing = self.mapper.missing(covered)
                if missing:
                    return False, (f"checkpoint {model_path} does not cover {len(missing)} model "
                                   f"weights, e.g. {missing[:8]}; nothing was updated")
                self.mapper.apply(named)
                self._pending_cover = set()
                self.model_path = model_path  # SGLang reports the new path on /model_info
                if weight_version is not None:
                    self.weight_version = str(weight_version)
        except (ValueError, FileNotFoundError, OSError) as e:
            return False, f"update_weights_from_disk failed, nothing was updated: {e}"
        msg = f"Succeeded to update model weights from {model_path}."
        if weight_version is not None:
            msg += f" Weight version updated to {weight_version}."
        return True, msg

    def update_weights_from_tensor(self, serialized_named_tensors: list, load_format: Optional[str] = None,
                                   flush_cache: bool = True,
                                   weight_version: Optional[str] = None) -> tuple[bool, str]:
        """Apply one bucket sent in SGLang's format (UpdateWeightsFromTensorReqInput).

        ``serialized_named_tensors``: list with one MultiprocessingSerializer payload (base64 text)
        per TP rank; this server is TP rank 0 and reads element 0 (see moerl.rollout.tensor_serde
        for the payloads of load_format null / "direct" / "flattened_bucket"). An element that is
        base64 safetensors bytes (moerl's earlier format) is read too. Tensors are HF-named, any
        dtype (cast to the parameter's). ``weight_version`` is set on success (SGLang semantics).
        Concurrent calls (moerl's sender keeps up to its buffer depth of buckets in flight and sends
        the one carrying weight_version after every other was answered) are decoded in parallel and
        applied one at a time under the model lock, in whatever order they take it.
        Returns (success, message); nothing is written when the bucket is refused.
        """
        from moerl.rollout.tensor_serde import TENSOR_LOAD_FORMATS, deserialize, named_tensors_from_payload

        if load_format not in TENSOR_LOAD_FORMATS:
            return False, (f"load_format={load_format!r} is not supported by the reference server "
                           f"(use one of {list(TENSOR_LOAD_FORMATS)})")
        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            return False, ("serialized_named_tensors must be a non-empty list (one serialized payload "
                           "per TP rank)")
        blob = serialized_named_tensors[0]
        if not isinstance(blob, str):
            return False, ("serialized_named_tensors[0] must be base64 text (SGLang MultiprocessingSerializer "
                           f"output_str=True), got {type(blob).__name__}")
        try:
            raw = base64.b64decode(blob, validate=True)
            if raw[:1] != b"\x80" and raw[8:9] == b"{" and load_format in (None, "direct"):
                from safetensors.torch import load as st_load  # moerl's earlier wire format

                named = list(st_load(raw).items())
            else:
                named = named_tensors_from_payload(deserialize(raw), load_format)
        except Exception as e:  # malformed base64 / pickle / payload shape
            return False, f"could not decode serialized_named_tensors[0]: {e}"
        ok, msg = self._apply_bucket(named, weight_version, "update_weights_from_tensor")
        with self._shm_lock:  # buckets of one sync may arrive concurrently (the sender pipelines them)
            self._keep_shared_mappings(named, ok and weight_version is not None)
        return ok, msg

    def _keep_shared_mappings(self, named: list, sync_done: bool) -> None:
        """Keep the shared-memory storages of the buckets received (tensor_serde.serialize_shared
        handles) mapped until the end of the next complete sync, so a sender that reuses its
        buffers (moerl.rollout.weight_sync.SharedBucketBuffers) costs no mmap or page faults: torch's
        shared_cache finds the live mapping by handle. The mappings of the last TWO complete syncs are
        kept (a call carrying weight_version completes one), because the trainer's export arena
        (moerl.rollout.shm_arena.SharedExportArena) alternates two slots sync after sync; a mapping
        neither of them used is dropped (a released sender buffer's file is then unlinked at the end
        of the second sync after its last use): at most three syncs' buffers stay mapped."""
        from moerl.rollout.tensor_serde import shared_storages

        cur = getattr(self, "_shm_cur", {})
        cur.update((st.data_ptr(), st) for st in shared_storages(named))
        if sync_done:
            self._shm_prev2, self._shm_prev, cur = getattr(self, "_shm_prev", {}), cur, {}
        self._shm_cur = cur

    # ------------------------------------------------------------------ distributed weight sync

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = "weight_update_group",
                                  backend: str = "gloo") -> tuple[bool, str]:
        """Join the trainer's weight update group as rank ``rank_offset`` (SGLang
        InitWeightsUpdateGroupReqInput; this server is one tp rank, so rank = rank_offset + 0).
        master_port, rank_offset and world_size may be ints or strings of ints ("29500"), as
        SGLang's pydantic body coerces them.

        Built like SGLang's ``init_custom_process_group``: tcp:// rendezvous at
        master_address:master_port (the trainer, rank 0, hosts the TCPStore), the store prefixed with
        group_name, the backend made by torch's ``_new_process_group_helper``. Blocks until every
        rank joined (timeout: MOERL_WEIGHT_SYNC_TIMEOUT_S, default 600 s). Only gloo (CPU) here.
        Returns (success, message).
        """
        import datetime

        import torch.distributed as tdist
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

        if backend != "gloo":
            return False, f"backend={backend!r}: the moerl reference server (CPU) supports only 'gloo'"
        if not isinstance(group_name, str) or not group_name:
            return False, "group_name must be a non-empty string"
        if group_name in self._update_groups:
            return False, f"weight update group {group_name!r} already exists; destroy it first"
        ints = {}
        for key, v in (("master_port", master_port), ("rank_offset", rank_offset), ("world_size", world_size)):
            # SGLang's pydantic body coerces integer strings ("29500"); so does this server
            if isinstance(v, str) and v.strip().lstrip("+-").isdigit():
                v = int(v)
            if not is_int(v):
                return False, f"{key} must be an integer (or a string of one), got {v!r}"
            ints[key] = int(v)
        master_port, rank_offset, world_size = ints["master_port"], ints["rank_offset"], ints["world_size"]
        if not 1 <= rank_offset < world_size:
            return False, f"rank_offset {rank_offset} must lie in 1..world_size-1 ({world_size - 1}); 0 is the trainer"
        timeout = datetime.timedelta(seconds=float(os.environ.get("MOERL_WEIGHT_SYNC_TIMEOUT_S", "600")))
        try:
            store, rank, size = next(tdist.rendezvous(f"tcp://{master_address}:{master_port}", rank_offset,
                                                      world_size, timeout=timeout))
            store.set_timeout(timeout)
            import inspect

            opt = ("backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters
                   else "pg_options")
            pg, _ = _new_process_group_helper(size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                              group_name=group_name, timeout=timeout, **{opt: None})
            _world.pg_group_ranks[pg] = {i: i for i in range(size)}
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e}."
        self._update_groups[group_name] = pg
        return True, "Succeeded to initialize custom process group."

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        """Leave and destroy a weight update group (SGLang DestroyWeightsUpdateGroupReqInput)."""
        import torch.distributed as tdist

        pg = self._update_groups.pop(group_name, None)
        if pg is None:
            return False, "The group to be destroyed does not exist."
        try:
            tdist.destroy_process_group(pg)
        except Exception as e:
            return False, f"Failed to destroy custom process group: {e}."
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list,
                                        group_name: str = "weight_update_group",
                                        weight_version: Optional[str] = None,
                                        load_format: Optional[str] = None) -> tuple[bool, str]:
        """Receive one bucket by broadcast from rank 0 of ``group_name`` and apply it (SGLang
        UpdateWeightsFromDistributedReqInput: tensor i is torch.empty(shapes[i], dtype=getattr(torch,
        dtypes[i])) filled by a broadcast from rank 0, in ``names`` order).

        With ``load_format="flattened_bucket"`` the bucket arrives as ONE uint8 broadcast of every
        tensor's bytes back to back in ``names`` order (SGLang ModelRunner
        ``_update_bucketed_weights_from_distributed`` / FlattenedTensorBucket); otherwise one
        broadcast per tensor. Every tensor is received before anything is checked against the model,
        so the group stays in step even when the bucket is then refused. ``weight_version`` is set
        on success (SGLang semantics, see the module doc). Returns (success, message).
        """
        import torch.distributed as tdist

        pg = self._update_groups.get(group_name)
        if pg is None:
            return False, (f"Group {group_name} not in {sorted(self._update_groups)}. "
                           f"Please call `init_weights_update_group` first.")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            return False, "names, dtypes and shapes must be lists of the same length"
        specs = []
        for n, d, s in zip(names, dtypes, shapes):
            dt = getattr(torch, d, None) if isinstance(d, str) else None
            if not isinstance(n, str) or not isinstance(dt, torch.dtype):
                return False, f"bad entry name={n!r} dtype={d!r}: names are strings, dtypes torch dtype names"
            if not isinstance(s, list) or not all(is_int(x) and x >= 0 for x in s):
                return False, f"shape of {n!r} must be a list of non-negative ints, got {s!r}"
            specs.append((n, dt, s))
        if load_format not in (None, "auto", "flattened_bucket"):
            return False, (f"load_format={load_format!r} is not supported by the reference server "
                           f"(use null or 'flattened_bucket')")
        try:
            named = [(n, torch.empty(s, dtype=dt)) for n, dt, s in specs]
            if load_format == "flattened_bucket" and named:
                from moerl.rollout.tensor_serde import flatten_bucket

                flat, meta = flatten_bucket(named)
                bufs = [flat]
            else:
                bufs = [t for _, t in named]
            works = []
            for t in bufs:
                opts = tdist.BroadcastOptions()
                opts.rootRank = 0
                works.append(pg.broadcast([t], opts))
            for w in works:
                w.wait()
            if load_format == "flattened_bucket" and named:
                named = [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in meta]
        except Exception as e:
            return False, (f"Failed to update parameter online: {e}. The weights may be partially updated; "
                           f"discard them.")
        return self._apply_bucket(named, weight_version, "update_weights_from_distributed")

    def _apply_bucket(self, named: list, weight_version: Optional[str], endpoint: str) -> tuple[bool, str]:
        """Apply one bucket of HF-named tensors (all or none of it); on success set
        ``weight_version`` when given (SGLang TokenizerManager ``_update_weight_version_if_provided``:
        every successful call carrying a version sets it). The message says when the updates since
        the last version did not cover every model weight. Returns SGLang's (success, message)."""
        n_sent = len(named)
        with self._model_lock:
            held = self._fp8.pending
            try:  # FP8 pairs folded to float32 weights; a half pair waits for the next bucket
                self._pending_cover |= self.mapper.apply(self._fp8.feed(named))
            except ValueError as e:
                self._fp8.pending = held
                return False, f"{endpoint} failed, this bucket was not applied: {e}"
            msg = f"Succeeded to update {n_sent} tensors."
            if weight_version is not None:
                missing = self.mapper.missing(self._pending_cover) + self._fp8.pending_names()
                self._fp8.pending = {}
                self._pending_cover = set()
                self.weight_version = str(weight_version)
                msg += f" Weight version updated to {weight_version}."
                if missing:
                    msg += (f" (The updates since the previous version left {len(missing)} model weights "
                            f"as they were, e.g. {missing[:4]}.)")
        return True, msg
