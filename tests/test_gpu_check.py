"""The GPU check kit on a machine without a GPU: tools/gpu_check.py skips every check with its reason
and exits 0, tools/gpu_check.sh --dry-run lists them, bad flags exit 2; the FP8 GEMM check's arithmetic (per-K-block
torch._scaled_mm with the block scales applied in FP32) equals moerl.precision.fp8's reference on CPU;
and the wheel kit pins the versions this environment is tested with."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402


def _run(*args):
    return subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=120, cwd=str(REPO))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the checks would run")
def test_cpu_machine_skips_every_check_with_its_reason(capsys):
    """gpu_check.py's CPU path in this process (torch is imported already; the shell script's path to it is
    run by the dry-run test below)."""
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in gpu_check.CHECKS:
        (line,) = [ln for ln in lines if ln.startswith(f"SKIP {name}: ")]
        assert "torch.cuda.is_available() is False" in line and "needs a CUDA GPU" in line, line
    assert not [ln for ln in lines if ln.startswith(("PASS", "FAIL"))]
    assert f"SUMMARY: 0 PASS, 0 FAIL, {len(gpu_check.CHECKS)} SKIP" in out


def test_dry_run_and_bad_flags():
    p = _run("--dry-run", "--only", "fp8_gemm", "mfu")
    assert p.returncode == 0, p.stderr
    assert [ln.split(":")[0] for ln in p.stdout.splitlines() if ln.startswith("SKIP")] == ["SKIP fp8_gemm", "SKIP mfu"]
    assert "SUMMARY: 0 PASS, 0 FAIL, 2 SKIP (dry run)" in p.stdout
    p = _run("--budget-s", "abc")
    assert p.returncode == 2 and "--budget-s" in p.stderr and "fix:" in p.stderr
    p = _run("--wheels", str(REPO / "no_such_wheels"))
    assert p.returncode == 2 and "requirements.txt" in p.stderr and "fetch_gpu_wheels.sh" in p.stderr
    assert gpu_check.main(["--device", "tpu"]) == 2


def test_fp8_gemm_check_arithmetic_matches_the_reference_on_cpu():
    """The worker's per-K-block FP8 products (scale 1) with the 1x128 / 128x128 scales applied in FP32 give
    moerl.precision.fp8.block_scaled_gemm (the same FP32 sums; only the order may differ on a GPU), and the
    FP8 rounding of the operands is visible (so the check compares quantised maths, not a copy)."""
    res = gpu_check.worker_fp8_gemm(argparse.Namespace(device="cpu"))
    if "skip" in res:
        pytest.skip(res["skip"])
    assert res["max_abs_diff"] <= 1e-5 * res["ref_max_abs"]
    assert 1e-3 < res["quant_rel_err"] < 0.1  # E4M3 has 3 mantissa bits


def test_wheel_kit_pins_the_tested_versions():
    """Every wheel the GPU kit pins that moerl requires lies inside setup.py's range for it (its exact pins:
    megatron-core, transformers, ... equal), as installed (the package metadata of the editable install). Not compared with this environment's versions: a fresh install
    takes the registry's newest release inside each range (CI failed on 2026-12-02 when uvicorn 0.55.0 came
    out an hour after the kit's 0.54.0 was the newest)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = (REPO / "tools" / "fetch_gpu_wheels.sh").read_text()
    block = re.search(r"PKGS=\((.*?)\n\)", text, re.S).group(1)
    pins = {canonicalize_name(k): v for k, v in (p.split("==") for p in block.split())}
    for must in ("megatron-core", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "httpx"):
        assert must in pins, must
    assert "torch" not in pins and not any(k.startswith("nvidia") for k in pins)
    ranges = {canonicalize_name(r.name): r.specifier for r in map(Requirement, md.requires("moerl") or [])
              if r.marker is None}
    assert {"megatron-core", "transformers", "uvicorn", "httpx"} <= set(ranges)  # the metadata was read
    outside = {k: (v, str(ranges[k])) for k, v in pins.items() if k in ranges and v not in ranges[k]}
    assert not outside, f"fetch_gpu_wheels.sh pins outside setup.py's ranges: {outside}"
