"""Numerical precision: DeepSeek-V3 blockwise FP8 (moerl.precision.fp8) and the FP8 checkpoint /
weight-sync layout SGLang loads (moerl.precision.fp8_checkpoint)."""
