"""Observability: timers, metric sinks (TensorBoard, optional W&B), progress lines."""

from moerl.observe.metrics import MetricsLogger, format_line
from moerl.observe.progress import Progress
from moerl.observe.timers import Timers

__all__ = ["MetricsLogger", "Progress", "Timers", "format_line"]
