"""Task generators: write a task's train/eval prompts as jsonl rows ``{"prompt": ..., "label": ...}``.

``reasoning_gym``: rows of a procedural dataset of the reasoning-gym package
(``reasoning_gym.create_dataset``), ``{"prompt": question, "label": answer, "metadata": "<json>"}``;
the metadata string is what reasoning-gym's ``score_answer`` needs (see :func:`row_metadata`).

``arithmetic``: zero-padded addition of two ``digits``-digit numbers, e.g. ``{"prompt": "007+123=",
"label": "130"}`` (label = the sum in plain decimal, no padding). Chosen for the CPU demo because
learning is abrupt but reliable and leaves room for RL (see the design's DEMO_CALIBRATION.md).
"""

from __future__ import annotations

import difflib
import json
import os
import random
import tempfile
from typing import Any, Mapping, Optional

from moerl.data.errors import DatasetError

TRAIN_FILE = "train.jsonl"
EVAL_FILE = "eval.jsonl"


def arithmetic_problem(a: int, b: int, digits: int) -> dict[str, str]:
    """The row for ``a + b``: ``{"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "label": str(a + b)}``."""
    return {"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "label": str(a + b)}


def _write_if_changed(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, unless the file already holds exactly that text."""
    data = text.encode("utf-8")
    if os.path.isfile(path) and os.path.getsize(path) == len(data):
        with open(path, "rb") as f:
            if f.read() == data:
                return
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_task_files(out_dir, train_rows: list[dict], eval_rows: list[dict]) -> tuple[str, str]:
    """Write <out_dir>/train.jsonl and eval.jsonl (atomically, untouched when unchanged); their paths."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    train_path, eval_path = os.path.join(out_dir, TRAIN_FILE), os.path.join(out_dir, EVAL_FILE)
    _write_if_changed(train_path, _rows_to_jsonl(train_rows))
    _write_if_changed(eval_path, _rows_to_jsonl(eval_rows))
    return train_path, eval_path


def _rows_to_jsonl(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def generate_arithmetic(
    out_dir: str | os.PathLike, num_train: int, num_eval: int, digits: int, seed: int
) -> tuple[str, str]:
    """Write ``<out_dir>/train.jsonl`` and ``<out_dir>/eval.jsonl`` of ``digits``-digit addition problems.

    Problems (ordered pairs (a, b), 0 <= a, b < 10**digits) are drawn uniformly without replacement
    by ``random.Random(seed)``: first the ``num_eval`` eval problems, then ``num_train`` train problems
    that are neither in eval nor repeated. The same arguments always give byte-identical files, and
    the eval set depends only on (num_eval, digits, seed), not on num_train. Existing files with
    identical content are not rewritten (their mtime is kept); files are replaced atomically.

    Returns:
        (train_path, eval_path).

    Raises:
        ValueError: a non-positive count or digits, or num_train + num_eval > 10**(2*digits).
    """
    for name, v in (("num_train", num_train), ("num_eval", num_eval), ("digits", digits)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} (data.{name}) must be a positive int, got {v!r}")
    base = 10**digits
    space = base * base
    if num_train + num_eval > space:
        raise ValueError(
            f"data.num_train + data.num_eval ({num_train + num_eval}) exceeds the {space} distinct "
            f"{digits}-digit addition problems"
        )
    rng = random.Random(seed)
    seen: set[int] = set()

    def draw(n: int) -> list[dict[str, str]]:
        rows = []
        while len(rows) < n:
            k = rng.randrange(space)
            if k in seen:
                continue
            seen.add(k)
            rows.append(arithmetic_problem(k // base, k % base, digits))
        return rows

    eval_rows = draw(num_eval)
    train_rows = draw(num_train)
    return _write_task_files(out_dir, train_rows, eval_rows)


def _metadata_default(obj: Any) -> Any:
    """json.dumps fallback for metadata values JSON has no type for: sets become sorted lists (their
    iteration order is not stable between processes), everything else its ``str``."""
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


def metadata_json(metadata: Mapping[str, Any] | None) -> str:
    """The metadata column's text: ``json.dumps`` of ``metadata`` (tuples become lists, sets sorted lists,
    other non-JSON values their ``str``; keys in the generator's order, non-ASCII kept). None -> ``"{}"``."""
    return json.dumps(dict(metadata or {}), ensure_ascii=False, default=_metadata_default)


def row_metadata(row: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata of a prompt row as a dict.

    ``row["metadata"]`` may be the JSON text written by :func:`generate_reasoning_gym` (parsed), a dict
    (returned as is) or missing / None / "" (-> ``{}``).

    Raises:
        ValueError: the metadata is text that is not a JSON object, or neither text nor a dict.
    """
    meta = row.get("metadata")
    if meta is None or meta == "":
        return {}
    if isinstance(meta, Mapping):
        return dict(meta)
    if isinstance(meta, str):
        try:
            parsed = json.loads(meta)
        except json.JSONDecodeError as e:
            raise ValueError(f"row metadata is not valid JSON ({e.msg} at column {e.colno}): {meta[:80]!r}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"row metadata must be a JSON object, got a JSON {type(parsed).__name__}")
        return parsed
    raise ValueError(f"row metadata must be a JSON string or a dict, got {type(meta).__name__}")


def _rg_dataset(name: str, config: Mapping[str, Any], size: int, seed: int) -> Any:
    """``reasoning_gym.create_dataset(name, size=size, seed=seed, **config)`` with recipe-key errors."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(str(name), sorted(DATASETS), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"unknown reasoning-gym dataset {name!r} (data.reasoning_gym.name){hint}; the registered names "
            "are the keys of reasoning_gym.factory.DATASETS (list them with: python -c 'from "
            "reasoning_gym.factory import DATASETS; print(sorted(DATASETS))')"
        )
    for key in ("size", "seed"):
        if key in config:
            raise ValueError(
                f"data.reasoning_gym.config must not set {key!r}; use data.reasoning_gym.{key} instead"
            )
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **dict(config))
    except (TypeError, ValueError, AssertionError) as e:
        _, config_cls = DATASETS[name]
        fields = sorted(getattr(config_cls, "__dataclass_fields__", {}))
        fields = [f for f in fields if f not in ("size", "seed")]
        raise ValueError(
            f"reasoning-gym dataset {name!r} rejects data.reasoning_gym.config {dict(config)!r}: "
            f"{type(e).__name__}: {e}; its config fields are {fields}"
        ) from None


def _rg_row(entry: Mapping[str, Any], name: str, index: int) -> dict[str, str]:
    question, answer = entry.get("question"), entry.get("answer")
    if not isinstance(question, str) or not question:
        raise ValueError(
            f"reasoning-gym dataset {name!r} (data.reasoning_gym.name) gave entry {index} without a "
            f"question text: {question!r}"
        )
    return {
        "prompt": question,
        "label": "" if answer is None else str(answer),
        "metadata": metadata_json(entry.get("metadata")),
    }


def generate_reasoning_gym(
    out_dir: str | os.PathLike,
    name: str,
    config: Mapping[str, Any] | None,
    size: int,
    num_eval: int,
    seed: int,
) -> tuple[str, str]:
    """Write ``<out_dir>/train.jsonl`` and ``<out_dir>/eval.jsonl`` from a reasoning-gym dataset.

    Train: the ``size`` entries of ``reasoning_gym.create_dataset(name, size=size, seed=seed, **config)``
    in order (repeated questions are kept). Eval: entries of the same dataset and config built with seed
    ``seed + size`` (reasoning-gym draws entry ``i`` from ``Random(seed + i)``, so this seed reuses none
    of the train draws), keeping the first ``num_eval`` distinct questions that are not train questions
    (at most ``10 * num_eval + 1000`` entries are tried). Each row is
    ``{"prompt": question, "label": str(answer) ("" for a None answer), "metadata": metadata_json(entry
    ["metadata"])}``. Deterministic: the same arguments give byte-identical files; identical files are
    not rewritten; files are replaced atomically.

    Follows reasoning-gym 0.1.x: ``reasoning_gym.create_dataset`` and ``reasoning_gym.factory.DATASETS``
    (name -> (dataset class, config dataclass)); entries are dicts with question, answer, metadata.

    Returns:
        (train_path, eval_path).

    Raises:
        ValueError: an unknown name (names data.reasoning_gym.name and where to list names); a config the
            dataset's config class rejects, or one setting size/seed (names data.reasoning_gym.config); a
            non-positive size / num_eval; fewer than ``num_eval`` distinct eval questions outside the train
            set (names data.reasoning_gym.size and data.num_eval).
    """
    for key, v in (("data.reasoning_gym.size", size), ("data.num_eval", num_eval)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive int, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"data.reasoning_gym.seed (or data.seed, or the run seed) must be a non-negative int, "
                         f"got {seed!r}")
    if not isinstance(name, str):
        raise ValueError(f"data.reasoning_gym.name must be a string, got {name!r}")
    config = dict(config or {})
    train_ds = _rg_dataset(name, config, size, seed)
    train_rows = [_rg_row(train_ds[i], name, i) for i in range(size)]
    seen = {r["prompt"] for r in train_rows}
    tries = 10 * num_eval + 1000
    eval_ds = _rg_dataset(name, config, tries, seed + size)
    eval_rows: list[dict[str, str]] = []
    for i in range(tries):
        row = _rg_row(eval_ds[i], name, i)
        if row["prompt"] in seen:
            continue
        seen.add(row["prompt"])
        eval_rows.append(row)
        if len(eval_rows) == num_eval:
            break
    else:
        raise ValueError(
            f"reasoning-gym dataset {name!r} gave only {len(eval_rows)} distinct eval questions outside the "
            f"{size} train entries in {tries} tries, fewer than data.num_eval={num_eval}; lower "
            f"data.num_eval or data.reasoning_gym.size, or widen data.reasoning_gym.config"
        )
    return _write_task_files(out_dir, train_rows, eval_rows)


def prepare_task_data(
    task: str,
    out_dir: str | os.PathLike,
    seed: int,
    *,
    train_path: Optional[str] = None,
    eval_path: Optional[str] = None,
    num_train: int = 20000,
    num_eval: int = 300,
    digits: int = 3,
    reasoning_gym: Optional[Mapping[str, Any]] = None,
) -> tuple[str, str]:
    """(train_path, eval_path) for ``data.task``: generate arithmetic or reasoning-gym rows into
    ``out_dir``, or return the user's prompt files (jsonl/json/parquet) after checking they exist.

    ``reasoning_gym`` (task "reasoning_gym"): ``{"name": str, "config": dict (optional), "size": int,
    "seed": int or None (optional; None/absent = the ``seed`` argument: data.seed, else the run seed)}``;
    ``num_eval`` gives the eval size.
    Rows go through :func:`generate_reasoning_gym`.

    Typical call (seed: data.seed, else the recipe seed): ``prepare_task_data(cfg.data.task, run_dir / "data",
    seed, **cfg.data.model_dump(include={"train_path", "eval_path", "num_train", "num_eval", "digits"}))``.

    Raises:
        ValueError: unknown task, or a jsonl path that is None or not a file (names data.train_path /
            data.eval_path), a missing/ill-formed reasoning_gym section (names data.reasoning_gym.<key>),
            and the errors of :func:`generate_reasoning_gym`.
    """
    if task == "arithmetic":
        return generate_arithmetic(out_dir, num_train, num_eval, digits, seed)
    if task == "reasoning_gym":
        if not isinstance(reasoning_gym, Mapping):
            raise ValueError("data.reasoning_gym must be set (name, size, optional config/seed) when data.task is 'reasoning_gym'")
        unknown = sorted(set(reasoning_gym) - {"name", "config", "size", "seed"})
        if unknown:
            raise ValueError(f"data.reasoning_gym has unknown keys {unknown}; expected name, config, size, seed")
        for key in ("name", "size"):
            if reasoning_gym.get(key) is None:
                raise ValueError(f"data.reasoning_gym.{key} must be set when data.task is 'reasoning_gym'")
        rg_config = reasoning_gym.get("config") or {}
        if not isinstance(rg_config, Mapping):
            raise ValueError(f"data.reasoning_gym.config must be a mapping, got {rg_config!r}")
        rg_seed = reasoning_gym.get("seed")
        return generate_reasoning_gym(
            out_dir, reasoning_gym["name"], rg_config, reasoning_gym["size"], num_eval,
            seed if rg_seed is None else rg_seed,
        )
    if task == "jsonl":
        for key, p in (("data.train_path", train_path), ("data.eval_path", eval_path)):
            if p is None:
                raise ValueError(f"{key} must be set when data.task is 'jsonl'")
            if os.path.isdir(p):
                raise DatasetError(f"{key} {p} is a directory, not a prompt file", key=key, file=os.fspath(p),
                                   hint=f"give {key} a .jsonl or .parquet file of prompt rows")
            if not os.path.isfile(p):
                raise DatasetError(f"{key} file not found: {p}")
        return os.fspath(train_path), os.fspath(eval_path)  # type: ignore[arg-type]
    raise ValueError(f"unknown data.task {task!r}; expected 'arithmetic', 'reasoning_gym' or 'jsonl'")
