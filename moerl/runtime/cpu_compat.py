"""CPU compatibility layer for megatron-core 0.16.1 (gloo, no CUDA, no Transformer Engine, no Apex).

megatron-core assumes CUDA in a handful of places. ``apply_cpu_patches()`` installs one small,
named, reversible patch per measured breakage (shared design CPU_MEGATRON.md, "What breaks"):

======================================  =====  ==============================================
patch name                              item   error it removes
======================================  =====  ==============================================
``rng_tracker``                         1      model_parallel_cuda_manual_seed -> "Torch not
                                               compiled with CUDA enabled"
``current_device``                      2      torch.cuda.current_device() -> same error
``te_general_gemm``                     3      NameError: name 'te_general_gemm' is not defined
``alltoall_streams``                    4      "torch.cuda.Stream requires CUDA support"
``cuda_factories``                      5      torch.zeros(..., device="cuda") in schedules and
                                               the default causal mask -> CUDA error
``torch_norm_sequence_parallel``        7      AssertionError "sequence parallel not supported
                                               by torch LayerNorm"
``optimizer_cuda_checks``               8      clip_grad / distributed optimizer asserting
                                               'torch.cuda.FloatTensor' and allocating on "cuda"
``cuda_synchronize``                    new    dist_checkpointing torch_dist save ->
                                               torch.cuda.synchronize() CUDA error
``tied_embedding_cuda``                 new    GPTModel with tied embeddings and pp > 1 ->
                                               ``weight.data.cuda()`` CUDA error
``mla_te_placeholders``                 new    multi-latent attention without Transformer Engine ->
                                               TypeError "isinstance() arg 2 must be a type"
``thd_rope``                            speed  (no error) Megatron's unfused RoPE for packed THD
                                               input loops over the sequences in Python (TE fuses
                                               it on GPU): moerl's vectorised, bit-equal version
``identity_chunk_sort``                 speed  (no error) with one EP x TP rank the alltoall
                                               dispatcher still splits and re-concatenates the
                                               tokens (and probs) in their own order, forward and
                                               backward: skipped when the order is the identity
======================================  =====  ==============================================

Item 4 also covers ``ep_size > 1`` with the alltoall dispatcher: the split sizes must become
host lists/arrays as upstream's device-to-host copy makes them (see ``patch_alltoall_streams``).

Item 9 (TorchInductor compiling the jit fusers, ~25 s cold) is handled by setting
``TORCHDYNAMO_DISABLE=1``; its dropout RNG warning is filtered by ``rng_tracker``. Item 6
(``add_bias_linear=True``) is avoided by the model builder (moerl.models.qwen3_moe sets
``add_bias_linear=False``).

The whole layer is a no-op when ``torch.cuda.is_available()``. Every patch records the attribute
it replaced so that tests can temporarily undo one patch with ``without_patch(name)`` and show the
original error.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = [
    "PATCH_NAMES",
    "apply_cpu_patches",
    "applied_patches",
    "cuda_type_names",
    "fused_cpu_adam",
    "patch_missing_te_general_gemm",
    "without_patch",
]

_LOCK = threading.RLock()
_MISSING = object()


@dataclass
class _Patch:
    """Book-keeping for one applied patch: the (owner, attribute, original, replacement) swaps."""

    name: str
    swaps: list[tuple[Any, str, Any, Any]] = field(default_factory=list)

    def set(self, owner: Any, attr: str, value: Any) -> None:
        # Only an attribute defined on the owner itself is restored; an inherited one is deleted.
        original = vars(owner).get(attr, _MISSING)
        self.swaps.append((owner, attr, original, value))
        setattr(owner, attr, value)

    def undo(self) -> None:
        for owner, attr, original, _ in reversed(self.swaps):
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)

    def redo(self) -> None:
        for owner, attr, _, value in self.swaps:
            setattr(owner, attr, value)


_APPLIED: dict[str, _Patch] = {}


def _cuda_is_absent() -> bool:
    return not torch.cuda.is_available()


# --------------------------------------------------------------------------------------------
# 1. RNG tracker
# --------------------------------------------------------------------------------------------


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """CPU stand-in for megatron's ``_get_cuda_rng_state``: the global CPU generator's state."""
    del device, clone, graph_safe
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    """CPU stand-in for megatron's ``_set_cuda_rng_state``: set the global CPU generator."""
    del device, graph_safe
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CPU version of ``CudaRNGStatesTracker.add``: a CPU generator state seeded with ``seed``.

    Same duplicate-seed / duplicate-name checks as upstream; the global CPU RNG is not touched.
    """
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(int(seed)).get_state()


class _DropCpuRngChangedWarning(logging.Filter):
    """The tracker's fork() warns 'CPU RNG state changed within GPU RNG context' whenever dropout
    runs inside it. On CPU the tracked state *is* the CPU generator, so the warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: A003 - logging API name
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_FILTER = _DropCpuRngChangedWarning()


def patch_rng_tracker(p: _Patch) -> None:
    """Item 1: ``tensor_parallel.model_parallel_cuda_manual_seed`` raises
    ``AssertionError: Torch not compiled with CUDA enabled`` (from ``torch.cuda.get_rng_state`` in
    ``CudaRNGStatesTracker.add``).

    Fix: the tracker's named states become CPU generator states seeded with upstream's offsets
    (data-parallel ``seed``, model-parallel ``seed + 2718 + tp_rank``, expert-parallel
    ``seed + 1024 + 100 * ep_rank + etp_rank``; the offsets are computed by the unchanged upstream
    ``model_parallel_cuda_manual_seed``), and the tracker's get/set state helpers (used by
    ``fork()`` and by activation recompute) read and write the global CPU generator.
    """
    from megatron.core.tensor_parallel import random as mrandom

    p.set(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
    p.set(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
    p.set(mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add)
    logger = logging.getLogger(mrandom.__name__)
    if _RNG_FILTER not in logger.filters:
        logger.addFilter(_RNG_FILTER)


# --------------------------------------------------------------------------------------------
# 2. torch.cuda.current_device()
# --------------------------------------------------------------------------------------------


def patch_current_device(p: _Patch) -> None:
    """Item 2: ``torch.cuda.current_device()`` raises ``AssertionError: Torch not compiled with
    CUDA enabled``; megatron-core uses its result as a device (layers' weights with
    use_cpu_initialization, the router, rotary embeddings, TP mappings, DDP buffers, ...).

    Fix: while CUDA is absent, ``torch.cuda.current_device()`` returns ``"cpu"``.
    """
    original = torch.cuda.current_device

    @functools.wraps(original)
    def current_device():
        if torch.cuda.is_available():
            return original()
        return "cpu"

    p.set(torch.cuda, "current_device", current_device)


def patch_cuda_synchronize(p: _Patch) -> None:
    """Found here (not in CPU_MEGATRON.md's list): dist_checkpointing's torch_dist saver preloads
    tensors to host with ``non_blocking=True`` and then calls ``torch.cuda.synchronize()``
    (filesystem_async.preload_tensors) -> ``AssertionError: Torch not compiled with CUDA
    enabled``; the cached-plan check in state_dict_saver allocates on ``device='cuda'``.

    Fix: while CUDA is absent, ``torch.cuda.synchronize()`` is a no-op (there is no device queue
    to wait for), and CUDA factory calls in state_dict_saver allocate on CPU.
    """
    from megatron.core.dist_checkpointing.strategies import state_dict_saver

    original = torch.cuda.synchronize

    @functools.wraps(original)
    def synchronize(device=None):
        if torch.cuda.is_available():
            return original(device)
        return None

    p.set(torch.cuda, "synchronize", synchronize)
    _redirect_cuda_factories(p, state_dict_saver)


# --------------------------------------------------------------------------------------------
# 3. te_general_gemm
# --------------------------------------------------------------------------------------------


def patch_te_general_gemm(p: _Patch) -> None:
    """Item 3 (megatron-core 0.16.1 only): ``moe_utils.RouterGatingLinearFunction`` (used when
    ``moe_router_dtype`` is set) reads ``te_general_gemm``, which is only defined when Transformer
    Engine imports -> ``NameError: name 'te_general_gemm' is not defined`` (also on a GPU without
    TE).

    Fix: define ``moe_utils.te_general_gemm = None`` so the torch.mm fallback runs.
    """
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in moe_utils.__dict__:
        p.set(moe_utils, "te_general_gemm", None)


def patch_missing_te_general_gemm() -> None:
    """Apply patch 3 alone (safe on GPU too: it only defines the name when TE is absent)."""
    _apply("te_general_gemm", patch_te_general_gemm)


def patch_mla_te_placeholders(p: _Patch) -> None:
    """New (megatron-core 0.16.1, DeepSeek-V3's MLA): ``megatron.core.extensions.transformer_engine``
    imports without Transformer Engine and hands out mock placeholders for ``TELinear`` etc., so
    ``multi_latent_attention`` sets ``HAVE_TE = True`` and ``MultiLatentAttention.__init__`` calls
    ``isinstance(self.linear_proj, TELinear)`` with a mock -> ``TypeError: isinstance() arg 2 must be
    a type, a tuple of types, or a union`` (also on a GPU without TE).

    Fix: when ``transformer_engine`` is not importable, ``multi_latent_attention.HAVE_TE = False`` (the
    value upstream's own ``except ImportError`` branch sets); its TE-only FP8 branch is then skipped.
    """
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        from megatron.core.transformer import multi_latent_attention

        p.set(multi_latent_attention, "HAVE_TE", False)


# --------------------------------------------------------------------------------------------
# 4. alltoall dispatcher CUDA streams
# --------------------------------------------------------------------------------------------


class _NoStream:
    """Placeholder for MoEAlltoAllTokenDispatcher.cuda_dtoh_stream on CPU (never used)."""

    def __repr__(self) -> str:
        return "<cpu: no device-to-host stream>"


def _cpu_maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """CPU version of ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: every tensor is
    already on the host, so there is nothing to copy and nothing to synchronise; but, as upstream's
    copy does, the all-to-all split sizes become numpy arrays at the copy point
    (``all_to_all_single`` takes a sequence of ints, not a tensor: with ep_size > 1 a tensor
    raises ``TypeError: all_to_all_single(): incompatible function arguments``)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name, None)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def patch_alltoall_streams(p: _Patch) -> None:
    """Item 4: ``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()`` ->
    ``RuntimeError: torch.cuda.Stream requires CUDA support``; its device-to-host sync uses
    ``torch.cuda.current_stream()`` / ``torch.cuda.stream()``.

    Fix: a placeholder class-level stream (so __init__ creates none) and a host "copy" that only
    turns the split sizes into numpy arrays as upstream's does (needed once ep_size > 1).
    The allgather dispatcher needs no fix.
    """
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    p.set(D, "cuda_dtoh_stream", _NoStream())
    p.set(D, "_maybe_dtoh_and_synchronize", _cpu_maybe_dtoh_and_synchronize)


# --------------------------------------------------------------------------------------------
# 5 and 8. device="cuda" literals in factory calls
# --------------------------------------------------------------------------------------------

_FACTORY_NAMES = frozenset(
    {
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "rand",
        "randn",
        "randint",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
    }
)


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA device index
    return device


class _CpuFactoryTorch:
    """Stand-in for the ``torch`` module inside one megatron module: every attribute is torch's,
    except that tensor factories map a CUDA ``device=`` to CPU and drop ``pin_memory``."""

    def __init__(self, real_torch):
        object.__setattr__(self, "_real", real_torch)
        object.__setattr__(self, "_wrapped", {})

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name not in _FACTORY_NAMES:
            return value
        wrapped = self._wrapped.get(name)
        if wrapped is None:

            @functools.wraps(value)
            def wrapped(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _to_cpu_device(kwargs["device"])
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
                return value(*args, **kwargs)

            self._wrapped[name] = wrapped
        return wrapped

    def __repr__(self) -> str:
        return f"<moerl cpu-factory proxy of {self._real!r}>"


def _redirect_cuda_factories(p: _Patch, module) -> None:
    if not isinstance(module.__dict__.get("torch"), _CpuFactoryTorch):
        p.set(module, "torch", _CpuFactoryTorch(torch))


def patch_cuda_factories(p: _Patch) -> None:
    """Item 5: ``attention_mask=None`` makes the default causal mask with
    ``torch.ones(sq, sq, device="cuda")`` (transformer/utils.py), and the schedules
    (no-pipelining and 1F1B) allocate ``torch.zeros([], device="cuda")`` -> ``Torch not compiled
    with CUDA enabled``. Same literal in the MoE logging tracker and ``broadcast_data``.

    Fix: inside those modules only, tensor factories with a CUDA ``device=`` allocate on CPU.
    (moerl still passes an explicit causal mask, see ``moerl.models.qwen3_moe.causal_attention_mask``.)
    """
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import data as tp_data
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import moe_utils

    for module in (schedules, transformer_utils, moe_utils, tp_data):
        _redirect_cuda_factories(p, module)


_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
}


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """Within the block, ``tensor.type()`` (no argument) of a CPU float tensor returns the CUDA
    type name (e.g. ``'torch.cuda.FloatTensor'``). Only used around the megatron optimizer calls
    that check type names; ``tensor.type(dtype)`` conversions are untouched."""
    with _LOCK:
        original = torch.Tensor.__dict__.get("type", _MISSING)
        real_type = torch.Tensor.type

        def type_(self, dtype=None, non_blocking=False, **kwargs):
            if dtype is None and not kwargs and self.device.type == "cpu":
                name = real_type(self)
                return _CPU_TO_CUDA_TYPE.get(name, name)
            return real_type(self, dtype, non_blocking, **kwargs)

        torch.Tensor.type = type_
        try:
            yield
        finally:
            if original is _MISSING:
                del torch.Tensor.type
            else:
                torch.Tensor.type = original


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with cuda_type_names():
            return fn(*args, **kwargs)

    wrapper.__moerl_cpu_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def patch_optimizer_cuda_checks(p: _Patch) -> None:
    """Item 8: with ``clip_grad > 0``, ``clip_grad_by_total_norm_fp32`` asserts
    ``param.grad.type() == 'torch.cuda.FloatTensor'`` (AssertionError); the fp16/bf16 and
    distributed optimizers sort parameters by ``param.type()`` CUDA names and raise
    ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...`` for CPU params;
    the grad-norm / FP32 optimizer / grad scaler allocate with ``device='cuda'``.

    Fix: those calls see CUDA type names for CPU tensors (scoped to the call), and CUDA factory
    calls in the optimizer modules allocate on CPU.
    """
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as mopt

    for module in (clip_grads, mopt, grad_scaler, distrib_optimizer, mcore_utils):
        _redirect_cuda_factories(p, module)

    wrapped_clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    p.set(clip_grads, "clip_grad_by_total_norm_fp32", wrapped_clip)
    p.set(mopt, "clip_grad_by_total_norm_fp32", wrapped_clip)
    for cls in (mopt.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        p.set(cls, "__init__", _with_cuda_type_names(cls.__dict__["__init__"]))


# --------------------------------------------------------------------------------------------
# 7. torch norm with sequence parallelism
# --------------------------------------------------------------------------------------------


def patch_torch_norm_sequence_parallel(p: _Patch) -> None:
    """Item 7: TP > 1 with MoE requires ``sequence_parallel=True``, and the torch (non-Apex,
    non-TE) norm ``WrappedTorchNorm`` asserts ``not config.sequence_parallel`` ->
    ``AssertionError: sequence parallel not supported by torch LayerNorm``.

    Fix: build the norm from a copy of the config with sequence_parallel off, then mark its
    parameters ``sequence_parallel = True`` so finalize_model_grads all-reduces their gradients
    over the TP group (what Transformer Engine's norms do).
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__dict__["__new__"]

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        local_config = copy.copy(config)
        object.__setattr__(local_config, "sequence_parallel", False)
        norm = original_new(cls, local_config, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    p.set(WrappedTorchNorm, "__new__", staticmethod(__new__))


# --------------------------------------------------------------------------------------------
# tied embeddings with pipeline parallelism
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _cpu_tensor_cuda_is_identity() -> Iterator[None]:
    """Within the block, ``tensor.cuda()`` of a CPU tensor returns the tensor itself."""
    with _LOCK:
        original = torch.Tensor.__dict__.get("cuda", _MISSING)
        real_cuda = torch.Tensor.cuda

        def cuda(self, *args, **kwargs):
            if self.device.type == "cpu" and not torch.cuda.is_available():
                return self
            return real_cuda(self, *args, **kwargs)

        torch.Tensor.cuda = cuda
        try:
            yield
        finally:
            if original is _MISSING:
                del torch.Tensor.cuda
            else:
                torch.Tensor.cuda = original


def patch_tied_embedding_cuda(p: _Patch) -> None:
    """Found here (not in CPU_MEGATRON.md's list): a GPTModel with
    ``share_embeddings_and_output_weights`` and pp_size > 1 copies the first stage's embedding to
    the last stage's output layer in ``LanguageModule.setup_embeddings_and_output_layer``, which
    runs ``weight.data = weight.data.cuda()`` before the all-reduce -> ``AssertionError: Torch not
    compiled with CUDA enabled``.

    Fix: during that method only, ``Tensor.cuda()`` of a CPU tensor is the tensor itself.
    """
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.__dict__["setup_embeddings_and_output_layer"]

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        with _cpu_tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    p.set(LanguageModule, "setup_embeddings_and_output_layer", setup_embeddings_and_output_layer)


def patch_thd_rope(p: _Patch) -> None:
    """Speed, not an error: for packed (THD) input megatron's attention calls the unfused
    ``rope_utils.apply_rotary_pos_emb``, which splits the row into its sequences in Python and
    rebuilds ``cos``/``sin`` for every query and key of every layer (6.4 ms of fwd + bwd per training
    step of the demo's 128 sequences, 3 layers; Transformer Engine's fused THD RoPE does it on GPU).

    Fix: megatron's attention module calls moerl.models.packed_attention.packed_rotary_pos_emb, which
    gives the same tensors bit for bit in one vectorised step (2.5 ms) and hands every other case to
    the original function.
    """
    from megatron.core.transformer import attention

    from moerl.models.packed_attention import packed_rotary_pos_emb

    original = attention.__dict__["apply_rotary_pos_emb"]

    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        return packed_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group,
                                     fallback=original)

    p.set(attention, "apply_rotary_pos_emb", apply_rotary_pos_emb)


def _is_identity_order(sorted_idxs: Any) -> bool:
    """``sorted_idxs`` (int tensor) is 0, 1, ..., n-1, read on the host (a CPU tensor only: no device sync)."""
    return (isinstance(sorted_idxs, torch.Tensor) and sorted_idxs.device.type == "cpu" and sorted_idxs.dim() == 1
            and torch.equal(sorted_idxs, torch.arange(sorted_idxs.numel(), dtype=sorted_idxs.dtype)))


def patch_identity_chunk_sort(p: _Patch) -> None:
    """Speed, not an error: ``MoEAlltoAllTokenDispatcher`` sorts the received tokens by local expert
    (``moe_utils.sort_chunks_by_idxs``: split into tp*ep x num_local_experts chunks, concatenate them in
    ``sort_input_by_local_experts`` order) and unsorts the expert outputs the same way, whenever a rank
    holds more than one expert. With tp_size * ep_size == 1 both orders are the identity, so each call
    is a copy of the tokens (and of the probs) forward and a split + concatenation of their gradients
    backward: 6 ``cat`` per MoE layer per micro-batch (3 forward, 3 backward), 54 of the 68 ``cat`` of a
    demo training step (3 MoE layers, 3 micro-batches), which took 15 ms of its 140 (torch.profiler).

    Fix: megatron's token dispatcher calls a ``sort_chunks_by_idxs`` that returns ``input`` and
    ``probs`` themselves when ``sorted_idxs`` is 0, 1, ..., n-1 (the result the original gives, without
    the copies; checked on the host index tensor, which is on the CPU unless moe_permute_fusion), and the
    original otherwise (tp * ep > 1, the fused TE path).
    """
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.__dict__["sort_chunks_by_idxs"]

    @functools.wraps(original)
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if not fused and _is_identity_order(sorted_idxs):
            return input, probs
        return original(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    p.set(token_dispatcher, "sort_chunks_by_idxs", sort_chunks_by_idxs)


# --------------------------------------------------------------------------------------------
# Not a patch: torch's fused Adam kernel for Megatron's CPU fallback optimizer
# --------------------------------------------------------------------------------------------


def fused_cpu_adam(optimizer) -> int:
    """Switch the torch Adam(W) inside a Megatron optimizer (``get_megatron_optimizer``'s wrapper, or a
    ``ChainedOptimizer`` of them) to torch's fused kernel (``fused=True``, torch >= 2.4 on CPU) when all
    of its parameters are CPU tensors; returns how many torch optimizers were switched.

    Megatron-Core takes Transformer Engine's or Apex's FusedAdam on GPUs and falls back to
    ``torch.optim.AdamW`` without them: on CPU that runs one Python-level update per parameter
    tensor (``foreach`` is off by default for CPU tensors). The fused kernel computes the same AdamW
    update (to float32 rounding) in one call: on the demo model the whole Megatron optimizer step
    (grad norm, clipping, Adam) took 2.8 ms instead of 6.4. GPU optimizers are left alone. The flag lives
    in the param groups, which torch's ``load_state_dict`` replaces with the saved ones: MegatronActor.set_lr
    calls this after building the optimizer, and moerl.checkpoint.dist_ckpt keeps the running optimizer's
    flags over a load.
    """
    switched = 0
    for wrapper in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(wrapper, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or any(p.device.type != "cpu" for p in params):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        switched += 1
    return switched


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

_PATCHES: dict[str, Callable[[_Patch], None]] = {
    "rng_tracker": patch_rng_tracker,
    "current_device": patch_current_device,
    "cuda_synchronize": patch_cuda_synchronize,
    "te_general_gemm": patch_te_general_gemm,
    "alltoall_streams": patch_alltoall_streams,
    "cuda_factories": patch_cuda_factories,
    "torch_norm_sequence_parallel": patch_torch_norm_sequence_parallel,
    "optimizer_cuda_checks": patch_optimizer_cuda_checks,
    "tied_embedding_cuda": patch_tied_embedding_cuda,
    "mla_te_placeholders": patch_mla_te_placeholders,
    "thd_rope": patch_thd_rope,
    "identity_chunk_sort": patch_identity_chunk_sort,
}

PATCH_NAMES: tuple[str, ...] = tuple(_PATCHES)


def _apply(name: str, fn: Callable[[_Patch], None]) -> None:
    with _LOCK:
        if name in _APPLIED:
            return
        patch = _Patch(name)
        try:
            fn(patch)
        except Exception:
            patch.undo()
            raise
        _APPLIED[name] = patch


def apply_cpu_patches() -> bool:
    """Install every CPU patch (idempotent). Returns True when patches are active.

    Does nothing and returns False when ``torch.cuda.is_available()``. On CPU it also sets
    ``TORCHDYNAMO_DISABLE=1`` (item 9: megatron's jit fusers would otherwise compile with Inductor,
    ~25 s cold) unless the variable is already set.
    """
    if not _cuda_is_absent():
        return False
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    for name, fn in _PATCHES.items():
        _apply(name, fn)
    return True


def applied_patches() -> tuple[str, ...]:
    """Names of the patches currently installed."""
    return tuple(_APPLIED)


@contextlib.contextmanager
def without_patch(name: str) -> Iterator[None]:
    """Temporarily undo one installed patch (for tests that reproduce the original error).

    Raises:
        ValueError: ``name`` is not one of ``PATCH_NAMES`` or is not installed.
    """
    if name not in _PATCHES:
        raise ValueError(f"unknown patch {name!r}; expected one of {PATCH_NAMES}")
    with _LOCK:
        patch = _APPLIED.get(name)
        if patch is None:
            raise ValueError(f"patch {name!r} is not installed; call apply_cpu_patches() first")
        patch.undo()
        try:
            yield
        finally:
            patch.redo()
