"""Numerical precision: DeepSeek-V3 blockwise FP8 (moerl.precision.fp8), the FP8 checkpoint /
weight-sync layout SGLang loads (moerl.precision.fp8_checkpoint), and FP8 training through
Transformer Engine (moerl.precision.te_fp8: the recipe's precision keys on Megatron-Core)."""
