"""tools/convert_checkpoint.py: HF -> Megatron torch_dist -> HF reproduces every tensor exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_convert import FIELDS, random_hf_model  # noqa: E402

from moerl.checkpoint.hf_convert import fused_experts_to_per_expert  # noqa: E402
from moerl.checkpoint.hf_io import load_hf_state_dict, save_hf_checkpoint  # noqa: E402
from moerl.models.qwen3_moe import make_hf_config  # noqa: E402

TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"


@pytest.mark.slow  # two subprocesses importing megatron-core (~30 s)
# slow_extra (CI's 30-min budget): the conversion both ways (moerl.checkpoint.hf_convert's functions: exact round trip, logits
# against transformers, sharded and TE names) is the fast suite's test_hf_convert / test_hf_convert_te. What leaves
# CI: the command line.
@pytest.mark.slow_extra
def test_hf_mcore_hf_round_trip(tmp_path):
    config = make_hf_config({**FIELDS, "tie_word_embeddings": False})
    model = random_hf_model(tie_word_embeddings=False)
    ref = fused_experts_to_per_expert(model.state_dict(), config)
    save_hf_checkpoint(ref, config, tmp_path / "hf")
    run = lambda *a: subprocess.run([sys.executable, str(TOOL), *a], capture_output=True, text=True, timeout=300)  # noqa: E731
    r = run("hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run("mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--config", str(tmp_path / "hf"), "--out", str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr[-3000:]
    back = load_hf_state_dict(tmp_path / "back")
    assert set(back) == set(ref)
    for k in ref:
        assert torch.equal(back[k], ref[k]), k
    r = run("hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"))
    assert r.returncode != 0 and "already exists" in r.stderr
    # mcore-to-hf refuses an existing --out too (it used to replace it, deleting the user's files)
    (tmp_path / "back" / "notes.txt").write_text("mine\n")
    before = sorted(p.name for p in (tmp_path / "back").iterdir())
    r = run("mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--config", str(tmp_path / "hf"), "--out", str(tmp_path / "back"))
    assert r.returncode == 2 and "--out" in r.stderr and "already exists" in r.stderr, r.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == before
    assert (tmp_path / "back" / "notes.txt").read_text() == "mine\n"
