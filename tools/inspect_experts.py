"""Inspect a run's expert load: heatmaps, imbalance and entropy curves, and a text summary.

    python tools/inspect_experts.py RUN_DIR/moe_telemetry.jsonl [--out DIR] [--top 3]

Reads the per-layer JSONL written by moerl.moe.telemetry.MoETelemetry (one line per step and MoE
layer: step, layer, tokens_per_expert [E], ...) and writes into ``--out`` (default: a
``moe_inspect/`` folder next to the JSONL):

* ``expert_load_heatmap.png``: one panel per layer, expert (y) x step (x), colour = the expert's
  share of the layer's routed tokens at that step (uniform = 1/E);
* ``mean_load_heatmap.png``: layer (y) x expert (x), share averaged over steps;
* ``imbalance.png``: max/mean tokens per expert of each layer over steps;
* ``entropy.png``: normalised load entropy H / ln(E) of each layer over steps;
* ``summary.txt``: per layer the most and least loaded experts (mean share over steps), mean and
  worst imbalance, lowest entropy, experts with no tokens over the last steps, and alert counts.

Needs matplotlib (Agg backend, no display).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np


def load_telemetry(path: str | Path) -> dict[str, Any]:
    """Parse a moe_telemetry.jsonl file.

    Returns:
        ``{"steps": [S] ints (sorted), "layers": [L] ints (sorted), "counts": float64 [S, L, E]
        (NaN where a (step, layer) line is missing), "alerts": {layer: count}}``.

    Raises:
        moerl.errors.DataError (a ValueError): no such file, a directory, a line that is not UTF-8 or not
            JSON, a line without step/layer/tokens_per_expert, a negative step or layer, a
            tokens_per_expert list whose length is not the line's num_experts, layers with different
            expert counts, or no lines at all (each naming the file and line number).
    """
    from moerl.errors import DataError

    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory, not a telemetry file", file=str(path),
                        hint=f"give the run's moe_telemetry.jsonl (e.g. {path / 'moe_telemetry.jsonl'})")
    if not path.is_file():
        raise DataError(f"telemetry file {path} not found", file=str(path),
                        hint="give a run's moe_telemetry.jsonl (written with moe.telemetry on)")
    rows = []
    fix = "give a moe_telemetry.jsonl written by moerl train (moe.telemetry on)"
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{i}: not UTF-8 text ({e.reason} at byte {e.start})", file=str(path), row=i,
                                hint=fix) from None
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                counts = [float(x) for x in d["tokens_per_expert"]]
                step, layer = int(d["step"]), int(d["layer"])
                if step < 0 or layer < 0:
                    raise ValueError(f"step {step} / layer {layer} must be >= 0")
                if "num_experts" in d and len(counts) != int(d["num_experts"]):
                    raise ValueError(f"tokens_per_expert has {len(counts)} entries, num_experts is {d['num_experts']}")
                if not counts or any(not math.isfinite(c) or c < 0 for c in counts):
                    raise ValueError("tokens_per_expert must be a non-empty list of counts >= 0")
                rows.append((step, layer, counts, len(d.get("alerts", []))))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise DataError(
                    f"{path}:{i}: not a MoETelemetry line (need step, layer, tokens_per_expert): {e}",
                    file=str(path), row=i, hint=fix) from None
    if not rows:
        raise DataError(f"{path}: no telemetry lines (was moe.telemetry on and did training run a step?)",
                        file=str(path), hint=fix)
    widths = {len(r[2]) for r in rows}
    if len(widths) != 1:
        raise DataError(f"{path}: lines have different numbers of experts {sorted(widths)}", file=str(path), hint=fix)
    steps = sorted({r[0] for r in rows})
    layers = sorted({r[1] for r in rows})
    si, li = {s: i for i, s in enumerate(steps)}, {l: i for i, l in enumerate(layers)}
    counts = np.full((len(steps), len(layers), widths.pop()), np.nan)
    alerts = {l: 0 for l in layers}
    for s, l, c, a in rows:
        counts[si[s], li[l]] = c
        alerts[l] += a
    return {"steps": steps, "layers": layers, "counts": counts, "alerts": alerts}


def load_shares(counts: np.ndarray) -> np.ndarray:
    """[S, L, E] counts -> shares (each (step, layer) row sums to 1; NaN where no tokens)."""
    tot = counts.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, counts / tot, np.nan)


def imbalance_and_entropy(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[S, L, E] counts -> (max/mean imbalance [S, L], normalised entropy H / ln E [S, L])."""
    e = counts.shape[-1]
    p = load_shares(counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        imb = counts.max(-1) / counts.mean(-1)
        h = -np.nansum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)
    h = np.where(np.isnan(p).all(-1), np.nan, h)
    return imb, h / math.log(e) if e > 1 else np.ones_like(h)


def summarize(data: dict[str, Any], top: int = 3, dead_window: int = 10) -> str:
    """The text summary (see the module docstring): per layer, the ``top`` most and least loaded
    experts by mean share over steps (uniform share = 1/E), imbalance, entropy, experts with no
    tokens in the last ``dead_window`` steps, alert count."""
    counts, steps, layers = data["counts"], data["steps"], data["layers"]
    e = counts.shape[-1]
    shares = np.nanmean(load_shares(counts), axis=0)  # [L, E]
    imb, ent = imbalance_and_entropy(counts)
    recent = counts[-dead_window:]
    lines = [f"MoE expert load: {len(steps)} steps ({steps[0]}..{steps[-1]}), {len(layers)} MoE layers, "
             f"{e} experts (uniform share {1 / e:.4f})"]
    for j, layer in enumerate(layers):
        order = np.argsort(-shares[j], kind="stable")
        most = ", ".join(f"e{k} {shares[j, k]:.4f}" for k in order[:top])
        least = ", ".join(f"e{k} {shares[j, k]:.4f}" for k in order[::-1][:top])
        dead = [int(k) for k in range(e) if np.nansum(recent[:, j, k]) == 0]
        lines.append(
            f"layer {layer}: most loaded [{most}]; least loaded [{least}]; imbalance mean "
            f"{np.nanmean(imb[:, j]):.3f} max {np.nanmax(imb[:, j]):.3f}; entropy/ln(E) min "
            f"{np.nanmin(ent[:, j]):.3f} last {ent[-1, j]:.3f}; no tokens in last {min(dead_window, len(steps))} "
            f"steps: {dead if dead else 'none'}; alerts {data['alerts'][layer]}"
        )
    return "\n".join(lines) + "\n"


def write_report(jsonl: str | Path, out: Optional[str | Path] = None, top: int = 3) -> dict[str, Path]:
    """Write the PNGs and summary.txt for ``jsonl`` into ``out``; returns name -> path.

    Raises:
        ImportError: matplotlib missing. ValueError: see :func:`load_telemetry`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load_telemetry(jsonl)
    out = Path(out) if out is not None else Path(jsonl).resolve().parent / "moe_inspect"
    out.mkdir(parents=True, exist_ok=True)
    steps, layers, counts = data["steps"], data["layers"], data["counts"]
    e = counts.shape[-1]
    shares = load_shares(counts)
    paths: dict[str, Path] = {}

    n = len(layers)
    fig, axes = plt.subplots(n, 1, figsize=(max(6.0, min(16.0, 0.08 * len(steps) + 4)), 1.2 + 0.25 * e * n + 0.4 * n),
                             squeeze=False)
    vmax = float(np.nanmax(shares)) if np.isfinite(np.nanmax(shares)) else 1.0
    for j, layer in enumerate(layers):
        ax = axes[j, 0]
        im = ax.imshow(shares[:, j, :].T, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=vmax,
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, e - 0.5), interpolation="nearest")
        ax.set_ylabel(f"layer {layer}\nexpert")
        fig.colorbar(im, ax=ax, label="token share")
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(f"expert load share per step (uniform = {1 / e:.3f})")
    fig.tight_layout()
    paths["expert_load_heatmap"] = out / "expert_load_heatmap.png"
    fig.savefig(paths["expert_load_heatmap"], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * e + 2), max(2.5, 0.4 * n + 1.5)))
    im = ax.imshow(np.nanmean(shares, axis=0), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(e))
    ax.set_yticks(range(n), [str(l) for l in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("mean token share over steps")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    paths["mean_load_heatmap"] = out / "mean_load_heatmap.png"
    fig.savefig(paths["mean_load_heatmap"], dpi=100)
    plt.close(fig)

    imb, ent = imbalance_and_entropy(counts)
    for name, values, ylabel in (("imbalance", imb, "max / mean tokens per expert"),
                                 ("entropy", ent, "load entropy / ln(E)")):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for j, layer in enumerate(layers):
            ax.plot(steps, values[:, j], label=f"layer {layer}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if name == "entropy":
            ax.set_ylim(0, 1.02)
        ax.legend(fontsize="small", ncol=max(1, n // 8))
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=100)
        plt.close(fig)

    paths["summary"] = out / "summary.txt"
    paths["summary"].write_text(summarize(data, top=top), encoding="utf-8")
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", help="a run's moe_telemetry.jsonl")
    ap.add_argument("--out", default=None, help="output folder (default: moe_inspect/ next to the JSONL)")
    ap.add_argument("--top", type=int, default=3, help="most / least loaded experts listed per layer")
    args = ap.parse_args(argv)
    from moerl.errors import run_entry

    return run_entry("inspect_experts", lambda: _inspect(args))


def _inspect(args: argparse.Namespace) -> int:
    """Check --top / --out / the telemetry file (moerl.errors: exit 2 naming it), then write the report."""
    from moerl.errors import CLIError, check_writable_path

    if args.top < 1:
        raise CLIError(f"--top must be >= 1, got {args.top}", key="--top", hint="give --top 1 or more")
    load_telemetry(args.jsonl)  # the file's errors first (named with file:line)
    if args.out is not None:
        check_writable_path(args.out, "--out")  # a file, or under a file / unwritable: refused
    paths = write_report(args.jsonl, args.out, top=args.top)
    print(paths["summary"].read_text(), end="")
    for name, p in paths.items():
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
