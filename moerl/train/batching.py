"""Turn Samples into padded micro-batches for the Megatron actor (no packing yet: issue #4).

Layout of one micro-batch (B samples, S = longest prompt+response in the micro-batch):
  tokens     [B, S] int64  prompt ids then response ids, right-padded with pad_id
  labels     [B, S] int64  labels[:, t] = tokens[:, t + 1] (next token), pad where undefined
  loss_mask  [B, S] float32 1 where labels[:, t] is a response token whose loss_mask is 1
  per-token float tensors [B, S] aligned with labels (old_log_probs, ref_log_probs, rollout_log_probs)
  advantages [B] float32
Right padding with a causal mask leaves every real token's logits unchanged.
"""

from __future__ import annotations

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

    Raises:
        ValueError: a sample without response tokens, or a per-token field of the wrong length.
    """
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    seq_len = max(lengths)
    bsz = len(samples)
    tokens = torch.full((bsz, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((bsz, seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((bsz, seq_len), dtype=torch.float32)
    starts, resp_lens = [], []
    for i, s in enumerate(samples):
        if not s.response_ids:
            raise ValueError(f"sample {s.index} (group {s.group_id}) has no response tokens")
        ids = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        tokens[i, : len(ids)] = ids
        labels[i, : len(ids) - 1] = ids[1:]
        start = len(s.prompt_ids) - 1  # label position of the first response token
        mask = s.loss_mask if s.loss_mask else [1] * len(s.response_ids)
        loss_mask[i, start : start + len(s.response_ids)] = torch.tensor(mask, dtype=torch.float32)
        starts.append(start)
        resp_lens.append(len(s.response_ids))
    extras = {}
    for name, values in (per_token_fields or {}).items():
        t = torch.zeros((bsz, seq_len), dtype=torch.float32)
        for i, v in enumerate(values):
            if len(v) != resp_lens[i]:
                raise ValueError(
                    f"{name} of sample {samples[i].index} has {len(v)} values for "
                    f"{resp_lens[i]} response tokens"
                )
            t[i, starts[i] : starts[i] + resp_lens[i]] = torch.as_tensor(v, dtype=torch.float32)
        extras[name] = t
    advantages = torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32)
    return MicroBatch(tokens, labels, loss_mask, advantages, list(sample_indices), starts, resp_lens, extras)


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
