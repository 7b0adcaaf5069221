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
attention within each ``cu_seqlens`` segment, computed segment by segment with the parent's own
math (same scaling, GQA expansion, masked softmax, dropout), so a packed forward matches
separate forwards to fp32 rounding. Without ``packed_seq_params`` it is the parent unchanged.

``max_seqlen`` must be the true longest segment: if it equals T with several segments, Megatron's
THD RoPE switches to "absolute offsets" mode (positions continue across sequences).
:func:`make_packed_seq_params` checks this.
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = [
    "PackedDotProductAttention",
    "make_packed_seq_params",
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
        for n, starts in by_length.items():
            idx = (torch.tensor(starts).unsqueeze(0) + torch.arange(n).unsqueeze(1)).reshape(-1)  # [n * B], s-major
            idx = idx.to(query.device)
            b = len(starts)
            q = query.index_select(0, idx).reshape(n, b, *query.shape[2:])
            k = key.index_select(0, idx).reshape(n, b, *key.shape[2:])
            v = value.index_select(0, idx).reshape(n, b, *value.shape[2:])
            mask = torch.ones(n, n, dtype=torch.bool, device=query.device).triu_(1).view(1, 1, n, n)
            o = super().forward(q, k, v, mask, attn_mask_type=AttnMaskType.causal)  # [n, b, hidden]
            out = out.index_copy(0, idx, o.reshape(n * b, self.hidden_size_per_partition))
        return out


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
