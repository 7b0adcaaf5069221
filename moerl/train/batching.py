"""Turn Samples into padded micro-batches for the Megatron actor (no packing yet: issue #4).

Layout of one micro-batch (B samples, S = longest prompt+response in the micro-batch):
  tokens     [B, S] int64  prompt ids then response ids, right-padded with pad_id
  labels     [B, S] int64  labels[:, t] = tokens[:, t + 1] (next token), pad where undefined
  loss_mask  [B, S] float32 1 where labels[:, t] is a response token whose loss_mask is 1
  per-token float tensors [B, S] aligned with labels (old_log_probs, ref_log_probs, rollout_log_probs)
  advantages [B] float32
  routed_experts [B, S, L, K] int32 or None: MoE routing replay targets, position-aligned with tokens
Right padding with a causal mask leaves every real token's logits unchanged.

Packed micro-batches (:class:`PackedMicroBatch`, :func:`make_packed_micro_batch`) carry the same
padded label-aligned fields (so loss closures run unchanged) plus the THD layout the model runs
on: all samples concatenated into one row ``packed_tokens [1, T]`` with ``cu_seqlens``; the
model's per-token outputs [1, T] are mapped back to [B, S] with :meth:`PackedMicroBatch.unpack`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from moerl.types import Sample


@dataclass
class MicroBatch:
    """One padded micro-batch. See the module docstring for shapes; ``sample_indices`` are the
    positions of its samples in the list the micro-batch was cut from."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    sample_indices: list[int]
    response_starts: list[int]
    response_lengths: list[int]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # MoE routing replay targets (moerl.moe.routing_replay): int32 [B, S, num_layers, topk],
    # POSITION-aligned with ``tokens`` (row t = experts of the token at t), -1 = router chooses
    # freely (padding, unrecorded positions); None when no sample carries Sample.routed_experts.
    # Kept separate from ``extras`` (which are [B, S] label-aligned floats).
    routed_experts: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def gather_response(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Split a [B, S] label-aligned tensor into per-sample response tensors (len = response length)."""
        return [
            per_token[i, s : s + n]
            for i, (s, n) in enumerate(zip(self.response_starts, self.response_lengths))
        ]


def make_micro_batch(
    samples: Sequence[Sample],
    sample_indices: Sequence[int],
    pad_id: int,
    per_token_fields: Optional[dict[str, Sequence[Sequence[float]]]] = None,
) -> MicroBatch:
    """Pad ``samples`` into one MicroBatch.

    Args:
        samples: the samples of this micro-batch (each with prompt_ids, response_ids, loss_mask).
        sample_indices: their indices in the caller's list (kept for scattering results back).
        pad_id: token id used for padding.
        per_token_fields: optional name -> one list of per-response-token floats per sample
            (e.g. "old_log_probs"); each is placed label-aligned into a [B, S] float32 tensor.

    No samples gives an EMPTY micro-batch (a packing plan with fewer samples than micro-batches):
    one all-padding row [1, 1] (pad_id, loss mask 0, advantage 0, every per-token field 0) and no
    sample_indices, so it contributes zero loss and zero tokens but still runs the model's
    collectives like the other ranks' micro-batches (:func:`padding_mask` marks the row padding).

    Raises:
        ValueError: a sample without prompt or response tokens, or a loss_mask / per-token field of the
            wrong length.
    """
    return _micro_batch(samples, sample_indices, pad_id, per_token_fields)[0]


def _micro_batch(samples, sample_indices, pad_id, per_token_fields):
    """make_micro_batch, plus the samples' tokens back to back (int64 [sum L]) and their lengths L (int64 [B]).

    Each field is written by ONE masked assignment from the samples' values concatenated (a Python
    loop of small tensor writes per sample cost ~10 torch ops per sample; padded Python rows cost B x S).
    """
    for s in samples:
        if not s.response_ids:
            raise ValueError(f"sample {s.index} (group {s.group_id}) has no response tokens")
        if not s.prompt_ids:
            raise ValueError(f"sample {s.index} (group {s.group_id}) has no prompt tokens")
        if s.loss_mask and len(s.loss_mask) != len(s.response_ids):
            raise ValueError(f"sample {s.index} has a loss_mask of {len(s.loss_mask)} values for "
                             f"{len(s.response_ids)} response tokens")
    b = len(samples)
    plen = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    rlen = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
    lengths = plen + rlen
    seq_len = int(lengths.max()) if b else 1
    flat = torch.tensor(list(itertools.chain.from_iterable(itertools.chain(s.prompt_ids, s.response_ids)
                                                            for s in samples)), dtype=torch.long)
    pos = torch.arange(seq_len)
    real = pos < lengths[:, None]  # [B, S]: token positions of each sample
    tokens = torch.full((max(b, 1), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((max(b, 1), seq_len), pad_id, dtype=torch.long)
    if b:
        tokens[real] = flat
        first = torch.ones(flat.numel(), dtype=torch.bool)
        first[torch.cumsum(lengths, 0) - lengths] = False  # each sample's first token is nobody's label
        labels[pos < (lengths - 1)[:, None]] = flat[first]
    starts = plen - 1  # label position of the first response token
    response = (pos >= starts[:, None]) & (pos < (starts + rlen)[:, None])  # [B, S], row-major = token order

    def label_aligned(values: list) -> torch.Tensor:  # [max(B, 1), S] float32, 0 outside responses
        t = torch.zeros((max(b, 1), seq_len), dtype=torch.float32)
        if values:  # the first len(values) samples' responses (a sample past the end keeps zeros)
            mask = response if len(values) == b else response & (torch.arange(b) < len(values))[:, None]
            t[mask] = torch.cat(values)
        return t

    loss_mask = label_aligned([torch.as_tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask
                               else torch.ones(len(s.response_ids), dtype=torch.float32) for s in samples])
    extras = {}
    for name, values in (per_token_fields or {}).items():
        rows = []
        for i, v in enumerate(values[:b]):
            v, n = torch.as_tensor(v, dtype=torch.float32), len(samples[i].response_ids)
            if v.dim() != 1:
                raise ValueError(f"{name} of sample {samples[i].index} has shape {tuple(v.shape)}; expected one "
                                 f"value per response token, shape ({n},)")
            if v.numel() != n:
                raise ValueError(f"{name} of sample {samples[i].index} has {v.numel()} values for {n} response tokens")
            rows.append(v)
        extras[name] = label_aligned(rows)  # an empty micro-batch keeps the zeros
    advantages = torch.tensor([float(s.advantage) for s in samples] or [0.0], dtype=torch.float32)
    mb = MicroBatch(tokens, labels, loss_mask, advantages, list(sample_indices), starts.tolist(), rlen.tolist(),
                    extras, routed_experts=_routing_tensor(samples, seq_len))
    return mb, flat, lengths


def _routing_tensor(samples: Sequence[Sample], seq_len: int) -> Optional[torch.Tensor]:
    """[B, S, L, K] int32 from the samples' ``routed_experts`` (-1 where absent); None if none has any.

    Raises:
        ValueError: a sample's routing has the wrong number of positions, or samples disagree on
            [num_layers, topk].
    """
    given = [s for s in samples if getattr(s, "routed_experts", None) is not None]
    if not given:
        return None
    shapes = {tuple(torch.as_tensor(s.routed_experts).shape[1:]) for s in given}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"Sample.routed_experts must be [P, num_layers, topk] with one [num_layers, topk] "
                         f"for all samples, got {sorted(shapes)}")
    n_layers, k = next(iter(shapes))
    out = torch.full((len(samples), seq_len, n_layers, k), -1, dtype=torch.int32)
    for i, s in enumerate(samples):
        if getattr(s, "routed_experts", None) is None:
            continue
        r = torch.as_tensor(s.routed_experts)
        n = len(s.prompt_ids) + len(s.response_ids)
        if r.shape[0] not in (n - 1, n):
            raise ValueError(
                f"Sample.routed_experts of sample {s.index} has {r.shape[0]} positions; expected "
                f"len(prompt_ids) + len(response_ids) - 1 = {n - 1} (SGLang's return_routed_experts) or {n}"
            )
        out[i, : r.shape[0]] = r.to(torch.int32)
    return out


def split_micro_batches(
    samples: Sequence[Sample],
    micro_batch_size: int,
    pad_id: int,
    per_token_fields: Optional[dict[str, Sequence[Sequence[float]]]] = None,
) -> list[MicroBatch]:
    """Cut ``samples`` in order into micro-batches of at most ``micro_batch_size`` samples.

    Raises:
        ValueError: micro_batch_size < 1 or no samples.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not samples:
        raise ValueError("no samples to batch")
    out = []
    for lo in range(0, len(samples), micro_batch_size):
        idx = list(range(lo, min(lo + micro_batch_size, len(samples))))
        fields = {k: [v[i] for i in idx] for k, v in (per_token_fields or {}).items()}
        out.append(make_micro_batch([samples[i] for i in idx], idx, pad_id, fields))
    return out


@dataclass
class PackedMicroBatch(MicroBatch):
    """A :class:`MicroBatch` whose samples are also packed into one THD row for the model.

    The padded [B, S] fields of MicroBatch (tokens, labels, loss_mask, extras, advantages,
    response_starts/lengths) are kept so loss closures and ``gather_response`` work unchanged.
    Packed fields (T = sum of sample lengths, plus padding up to ``pad_to_multiple_of``):

    - ``packed_tokens`` [1, T] int64: the samples' prompt+response ids back to back, then pad_id;
    - ``packed_labels`` [1, T] int64: next token within the same sample; pad_id at each sample's
      last token and in the padding;
    - ``packed_position_ids`` [1, T] int64: position within each sample (0..L_i-1; Megatron's
      RoPE takes positions from cu_seqlens, these are for other consumers);
    - ``cu_seqlens`` [k+1] int32 (k = B, or B + 1 with a trailing padding segment);
    - ``unpack_index`` [B, S] int64: packed position of padded (i, t), T for padding;
    - ``pad_id``: the padding token id.
    """

    packed_tokens: Optional[torch.Tensor] = None
    packed_labels: Optional[torch.Tensor] = None
    packed_position_ids: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    unpack_index: Optional[torch.Tensor] = None
    pad_id: int = 0

    @property
    def num_packed_tokens(self) -> int:
        """T, the packed row length the model runs on (padding included)."""
        return int(self.packed_tokens.shape[1])

    @property
    def num_real_tokens(self) -> int:
        """Sum of the samples' lengths (padding excluded)."""
        return int(sum(self.response_lengths) + sum(s + 1 for s in self.response_starts))

    def packed_seq_params(self, device=None):
        """megatron ``PackedSeqParams`` (qkv_format "thd") for this micro-batch; pass it as
        ``packed_seq_params=`` to GPTModel.forward with ``packed_tokens``.

        Args:
            device: device for the int32 cu_seqlens (CUDA for Transformer Engine).
        """
        from moerl.models.packed_attention import make_packed_seq_params

        return make_packed_seq_params(self.cu_seqlens, device=device)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Map a per-token tensor of the packed row to the padded label-aligned layout.

        Args:
            packed: [1, T] or [T] (any dtype; e.g. log-probs computed against ``packed_labels``).

        Returns:
            tensor of ``loss_mask``'s shape [B, S] (also after the padded fields were padded
            further), entry (i, t) = packed value at sample i's token t, 0 at padding.
            Differentiable (a gather).

        Raises:
            ValueError: the input does not have T entries.
        """
        flat = packed.reshape(-1)
        if flat.numel() != self.num_packed_tokens:
            raise ValueError(
                f"unpack expects {self.num_packed_tokens} packed values ([1, T] or [T]), "
                f"got shape {tuple(packed.shape)}"
            )
        flat = torch.cat([flat, flat.new_zeros(1)])
        index = self.unpack_index.to(flat.device)
        b, s = self.loss_mask.shape  # the padded fields may have been padded further (PP/SP)
        if (b, s) != tuple(index.shape):
            grown = torch.full((b, s), self.num_packed_tokens, dtype=index.dtype, device=index.device)
            grown[: index.shape[0], : index.shape[1]] = index
            index = grown
        return flat[index.reshape(-1)].reshape(index.shape)


def make_packed_micro_batch(
    samples: Sequence[Sample],
    sample_indices: Sequence[int],
    pad_id: int,
    per_token_fields: Optional[dict[str, Sequence[Sequence[float]]]] = None,
    *,
    pad_to_multiple_of: int = 1,
) -> PackedMicroBatch:
    """Pack ``samples`` into one THD row (plus the padded fields of :func:`make_micro_batch`).

    Args:
        samples, sample_indices, pad_id, per_token_fields: as for :func:`make_micro_batch`.
        pad_to_multiple_of: pad T up to a multiple of this (tp_size with sequence parallelism:
            Megatron splits the token axis over TP ranks). Padding is one extra cu_seqlens
            segment of pad_id tokens with no labels and no loss; it attends only to itself.

    Returns:
        :class:`PackedMicroBatch`.

    Raises:
        ValueError: as :func:`make_micro_batch`; pad_to_multiple_of < 1.
    """
    if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be an int >= 1, got {pad_to_multiple_of!r}")
    mb, flat, lengths = _micro_batch(samples, sample_indices, pad_id, per_token_fields)
    real = flat.numel()
    # no samples (an empty micro-batch): one padding segment of pad_to_multiple_of tokens
    total = max(-(-real // pad_to_multiple_of), 1) * pad_to_multiple_of
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths  # packed offset of each sample
    tokens = torch.full((1, total), pad_id, dtype=torch.long)
    labels = torch.full((1, total), pad_id, dtype=torch.long)
    tokens[0, :real] = flat
    if real:
        has_label = torch.ones(real, dtype=torch.bool)
        has_label[ends - 1] = False  # a sample's last token: no next token in the sample
        labels[0, :real][has_label] = flat[1:][has_label[:-1]]
    positions = torch.arange(total)
    positions[:real] -= torch.repeat_interleave(starts, lengths)
    positions[real:] -= real
    positions = positions.unsqueeze(0)
    seq_len = mb.tokens.shape[1]
    col = torch.arange(seq_len)
    index = (torch.where(col < lengths[:, None], starts[:, None] + col, torch.tensor(total))
             if len(samples) else torch.full((1, seq_len), total, dtype=torch.long))
    cu = [0] + ends.tolist() + ([total] if total > real else [])
    base = {f.name: getattr(mb, f.name) for f in dataclasses.fields(MicroBatch)}
    return PackedMicroBatch(
        **base,
        packed_tokens=tokens,
        packed_labels=labels,
        packed_position_ids=positions,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        unpack_index=index,
        pad_id=int(pad_id),
    )


def split_packed_micro_batches(
    samples: Sequence[Sample],
    micro_batches: Sequence[Sequence[int]],
    pad_id: int,
    per_token_fields: Optional[dict[str, Sequence[Sequence[float]]]] = None,
    *,
    pad_to_multiple_of: int = 1,
) -> list[PackedMicroBatch]:
    """Build the packed micro-batches of one DP rank from a packing plan.

    Args:
        samples: the whole list the plan indexes (e.g. the global batch).
        micro_batches: lists of indices into ``samples``, one per micro-batch
            (``moerl.parallel.packing.PackingPlan.for_rank(dp_rank)``).
        pad_id, per_token_fields, pad_to_multiple_of: see :func:`make_packed_micro_batch`;
            ``per_token_fields`` lists are indexed like ``samples``.

    Returns:
        list of :class:`PackedMicroBatch`; ``sample_indices`` index ``samples``. An empty index list
        gives an empty micro-batch (padding only, see :func:`make_micro_batch`).

    Raises:
        ValueError: an index out of range.
    """
    out = []
    for k, idx in enumerate(micro_batches):
        idx = list(idx)
        bad = [i for i in idx if not 0 <= i < len(samples)]
        if bad:
            raise ValueError(f"micro-batch {k} has sample indices {bad} outside [0, {len(samples)})")
        fields = {name: [v[i] for i in idx] for name, v in (per_token_fields or {}).items()}
        out.append(make_packed_micro_batch([samples[i] for i in idx], idx, pad_id, fields,
                                           pad_to_multiple_of=pad_to_multiple_of))
    return out


def model_forward_args(mb: MicroBatch) -> tuple[tuple, dict]:
    """Positional and keyword arguments of ``GPTModel.forward`` for a micro-batch.

    - padded MicroBatch: ``(tokens [B,S], position_ids [B,S], causal_attention_mask(S)), {}``;
    - PackedMicroBatch: ``(packed_tokens [1,T], packed_position_ids [1,T], None),
      {"packed_seq_params": mb.packed_seq_params()}`` (the model's core attention must
      understand THD: Transformer Engine on GPU, moerl's PackedDotProductAttention on CPU).

    The logits come back [B, S, V] / [1, T, V]; compute per-token values against
    :func:`model_labels` and map them with :func:`to_label_layout`.
    """
    if isinstance(mb, PackedMicroBatch):
        device = mb.packed_tokens.device
        kwargs = {"packed_seq_params": mb.packed_seq_params(device)}
        pad = padding_mask(mb)
        if pad is not None:
            kwargs["padding_mask"] = pad
        return (mb.packed_tokens, mb.packed_position_ids, None), kwargs
    from moerl.models.gpt import causal_attention_mask

    seq_len = mb.tokens.shape[1]
    position_ids = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand_as(mb.tokens)
    kwargs = {}
    pad = padding_mask(mb)
    if pad is not None:
        kwargs["padding_mask"] = pad
    return (mb.tokens, position_ids, causal_attention_mask(seq_len, device=mb.tokens.device)), kwargs


def padding_mask(mb: MicroBatch) -> Optional[torch.Tensor]:
    """Which positions of a padded micro-batch are padding: bool [B, S], True = padding (Megatron-Core
    0.16 ``GPTModel.forward(padding_mask=...)``: the MoE routers leave those tokens out of the
    load-balancing and z losses and of the expert-bias counts). Row i holds
    ``response_starts[i] + response_lengths[i] + 1`` real tokens (prompt + response); rows past the
    real samples (added by pipeline padding) are all padding. None when nothing is padded, so an
    unpadded micro-batch runs exactly as before.

    Without it the per-micro-batch aux loss would count padding tokens, so two layouts that pad the
    same samples differently (e.g. PP pads every micro-batch to one shape) would train differently.

    A :class:`PackedMicroBatch`: bool [1, T] over the packed row, True past the samples' tokens (the
    trailing padding segment; all of an empty micro-batch's row), None when there is none.
    """
    if isinstance(mb, PackedMicroBatch):
        t, real = mb.num_packed_tokens, mb.num_real_tokens
        if real == t:
            return None
        return (torch.arange(t, device=mb.packed_tokens.device) >= real).unsqueeze(0)
    b, s = mb.tokens.shape
    lengths = [st + n + 1 for st, n in zip(mb.response_starts, mb.response_lengths)]
    if len(lengths) == b and all(n == s for n in lengths):
        return None
    pos = torch.arange(s, device=mb.tokens.device).unsqueeze(0)
    real = torch.zeros(b, dtype=torch.long, device=mb.tokens.device)
    real[: len(lengths)] = torch.tensor(lengths, dtype=torch.long, device=mb.tokens.device)
    return pos >= real.unsqueeze(1)


def model_labels(mb: MicroBatch) -> torch.Tensor:
    """Labels aligned with the model's output: ``packed_labels [1,T]`` or ``labels [B,S]``."""
    return mb.packed_labels if isinstance(mb, PackedMicroBatch) else mb.labels


def response_rows(mb: MicroBatch) -> torch.Tensor:
    """Positions of the model's output rows whose label is a response token, flattened: int64 [R]
    (R = sum of response lengths) into the packed row's T positions (PackedMicroBatch) or into the
    B * S positions of a padded [B, S] micro-batch, sample by sample in token order. The rows a loss
    reads (every loss in moerl.train.losses masks with ``loss_mask``, which lies inside the response)
    are among them, so a training forward needs log-probs only there (MegatronActor's fused log-prob
    skips the prompt rows)."""
    b = len(mb.response_starts)
    layout = mb.unpack_index if isinstance(mb, PackedMicroBatch) else mb.labels
    s = layout.shape[1]
    if b == 0:
        return torch.zeros(0, dtype=torch.long)
    starts = torch.tensor(mb.response_starts, dtype=torch.long).unsqueeze(1)
    ends = starts + torch.tensor(mb.response_lengths, dtype=torch.long).unsqueeze(1)
    t = torch.arange(s).unsqueeze(0)
    inside = (t >= starts) & (t < ends)  # [B, S]
    if isinstance(mb, PackedMicroBatch):
        return mb.unpack_index[:b][inside].to(torch.long)
    return torch.arange(b * s).view(b, s)[inside]


def to_label_layout(mb: MicroBatch, per_token: torch.Tensor) -> torch.Tensor:
    """Per-token values computed on the model's output layout -> the padded [B, S] layout of
    ``mb.labels`` / ``mb.loss_mask`` (identity for a padded MicroBatch, ``mb.unpack`` for a
    packed one)."""
    return mb.unpack(per_token) if isinstance(mb, PackedMicroBatch) else per_token


def pad_packed_micro_batch(mb: PackedMicroBatch, num_tokens: int) -> PackedMicroBatch:
    """Grow a packed micro-batch's row to ``num_tokens`` (e.g. one common T for every micro-batch
    under pipeline parallelism, whose P2P buffers have a fixed [T, 1, hidden] shape) by extending
    its trailing padding segment (pad_id tokens, no labels, attends only to itself).

    Args:
        mb: the packed micro-batch.
        num_tokens: target T (>= mb.num_packed_tokens).

    Returns:
        A new PackedMicroBatch (the same one when T already equals ``num_tokens``).

    Raises:
        ValueError: num_tokens smaller than the current row.
    """
    t = mb.num_packed_tokens
    if num_tokens == t:
        return mb
    if num_tokens < t:
        raise ValueError(f"num_tokens={num_tokens} is smaller than the packed row ({t} tokens)")
    extra = num_tokens - t
    pad_id = mb.pad_id
    real = mb.num_real_tokens
    positions = torch.cat([mb.packed_position_ids, torch.zeros((1, extra), dtype=torch.long)], dim=1)
    positions[0, real:] = torch.arange(num_tokens - real)
    cu = mb.cu_seqlens.tolist()
    if t > real:
        cu[-1] = num_tokens
    else:
        cu.append(num_tokens)
    index = mb.unpack_index.clone()
    index[index == t] = num_tokens
    return dataclasses.replace(
        mb,
        packed_tokens=torch.cat([mb.packed_tokens, torch.full((1, extra), pad_id, dtype=torch.long)], dim=1),
        packed_labels=torch.cat([mb.packed_labels, torch.full((1, extra), pad_id, dtype=torch.long)], dim=1),
        packed_position_ids=positions,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        unpack_index=index,
    )
