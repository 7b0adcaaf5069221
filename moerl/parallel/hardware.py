"""GPU table of the planner (``moerl plan``, recipe key ``hardware.gpu``): memory, peak dense tensor-core
throughput and NVLink bandwidth of common training GPUs. Pure python (the recipe schema checks names).

Every figure is the vendor datasheet's, per GPU, SXM form factor unless the name says otherwise:

* ``memory_gib``: the datasheet's memory in GB, used as GiB. CUDA reports a little less (an H100
  80 GB shows 79.6 GiB, an H200 139.8 GiB); ``hardware.reserved_fraction`` of the planner covers it.
* ``bf16_tflops`` / ``fp8_tflops``: DENSE tensor-core peaks, i.e. the datasheet's "with sparsity"
  figure halved (NVIDIA prints the 2:4-sparse numbers with a footnote). ``fp8_tflops`` is None where
  the GPU has no FP8 tensor cores.
* ``nvlink_gbs``: NVLink bandwidth per GPU and direction (the datasheet's bidirectional total
  halved), GB/s = 1e9 bytes/s; PCIe cards without NVLink get their PCIe bandwidth per direction.
* ``capability``: CUDA compute capability (NVIDIA's CUDA GPUs list: A100 8.0, L40S 8.9, H100/H800/H20/
  H200 9.0, B200 10.0), for the planner's precision.fp8 check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["GPUSpec", "GPUS", "gpu_spec", "known_gpus"]


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model. Units: GiB, dense TFLOP/s (1e12 FLOP/s), GB/s per direction."""

    name: str
    memory_gib: float
    bf16_tflops: float
    fp8_tflops: Optional[float]
    nvlink_gbs: float
    source: str
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability (FP8: 8.9+; blockwise FP8 9.0+; MXFP8 10.x)


GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 (624 sparse) TFLOPS, no FP8; NVLink 600 GB/s
    "A100-40GB": GPUSpec("A100-40GB", 40, 312, None, 300, "NVIDIA A100 datasheet (SXM4 40GB)", (8, 0)),
    "A100": GPUSpec("A100", 80, 312, None, 300, "NVIDIA A100 datasheet (SXM4 80GB)", (8, 0)),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 1,979 and FP8 3,958 TFLOPS with sparsity;
    # 80 GB HBM3; NVLink 900 GB/s
    "H100": GPUSpec("H100", 80, 989, 1979, 450, "NVIDIA H100 datasheet (H100 SXM 80GB)", (9, 0)),
    # same datasheet, H100 PCIe: BF16 1,513 and FP8 3,026 TFLOPS with sparsity; NVLink bridge 600 GB/s
    "H100-PCIE": GPUSpec("H100-PCIE", 80, 756, 1513, 300, "NVIDIA H100 datasheet (H100 PCIe 80GB)", (9, 0)),
    # NVIDIA H800 SXM5 (export variant of the H100 SXM): H100 compute, NVLink 400 GB/s
    "H800": GPUSpec("H800", 80, 989, 1979, 200, "NVIDIA H800 SXM5 product brief", (9, 0)),
    # NVIDIA H20 (HGX H20): 96 GB HBM3, BF16 148 and FP8 296 TFLOPS dense, NVLink 900 GB/s
    "H20": GPUSpec("H20", 96, 148, 296, 450, "NVIDIA HGX H20 product brief", (9, 0)),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 141 GB HBM3e, BF16 1,979 and FP8 3,958 TFLOPS
    # with sparsity, NVLink 900 GB/s
    "H200": GPUSpec("H200", 141, 989, 1979, 450, "NVIDIA H200 datasheet (H200 SXM 141GB)", (9, 0)),
    # NVIDIA HGX B200 specifications, per GPU: 180 GB HBM3e, FP16/BF16 4.5 PFLOPS and FP8 9 PFLOPS
    # with sparsity, 5th-generation NVLink 1.8 TB/s
    "B200": GPUSpec("B200", 180, 2250, 4500, 900, "NVIDIA HGX B200 specifications", (10, 0)),
    # NVIDIA L40S datasheet: 48 GB GDDR6, BF16 733 and FP8 1,466 TFLOPS with sparsity, PCIe Gen4 x16
    # (64 GB/s bidirectional), no NVLink
    "L40S": GPUSpec("L40S", 48, 366, 733, 32, "NVIDIA L40S datasheet", (8, 9)),
}

_ALIASES = {"H100-SXM": "H100", "H100-80GB": "H100", "H200-SXM": "H200", "A100-80GB": "A100", "A100-SXM": "A100"}


def known_gpus() -> list[str]:
    """The names ``hardware.gpu`` accepts (aliases such as H100-SXM not listed)."""
    return list(GPUS)


def gpu_spec(name: str) -> GPUSpec:
    """The table entry for ``name`` (case-insensitive; ``_`` and spaces read as ``-``).

    Raises:
        moerl.errors.RecipeError (a ValueError): an unknown name; the message names ``hardware.gpu``,
            lists the known GPUs and the way out (``hardware.gpu_memory_gib`` for a GPU not in the table).
    """
    from moerl.errors import RecipeError

    key = str(name).strip().upper().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        raise RecipeError(
            f"hardware.gpu {name!r} is not a known GPU; known: {', '.join(GPUS)}", key="hardware.gpu",
            hint="give one of those, or hardware.gpu_memory_gib and hardware.peak_bf16_tflops for another GPU")
    return GPUS[key]
