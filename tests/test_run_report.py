"""moerl report RUN_DIR (moerl/observe/run_report.py) on a tiny run dir written here with TensorBoard's
SummaryWriter (the writer MetricsLogger uses): the PNGs and summary.md exist, the plotted series equal
the logged scalars, a resumed run's re-logged step keeps its last value, absent figures are named, and
bad RUN_DIRs exit 2."""

from __future__ import annotations

import json
import math

import pytest

from moerl.cli import main as cli_main
from moerl.observe.run_report import write_run_report

STEPS = [1, 2, 3, 4, 5, 6]
REWARD = [0.1, 0.25, 0.3, 0.45, 0.5, 0.7]
ROLLOUT_S = [0.5, 0.4, 0.45, 0.42, 0.41, 0.40]
UPDATE_S = [0.2, 0.21, 0.19, 0.2, 0.22, 0.18]
EVAL_S = {3: 0.3, 6: 0.31}  # eval only every 3 steps: 0 in the stack elsewhere
LP_DIFF = [1e-6, 2e-6, 1.5e-6, 3e-6, 1e-6, 2e-6]
STALE = [0.0, 0.5, 1.0, 0.75, 1.0, 0.5]
MFU = [0.11, 0.12, 0.125, 0.12, 0.13, 0.128]
TOK_S = [900.0, 950.0, 1000.0, 980.0, 1010.0, 1005.0]


def _write_run(run, perf=True, stale=True, resumed=True):
    from torch.utils.tensorboard import SummaryWriter

    tb = run / "tensorboard"
    w = SummaryWriter(str(tb))
    w.add_scalar("eval/accuracy", 0.4, 0)
    for i, s in enumerate(STEPS):
        if resumed and s == 4:  # the first process dies here: steps 4.. come from the resumed run
            w.add_scalar("reward_mean", -99.0, s)  # re-logged by the resumed process below
            w.close()
            w = SummaryWriter(str(tb))
        w.add_scalar("reward_mean", REWARD[i], s)
        w.add_scalar("time/rollout", ROLLOUT_S[i], s)
        w.add_scalar("time/update", UPDATE_S[i], s)
        if s in EVAL_S:
            w.add_scalar("time/eval", EVAL_S[s], s)
            w.add_scalar("eval/accuracy", 0.4 + 0.1 * s, s)
        w.add_scalar("logprob_abs_diff_mean", LP_DIFF[i], s)
        w.add_scalar("logprob_abs_diff_max", 10 * LP_DIFF[i], s)
        w.add_scalar("staleness/mean", STALE[i] if stale else 0.0, s)
        if perf:
            w.add_scalar("perf/mfu", MFU[i], s)
            w.add_scalar("perf/tokens_per_s_train", TOK_S[i], s)
            w.add_scalar("memory/update_peak_gib", 0.5 + 0.01 * s, s)
            w.add_scalar("memory/peak_max_rank", 0.0, s)  # a rank index, not GiB: not on the memory plot
    w.close()
    lines = [{"step": s, "layer": 0, "tokens_per_expert": [4, 2, 1, 1]} for s in STEPS]
    (run / "moe_telemetry.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    (run / "summary.json").write_text(json.dumps({"accuracy_after_warm_start": 0.4, "accuracy_after_rl": 1.0}))
    return run


def _close(a, b):
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12) for x, y in zip(a, b))


def test_report_plots_the_logged_series(tmp_path):
    run = _write_run(tmp_path / "run")
    res = write_run_report(run)
    out = run / "report"
    for name in ("reward", "step_time", "logprob_mismatch", "staleness", "perf", "memory"):
        png = out / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    for name in ("expert_load_heatmap", "mean_load_heatmap", "imbalance", "entropy"):
        assert (out / "experts" / f"{name}.png").is_file()
    p = res["plotted"]
    # resumed run: step 4's value is the one the resumed process wrote (0.45, not -99)
    assert p["reward"]["reward_mean"][0] == STEPS and _close(p["reward"]["reward_mean"][1], REWARD)
    assert p["reward"]["eval/accuracy"][0] == [0, 3, 6] and _close(p["reward"]["eval/accuracy"][1], [0.4, 0.7, 1.0])
    assert _close(p["logprob_mismatch"]["logprob_abs_diff_mean"][1], LP_DIFF)
    assert _close(p["logprob_mismatch"]["logprob_abs_diff_max"][1], [10 * v for v in LP_DIFF])
    assert _close(p["staleness"]["staleness/mean"][1], STALE)
    assert _close(p["perf"]["perf/mfu"][1], MFU) and _close(p["perf"]["perf/tokens_per_s_train"][1], TOK_S)
    assert list(p["memory"]) == ["memory/update_peak_gib"]
    assert _close(p["memory"]["memory/update_peak_gib"][1], [0.5 + 0.01 * s for s in STEPS])
    steps, stacked = p["step_time"]
    assert steps == STEPS and list(stacked) == ["rollout", "update", "eval"]
    assert _close(stacked["rollout"], ROLLOUT_S) and _close(stacked["update"], UPDATE_S)
    assert _close(stacked["eval"], [EVAL_S.get(s, 0.0) for s in STEPS])
    md = res["summary"].read_text()
    for name in ("reward.png", "step_time.png", "perf.png", "experts/imbalance.png", "experts/summary.txt"):
        assert f"]({name})" in md, name
    # the table's first / last values are the logged ones (float32 in the event file, 4 significant digits)
    assert "| reward_mean | 6 | 1 | 0.1 | 6 | 0.7 | 0.1 | 0.7 |" in md
    assert "| eval/accuracy | 3 | 0 | 0.4 | 6 | 1 | 0.4 | 1 |" in md
    assert "accuracy_after_rl 1" in md


def test_absent_figures_are_named(tmp_path, capsys):
    run = _write_run(tmp_path / "run", perf=False, stale=False, resumed=False)
    assert cli_main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    assert "perf: not drawn: no perf/mfu" in printed and "memory: not drawn" in printed
    assert "staleness: not drawn: staleness is 0 at every step (synchronous run)" in printed
    assert not (tmp_path / "rep" / "perf.png").exists() and not (tmp_path / "rep" / "staleness.png").exists()
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "- perf: not drawn" in md and "- sft: not drawn" in md and "![reward](reward.png)" in md


@pytest.mark.parametrize("what, message", [
    ("missing", "not found"), ("file", "is not a directory"), ("empty", "nothing to report"),
    ("bad_telemetry", "moe_telemetry.jsonl:1: not a MoETelemetry line"), ("out_file", "exists and is not a directory")])
def test_bad_run_dir_exits_2(tmp_path, capsys, what, message):
    path = tmp_path / "x"
    extra = []
    if what == "file":
        path.write_text("not a run")
    elif what != "missing":
        path.mkdir()
    if what in ("bad_telemetry", "out_file"):
        (path / "moe_telemetry.jsonl").write_text("not json\n")
    if what == "out_file":
        (tmp_path / "out").write_text("a file")
        extra = ["--out", str(tmp_path / "out")]
    assert cli_main(["report", str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moerl report: bad ") and message in err and "fix:" in err
