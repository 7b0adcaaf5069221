"""moerl.observe.profiling: a profiled step writes a Chrome trace with the phase names, memory peaks per
phase, the per-rank spread of step times, and the profile.* recipe keys refused with the key named."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch

from moerl.observe.metrics import perf_line, perf_metrics
from moerl.observe.profiling import PhaseTimers, StepProfiler, rank_spread, reset_peak

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "configs" / "tiny_arith.yaml")
PHASES = ("rollout", "log_prob", "update", "weight_sync")


def _step(timers: PhaseTimers) -> None:
    a = torch.randn(64, 64)
    for name in PHASES:
        with timers(name):
            (a @ a).sum()


def test_profiled_steps_write_a_chrome_trace_with_the_phase_names(tmp_path):
    timers = PhaseTimers()
    prof = StepProfiler([2, 3], ranks=[0], rank=0, out_dir=tmp_path / "profile")
    idle = StepProfiler([2, 3], ranks=[0], rank=1, out_dir=tmp_path / "profile")  # rank 1 is not listed
    for step in range(1, 5):
        for p in (prof, idle):
            p.step_begin(step)
        _step(timers)
        for p in (prof, idle):
            p.step_end(step)
        if step == 3:  # written when the last profiled step ends
            assert prof.path.is_file()
    assert prof.close() is None and idle.close() is None
    assert sorted(os.listdir(tmp_path / "profile")) == ["trace_rank0.json"]
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    names = [e.get("name") for e in trace["traceEvents"]]
    for name in PHASES:
        assert names.count(name) == 2, name  # steps 2 and 3 only
    assert "step 2" in names and "step 3" in names and "step 1" not in names and "step 4" not in names
    assert "aten::mm" in names  # the ops inside the phases


def test_phase_memory_peaks_are_per_phase_and_nested():
    """On CPU the peak is the process's resident-set high-water mark, reset per phase: a phase that
    touches 256 MiB peaks >= 200 MiB above a later phase that does not; an outer phase includes it."""
    if torch.cuda.is_available() or not reset_peak():
        pytest.skip("the CPU RSS peak cannot be reset here (/proc/self/clear_refs)")
    timers = PhaseTimers()
    with timers("outer"):
        with timers("big"):
            x = torch.ones(64 * 2**20)  # 256 MiB, every page written
            del x
    with timers("small"):
        torch.ones(16).sum()
    peaks = timers.pop_memory()
    assert peaks["big"] - peaks["small"] >= 200 * 2**20, peaks
    assert peaks["outer"] >= peaks["big"]
    assert timers.pop_memory() == {} and set(timers.pop()) == {"outer", "big", "small"}


def test_perf_metrics_and_step_line():
    # 3e12 FLOPs of log-probs + 9e12 of update in 1 + 2 s on 2 devices: 12e12 / 3 / 2 = 2 TFLOP/s per device;
    # peak 8 -> MFU 0.25; 6000 trained tokens / 2 s / 2 = 1500; 400 generated tokens / 0.5 s / 4 servers = 200
    m = {"perf/logprob_flops": 3e12, "perf/update_flops": 9e12, "time/log_prob": 1.0, "time/update": 2.0,
         "time/rollout": 0.5, "perf/trained_tokens": 6000.0, "perf/generated_tokens": 400.0}
    out = perf_metrics(m, step_s=4.0, trainer_devices=2, rollout_devices=4, peak_tflops=8.0)
    assert out == pytest.approx({"perf/step_s": 4.0, "perf/tflops_per_device": 2.0, "perf/mfu": 0.25,
                                 "perf/tokens_per_s_per_device_train": 1500.0,
                                 "perf/tokens_per_s_per_device_rollout": 200.0})
    # async: generation overlaps the step (400 / 4 s / 4); no peak (CPU): no MFU
    out = perf_metrics(m, step_s=4.0, trainer_devices=2, rollout_devices=4, peak_tflops=None, rollout_overlaps=True)
    assert "perf/mfu" not in out and out["perf/tokens_per_s_per_device_rollout"] == pytest.approx(25.0)
    line = perf_line({**out, "memory/update_peak_gib": 1.5})
    assert line == " | perf step 4.00s mfu n/a tflops/dev 2 tok/s/dev rollout 25 train 1.5e+03 mem peak update 1.50 GiB"
    ranks = {"straggler/busy_s_min": 0.9, "straggler/busy_s_max": 1.25, "straggler/slowest_rank": 3.0,
             "memory/peak_gib_max_over_ranks": 2.5, "memory/peak_max_rank": 1.0}
    assert perf_line({**out, **ranks}).endswith(" | ranks busy 0.90-1.25s slowest 3 mem max 2.50 GiB on rank 1")


def test_step_monitor_counts_flops_and_times_only_the_step(tmp_path):
    """StepMonitor.end: FLOPs of the counted passes (moerl.observe.flops, checked against hand counts in
    test_flops), tokens, MFU against hardware.peak_bf16_tflops, and a step time that leaves out the
    phases run before the RL steps (an SFT checkpoint) and the step's own eval."""
    import time
    from types import SimpleNamespace as NS

    from moerl.observe.flops import forward_flops
    from moerl.observe.profiling import StepMonitor

    cfg = NS(hardware=NS(peak_bf16_tflops=4.0, gpu=None), profile=NS(steps=None, ranks=[0]), train=NS(mode="sync"),
             rollout=NS(backend="reference", num_servers=2, server_tp_size=1, server_dp_size=1))
    hf = NS(model_type="qwen3_moe", hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6, intermediate_size=12,
            vocab_size=16)
    samples = [NS(tokens=[1] * 5), NS(tokens=[1] * 3)]
    timers = StepMonitor(cfg, tmp_path)
    with timers("checkpoint"):  # before the RL steps (the SFT warm start's checkpoints)
        time.sleep(0.5)
    for step in timers.steps(1, 1):
        with timers("rollout"):
            time.sleep(0.05)
        with timers("log_prob"):
            timers.count("logprob", hf, samples, passes=2)
        with timers("update"):
            timers.count("update", hf, samples)
            time.sleep(0.05)
        with timers("eval"):
            time.sleep(0.5)
        out = timers.end(step, {"response_length": 2.5, "num_samples": 8.0})
    fwd = forward_flops(hf, [5, 3])
    assert out["perf/logprob_flops"] == 2 * fwd and out["perf/update_flops"] == 3 * fwd
    assert out["perf/trained_tokens"] == 8 and out["perf/generated_tokens"] == 20
    assert 0.1 <= out["perf/step_s"] < 0.45, out  # rollout + update sleeps, not the 0.5 s eval nor the SFT checkpoint
    busy = out["time/log_prob"] + out["time/update"]
    assert out["perf/mfu"] == pytest.approx(5 * fwd / busy / 1e12 / 4.0)
    assert out["perf/tokens_per_s_per_device_rollout"] == pytest.approx(20 / out["time/rollout"] / 2)
    assert out["time/checkpoint"] >= 0.5  # reported as before: the totals since the last pop


def _spread_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        res = rank_spread([2.0, 0.5][rank])
        Path(out, f"{rank}.json").write_text(json.dumps(res))
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
def test_rank_spread_names_the_slowest_rank(tmp_path):
    """Two gloo ranks with step times 2.0 and 0.5 s: both get max 2.0 (rank 0), min 0.5, spread 1.5."""
    import torch.multiprocessing as mp

    from moerl.rollout.common import free_port_block

    mp.spawn(_spread_worker, args=(free_port_block(1), str(tmp_path)), nprocs=2)
    for r in range(2):
        assert json.loads((tmp_path / f"{r}.json").read_text()) == {"max": 2.0, "min": 0.5, "spread": 1.5,
                                                                    "slowest_rank": 0.0}
    assert rank_spread(1.0) is None  # one process


@pytest.mark.parametrize("overrides, needles", [
    (["profile.steps=[3,1]"], ["profile.steps [3, 1]", "first <= last"]),
    (["profile.steps=[-1,2]"], ["profile.steps [-1, 2]", "0 <= first"]),
    (["profile.steps=[1,2,3]"], ["profile.steps [1, 2, 3]", "[first, last]"]),
    (["train.num_steps=5", "profile.steps=[4,6]"], ["profile.steps [4, 6]", "train.num_steps=5"]),
    (["profile.ranks=[]"], ["profile.ranks []"]),
    (["profile.ranks=[0,0]"], ["profile.ranks [0, 0]", "distinct"]),
    (["profile.ranks=[0,2]"], ["profile.ranks [0, 2]", "ranks [2] do not exist", "1 processes"]),
], ids=["reversed", "negative", "three", "after-last-step", "no-rank", "duplicate", "rank-beyond-world"])
def test_bad_profile_keys_exit_2_before_any_work(tmp_path, overrides, needles, monkeypatch):
    from moerl.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(["train", RECIPE, f"output_dir={tmp_path / 'run'}", *overrides])
    out = buf.getvalue()
    assert rc == 2, out
    for n in needles:
        assert n in out, (n, out)
    assert not (tmp_path / "run").exists()
