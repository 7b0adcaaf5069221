"""Prompt datasets, chat prompts, the byte-level tokenizer and chat template, task generators,
data/tokenizer fingerprints.

Names are imported lazily (PEP 562) so ``import moerl.data.tasks`` does not pay for importing
transformers and datasets.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DatasetError": "moerl.data.dataset",
    "PromptSampler": "moerl.data.dataset",
    "load_prompt_dataset": "moerl.data.dataset",
    "describe_change": "moerl.data.fingerprint",
    "file_fingerprint": "moerl.data.fingerprint",
    "rows_fingerprint": "moerl.data.fingerprint",
    "tokenizer_fingerprint": "moerl.data.fingerprint",
    "CHAT_ROLES": "moerl.data.messages",
    "check_messages": "moerl.data.messages",
    "to_messages": "moerl.data.messages",
    "arithmetic_problem": "moerl.data.tasks",
    "generate_arithmetic": "moerl.data.tasks",
    "generate_reasoning_gym": "moerl.data.tasks",
    "metadata_json": "moerl.data.tasks",
    "prepare_task_data": "moerl.data.tasks",
    "row_metadata": "moerl.data.tasks",
    "build_tokenizer": "moerl.data.tokenizer",
    "decode_response": "moerl.data.tokenizer",
    "encode_prompt": "moerl.data.tokenizer",
    "encode_sft_example": "moerl.data.tokenizer",
    "is_moerl_tokenizer": "moerl.data.tokenizer",
    "load_tokenizer": "moerl.data.tokenizer",
    "render_prompt": "moerl.data.tokenizer",
    "tokenizer_from_config": "moerl.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moerl.data' has no attribute {name!r}")
