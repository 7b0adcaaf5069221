"""Tests for moerl.observe: TensorBoard events read back with tensorboard's EventAccumulator,
timers with an injected clock, progress lines, wandb's optional import."""

from __future__ import annotations

import io
import sys
import time
import types

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from moerl.observe import MetricsLogger, Progress, Timers, format_line


def _read_scalars(log_dir):
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_round_trip(tmp_path):
    with MetricsLogger(tmp_path / "tb") as logger:
        logger.log(0, {"reward": 0.25, "pg_loss": torch.tensor(-0.5)}, prefix="train")
        logger.log(1, {"reward": np.float32(0.75), "pg_loss": torch.tensor([1.5])}, prefix="train/")
        logger.log(1, {"tokens_per_s": 1234})
    scalars = _read_scalars(tmp_path / "tb")
    assert scalars["train/reward"] == [(0, pytest.approx(0.25)), (1, pytest.approx(0.75))]
    assert scalars["train/pg_loss"] == [(0, pytest.approx(-0.5)), (1, pytest.approx(1.5))]
    assert scalars["tokens_per_s"] == [(1, pytest.approx(1234.0))]
    assert set(scalars) == {"train/reward", "train/pg_loss", "tokens_per_s"}


def test_one_event_per_log_call_holds_every_scalar(tmp_path):
    """log() writes one TensorBoard event per call (a Summary with one value per tag), not one per scalar."""
    import glob

    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    with MetricsLogger(tmp_path / "tb") as logger:
        logger.log(3, {f"m{i}": float(i) for i in range(5)}, prefix="rollout")
        logger.log(4, {})  # nothing to write
    (path,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    events = [e for e in map(Event.FromString, RawEventFileLoader(path).Load()) if e.HasField("summary")]
    assert len(events) == 1 and events[0].step == 3
    assert [(v.tag, v.simple_value) for v in events[0].summary.value] == [(f"rollout/m{i}", float(i)) for i in range(5)]


def test_log_rejects_non_scalars(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(TypeError, match="'kl'"):
        logger.log(0, {"kl": torch.zeros(3)})
    with pytest.raises(TypeError, match="step"):
        logger.log(1.0, {"kl": 0.0})
    logger.close()


def test_format_line():
    line = format_line(7, {"reward": 0.53125, "pg_loss": torch.tensor(-0.0123456), "x": 1}, ["reward", "pg_loss", "kl"])
    assert line == "step 7 | reward 0.5312 | pg_loss -0.01235 | kl n/a"
    assert MetricsLogger.format_line(1, {"a": 2.0}, ["a"]) == "step 1 | a 2"


def test_missing_wandb_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, wandb_project="moerl")


def test_wandb_receives_prefixed_scalars(tmp_path, monkeypatch):
    calls = {}

    class FakeRun:
        def __init__(self):
            calls["log"] = []

        def log(self, data, step):
            calls["log"].append((step, dict(data)))

        def finish(self):
            calls["finished"] = True

    def init(**kw):
        calls["init"] = kw
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb_project="p", wandb_run_name="r")
    logger.log(3, {"reward": torch.tensor(0.5)}, prefix="train")
    logger.close()
    assert calls["init"]["project"] == "p" and calls["init"]["name"] == "r"
    assert calls["log"] == [(3, {"train/reward": 0.5})]
    assert calls["finished"]


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_timers_accumulate_and_pop():
    clock = FakeClock()
    timers = Timers(clock=clock)
    with timers("rollout"):
        clock.t += 2.0
        with timers("reward"):
            clock.t += 0.5
    with timers("rollout"):
        clock.t += 1.25
    assert timers.elapsed() == {"reward": 0.5, "rollout": 3.75}
    assert timers.pop() == {"reward": 0.5, "rollout": 3.75}
    assert timers.pop() == {}
    with pytest.raises(RuntimeError, match="already running"):
        with timers("a"):
            with timers("a"):
                pass


def test_timers_real_clock_and_exception():
    timers = Timers()
    with pytest.raises(KeyError):
        with timers("sleep"):
            time.sleep(0.02)
            raise KeyError("x")
    t = timers.pop()["sleep"]
    assert 0.015 <= t < 1.0


def test_progress_prints_periodic_lines():
    clock, out = FakeClock(), io.StringIO()
    p = Progress(100, "rollout", interval_s=10, unit="samples", file=out, clock=clock)
    clock.t += 5
    p.update(10)  # 5 s since start: silent
    assert out.getvalue() == ""
    clock.t += 5
    p.update(10)  # 10 s: 20 done, 2/s, 80 left -> eta 40 s
    assert out.getvalue() == "rollout: 20/100 (20.0%) | 2 samples/s | elapsed 00:10 | eta 00:40\n"
    clock.t += 3
    p.update(5)  # 3 s since last line: silent
    assert out.getvalue().count("\n") == 1
    clock.t += 37
    p.update(75)
    p.close()
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    assert lines[-1] == "rollout: 100/100 (100.0%) | 2 samples/s | elapsed 00:50 | eta 00:00"


def test_progress_unknown_total_and_errors():
    clock, out = FakeClock(), io.StringIO()
    with Progress(None, "steps", interval_s=0, file=out, clock=clock) as p:
        clock.t += 4
        p.update(2)
    assert out.getvalue().splitlines()[0] == "steps: 2 | 0.5 it/s | elapsed 00:04"
    with pytest.raises(ValueError, match="total"):
        Progress(0, "x")
