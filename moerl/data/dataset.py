"""Prompt datasets (jsonl / parquet -> ``datasets.Dataset``) and a resumable, deterministic prompt sampler.

Files are checked row by row *before* anything is computed, so a bad row fails the run at start-up
with its row number and the recipe key to fix, not deep inside a rollout.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from typing import Any, Iterator, Optional, Sequence

import datasets
from datasets import Value

from moerl.data.errors import DatasetError  # noqa: F401  (re-exported)
from moerl.data.messages import check_messages

_DEFAULT_CACHE = os.path.join(tempfile.gettempdir(), f"moerl-datasets-cache-{os.getuid() if hasattr(os, 'getuid') else 0}")


class _RowChecker:
    """Validates rows one at a time; remembers the prompt kind and label type of the first row so that
    a file mixing kinds fails at the first offending row (Arrow would fail later, without a row)."""

    def __init__(self, path: str, prompt_key: str, label_key: str) -> None:
        self.path, self.name = path, os.path.basename(path)
        self.prompt_key, self.label_key = prompt_key, label_key
        self.label_type: Optional[type] = None
        self.label_row = 0
        self.prompt_kind: Optional[str] = None
        self.prompt_row = 0
        self.rows = 0

    def check(self, row: Any, rownum: int) -> None:
        path, name = self.path, self.name
        if not isinstance(row, dict):
            raise DatasetError(f"row {rownum} of {path} is a JSON {type(row).__name__}, not an object")
        for key, recipe_key in ((self.prompt_key, "data.prompt_key"), (self.label_key, "data.label_key")):
            if key not in row:
                raise DatasetError(f"row {rownum} of {name} has no field '{key}' ({recipe_key}); file {path}")
        prompt, label = row[self.prompt_key], row[self.label_key]
        if isinstance(prompt, list):
            try:
                check_messages(prompt, f"row {rownum} of {name}: field '{self.prompt_key}' (data.prompt_key)")
            except ValueError as e:
                raise DatasetError(f"{e}; file {path}") from None
            kind = "list of chat messages"
        elif isinstance(prompt, str) and prompt:
            kind = "string"
        else:
            raise DatasetError(
                f"row {rownum} of {name}: field '{self.prompt_key}' (data.prompt_key) must be a non-empty "
                f"string or a non-empty list of chat messages, got {prompt!r}; file {path}"
            )
        if self.prompt_kind is None:
            self.prompt_kind, self.prompt_row = kind, rownum
        elif kind != self.prompt_kind:
            raise DatasetError(
                f"row {rownum} of {name}: field '{self.prompt_key}' (data.prompt_key) is a {kind} but row "
                f"{self.prompt_row} holds a {self.prompt_kind}; use one kind for every prompt; file {path}"
            )
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            raise DatasetError(
                f"row {rownum} of {name}: field '{self.label_key}' (data.label_key) must be a string or an "
                f"integer, got {label!r}; file {path}"
            )
        if self.label_type is None:
            self.label_type, self.label_row = type(label), rownum
        elif type(label) is not self.label_type:
            raise DatasetError(
                f"row {rownum} of {name}: field '{self.label_key}' is {type(label).__name__} but row "
                f"{self.label_row} holds {self.label_type.__name__}; use one type for every label; file {path}"
            )
        self.rows += 1


def _check_jsonl(path: str, prompt_key: str, label_key: str) -> int:
    """Validate every line of ``path``; return the number of rows. Rows are numbered by line (1-based)."""
    checker = _RowChecker(path, prompt_key, label_key)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"row {lineno} of {path} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)", file=path, row=lineno) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"row {lineno} of {path} is not valid JSON ({e.msg} at column {e.colno})") from None
            checker.check(row, lineno)
    return checker.rows


def _check_parquet_rows(ds: datasets.Dataset, path: str, prompt_key: str, label_key: str) -> None:
    """Validate the prompt and label columns of a loaded parquet file, row by row (1-based row index)."""
    checker = _RowChecker(path, prompt_key, label_key)
    name = os.path.basename(path)
    for key, recipe_key in ((prompt_key, "data.prompt_key"), (label_key, "data.label_key")):
        if key not in ds.column_names:
            raise DatasetError(
                f"row 1 of {name} has no field '{key}' ({recipe_key}); the file's columns are "
                f"{ds.column_names}; file {path}"
            )
    for i, row in enumerate(ds.select_columns([prompt_key, label_key]), start=1):
        checker.check(row, i)


def _load(builder: str, path: str, cache_dir: Optional[str], key_hint: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(
            builder, data_files=os.path.abspath(path), split="train", cache_dir=cache_dir or _DEFAULT_CACHE
        )
    except Exception as e:  # noqa: BLE001 - e.g. a column of mixed types in a field moerl does not use
        raise DatasetError(f"datasets could not read {path}{key_hint}: {e}") from e


def load_prompt_dataset(
    path: str | os.PathLike,
    prompt_key: str = "prompt",
    label_key: str = "label",
    *,
    recipe_key: Optional[str] = None,
    cache_dir: Optional[str] = None,
) -> datasets.Dataset:
    """Load a prompt file (jsonl/json lines, or parquet) with ``datasets`` after validating every row.

    Args:
        path: a ``.parquet`` file (read by ``datasets``' "parquet" builder, i.e. pyarrow), or any other
            name: JSON lines, one JSON object per line (blank lines are skipped), read by the "json" builder.
        prompt_key / label_key: field names of the prompt and the verifier label
            (``data.prompt_key`` / ``data.label_key``). A prompt is a non-empty string or a non-empty
            list of chat messages ``{"role": "system"|"user"|"assistant", "content": str}`` (one kind per
            file); see ``moerl.data.tokenizer.render_prompt`` for how each is templated.
        recipe_key: the recipe key that gave ``path`` (``"data.train_path"`` / ``"data.eval_path"``),
            named in the missing-file error.
        cache_dir: where ``datasets`` writes its Arrow cache (default: a per-user temp dir; pass the
            run dir to keep it with the run). No network is used.

    Returns:
        A ``datasets.Dataset`` with every column of the file, in file order; the label column is cast
        to string (``int`` labels become their decimal text); message prompts come back as lists of
        dicts; other columns (e.g. a JSON-text ``metadata`` column) are left as they are.

    Raises:
        DatasetError (a ValueError): missing file, a line that is not UTF-8 (row and byte named), invalid
            JSON or non-object line, a row without the prompt/label field, an empty or non-string prompt
            that is not a valid message list (or a file mixing the two kinds), a label that is not a string or integer (or mixes the two), or
            no rows at all. Row numbers are 1-based line numbers (jsonl) or row indices (parquet).
            jsonl rows are checked before ``datasets`` reads the file; parquet rows right after.
    """
    path = os.fspath(path)
    key_hint = f" ({recipe_key})" if recipe_key else " (data.train_path / data.eval_path)"
    if os.path.isdir(path):
        raise DatasetError(f"prompt file {path}{key_hint} is a directory", key=recipe_key, file=path,
                           hint="give a .jsonl or .parquet file of prompt rows")
    if not os.path.isfile(path):
        raise DatasetError(f"prompt file not found: {path}{key_hint}")
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            declared = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid and OSError subclasses
            raise DatasetError(f"{path}{key_hint} is not a readable parquet file: {e}") from e
        if declared == 0:
            raise DatasetError(f"prompt file {path}{key_hint} holds no rows")
        ds = _load("parquet", path, cache_dir, key_hint)
        _check_parquet_rows(ds, path, prompt_key, label_key)
        num_rows = len(ds)
    else:
        num_rows = _check_jsonl(path, prompt_key, label_key)
        if num_rows == 0:
            raise DatasetError(f"prompt file {path}{key_hint} holds no rows")
        ds = _load("json", path, cache_dir, key_hint)
    if ds.features[label_key] != Value("string"):
        ds = ds.cast_column(label_key, Value("string"))
    if len(ds) != num_rows:  # pragma: no cover - would mean our line check and pyarrow disagree
        raise DatasetError(f"{path}: read {len(ds)} rows but validated {num_rows}")
    return ds


class PromptSampler:
    """Deterministic, resumable, epoch-wise shuffled batches of dataset rows.

    Epoch e visits the rows in the order ``random.Random(f"moerl-sampler:{seed}:{e}").shuffle``; batches
    take the next ``batch_size`` rows of that order. A batch that reaches the end of an epoch continues
    with the start of the next one, so no row is dropped or repeated within an epoch (a batch larger
    than the dataset spans several epochs). ``state_dict()`` / ``load_state_dict()`` store the
    (epoch, position) cursor, so a resumed run draws exactly the batches the original run would have.

    Args:
        dataset: a ``datasets.Dataset`` or any sequence whose items are row dicts.
        batch_size: rows per batch (``rollout.rollout_batch_size``).
        seed: the recipe seed.
    """

    def __init__(self, dataset: Sequence[Any], batch_size: int, seed: int = 0) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if len(dataset) == 0:
            raise ValueError("PromptSampler needs a non-empty dataset")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.num_rows = len(dataset)
        self.epoch = 0
        self.position = 0  # rows of the current epoch already handed out
        self._order_epoch = -1
        self._order: list[int] = []

    def epoch_order(self, epoch: int) -> list[int]:
        """The row indices of ``epoch`` in visiting order (a permutation of range(num_rows))."""
        if epoch != self._order_epoch:
            order = list(range(self.num_rows))
            random.Random(f"moerl-sampler:{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def next_indices(self) -> list[int]:
        """Row indices of the next batch (length batch_size) and advance the cursor."""
        out: list[int] = []
        while len(out) < self.batch_size:
            order = self.epoch_order(self.epoch)
            take = min(self.batch_size - len(out), self.num_rows - self.position)
            out.extend(order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_rows:
                self.epoch += 1
                self.position = 0
        return out

    def next_batch(self) -> list[dict[str, Any]]:
        """The next batch as a list of row dicts (e.g. ``{"prompt": "123+456=", "label": "579"}``)."""
        return [self.dataset[i] for i in self.next_indices()]

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed", "num_rows"}`` (JSON-safe ints)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the cursor saved by :meth:`state_dict`.

        Raises:
            ValueError: a missing entry, a position outside [0, num_rows), or a state saved with a
                different seed or dataset size (the order would not match the original run).
        """
        missing = {"epoch", "position", "seed", "num_rows"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}")
        if int(state["seed"]) != self.seed or int(state["num_rows"]) != self.num_rows:
            raise ValueError(
                f"sampler state was saved with seed={state['seed']}, num_rows={state['num_rows']} but this "
                f"sampler has seed={self.seed}, num_rows={self.num_rows}; resume with the same seed and data"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_rows:
            raise ValueError(f"sampler state has epoch={epoch}, position={position} outside the dataset")
        self.epoch, self.position = epoch, position
