"""A scalar value head for Megatron-Core GPTModels (the critic of PPO, moerl.train.critic).

``ValueHead`` takes the place of ``GPTModel.output_layer`` (the LM head): GPTModel's post-processing
calls ``output_layer(hidden_states, weight=..., runtime_gather_output=...)`` and returns the first
output transposed to [B, S, ...], so the model returns ``values [B, S, 1]`` (``[1, T, 1]`` for a
packed THD row) instead of logits. The head is the HF ``score`` layer of
``transformers.Qwen3MoeForTokenClassification(num_labels=1)``: ``v = h @ score.weight.T +
score.bias`` on the final-normed hidden state h (``weight`` [1, H], ``bias`` [1]; conversion in
moerl.checkpoint.hf_convert with ``head="value"``).

Tensor parallelism. The head is replicated on every TP rank of the last pipeline stage and every
rank computes the whole [S, B] value map:

* with sequence parallelism the hidden states arrive split along the sequence; they are
  all-gathered with ``gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)``,
  whose backward hands each rank ITS slice of the (identical, complete) gradient instead of
  reduce-scattering it (which would count the duplicated computation tp_size times);
* without it the hidden states are already whole and identical on the TP ranks; the gradient each
  rank computes is the whole gradient (Megatron's replicated region).

The head's own gradients are therefore identical on the TP ranks: the parameters are plain
(not ``tensor_model_parallel``, not ``sequence_parallel``) replicated parameters, reduced over DP
only and counted once in the clipped grad norm (Megatron counts duplicated parameters on TP
rank 0).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

__all__ = ["ValueHead", "value_model_hf_config"]


class ValueHead(torch.nn.Module):
    """Drop-in replacement of ``GPTModel.output_layer``: hidden [S, B, H] (sequence-split under
    sequence parallelism) -> (values [S, B, 1] float, None).

    Args:
        hidden_size: H.
        sequence_parallel: the model runs with Megatron sequence parallelism (tp_size > 1).
        tp_group: the tensor-parallel process group (None: parallel_state's).
        dtype, device: of the parameters.

    The parameters start at ZERO (a fresh critic predicts 0 for every state; see
    :meth:`reset_parameters`): deterministic and identical in every parallel layout.
    """

    def __init__(self, hidden_size: int, *, sequence_parallel: bool = False, tp_group=None,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        self.sequence_parallel = bool(sequence_parallel)
        self.tp_group = tp_group
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero weight and bias. With a zero weight the first update moves only the head (the
        gradient reaching the trunk is ``dL/dv * weight`` = 0); the trunk follows from the second
        update on. Zeros need no RNG, so every rank of every layout starts from the same head."""
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()

    def forward(self, hidden_states: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None, **_unused):
        """``output_layer``'s call signature; ``weight`` (a tied LM head's embedding) and
        ``runtime_gather_output`` do not apply to a value head and are ignored."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group)
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        return values, None


def value_model_hf_config(hf_config):
    """The transformers config a critic exports with: a copy of the policy's ``hf_config`` with
    ``num_labels=1`` and ``architectures=["<Family>ForTokenClassification"]`` (e.g.
    Qwen3MoeForTokenClassification), so that ``moerl.checkpoint.hf_io.save_hf_checkpoint(
    critic.export_hf_state_dict(), value_model_hf_config(cfg), path)`` writes a checkpoint
    ``transformers.AutoModelForTokenClassification.from_pretrained(path)`` loads."""
    config = copy.deepcopy(hf_config)
    config.num_labels = 1
    name = type(config).__name__
    config.architectures = [(name[: -len("Config")] if name.endswith("Config") else name) + "ForTokenClassification"]
    return config
