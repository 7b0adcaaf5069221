"""Fingerprints of a run's data and tokenizer, so a resumed run can tell what changed under it.

A fingerprint is a sha256 hex digest. Save ``{"train_data": ..., "eval_data": ..., "tokenizer": ...,
"train_rows": n, "eval_rows": m}`` with a checkpoint; on resume compute the same dict and pass both to
:func:`describe_change`, which names every entry that differs (None when nothing did).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Mapping, Optional

_CHUNK = 1 << 20


def file_fingerprint(path: str | os.PathLike) -> str:
    """sha256 hex digest of the file's bytes (read in 1 MiB chunks).

    Raises:
        FileNotFoundError / OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(os.fspath(path), "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def rows_fingerprint(rows: Iterable[Mapping[str, Any]]) -> str:
    """sha256 hex digest of the rows' canonical JSON (a list of objects, keys sorted, no whitespace,
    UTF-8): equal for equal rows in the same order whatever their key order, for generated datasets
    that have no file of their own.

    Raises:
        TypeError / ValueError: a value JSON cannot hold (e.g. a set, NaN).
    """
    return hashlib.sha256(_canonical([dict(r) for r in rows])).hexdigest()


def _backend_state(tokenizer: Any) -> Any:
    """The encoding pipeline of a fast tokenizer (normalizer, pre-tokenizer, model incl. merges,
    post-processor, decoder) from ``tokenizers``' JSON; runtime padding/truncation settings and the
    added-token list (hashed separately, in a canonical form) are left out."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    state = json.loads(backend.to_str())
    return {k: state.get(k) for k in ("normalizer", "pre_tokenizer", "model", "post_processor", "decoder")}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 hex digest of what decides a (Hugging Face) tokenizer's ids and prompts: the full vocab
    (token -> id, sorted), the added tokens (id, content, special and the strip/normalize flags), the
    special-token map, the bos/eos/pad/unk ids, the chat template and, for fast tokenizers, the
    ``tokenizers`` pipeline (normalizer, pre-tokenizer, model with its merges, post-processor, decoder).

    The same tokenizer saved with ``save_pretrained`` and loaded again has the same fingerprint;
    tokenizers that encode any text differently, or template chats differently, differ.
    Follows the transformers API: ``get_vocab``, ``added_tokens_decoder``, ``special_tokens_map``,
    ``chat_template``, ``backend_tokenizer``.
    """
    added = {
        str(i): {
            "content": t.content,
            "special": bool(t.special),
            "lstrip": bool(t.lstrip),
            "rstrip": bool(t.rstrip),
            "normalized": bool(t.normalized),
            "single_word": bool(t.single_word),
        }
        for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
    }
    special = {k: (sorted(v) if isinstance(v, list) else str(v)) for k, v in tokenizer.special_tokens_map.items()}
    template = getattr(tokenizer, "chat_template", None)
    state = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "added_tokens": added,
        "special_tokens": special,
        "ids": {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")},
        "chat_template": template if isinstance(template, (str, type(None))) else dict(template),
        "backend": _backend_state(tokenizer),
    }
    return hashlib.sha256(_canonical(state)).hexdigest()


# entry -> (what it is, the recipe key behind it, the row-count entry that goes with it)
_ENTRIES = {
    "train_data": ("training data", "data.train_path", "train_rows"),
    "eval_data": ("eval data", "data.eval_path", "eval_rows"),
    "tokenizer": ("tokenizer", "data.tokenizer_path", None),
}


def _rows_text(saved: Mapping[str, Any], now: Mapping[str, Any], key: Optional[str]) -> Optional[str]:
    if key is None or key not in saved or key not in now:
        return None
    if saved[key] == now[key]:
        return f"{now[key]} rows both"
    return f"{saved[key]} rows then, {now[key]} now"


def describe_change(
    saved: Mapping[str, Any], now: Mapping[str, Any], sources: Optional[Mapping[str, str]] = None
) -> Optional[str]:
    """A message naming each entry that differs between two fingerprint dicts, or None if none does.

    Known entries: ``train_data`` / ``eval_data`` (file or rows fingerprints; their row counts
    ``train_rows`` / ``eval_rows`` are reported with them) and ``tokenizer``. E.g.
    ``"training data changed (data.train_path: content differs, 2000 rows both)"``. Any other entry is
    reported as ``"<key> changed (<saved> -> <now>)"``; an entry in only one dict as
    ``"<key> not recorded then"`` / ``"<key> no longer recorded"``. Parts are joined with ``"; "``.

    Args:
        sources: recipe key per entry, overriding the defaults (data.train_path, data.eval_path,
            data.tokenizer_path), e.g. ``{"train_data": "data.reasoning_gym"}`` for generated data.
    """
    sources = dict(sources or {})
    parts: list[str] = []
    row_keys = {v[2] for v in _ENTRIES.values() if v[2]}
    for key, (what, recipe_key, rows_key) in _ENTRIES.items():
        source = sources.get(key, recipe_key)
        if key not in saved and key not in now:
            continue
        if key not in saved or key not in now:
            parts.append(f"{what} {'not recorded then' if key not in saved else 'no longer recorded'} ({source})")
            continue
        content_changed = saved[key] != now[key]
        rows = _rows_text(saved, now, rows_key)
        rows_changed = rows is not None and saved[rows_key] != now[rows_key]
        if not (content_changed or rows_changed):
            continue
        detail = ", ".join(x for x in ("content differs" if content_changed else None, rows) if x)
        if key == "tokenizer":
            detail = "vocab, special tokens, encoding or chat template differ"
        parts.append(f"{what} changed ({source}: {detail})")
    for key in sorted(set(saved) | set(now)):
        if key in _ENTRIES or key in row_keys:
            continue
        if key not in saved:
            parts.append(f"{key} not recorded then")
        elif key not in now:
            parts.append(f"{key} no longer recorded")
        elif saved[key] != now[key]:
            parts.append(f"{key} changed ({saved[key]!r} -> {now[key]!r})")
    # row counts recorded without their fingerprint
    for key, (what, recipe_key, rows_key) in _ENTRIES.items():
        if rows_key and key not in saved and key not in now and rows_key in saved and rows_key in now:
            if saved[rows_key] != now[rows_key]:
                parts.append(f"{what} changed ({sources.get(key, recipe_key)}: {_rows_text(saved, now, rows_key)})")
    return "; ".join(parts) if parts else None
