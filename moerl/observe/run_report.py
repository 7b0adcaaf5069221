"""``moerl report RUN_DIR``: PNG plots and a markdown summary of a finished (or running) training run.

Reads what ``moerl train`` writes into its output directory:

* ``RUN_DIR/tensorboard/events.out.tfevents.*``: the scalars of :class:`moerl.observe.MetricsLogger`
  (read with TensorBoard's ``EventAccumulator``; several event files of a resumed run are merged, the
  last value written for a step wins);
* ``RUN_DIR/moe_telemetry.jsonl``: per-layer expert loads (plotted by ``tools/inspect_experts.py``,
  whose functions are reused here);
* ``RUN_DIR/summary.json``: the run's end-of-run figures (accuracy after warm start / after RL).

and writes into ``RUN_DIR/report/`` (or ``--out``):

==========================  ===================================================================
``reward.png``              ``reward_mean`` and training-sample ``accuracy`` per RL step, greedy
                            held-out ``eval/accuracy`` (step 0 = after the warm start)
``sft.png``                 ``sft/loss`` and ``sft/eval_accuracy`` (when the run had an SFT warm start)
``step_time.png``           the RL step's seconds per phase (``time/<phase>``), stacked
``logprob_mismatch.png``    trainer vs rollout-server log-probs, mean and max ``|diff|`` per token
                            (``logprob_abs_diff_mean`` / ``_max``)
``staleness.png``           ``staleness/mean`` / ``staleness/max`` in weight versions (async runs only:
                            a run whose staleness is always 0 is synchronous and gets a line instead)
``perf.png``                ``perf/mfu``, ``perf/tflops_per_device`` and ``perf/tokens_per_s_*`` (when
                            logged; else a line)
``memory.png``              ``memory/*_gib`` peaks (when logged; else a line)
``experts/*.png``           tools/inspect_experts.py's heatmaps, imbalance and entropy curves
``summary.md``              links to the figures, the skipped ones with their reason, and a table of
                            every scalar's first / last / min / max value
==========================  ===================================================================

Needs matplotlib (Agg backend, no display) and tensorboard (both moerl dependencies).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["load_scalars", "find_event_dir", "plot_lines", "plot_stacked", "write_run_report", "main"]

Series = dict[str, tuple[list[int], list[float]]]  # tag -> (steps ascending, values)

REWARD_TAGS = ("reward_mean", "accuracy", "eval/accuracy")
SFT_TAGS = ("sft/loss", "sft/eval_accuracy")
MISMATCH_TAGS = ("logprob_abs_diff_mean", "logprob_abs_diff_max")
STALENESS_TAGS = ("staleness/mean", "staleness/max")


def find_event_dir(run_dir: str | Path) -> Optional[Path]:
    """The folder holding the run's TensorBoard event files: ``RUN_DIR/tensorboard`` (moerl's layout),
    else ``RUN_DIR`` itself when it holds ``events.out.tfevents.*`` files; None when neither does.

    Raises:
        moerl.errors.CLIError (exit 2 in ``moerl report``): ``run_dir`` does not exist or is not a directory.
    """
    from moerl.errors import CLIError

    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise CLIError(f"run directory {run_dir} not found", key="RUN_DIR", file=str(run_dir),
                       hint="give the output_dir of a moerl train run (it holds tensorboard/ and summary.json)")
    if not run_dir.is_dir():
        raise CLIError(f"RUN_DIR {run_dir} is not a directory", key="RUN_DIR", file=str(run_dir),
                       hint="give the run's output_dir itself, not one of its files")
    for d in (run_dir / "tensorboard", run_dir):
        if d.is_dir() and any(d.glob("events.out.tfevents.*")):
            return d
    return None


def load_scalars(event_dir: str | Path) -> Series:
    """Every scalar in the TensorBoard event files of ``event_dir``.

    Returns:
        tag -> (steps, values): python ints ascending without repeats, python floats (NaN / inf kept).
        A step written twice (a resumed run re-logging it) keeps the value written last.

    Source: TensorBoard's ``event_accumulator.EventAccumulator`` (``size_guidance`` 0 = keep all).
    """
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(event_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    out: Series = {}
    for tag in acc.Tags().get(SCALARS, []):
        by_step: dict[int, float] = {}
        for ev in sorted(acc.Scalars(tag), key=lambda e: e.wall_time):
            by_step[int(ev.step)] = float(ev.value)
        steps = sorted(by_step)
        out[tag] = (steps, [by_step[s] for s in steps])
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lines(panels: Sequence[tuple[str, Series]], path: str | Path, title: str) -> Series:
    """One figure with one panel per ``(y label, {label: (steps, values)})``, a line per series; saved as
    PNG at ``path``.

    Returns:
        label -> (x, y) read back from the drawn ``Line2D`` artists (what the PNG shows).
    """
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.8 * len(panels) + 0.6), squeeze=False, sharex=True)
    drawn: Series = {}
    for ax, (ylabel, series) in zip(axes[:, 0], panels):
        for label, (x, y) in series.items():
            ax.plot(x, y, label=label, marker="o" if len(x) <= 30 else None, markersize=3)
        for line in ax.get_lines():
            drawn[line.get_label()] = ([int(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()])
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def plot_stacked(series: Series, path: str | Path, title: str, ylabel: str) -> tuple[list[int], dict[str, list[float]]]:
    """A stacked area plot of ``series`` over the union of their steps (a series missing at a step
    counts 0 there, e.g. ``time/eval`` on the steps without an evaluation); saved as PNG at ``path``.

    Returns:
        (steps, label -> values aligned on those steps): the arrays handed to ``Axes.stackplot``.
    """
    plt = _pyplot()
    steps = sorted({s for x, _ in series.values() for s in x})
    stacked = {}
    for label, (x, y) in series.items():
        at = dict(zip(x, y))
        stacked[label] = [at.get(s, 0.0) for s in steps]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.stackplot(steps, *stacked.values(), labels=list(stacked), alpha=0.85)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", ncol=max(1, len(stacked) // 4))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return steps, stacked


def _inspect_experts_module():
    """tools/inspect_experts.py of this checkout (tools/ is not an installed package), or None."""
    path = Path(__file__).resolve().parents[2] / "tools" / "inspect_experts.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("moerl_tools_inspect_experts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fmt(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def write_run_report(run_dir: str | Path, out: Optional[str | Path] = None) -> dict[str, Any]:
    """Write the figures and ``summary.md`` of the run in ``run_dir`` (see the module docstring).

    Args:
        run_dir: a ``moerl train`` output_dir (or a folder holding TensorBoard event files).
        out: output folder (default ``run_dir/report``), created if missing.

    Returns:
        ``{"figures": {name: Path}, "plotted": {figure: data returned by plot_lines / plot_stacked},
        "skipped": [one line per figure not drawn, with the reason], "summary": Path,
        "scalars": the Series read}``.

    Raises:
        moerl.errors.CLIError: ``run_dir`` missing / not a directory, ``out`` not writable.
        moerl.errors.DataError: ``run_dir`` holds neither TensorBoard event files nor moe_telemetry.jsonl
            (nothing to report), or its moe_telemetry.jsonl is malformed.
    """
    from moerl.errors import DataError, check_writable_path

    run_dir = Path(run_dir)
    event_dir = find_event_dir(run_dir)
    telemetry = run_dir / "moe_telemetry.jsonl"
    if event_dir is None and not telemetry.is_file():
        raise DataError(f"{run_dir} holds no TensorBoard event files (tensorboard/events.out.tfevents.*) and no "
                        "moe_telemetry.jsonl: nothing to report", file=str(run_dir),
                        hint="give the output_dir of a moerl train run that logged at least one step "
                             "(log.tensorboard=true)")
    out = Path(out) if out is not None else run_dir / "report"
    check_writable_path(out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    scalars = load_scalars(event_dir) if event_dir is not None else {}
    figures: dict[str, Path] = {}
    plotted: dict[str, Any] = {}
    skipped: list[str] = []

    def pick(tags: Sequence[str]) -> Series:
        return {t: scalars[t] for t in tags if t in scalars}

    def lines(name: str, panels: list[tuple[str, Series]], title: str, why_absent: str) -> None:
        panels = [(yl, s) for yl, s in panels if s]
        if not panels:
            skipped.append(f"{name}: not drawn: {why_absent}")
            return
        figures[name] = out / f"{name}.png"
        plotted[name] = plot_lines(panels, figures[name], title)

    lines("reward", [("reward / accuracy", pick(REWARD_TAGS))],
          "RL reward and accuracy (eval/accuracy: greedy, held out; step 0 = after warm start)",
          f"none of {', '.join(REWARD_TAGS)} was logged")
    lines("sft", [("SFT loss", pick(SFT_TAGS[:1])), ("greedy accuracy", pick(SFT_TAGS[1:]))],
          "SFT warm start", "no sft/* scalars (sft.enabled=false or resumed after SFT)")
    times = {t[len("time/"):]: v for t, v in scalars.items() if t.startswith("time/")}
    if times:
        figures["step_time"] = out / "step_time.png"
        plotted["step_time"] = plot_stacked(times, figures["step_time"], "RL step time per phase", "seconds")
    else:
        skipped.append("step_time: not drawn: no time/<phase> scalars")
    lines("logprob_mismatch", [("|log p_trainer - log p_rollout|", pick(MISMATCH_TAGS))],
          "trainer vs rollout-server log-probs per token", f"none of {', '.join(MISMATCH_TAGS)} was logged")
    stale = pick(STALENESS_TAGS)
    if stale and all(v == 0 for _, ys in stale.values() for v in ys):
        skipped.append("staleness: not drawn: staleness is 0 at every step (synchronous run)")
    else:
        lines("staleness", [("weight versions behind", stale)], "staleness of the trained tokens",
              "no staleness/* scalars")
    mfu = {t: s for t, s in scalars.items() if t.startswith("perf/mfu")}
    tput = {t: s for t, s in scalars.items() if t.startswith("perf/tokens_per_s")}
    lines("perf", [("MFU", mfu), ("TFLOP/s per device", pick(("perf/tflops_per_device",))), ("tokens / s", tput)],
          "model FLOPs utilisation and throughput",
          "no perf/mfu or perf/tokens_per_s_* scalars in this run (logged by moerl versions with MFU logging)")
    lines("memory", [("GiB", {t: s for t, s in scalars.items() if t.startswith("memory/") and t.endswith("_gib")})],
          "memory peak per phase (CUDA allocator on GPU, process RSS on CPU)", "no memory/* scalars in this run")

    if telemetry.is_file():
        ie = _inspect_experts_module()
        if ie is None:
            skipped.append("experts: not drawn: tools/inspect_experts.py is not in this checkout")
        else:
            for name, p in ie.write_report(telemetry, out / "experts").items():
                figures[f"experts/{name}"] = p
    else:
        skipped.append("experts: not drawn: no moe_telemetry.jsonl (moe.telemetry off)")

    summary = out / "summary.md"
    summary.write_text(_summary_markdown(run_dir, out, figures, skipped, scalars), encoding="utf-8")
    return {"figures": figures, "plotted": plotted, "skipped": skipped, "summary": summary, "scalars": scalars}


def _summary_markdown(run_dir: Path, out: Path, figures: dict[str, Path], skipped: list[str], scalars: Series) -> str:
    text = [f"# moerl run report: {run_dir}", ""]
    end = run_dir / "summary.json"
    if end.is_file():
        try:
            s = json.loads(end.read_text())
        except (OSError, ValueError):
            s = {}
        keys = [k for k in ("accuracy_after_warm_start", "accuracy_after_rl", "sft_steps", "total_seconds")
                if isinstance(s.get(k), (int, float))]
        if keys:
            text += ["From summary.json: " + ", ".join(f"{k} {_fmt(float(s[k]))}" for k in keys), ""]
    text += ["## Figures", ""]
    for name, p in figures.items():
        if p.suffix == ".png":
            rel = p.relative_to(out).as_posix()
            text += [f"### {name}", "", f"![{name}]({rel})", ""]
    if "experts/summary" in figures:
        text += ["Expert load summary: [experts/summary.txt](experts/summary.txt)", ""]
    if skipped:
        text += ["## Not drawn", ""] + [f"- {line}" for line in skipped] + [""]
    if scalars:
        text += ["## Scalars (first / last logged value)", "",
                 "| scalar | points | first step | first | last step | last | min | max |",
                 "|---|---|---|---|---|---|---|---|"]
        for tag in sorted(scalars):
            x, y = scalars[tag]
            finite = [v for v in y if math.isfinite(v)] or [float("nan")]
            text.append(f"| {tag} | {len(x)} | {x[0]} | {_fmt(y[0])} | {x[-1]} | {_fmt(y[-1])} | "
                        f"{_fmt(min(finite))} | {_fmt(max(finite))} |")
        text.append("")
    return "\n".join(text)


def main(argv: Optional[list[str]] = None) -> int:
    """``moerl report RUN_DIR [--out DIR]``: write the report, print the summary's path and the skipped
    figures; exit 2 (moerl.errors) for a RUN_DIR that is missing, not a directory or holds no logs."""
    ap = argparse.ArgumentParser(prog="moerl report", description="PNG plots and a markdown summary of a run")
    ap.add_argument("run_dir", metavar="RUN_DIR", help="a moerl train output_dir")
    ap.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    args = ap.parse_args(argv)
    res = write_run_report(args.run_dir, args.out)
    for name, p in res["figures"].items():
        print(f"wrote {p}")
    for line in res["skipped"]:
        print(line)
    print(f"summary: {res['summary']}")
    return 0


if __name__ == "__main__":
    from moerl.errors import run_entry

    sys.exit(run_entry("moerl report", main))
