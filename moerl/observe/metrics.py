"""Metric sinks: TensorBoard event files (always available), optional Weights & Biases, and a
compact one-line stdout summary.

Create one :class:`MetricsLogger` on the rank that reports (e.g. global rank 0 / last PP stage);
the logger itself does no collective communication.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Iterable, Mapping, Optional

__all__ = ["MetricsLogger", "format_line"]


def _to_float(key: str, value: Any) -> float:
    """A python float from a number, a numpy scalar or a one-element tensor/array."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    if callable(item):
        n = numel() if callable(numel) else numel
        if n in (None, 1):
            return float(item())
    raise TypeError(
        f"metric {key!r} must be a number or a one-element tensor/array, got {type(value).__name__}; "
        f"log a scalar (e.g. .mean().item())"
    )


def _join(prefix: str, key: str) -> str:
    if not prefix:
        return key
    return prefix + key if prefix.endswith("/") else f"{prefix}/{key}"


def format_line(step: int, metrics: Mapping[str, Any], keys: Iterable[str]) -> str:
    """Compact one-line summary for stdout: ``step 12 | reward 0.531 | pg_loss -0.0123``.

    Values are printed with 4 significant digits; a key absent from ``metrics`` prints ``n/a``.

    Args:
        step: training step.
        metrics: name -> scalar.
        keys: the names to show, in order.
    """
    parts = [f"step {step}"]
    for k in keys:
        if k not in metrics:
            parts.append(f"{k} n/a")
            continue
        v = _to_float(k, metrics[k])
        parts.append(f"{k} {v:.4g}")
    return " | ".join(parts)


class MetricsLogger:
    """Write scalar metrics to TensorBoard and, optionally, Weights & Biases.

    Args:
        log_dir: directory of the TensorBoard event files (created if missing); also wandb's ``dir``.
        tensorboard: write TensorBoard events (``torch.utils.tensorboard.SummaryWriter``).
        wandb_project: W&B project name; None disables W&B. W&B is imported only then.
        wandb_run_name: W&B run name (optional).
        wandb_config: run configuration recorded by W&B (optional).

    Raises:
        ImportError: ``wandb_project`` is set but the ``wandb`` package is not installed
            (``pip install wandb``), or TensorBoard is requested but not installed.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        tensorboard: bool = True,
        wandb_project: Optional[str] = None,
        wandb_run_name: Optional[str] = None,
        wandb_config: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.log_dir = os.fspath(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self._tb = None
        self._wandb_run = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - tensorboard is a declared dependency
                raise ImportError(
                    "TensorBoard logging needs the tensorboard package: pip install tensorboard "
                    "(or pass tensorboard=False)"
                ) from e
            self._tb = SummaryWriter(log_dir=self.log_dir)
        if wandb_project is not None:
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    f"wandb_project={wandb_project!r} is set but wandb is not installed: pip install wandb "
                    f"(or pip install 'moerl[wandb]'), or unset wandb_project"
                ) from e
            self._wandb_run = wandb.init(
                project=wandb_project,
                name=wandb_run_name,
                dir=self.log_dir,
                config=dict(wandb_config) if wandb_config is not None else None,
            )

    def log(self, step: int, metrics: Mapping[str, Any], prefix: str = "") -> None:
        """Record scalars at ``step``.

        Args:
            step: training step (int >= 0), the x axis.
            metrics: name -> number / numpy scalar / one-element tensor. NaN and inf are recorded as is.
            prefix: prepended to every name as ``prefix/name`` (e.g. "train", "rollout").

        Raises:
            TypeError: a value is not a scalar, or ``step`` is not an int.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        values = {_join(prefix, k): _to_float(k, v) for k, v in metrics.items()}
        if self._tb is not None:
            for name, v in values.items():
                self._tb.add_scalar(name, v, global_step=int(step))
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=int(step))

    format_line = staticmethod(format_line)

    def flush(self) -> None:
        """Flush pending TensorBoard events to disk."""
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close all sinks (idempotent)."""
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
