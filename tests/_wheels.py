"""Download-and-cache of pinned upstream wheels for the contract tests (parsed, never installed).

Wheels are fetched with ``pip download --no-deps`` into $MOERL_WHEEL_CACHE (default
<tmp>/moerl_wheel_cache) once, then reused. Used by tests/test_sglang_contract.py (SGLang) and
tests/test_te_fp8_contract.py (Transformer Engine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def cached_wheel(dist: str, version: str, file_prefix: str) -> Path:
    """Path of the ``dist==version`` wheel (file name ``<file_prefix>-<version>-*.whl``) in the cache,
    downloading it first when absent. Calls pytest.skip, with pip's reason, when it cannot be had."""
    cache = Path(os.environ.get("MOERL_WHEEL_CACHE", Path(tempfile.gettempdir()) / "moerl_wheel_cache"))
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"{file_prefix}-{version}-*.whl"
    wheels = sorted(cache.glob(pattern))
    if not wheels:
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                                   f"{dist}=={version}", "-d", str(cache)], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"could not download the {dist} {version} wheel: {e}")
        wheels = sorted(cache.glob(pattern))
        if proc.returncode != 0 or not wheels:
            pytest.skip(f"could not download the {dist} {version} wheel (pip exit {proc.returncode}): "
                        f"{(proc.stderr or proc.stdout)[-500:]}")
    return wheels[-1]
