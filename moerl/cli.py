"""moerl command line: ``moerl train RECIPE.yaml [key=value ...]`` and ``moerl serve ...``."""

from __future__ import annotations

import argparse
import os
import signal
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
        # the layout rules need the world size: check them before any work (torchrun sets WORLD_SIZE)
        cfg.check_world_size(int(os.environ.get("WORLD_SIZE", "1")))
        from moerl.moe.config import check_rollout_routing_matches

        check_rollout_routing_matches(cfg.moe)  # the trained router must be the one that samples
        from moerl.rollout.sglang_launcher import check_rollout_environment

        check_rollout_environment(cfg.rollout)  # sglang installed / CUDA for NCCL, before any work
        from moerl.rewards import resolve_reward_fn

        resolve_reward_fn(cfg.reward.function, group=cfg.reward.group)  # user code: path and signature
        if cfg.model.params_dtype != "float32":
            raise ValueError(f"model.params_dtype={cfg.model.params_dtype}: moerl train keeps fp32 weights and "
                             "Adam state today (the key sizes `moerl plan`); set model.params_dtype=float32")
    except (ConfigError, ValueError) as e:
        print(f"moerl train: {e}", file=sys.stderr)
        return 2
    if os.path.exists(cfg.output_dir) and not os.path.isdir(cfg.output_dir):
        print(f"moerl train: output_dir {cfg.output_dir} exists and is not a directory; choose another "
              "output_dir", file=sys.stderr)
        return 2
    from moerl.train.loop import train

    return _run_train(lambda: train(cfg))


def _run_train(run) -> int:
    """Run the job and turn what can end it into one line and an exit code: 0 done, 2 bad input
    (found before or early in the run), 1 rollout failure (e.g. a server died; named), 130 Ctrl-C
    (the rollout launcher has stopped every server and the router by then)."""
    from moerl.config.loader import ConfigError
    from moerl.data.dataset import DatasetError
    from moerl.rewards.errors import RewardConfigError
    from moerl.rollout.errors import PortInUseError, RolloutError

    interrupted = []

    def on_sigint(signum, frame):  # the rollout launcher chains its own cleanup in front of this
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        run()
        return 0
    except BaseException as e:  # noqa: BLE001 - an interrupt can surface as any error mid-shutdown
        if interrupted or isinstance(e, KeyboardInterrupt):
            print("moerl train: interrupted; rollout servers and router stopped", file=sys.stderr)
            return 130
        if isinstance(e, (DatasetError, FileNotFoundError, ConfigError, PortInUseError, RewardConfigError)):
            print(f"moerl train: bad input: {e}", file=sys.stderr)
            return 2
        if isinstance(e, RolloutError):
            print(f"moerl train: rollout failure: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


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
        print("usage: moerl {" + ",".join(COMMANDS) + "} ...\n")
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
