"""tools/inspect_experts.py on a synthetic moe_telemetry.jsonl: summary numbers worked by hand,
valid PNGs, clear errors on bad input."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import inspect_experts as ie  # noqa: E402

LAYER1 = {1: [10, 4, 2, 0], 2: [10, 4, 2, 0], 3: [12, 2, 2, 0], 4: [12, 2, 2, 0]}


def write_jsonl(path: Path) -> Path:
    lines = []
    for step in (3, 1, 4, 2):  # out of order on purpose
        lines.append({"step": step, "layer": 0, "tokens_per_expert": [4, 4, 4, 4], "alerts": []})
        lines.append({"step": step, "layer": 1, "tokens_per_expert": LAYER1[step],
                      "alerts": ["dead experts: ..."] if step == 4 else []})
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    return path


def test_summary_and_curves_by_hand(tmp_path):
    data = ie.load_telemetry(write_jsonl(tmp_path / "moe_telemetry.jsonl"))
    assert data["steps"] == [1, 2, 3, 4] and data["layers"] == [0, 1]
    assert data["counts"][2, 1].tolist() == [12, 2, 2, 0]
    imb, ent = ie.imbalance_and_entropy(data["counts"])
    # layer 1: max / mean = 10/4, 10/4, 12/4, 12/4 ; layer 0 balanced
    assert imb[:, 1].tolist() == [2.5, 2.5, 3.0, 3.0] and imb[:, 0].tolist() == [1.0] * 4
    h = -(0.75 * math.log(0.75) + 2 * 0.125 * math.log(0.125))  # p = [12, 2, 2, 0] / 16
    assert ent[3, 1] == pytest.approx(h / math.log(4)) and ent[0, 0] == pytest.approx(1.0)
    text = ie.summarize(data, top=1)
    # mean shares of layer 1: e0 44/64 = 0.6875, e3 0
    assert "layer 1: most loaded [e0 0.6875]; least loaded [e3 0.0000]" in text
    assert "imbalance mean 2.750 max 3.000" in text
    assert "no tokens in last 4 steps: [3]; alerts 1" in text
    assert "layer 0: most loaded [e0 0.2500]" in text and "no tokens in last 4 steps: none; alerts 0" in text


def test_cli_writes_valid_pngs_and_summary(tmp_path, capsys):
    import matplotlib.image as mpimg

    (tmp_path / "run").mkdir()
    jsonl = write_jsonl(tmp_path / "run" / "moe_telemetry.jsonl")
    assert ie.main([str(jsonl)]) == 0
    out = tmp_path / "run" / "moe_inspect"
    for name in ("expert_load_heatmap", "mean_load_heatmap", "imbalance", "entropy"):
        p = out / f"{name}.png"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(p)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert np.ptp(img[..., :3]) > 0.1  # something was drawn
    assert "layer 1: most loaded [e0 0.6875, e1 0.1875, e2 0.1250]" in (out / "summary.txt").read_text()
    assert "layer 1: most loaded" in capsys.readouterr().out


def test_bad_input_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "layer": 0, "tokens_per_expert": [1, 2]}\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a MoETelemetry line"):
        ie.load_telemetry(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert ie.main([str(empty)]) == 2
    assert "no telemetry lines" in capsys.readouterr().err
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"step": 1, "layer": 0, "tokens_per_expert": [1, 2]}\n'
                     '{"step": 1, "layer": 1, "tokens_per_expert": [1, 2, 3]}\n')
    with pytest.raises(ValueError, match="different numbers of experts"):
        ie.load_telemetry(mixed)
