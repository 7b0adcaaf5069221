"""moerl command line: ``moerl train RECIPE.yaml [key=value ...]`` and ``moerl serve ...``."""

from __future__ import annotations

import argparse
import contextlib
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
        epilog="Every key, with its default and meaning, is in configs/tiny_arith.yaml (typed and checked by "
        "moerl/config/schema.py). Asynchronous RL: train.mode=sync|one_step_off|async with train.max_staleness, "
        "train.staleness_policy and algorithm.off_policy_correction (README, 'Asynchronous RL'). "
        "Continue a stopped run: the same command with resume=auto.",
    )
    parser.add_argument("recipe", help="path to a recipe YAML (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, key=value")
    args = parser.parse_args(argv)
    _quiet_runtime()
    from moerl.config.loader import ConfigError, load_config
    from moerl.errors import input_kind, report_input_error

    try:
        cfg = load_config(args.recipe, args.overrides)
        # the layout rules need the world size: check them before any work (torchrun sets WORLD_SIZE)
        world = os.environ.get("WORLD_SIZE", "") or "1"
        if not world.strip().isdigit() or int(world) < 1:
            from moerl.errors import CLIError

            raise CLIError(f"environment variable WORLD_SIZE={world!r} is not a positive integer", key="WORLD_SIZE",
                           hint="unset WORLD_SIZE (one process) or launch with torchrun --nproc_per_node N")
        cfg.check_world_size(int(world))
        from moerl.moe.config import check_rollout_routing_matches

        if cfg.model.hf_config.model_type == "qwen3_moe":  # other families: against their HF router (train.setup)
            check_rollout_routing_matches(cfg.moe)  # the trained router must be the one that samples
        from moerl.rollout.sglang_launcher import check_rollout_environment

        check_rollout_environment(cfg.rollout)  # sglang installed / CUDA for NCCL, before any work
        if cfg.precision.fp8 is not None:
            from moerl.precision.te_fp8 import check_fp8_training

            check_fp8_training(cfg.precision.fp8_recipe, cfg.model.layer_spec)  # TE, CUDA GPU, recipe vs GPU, TE layers
        from moerl.models.gpt import resolve_layer_spec

        resolve_layer_spec(cfg.model.layer_spec)  # model.layer_spec=transformer_engine: TE importable and CUDA
        from moerl.rewards import resolve_reward_fn

        resolve_reward_fn(cfg.reward.function, group=cfg.reward.group)  # user code: path and signature
        from moerl.models.dtypes import params_torch_dtype

        params_torch_dtype(cfg.model.params_dtype)  # float32 | bfloat16 (float16 refused: no loss scaling)
    except ValueError as e:  # every input error is a ValueError (moerl.errors.InputError)
        return report_input_error("moerl train", e if input_kind(e) else ConfigError(str(e)))
    if os.path.exists(cfg.output_dir) and not os.path.isdir(cfg.output_dir):
        return report_input_error("moerl train", ConfigError(
            f"output_dir {cfg.output_dir} exists and is not a directory", key="output_dir",
            hint="choose another output_dir"))
    from moerl.train.loop import train

    return _run_train(lambda: train(cfg), run_dir=cfg.output_dir)


def _resume_hint(run_dir) -> str:
    """What an interrupted run left to continue from (its newest complete checkpoint), as one clause."""
    from pathlib import Path

    from moerl.checkpoint.run_state import list_complete_checkpoints

    found = list_complete_checkpoints(Path(run_dir) / "checkpoints")
    if not found:
        return ("; no checkpoint was saved, so a rerun starts over (train.save_every / train.save_every_minutes "
                "save during the run)")
    return f"; the newest complete checkpoint is {found[-1]}: the same command with resume=auto continues from it"


def _run_train(run, run_dir=None) -> int:
    """Run the job and turn what can end it into one line and an exit code: 0 done, 2 bad input
    (found before or early in the run), 1 rollout failure (e.g. a server died; named), 130 Ctrl-C
    (the rollout launcher has stopped every server and the router by then)."""
    from moerl.errors import input_kind, report_input_error
    from moerl.rollout.errors import RolloutError

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
            hint = ""
            if run_dir is not None:
                with contextlib.suppress(Exception):  # the hint must not turn Ctrl-C into a traceback
                    hint = _resume_hint(run_dir)
            print(f"moerl train: interrupted; rollout servers and router stopped{hint}", file=sys.stderr)
            return 130
        if input_kind(e) is not None:
            return report_input_error("moerl train", e)
        if isinstance(e, FileNotFoundError):  # a path the recipe names (the message says which)
            from moerl.errors import InputError

            return report_input_error("moerl train", InputError(str(e)))
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
        "does a recipe fit its GPUs (per-GPU memory per pipeline stage, FITS / DOES NOT FIT); --search: which layout does",
    ),
    "doctor": (
        lambda argv: __import__("moerl.kernels.doctor", fromlist=["main"]).main(argv),
        "which implementation (native csrc/ kernel or torch reference) each op uses here, and why",
    ),
    "report": (
        lambda argv: __import__("moerl.observe.run_report", fromlist=["main"]).main(argv),
        "PNG plots (reward, step time, log-prob mismatch, staleness, MFU, expert load) and summary.md of a run dir",
    ),
}


def _usage(file) -> None:
    print("usage: moerl [--debug] {" + ",".join(COMMANDS) + "} ...\n", file=file)
    for name, (_, help_) in COMMANDS.items():
        print(f"  {name:6s} {help_}", file=file)
    print("\n  --debug  print the Python traceback of a bad-input error too (or set MOERL_DEBUG=1)", file=file)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``moerl`` console script: ``moerl [--debug] {train,serve,plan} ...``.

    Exit codes (README "Exit codes"): 0 done, 2 bad input (one line ``moerl <cmd>: bad <kind> input:
    ...`` naming the key / file / row, and a fix; moerl.errors), 1 rollout failure, 130 Ctrl-C.
    ``--debug`` (or ``MOERL_DEBUG=1``) adds the traceback of a bad-input error.
    """
    from moerl.errors import DEBUG_ENV, CLIError, report_input_error, run_entry

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--debug":
        os.environ[DEBUG_ENV] = "1"
        argv = argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        _usage(sys.stdout)
        return 0
    if not argv or argv[0] not in COMMANDS:
        import difflib

        if not argv:
            err = CLIError("no command given", key="command", hint="moerl train RECIPE.yaml (see moerl --help)")
        else:
            close = ([argv[0].lower()] if argv[0].lower() in COMMANDS
                     else difflib.get_close_matches(argv[0].lower(), list(COMMANDS), n=1, cutoff=0.5))
            err = CLIError(f"unknown command {argv[0]!r}" + (f"; did you mean {close[0]!r}?" if close else ""),
                           key="command", hint=f"use one of {', '.join(COMMANDS)} (moerl --help)")
        _usage(sys.stderr)
        return report_input_error("moerl", err)
    fn, _ = COMMANDS[argv[0]]
    try:
        return run_entry(f"moerl {argv[0]}", lambda: fn(argv[1:]))
    except KeyboardInterrupt:
        print("moerl: interrupted", file=sys.stderr)
        return 130


def exit_without_teardown(code: int) -> None:
    """End this process with ``code`` the way the interpreter would, less the module teardown: first the
    exit handlers (``atexit``: rollout cluster, reward pool, logging, multiprocessing...) and a flush of
    stdout / stderr, then ``os._exit``. Freeing the modules of torch, megatron-core and transformers one by
    one takes about a second of CPU after every `moerl train`, and nothing in it is output. Returns (and
    the caller exits normally) while a non-daemon thread still runs: the interpreter would wait for it."""
    import atexit
    import threading

    main_thread = threading.main_thread()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main_thread):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":  # `python -m moerl.cli` (tests, torchrun -m moerl.cli)
    _code = main()
    if _code is None or isinstance(_code, int):
        exit_without_teardown(_code or 0)
    sys.exit(_code)
