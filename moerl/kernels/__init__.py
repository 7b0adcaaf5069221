"""moerl's native kernels (csrc/) and their pure-torch references.

* :mod:`moerl.kernels.fused_logprob`: fused linear log-prob + entropy (no [tokens, vocab] logits),
  vocabulary-parallel aware;
* :mod:`moerl.kernels.fp8_quant`: blockwise FP8 (E4M3) quantise / dequantise, bitwise equal to
  :mod:`moerl.precision.fp8`;
* :mod:`moerl.kernels._build`: build-on-first-use of csrc/ and ``kernel_report`` (``moerl doctor``).
"""

from moerl.kernels._build import NativeBuildError, kernel_report, load_native
from moerl.kernels.fused_logprob import fused_linear_log_probs, naive_linear_log_probs

__all__ = ["NativeBuildError", "kernel_report", "load_native", "fused_linear_log_probs", "naive_linear_log_probs"]
