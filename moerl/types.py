"""The one sample type that flows from rollout to loss (see shared design ARCHITECTURE.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Sample:
    """One prompt/response pair of a rollout batch.

    Attributes:
        index: position of the sample in its rollout batch (0-based, unique within the batch).
        group_id: index of the prompt group; the n_samples_per_prompt responses to one prompt share it.
        prompt: the prompt text as given by the dataset (before the chat template).
        label: the ground-truth answer used by the verifier (a string).
        prompt_ids: token ids of the templated prompt (list[int]).
        response_ids: generated token ids, including the stop token when the response stopped on one.
        rollout_log_probs: log-probs of each response token under the rollout engine, computed at the
            sampling temperature (list[float], len == len(response_ids)).
        loss_mask: 1 for response tokens that enter the loss, 0 otherwise (list[int], len == len(response_ids)).
        reward: scalar reward from the verifier.
        advantage: scalar advantage (broadcast to every response token).
        weight_version: weight version of the rollout engine that generated the response (the newest one
            when a partial rollout spans several versions).
        token_versions: weight version (int) that generated each response token (len == len(response_ids));
            several values when an in-flight weight update cut the response and it was resumed
            (moerl.rollout.manager). Empty for samples not made by the RolloutManager (e.g. SFT).
        status: "completed" (stopped on a stop token), "truncated" (hit max_new_tokens) or "aborted".
        metadata: free-form extras (e.g. server finish_reason).
        routed_experts: MoE routing to replay (moe.routing_replay r3: the rollout server's, SGLang
            ``return_routed_experts``; r2: the trainer's first-pass routing), or None. A torch.int32
            tensor [P, num_layers, topk] with P = len(prompt_ids) + len(response_ids) - 1 (SGLang's
            convention: every position fed to the model; P = len(tokens) is accepted too); row p
            holds the expert ids chosen for the token at position p in each layer (num_layers =
            num_hidden_layers; -1 = not recorded / dense layer: the router chooses freely).
    """

    index: int
    group_id: int
    prompt: str
    label: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    advantage: float = 0.0
    weight_version: Optional[str] = None
    status: str = "completed"
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: Optional[Any] = None
    token_versions: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        """prompt_ids + response_ids."""
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)
