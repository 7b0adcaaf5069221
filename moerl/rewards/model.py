"""Reward-model scoring with a Hugging Face sequence-classification checkpoint (``reward.model_path``).

torch and transformers are imported when a ``RewardModel`` is built, never at module import.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

from moerl.rewards.errors import RewardConfigError

Prompt = Union[str, Sequence[dict]]  # text, or chat messages [{"role": ..., "content": ...}, ...]


class RewardModel:
    """A scalar reward model: ``transformers.AutoModelForSequenceClassification`` + its ``AutoTokenizer``
    loaded from a local directory (``local_files_only=True``), in eval mode.

    The score of (prompt, response) is ``logits[i, 0]`` of the model's pooled output, i.e. the
    classification head at the last non-pad token, exactly as the transformers
    ``*ForSequenceClassification`` forward pools it (the model is called with ``input_ids`` and
    ``attention_mask``; padding on the tokenizer's ``padding_side``).

    Text: the tokenizer's chat template applied to ``[user: prompt, assistant: response]``
    (``tokenize=False``; a prompt given as chat messages is used as the message list) and tokenized
    without adding special tokens again; without a chat template, ``prompt + response`` tokenized with
    the tokenizer's special tokens (message contents are joined with newlines).

    Args:
        model_path: local HF checkpoint directory (``reward.model_path``).
        batch_size: sequences per forward (``reward.model_batch_size``).
        device: torch device string (``"cpu"``, ``"cuda:0"``).
        dtype: optional torch dtype name (``"bfloat16"``); None = as saved.

    Raises:
        RewardConfigError: the directory is missing or does not load as a sequence-classification
            model + tokenizer, or the tokenizer has neither a pad nor an eos token.
    """

    def __init__(self, model_path: str, batch_size: int = 16, device: str = "cpu", dtype: Optional[str] = None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not os.path.isdir(model_path):
            raise RewardConfigError(f"reward.model_path={model_path!r} is not a directory; give a local HF "
                                    "sequence-classification checkpoint")
        if batch_size < 1:
            raise RewardConfigError(f"reward.model_batch_size must be >= 1, got {batch_size}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            kwargs: dict[str, Any] = {"local_files_only": True}
            if dtype is not None:
                kwargs["dtype"] = getattr(torch, dtype)
            self.model = AutoModelForSequenceClassification.from_pretrained(model_path, **kwargs)
        except Exception as e:
            raise RewardConfigError(f"reward.model_path={model_path!r} does not load as a HF sequence-classification "
                                    f"model with a tokenizer: {e!r}") from e
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise RewardConfigError(f"reward.model_path={model_path!r}: the tokenizer has no pad and no eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # the head finds the last non-pad token by this id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()
        self.device = device
        self.batch_size = int(batch_size)
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))

    def text(self, prompt: Prompt, response: str) -> str:
        """The text the model scores for one (prompt, response); see the class docstring."""
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = [dict(m) for m in prompt]
        if self.has_chat_template:
            return self.tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                                      tokenize=False)
        return "\n".join(str(m.get("content", "")) for m in messages) + response

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
        """One float per (prompt, response) pair, in order, computed in batches of ``batch_size``.

        Raises:
            ValueError: ``prompts`` and ``responses`` differ in length.
        """
        import torch

        if len(prompts) != len(responses):
            raise ValueError(f"RewardModel.score: {len(prompts)} prompts for {len(responses)} responses")
        texts = [self.text(p, r) for p, r in zip(prompts, responses)]
        out: list[float] = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i:i + self.batch_size], padding=True, return_tensors="pt",
                                     add_special_tokens=not self.has_chat_template)
                logits = self.model(input_ids=enc["input_ids"].to(self.device),
                                    attention_mask=enc["attention_mask"].to(self.device)).logits
                out.extend(float(x) for x in logits[:, 0].float().cpu())
        return out
