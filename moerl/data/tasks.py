"""Task generators: write a task's train/eval prompts as jsonl rows ``{"prompt": ..., "label": ...}``.

``arithmetic``: zero-padded addition of two ``digits``-digit numbers, e.g. ``{"prompt": "007+123=",
"label": "130"}`` (label = the sum in plain decimal, no padding). Chosen for the CPU demo because
learning is abrupt but reliable and leaves room for RL (see the design's DEMO_CALIBRATION.md).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from typing import Optional

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
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    train_path, eval_path = os.path.join(out_dir, TRAIN_FILE), os.path.join(out_dir, EVAL_FILE)
    _write_if_changed(train_path, _rows_to_jsonl(train_rows))
    _write_if_changed(eval_path, _rows_to_jsonl(eval_rows))
    return train_path, eval_path


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
) -> tuple[str, str]:
    """(train_path, eval_path) for ``data.task``: generate arithmetic into ``out_dir``, or return the
    user's jsonl paths after checking they exist.

    Typical call: ``prepare_task_data(cfg.data.task, run_dir / "data", cfg.seed, **cfg.data.model_dump(
    include={"train_path", "eval_path", "num_train", "num_eval", "digits"}))``.

    Raises:
        ValueError: unknown task, or a jsonl path that is None or not a file (names data.train_path /
            data.eval_path).
    """
    if task == "arithmetic":
        return generate_arithmetic(out_dir, num_train, num_eval, digits, seed)
    if task == "jsonl":
        for key, p in (("data.train_path", train_path), ("data.eval_path", eval_path)):
            if p is None:
                raise ValueError(f"{key} must be set when data.task is 'jsonl'")
            if not os.path.isfile(p):
                raise DatasetError(f"{key} file not found: {p}")
        return os.fspath(train_path), os.fspath(eval_path)  # type: ignore[arg-type]
    raise ValueError(f"unknown data.task {task!r}; expected 'arithmetic' or 'jsonl'")
