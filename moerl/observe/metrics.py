"""Metric sinks: TensorBoard event files (always available), optional Weights & Biases, and a
compact one-line stdout summary.

Create one :class:`MetricsLogger` on the rank that reports (e.g. global rank 0 / last PP stage);
the logger itself does no collective communication.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Iterable, Mapping, Optional

__all__ = ["MetricsLogger", "format_line", "perf_metrics", "perf_line"]


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


def perf_metrics(m: Mapping[str, Any], *, step_s: float, trainer_devices: int, rollout_devices: int,
                 peak_tflops: Optional[float], rollout_overlaps: bool = False) -> dict[str, float]:
    """Throughput and MFU of one RL step from its work counters and phase times.

    Reads ``m``: perf/logprob_flops and perf/update_flops (model FLOPs of all trainer ranks together,
    moerl.observe.flops), perf/trained_tokens, perf/generated_tokens, time/log_prob, time/update,
    time/rollout (seconds). Returns (keys absent when their inputs are):

    * perf/tflops_per_device: (log-prob + update FLOPs) / (log_prob + update seconds) / trainer_devices / 1e12;
    * perf/mfu: that / ``peak_tflops`` (dense BF16 peak per device; absent when None, e.g. on CPU);
    * perf/tokens_per_s_per_device_train: trained tokens (prompt + response of every updated sequence)
      / update seconds / trainer_devices;
    * perf/tokens_per_s_per_device_rollout: generated tokens / rollout seconds / rollout_devices, the
      rollout seconds being the rollout phase, or the whole step (``step_s``) when ``rollout_overlaps``
      (train.mode one_step_off / async: generation runs during the step);
    * perf/step_s: ``step_s``.
    """
    out = {"perf/step_s": float(step_s)}
    flops = float(m.get("perf/logprob_flops", 0.0)) + float(m.get("perf/update_flops", 0.0))
    busy = float(m.get("time/log_prob", 0.0)) + float(m.get("time/update", 0.0))
    if flops > 0 and busy > 0:
        out["perf/tflops_per_device"] = flops / busy / trainer_devices / 1e12
        if peak_tflops:
            out["perf/mfu"] = out["perf/tflops_per_device"] / peak_tflops
    if m.get("perf/trained_tokens") and m.get("time/update"):
        out["perf/tokens_per_s_per_device_train"] = (float(m["perf/trained_tokens"]) / float(m["time/update"])
                                                     / trainer_devices)
    ro_s = step_s if rollout_overlaps else float(m.get("time/rollout", 0.0))
    if m.get("perf/generated_tokens") and ro_s > 0:
        out["perf/tokens_per_s_per_device_rollout"] = float(m["perf/generated_tokens"]) / ro_s / rollout_devices
    return out


def perf_line(m: Mapping[str, Any]) -> str:
    """The step line's performance part, e.g. `` | perf step 1.23s mfu 0.412 tflops/dev 407 tok/s/dev rollout
    1.1e+03 train 2.3e+04 mem peak log_prob 2.10 update 3.21 GiB | ranks busy 0.91-0.97s slowest 3 mem max
    3.30 GiB on rank 5`` (``n/a`` for MFU without a known peak; memory and ranks only when logged)."""
    g = lambda k, fmt="{:.3g}": fmt.format(float(m[k])) if k in m else "n/a"  # noqa: E731
    line = (f" | perf step {g('perf/step_s', '{:.2f}s')} mfu {g('perf/mfu')} tflops/dev {g('perf/tflops_per_device')} "
            f"tok/s/dev rollout {g('perf/tokens_per_s_per_device_rollout')} "
            f"train {g('perf/tokens_per_s_per_device_train')}")
    mem = [(k[len("memory/"):-len("_peak_gib")], float(v)) for k, v in m.items()
           if k.startswith("memory/") and k.endswith("_peak_gib")]
    if mem:
        line += " mem peak " + " ".join(f"{k} {v:.2f}" for k, v in mem) + " GiB"
    if "straggler/busy_s_max" in m:
        line += (f" | ranks busy {float(m['straggler/busy_s_min']):.2f}-{float(m['straggler/busy_s_max']):.2f}s "
                 f"slowest {int(m['straggler/slowest_rank'])}")
        if "memory/peak_gib_max_over_ranks" in m:
            line += (f" mem max {float(m['memory/peak_gib_max_over_ranks']):.2f} GiB on rank "
                     f"{int(m['memory/peak_max_rank'])}")
    return line


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
        if self._tb is not None and values:
            # one event holding every scalar of the step (a Summary with one value per tag, what add_scalar
            # writes one event each for): ~100 add_scalar calls were 3 ms of the demo's 0.2 s trainer step
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=name, simple_value=v) for name, v in values.items()])
            self._tb._get_file_writer().add_summary(summary, int(step))
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
