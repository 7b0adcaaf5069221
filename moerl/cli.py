"""moerl command line: ``moerl train RECIPE.yaml [key=value ...]`` and ``moerl serve ...``."""

from __future__ import annotations

import argparse
import os
import sys
import warnings


def _quiet_runtime() -> None:
    """CPU-friendly defaults set before torch loads (DEMO_CALIBRATION.md: trainer and rollout servers
    share the cores, so idle OpenMP threads must sleep) and silence for known-harmless warnings
    (megatron-core's "Apex/Transformer Engine not installed" fallbacks on CPU)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\..*)?$")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="moerl train",
        description="Run the RL main job from a YAML recipe; dotted key=value pairs override recipe keys "
        "(e.g. rollout.n_samples_per_prompt=8).",
    )
    parser.add_argument("recipe", help="path to a recipe YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, key=value")
    args = parser.parse_args(argv)
    _quiet_runtime()
    from moerl.config.loader import ConfigError, load_config

    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as e:
        print(f"moerl train: invalid recipe: {e}", file=sys.stderr)
        return 2
    from moerl.data.dataset import DatasetError
    from moerl.rollout.errors import PortInUseError, RolloutError
    from moerl.train.loop import train

    try:
        train(cfg)
    except (DatasetError, FileNotFoundError, ConfigError) as e:
        print(f"moerl train: bad input: {e}", file=sys.stderr)
        return 2
    except PortInUseError as e:
        print(f"moerl train: bad input: {e}", file=sys.stderr)
        return 2
    except RolloutError as e:
        print(f"moerl train: rollout failure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def _serve(argv: list[str]) -> int:
    from moerl.rollout.server import main as serve_main

    return serve_main(argv) or 0


COMMANDS = {
    "train": (_train, "run the RL main job from a recipe"),
    "serve": (_serve, "run a reference rollout server speaking SGLang's HTTP API (CPU)"),
    "plan": (
        lambda argv: __import__("moerl.parallel.memory_plan", fromlist=["main"]).main(argv),
        "per-GPU memory of a recipe's parallel layout (weights, grads, Adam state, activations)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moerl`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: moerl {train,serve} ...\n")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:6s} {help_}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    fn, _ = COMMANDS[argv[0]]
    try:
        return fn(argv[1:])
    except KeyboardInterrupt:
        print("moerl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
