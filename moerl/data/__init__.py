"""Prompt datasets, the byte-level tokenizer and chat template, task generators.

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
    "arithmetic_problem": "moerl.data.tasks",
    "generate_arithmetic": "moerl.data.tasks",
    "prepare_task_data": "moerl.data.tasks",
    "build_tokenizer": "moerl.data.tokenizer",
    "decode_response": "moerl.data.tokenizer",
    "encode_prompt": "moerl.data.tokenizer",
    "encode_sft_example": "moerl.data.tokenizer",
    "load_tokenizer": "moerl.data.tokenizer",
    "render_prompt": "moerl.data.tokenizer",
    "tokenizer_from_config": "moerl.data.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moerl.data' has no attribute {name!r}")
