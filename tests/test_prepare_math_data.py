"""tools/prepare_math_data.py: GSM8K / DAPO-Math / MATH rows -> moerl rows, checked on hand-written rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from prepare_math_data import convert_row, last_boxed, main  # noqa: E402


def test_last_boxed_balanced_braces():
    assert last_boxed(r"a \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{unclosed") is None


def test_convert_rows_by_hand():
    g = convert_row({"question": "Tom has 3 apples...", "answer": "3 + 4 = 7\n#### 1,007"}, "gsm8k")
    assert g == {"prompt": [{"role": "user", "content": "Tom has 3 apples..."}], "label": "1007"}
    assert convert_row({"question": "q", "answer": "no marker"}, "gsm8k") is None
    d = convert_row({"prompt": [{"role": "user", "content": "Solve x"}], "reward_model": {"ground_truth": " 34 "},
                     "data_source": "math_dapo"}, "dapo")
    assert d == {"prompt": [{"role": "user", "content": "Solve x"}], "label": "34"}
    m = convert_row({"problem": "p", "solution": r"so \boxed{\dfrac{3}{4}}"}, "math")
    assert m["label"] == r"\dfrac{3}{4}"
    assert convert_row({"problem": "p", "answer": "5", "solution": r"\boxed{6}"}, "math")["label"] == "5"
    with pytest.raises(ValueError, match="'question' and 'answer'"):
        convert_row({"problem": "p"}, "gsm8k")


def test_cli_jsonl_and_parquet(tmp_path):
    import datasets

    src = tmp_path / "gsm8k.jsonl"
    src.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"r\n#### {i}"}) + "\n" for i in range(5))
                   + json.dumps({"question": "bad", "answer": "none"}) + "\n")
    dst = tmp_path / "out" / "eval.jsonl"
    assert main(["--format", "gsm8k", str(src), str(dst)]) == 0
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["0", "1", "2", "3", "4"]
    pq = tmp_path / "dapo.parquet"
    datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"p{i}"}],
                                 "reward_model": {"ground_truth": str(i * i)}} for i in range(4)]).to_parquet(str(pq))
    dst2 = tmp_path / "train.jsonl"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_math_data.py"), "--format", "dapo", str(pq),
                        str(dst2), "--limit", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in dst2.read_text().splitlines()]
    assert rows == [{"prompt": [{"role": "user", "content": f"p{i}"}], "label": str(i * i)} for i in range(3)]
    assert main(["--format", "gsm8k", str(tmp_path / "missing.jsonl"), str(dst)]) == 2


def test_cli_refuses_unusable_input_with_exit_2(tmp_path, capsys):
    """Empty, malformed or answerless inputs and --limit < 1 stop with exit code 2 and one line (no
    traceback); nothing is written."""
    dst = tmp_path / "out.jsonl"
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"question": "a", "answer": "#### 3"}\n{bad\n')
    (tmp_path / "noans.jsonl").write_text('{"question": "a", "answer": "no marker"}\n')
    for name, needle in (("empty.jsonl", "empty"), ("bad.jsonl", "cannot read"), ("noans.jsonl", "is --format right")):
        assert main(["--format", "gsm8k", str(tmp_path / name), str(dst)]) == 2, name
        assert needle in capsys.readouterr().err, name
    (tmp_path / "ok.jsonl").write_text('{"question": "a", "answer": "x #### 3"}\n')
    with pytest.raises(SystemExit) as e:
        main(["--format", "gsm8k", "--limit", "0", str(tmp_path / "ok.jsonl"), str(dst)])
    assert e.value.code == 2 and "--limit must be >= 1" in capsys.readouterr().err
    assert not dst.exists()
    assert main(["--format", "gsm8k", str(tmp_path / "ok.jsonl"), str(dst)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert dst.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
