"""Packed (THD) sequences through Megatron-Core's local (non-Transformer-Engine) layer spec.

Several sequences are concatenated along the token axis into one row, ``tokens [1, T]``, with
``cu_seqlens [k+1]`` (int32, cumulative lengths, ``cu_seqlens[0] = 0``, ``cu_seqlens[-1] = T``)
and handed to ``GPTModel.forward(..., packed_seq_params=PackedSeqParams(qkv_format="thd", ...))``.
megatron-core 0.16.1 then

* builds RoPE frequencies for ``max_seqlen`` positions and applies them per sequence, each
  sequence from position 0 (``rope_utils._apply_rotary_pos_emb_thd``; ``position_ids`` are
  ignored for RoPE, so packing with a block-diagonal mask alone would be wrong: shared design
  CPU_MEGATRON.md);
* squeezes q/k/v to ``[T, heads, head_dim]`` and calls the core attention with
  ``packed_seq_params``. Transformer Engine's attention handles that on GPU; the local spec's
  ``DotProductAttention`` asserts ``packed_seq_params is None``.

:class:`PackedDotProductAttention` is that local core attention with a THD branch: causal
attention within each ``cu_seqlens`` segment, segments of equal length batched together, so a
packed forward matches separate forwards to fp32 rounding. Each batch runs through torch's
``scaled_dot_product_attention`` (its CPU flash kernel, forward and backward, with the parent's
softmax scale and grouped-query heads) when the parent's math would compute the same thing: no
attention dropout in training, a vanilla softmax, no sliding window. Otherwise it runs through
the parent's own math (GQA expansion, masked softmax, dropout under Megatron's RNG tracker). On
the demo model the flash kernel made a training step (forward + backward + Adam) 7-9% faster
than the parent's math (``python tools/bench_train.py --threads 1``). Without
``packed_seq_params`` it is the parent unchanged.

``max_seqlen`` must be the true longest segment: if it equals T with several segments, Megatron's
THD RoPE switches to "absolute offsets" mode (positions continue across sequences).
:func:`make_packed_seq_params` checks this.
"""

from __future__ import annotations

import copy
import threading
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = [
    "PackedDotProductAttention",
    "make_packed_seq_params",
    "packed_rotary_pos_emb",
    "with_packed_core_attention",
]


def make_packed_seq_params(cu_seqlens: torch.Tensor | Sequence[int], device=None) -> PackedSeqParams:
    """``PackedSeqParams`` for causal self-attention over packed sequences (THD layout).

    Args:
        cu_seqlens: cumulative sequence lengths [k+1] (tensor or ints): 0, L1, L1+L2, ..., T,
            every segment non-empty.
        device: where to put the int32 tensor (default: the input's device, or CPU).

    Returns:
        megatron.core.packed_seq_params.PackedSeqParams with qkv_format="thd",
        cu_seqlens_q = cu_seqlens_kv (int32 [k+1]) and max_seqlen_q = max_seqlen_kv = the
        longest segment.

    Raises:
        ValueError: not 1-D, fewer than 2 entries, not starting at 0, or a segment of length <= 0.
    """
    cu = torch.as_tensor(cu_seqlens)
    if device is not None:
        cu = cu.to(device)
    cu = cu.to(torch.int32)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries (0 and T), got shape {tuple(cu.shape)}")
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    seg = cu[1:] - cu[:-1]
    if bool((seg <= 0).any()):
        raise ValueError(f"cu_seqlens must be strictly increasing (empty segments are not allowed), got {cu.tolist()}")
    max_seqlen = int(seg.max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )


_ROPE_CACHE = threading.local()


def _tensor_version(t: torch.Tensor) -> Optional[int]:
    """``t``'s in-place modification counter, or None where it has none (inference-mode tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


def packed_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens: Optional[torch.Tensor] = None,
                          mscale: float = 1.0, cp_group=None, *, fallback=None) -> torch.Tensor:
    """RoPE for packed THD input in one vectorised step: what megatron-core 0.16.1's unfused
    ``rope_utils.apply_rotary_pos_emb`` computes for ``cu_seqlens`` (each segment from position 0,
    rotate-half form, ``cos``/``sin`` times ``mscale`` in ``t``'s dtype), bit for bit, without its
    Python loop over the segments and with ``cos``/``sin`` made once per packed micro-batch instead of
    once per call (the query and key of every layer share them: one cache entry per thread, held while
    the same ``freqs`` and ``cu_seqlens`` tensors come back unmodified: their identity and in-place version
    counters are the key). On GPUs Transformer Engine's fused THD RoPE does
    this; moerl.runtime.cpu_compat installs this function in megatron's attention module on CPU.

    Args:
        t: [T, heads, head_dim] (packed tokens; any float dtype).
        freqs: [max_seqlen, 1, 1, rot_dim] float angles (Megatron's RotaryEmbedding output).
        config: the TransformerConfig (apply_rope_fusion, rotary_interleaved, multi_latent_attention).
        cu_seqlens: int32 [k+1] segment boundaries, or None (not packed).
        mscale, cp_group: as Megatron's.
        fallback: the function to call for every case this one does not cover (no cu_seqlens, RoPE
            fusion, interleaved or MLA rotary, partial rotary, context parallelism, and freqs covering
            all T positions, Megatron's "exact offsets" mode); default megatron's
            ``rope_utils.apply_rotary_pos_emb``.

    Returns:
        [T, heads, head_dim], ``t``'s dtype.
    """
    if fallback is None:
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as fallback
    if (cu_seqlens is None or getattr(config, "apply_rope_fusion", False) or getattr(config, "rotary_interleaved", False)
            or getattr(config, "multi_latent_attention", False) or t.dim() != 3 or freqs.shape[-1] != t.shape[-1]
            or (cp_group is not None and cp_group.size() > 1) or freqs.size(0) == int(cu_seqlens[-1])):
        return fallback(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    key = (mscale, t.dtype, t.device, _tensor_version(freqs), _tensor_version(cu_seqlens))
    hit = getattr(_ROPE_CACHE, "entry", None)
    if hit is None or hit[0] is not freqs or hit[1] is not cu_seqlens or hit[2] != key or None in key:
        cu = cu_seqlens.to(device=freqs.device, dtype=torch.long)
        lengths = cu[1:] - cu[:-1]
        positions = torch.arange(int(cu[-1]), device=freqs.device) - torch.repeat_interleave(cu[:-1], lengths)
        angles = freqs.index_select(0, positions).squeeze(1)  # [T, 1, rot_dim]
        cos = (torch.cos(angles) * mscale).to(device=t.device, dtype=t.dtype)
        sin = (torch.sin(angles) * mscale).to(device=t.device, dtype=t.dtype)
        hit = _ROPE_CACHE.entry = (freqs, cu_seqlens, key, cos, sin)
    cos, sin = hit[3], hit[4]
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


class PackedDotProductAttention(DotProductAttention):
    """Megatron-Core ``DotProductAttention`` (local spec) that also accepts THD packed input.

    With ``packed_seq_params`` (qkv_format "thd"): query ``[T, np, hn]``, key/value
    ``[T, ng, hn]`` (T = total packed tokens, np/ng = query heads / query groups of this TP
    rank), any float dtype; returns ``[T, np * hn]``. Each segment ``cu_seqlens_q[i] :
    cu_seqlens_q[i+1]`` attends causally to itself only (``attention_mask`` is ignored; the
    model may be called with ``attention_mask=None``). With ``cu_seqlens_q_padded`` given
    (Transformer Engine's convention), segments are laid out at the padded offsets and the
    padding rows of each segment are zero in the output.

    Without ``packed_seq_params`` it is ``DotProductAttention.forward`` unchanged.

    The segments of one length run as one batch: through ``torch.nn.functional.
    scaled_dot_product_attention`` (causal, scale = the parent's 1/sqrt(head_dim) including
    apply_query_key_layer_scaling's factor, ``enable_gqa``) when :meth:`uses_flash_kernel`, else
    through ``DotProductAttention.forward`` with an explicit causal mask.

    Raises:
        ValueError: a THD call with a mask type other than causal, different q/kv segment
            boundaries, or cu_seqlens that do not cover the tokens.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params,
            )
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type != AttnMaskType.causal:
            raise ValueError(f"packed (THD) attention supports the causal mask only, got {mask_type}")
        p = packed_seq_params
        cu_q = p.cu_seqlens_q
        cu_kv = p.cu_seqlens_kv if p.cu_seqlens_kv is not None else cu_q
        if cu_q is None or not torch.equal(cu_q.cpu(), cu_kv.cpu()):
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv (set both)")
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        offsets = (p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else cu_q).tolist()
        t = query.shape[0]
        if offsets[-1] != t:
            raise ValueError(f"cu_seqlens cover {offsets[-1]} tokens but the packed input has {t}")
        if query.dim() == 3:  # [T, np, hn] -> [T, 1, np, hn] (the parent expects sbhd)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        # Segments of equal length run as one batch through the parent's attention (one call per
        # distinct length instead of one per sequence); rows outside every segment stay zero.
        by_length: dict[int, list[int]] = {}
        for start, n in zip(offsets[:-1], lengths):
            if n > 0:
                by_length.setdefault(n, []).append(start)
        out = query.new_zeros(t, self.hidden_size_per_partition)
        flash = self.uses_flash_kernel()
        for n, starts in by_length.items():
            b = len(starts)
            if flash:  # [B * n], b-major: each segment's rows in order
                idx = (torch.tensor(starts).unsqueeze(1) + torch.arange(n).unsqueeze(0)).reshape(-1).to(query.device)
                q, k, v = (x.index_select(0, idx).view(b, n, *x.shape[2:]).transpose(1, 2)  # [B, heads, n, hn]
                           for x in (query, key, value))
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self._sdpa_scale(),
                                                   enable_gqa=k.shape[1] != q.shape[1])
                o = o.transpose(1, 2).reshape(b * n, self.hidden_size_per_partition)
            else:  # [n * B], s-major (the parent's sbhd layout)
                idx = (torch.tensor(starts).unsqueeze(0) + torch.arange(n).unsqueeze(1)).reshape(-1).to(query.device)
                q, k, v = (x.index_select(0, idx).reshape(n, b, *x.shape[2:]) for x in (query, key, value))
                mask = torch.ones(n, n, dtype=torch.bool, device=query.device).triu_(1).view(1, 1, n, n)
                o = super().forward(q, k, v, mask, attn_mask_type=AttnMaskType.causal)  # [n, b, hidden]
                o = o.reshape(n * b, self.hidden_size_per_partition)
            out = out.index_copy(0, idx, o)
        return out

    def uses_flash_kernel(self) -> bool:
        """True when the THD branch runs torch's ``scaled_dot_product_attention``: it then computes
        exactly the parent's attention (to rounding), because no dropout is applied (eval, or
        attention_dropout 0), the softmax is vanilla (no offset) and there is no sliding window."""
        no_dropout = not (self.training and self.attention_dropout.p > 0)
        return (no_dropout and self.config.softmax_type == "vanilla" and self.softmax_offset is None
                and self.scale_mask_softmax.window_size is None)

    def _sdpa_scale(self) -> float:
        """The parent's total softmax scale: ``softmax_scale`` (divided by the layer number under
        apply_query_key_layer_scaling) times the scale its fused softmax multiplies back."""
        return self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)


TE_INSTALL_HINT = (
    "packed (THD) attention on GPU uses Transformer Engine's fused attention; install it in the GPU "
    "image (pip install --no-build-isolation 'transformer_engine[pytorch]', see the Dockerfile) or "
    "set train.pack=false"
)


def packed_core_attention_class(use_cuda: Optional[bool] = None):
    """The core-attention module for packed (THD) micro-batches on this machine.

    - CPU (no CUDA): :class:`PackedDotProductAttention` (moerl's, exact, batched per length).
    - CUDA: Megatron's ``TEDotProductAttention`` (Transformer Engine fused attention, which takes
      ``packed_seq_params`` with ``cu_seqlens`` natively); it has no parameters, so the model's
      state dict and the HF conversion are unchanged.

    Args:
        use_cuda: None = ``torch.cuda.is_available()``.

    Raises:
        ImportError: CUDA without Transformer Engine (the message says what to install).
    """
    if use_cuda is None:
        use_cuda = torch.cuda.is_available()
    if not use_cuda:
        return PackedDotProductAttention
    try:
        import transformer_engine  # noqa: F401  (megatron's extension module imports without it)
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError as e:  # Transformer Engine missing or broken
        raise ImportError(f"{TE_INSTALL_HINT} ({e})") from e
    return TEDotProductAttention


def with_packed_core_attention(block_spec, use_cuda: Optional[bool] = None):
    """A copy of a local-spec decoder block spec whose core attention takes packed THD input
    (:func:`packed_core_attention_class`) wherever it was ``DotProductAttention``.

    Args:
        block_spec: a ``TransformerBlockSubmodules`` (``get_gpt_decoder_block_spec(...,
            use_transformer_engine=False)``) or a single layer ``ModuleSpec``.
        use_cuda: None = ``torch.cuda.is_available()``.

    Returns:
        The modified copy; Transformer Engine specs (which handle THD themselves) come back
        unchanged. The model's parameters and state dict are the same either way.

    Raises:
        ImportError: CUDA without Transformer Engine.
    """
    core_attention = packed_core_attention_class(use_cuda)
    spec = copy.deepcopy(block_spec)
    layer_specs = getattr(spec, "layer_specs", None)
    for layer in layer_specs if layer_specs is not None else [spec]:
        attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
        sub = getattr(attn, "submodules", None)
        if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention:
            sub.core_attention = core_attention
    return spec
