"""``moerl doctor``: which implementation each native-kernel op uses on this machine, and why.

Builds the csrc/ extension if it is not built yet (the first call compiles it, about a minute on 2
cores; later calls load the cached build). Exit code 0 when every op has its native kernel, 1 when
one runs its torch reference (the line says why: no compiler, no ninja, a build error,
MOERL_KERNELS=torch).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Print one line per op (``op [device]: implementation -- why``); see the module docstring."""
    parser = argparse.ArgumentParser(prog="moerl doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-build", action="store_true", help="report without compiling csrc/")
    args = parser.parse_args(argv)
    import torch

    from moerl.kernels._build import CSRC, kernel_mode, kernel_report

    print(f"moerl doctor: torch {torch.__version__}, CUDA {'available' if torch.cuda.is_available() else 'not available'}, "
          f"csrc at {CSRC}, MOERL_KERNELS={kernel_mode()}")
    rows = kernel_report(build=not args.no_build)
    width = max(len(op) for op, _, _ in rows)
    for op, impl, why in rows:
        print(f"  {op:{width}s}  {impl:28s}  {why}")
    sys.stdout.flush()
    return 0 if all(impl.startswith("native") for _, impl, _ in rows) else 1
