"""Convert public math datasets into moerl prompt rows ``{"prompt": [chat messages], "label": answer}``.

Formats (read with ``datasets``, so .jsonl / .json / .parquet all work, offline from local files):

* ``gsm8k`` (openai/gsm8k): ``{"question": str, "answer": "...reasoning... #### 72"}``; the label is the
  text after the last ``####`` with thousands separators removed ("1,000" -> "1000").
* ``dapo`` (BytedTsinghua-SIA/DAPO-Math-17k, verl's RL format): ``{"prompt": [{"role", "content"}, ...],
  "reward_model": {"ground_truth": str}, ...}``; messages are kept, the label is ground_truth.
* ``math`` (hendrycks MATH / MATH-500): ``{"problem": str, "solution": "... \\boxed{ans} ..."}`` or with an
  ``"answer"`` field; the label is ``answer`` when present, else the last ``\\boxed{...}`` of the solution.

Usage:
    python tools/prepare_math_data.py --format gsm8k gsm8k_test.jsonl data/math_eval.jsonl [--limit N] [--overwrite]

Rows whose label cannot be found are skipped and counted (printed); a row whose question / problem /
message is not text (e.g. a list) is refused, naming the row. The output is written atomically; an
existing output file is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Optional


def last_boxed(text: str) -> Optional[str]:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text`` with balanced braces, or None.

    >>> last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{3}")
    '3'
    """
    for macro in ("\\boxed{", "\\fbox{"):
        start = text.rfind(macro)
        if start < 0:
            continue
        i, depth = start + len(macro), 1
        while i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len(macro): i]
            i += 1
    return None


def _text(value, field: str, numbers: bool = False) -> str:
    """``value`` as text: a string (or, with ``numbers``, an int/float answer); a list, dict, bool... is
    refused (``str()`` would turn ``['q']`` into the text "['q']")."""
    if isinstance(value, str) or (numbers and isinstance(value, (int, float)) and not isinstance(value, bool)):
        return str(value)
    raise ValueError(f"field {field!r} must be {'text or a number' if numbers else 'text'}, got "
                     f"{type(value).__name__} {str(value)[:60]}")


def convert_row(row: dict, fmt: str) -> Optional[dict]:
    """One source row -> ``{"prompt": [{"role": "user", "content": ...}] or the row's messages, "label": str}``,
    or None when the row has no usable answer.

    Raises:
        ValueError: ``fmt`` unknown, or a row lacks the format's fields (names them).
    """
    if fmt == "gsm8k":
        if row.get("question") is None or row.get("answer") is None:  # datasets fills a missing field with None
            raise ValueError(f"--format gsm8k rows need 'question' and 'answer' fields, got {sorted(row)}")
        answer = _text(row["answer"], "answer")
        if "####" not in answer:
            return None
        label = answer.rsplit("####", 1)[1].strip().replace(",", "")
        prompt = [{"role": "user", "content": _text(row["question"], "question")}]
    elif fmt == "dapo":
        gt = (row.get("reward_model") or {}).get("ground_truth")
        if row.get("prompt") is None:
            raise ValueError(f"--format dapo rows need 'prompt' (chat messages) and reward_model.ground_truth, got {sorted(row)}")
        if gt is None:
            return None
        msgs = row["prompt"]
        prompt = ([{"role": _text(m["role"], "prompt[].role"), "content": _text(m["content"], "prompt[].content")}
                   for m in msgs] if isinstance(msgs, list) else [{"role": "user", "content": _text(msgs, "prompt")}])
        label = _text(gt, "reward_model.ground_truth", numbers=True).strip()
    elif fmt == "math":
        if row.get("problem") is None:
            raise ValueError(f"--format math rows need 'problem' and 'answer' or 'solution', got {sorted(row)}")
        label = row.get("answer")
        if label is None:
            label = last_boxed(_text(row.get("solution") or "", "solution"))
        if label is None:
            return None
        prompt = [{"role": "user", "content": _text(row["problem"], "problem")}]
        label = _text(label, "answer", numbers=True).strip()
    else:
        raise ValueError(f"unknown --format {fmt!r}; expected gsm8k, dapo or math")
    if not label:
        return None
    return {"prompt": prompt, "label": label}


def load_rows(path: str) -> list[dict]:
    """Rows of a local .jsonl / .json / .parquet file through ``datasets`` (no network)."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets

    datasets.disable_progress_bars()  # stderr keeps moerl's one line (no "Generating train split" bars)
    datasets.logging.set_verbosity_error()
    kind = "parquet" if path.endswith(".parquet") else "json"
    ds = datasets.load_dataset(kind, data_files=os.path.abspath(path), split="train")
    return [ds[i] for i in range(len(ds))]


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"--limit must be >= 1, got {n}")
    return n


def main(argv=None) -> int:
    """``python tools/prepare_math_data.py --format F SRC DST [--limit N]``; exit 0 done, 2 bad input
    (one line naming the file / row / flag, moerl.errors), argparse's 2 for a malformed command line."""
    from moerl.errors import run_entry

    return run_entry("prepare_math_data", lambda: _main(argv))


def _main(argv) -> int:
    from moerl.errors import CLIError, DataError, check_writable_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", required=True, choices=["gsm8k", "dapo", "math"])
    ap.add_argument("src", help="input .jsonl / .json / .parquet")
    ap.add_argument("dst", help="output .jsonl of moerl rows")
    ap.add_argument("--limit", type=_positive_int, default=None, help="keep the first N converted rows")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.src):
        raise DataError(f"input file not found: {args.src}", key="src", file=args.src, hint="give an existing file")
    if os.path.getsize(args.src) == 0:
        raise DataError(f"input file is empty: {args.src}", key="src", file=args.src, hint="give a file with rows")
    if os.path.isdir(args.dst):
        raise CLIError(f"output {args.dst} is a directory", key="dst", file=args.dst,
                       hint="give a file name, e.g. data/math_train.jsonl")
    check_writable_path(os.path.dirname(os.path.abspath(args.dst)), "dst (its directory)")
    if os.path.abspath(args.dst) == os.path.abspath(args.src):
        raise CLIError(f"output {args.dst} is the input file", key="dst", file=args.dst,
                       hint="write to another file; the input would be replaced")
    if os.path.exists(args.dst) and not args.overwrite:
        raise CLIError(f"output {args.dst} already exists", key="dst", file=args.dst,
                       hint="give another output file, or add --overwrite to replace it")
    try:
        rows = load_rows(args.src)
    except Exception as e:  # noqa: BLE001 - datasets' parse errors (malformed json / parquet) name no line
        cause = e.__cause__ or e.__context__ or e
        kind = "parquet" if args.src.endswith(".parquet") else "json lines"
        raise DataError(f"cannot read {args.src} as {kind}: {type(cause).__name__}: {str(cause)[:300]}",
                        key="src", file=args.src, hint=f"give a valid {kind} file (UTF-8, one JSON object per line)") from None
    out, skipped = [], 0
    for i, row in enumerate(rows, start=1):
        try:
            r = convert_row(row, args.format)
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"row {i} of {args.src}: {e}", key="--format", file=args.src, row=i,
                            hint="check --format matches the file, or fix that row") from None
        if r is None:
            skipped += 1
            continue
        out.append(r)
        if args.limit is not None and len(out) >= args.limit:
            break
    if not out:
        raise DataError(f"no row of {args.src} has a {args.format} answer ({skipped} skipped)", key="--format",
                        file=args.src, hint="is --format right?")
    os.makedirs(os.path.dirname(os.path.abspath(args.dst)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.dst)), suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for r in out:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
    os.replace(tmp, args.dst)
    print(f"wrote {len(out)} rows to {args.dst} ({skipped} skipped without an answer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
