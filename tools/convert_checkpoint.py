"""Convert between Hugging Face checkpoints and Megatron-Core distributed checkpoints (torch_dist).

    python tools/convert_checkpoint.py hf-to-mcore --hf HF_DIR --out CKPT_DIR
    python tools/convert_checkpoint.py mcore-to-hf --ckpt CKPT_DIR --config HF_DIR_WITH_CONFIG --out HF_DIR

``mcore-to-hf`` needs the model's HF config.json (e.g. a run's ``hf_export/`` or ``hf_warm_start/``);
tokenizer files found next to that config are copied too. Model weights only (no optimizer state),
single process (tp = pp = ep = 1). Architectures: the model families of moerl.models.families (``model_type``
qwen3_moe, mixtral, ...); another model_type exits 2 listing them. Conversion rules are the family's, through
moerl.checkpoint.hf_convert (exact in both directions).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _build(hf_config):
    from moerl.models.gpt import build_gpt_model

    return build_gpt_model(hf_config)


def hf_to_mcore(hf_dir: str, out: str) -> Path:
    """Load an HF checkpoint (a registered model family) into a Megatron GPTModel and save it as torch_dist."""
    from transformers import AutoConfig

    from moerl.checkpoint.dist_ckpt import save_dist_checkpoint
    from moerl.checkpoint.hf_convert import hf_to_megatron, load_megatron_state_dict
    from moerl.checkpoint.hf_io import load_hf_state_dict

    hf_config = AutoConfig.from_pretrained(hf_dir)
    model = _build(hf_config)
    load_megatron_state_dict(model, hf_to_megatron(load_hf_state_dict(hf_dir), hf_config))
    return save_dist_checkpoint(model, None, out, extra={"converted_from": str(hf_dir)})


def mcore_to_hf(ckpt: str, config_dir: str, out: str) -> Path:
    """Load a torch_dist checkpoint (model part) and write an HF checkpoint with ``config_dir``'s config."""
    from transformers import AutoConfig

    from moerl.checkpoint.dist_ckpt import load_dist_checkpoint
    from moerl.checkpoint.hf_convert import megatron_to_hf
    from moerl.checkpoint.hf_io import save_hf_checkpoint

    hf_config = AutoConfig.from_pretrained(config_dir)
    model = _build(hf_config)
    load_dist_checkpoint(model, None, ckpt)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    path = Path(save_hf_checkpoint(megatron_to_hf(sd, hf_config), hf_config, out) or out)
    for name in TOKENIZER_FILES:
        src = Path(config_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(out) / name)
    return path


def check_args(args: argparse.Namespace) -> None:
    """Every input of a conversion, before torch.distributed starts or a model is built.

    hf-to-mcore: ``--hf`` an HF directory of a registered model family (moerl.models.families) whose
    config the family maps and whose safetensors match its config.json (names and shapes), ``--out`` not
    existing. mcore-to-hf: ``--ckpt`` a torch_dist checkpoint written for the model of ``--config`` (its
    recorded tensor shapes), ``--config`` a config directory of a registered family, ``--out`` not an
    existing non-empty directory (both subcommands: nothing is overwritten).

    Raises:
        moerl.errors.ModelError / CheckpointError / CLIError: naming the flag, the path and the fix.
    """
    from moerl.checkpoint.input_checks import check_checkpoint_shapes, check_hf_model_dir, check_hf_tensors
    from moerl.errors import CLIError, check_writable_path

    if not str(args.out).strip():
        raise CLIError("--out is empty", key="--out", hint="give --out a new directory path")
    check_writable_path(args.out, "--out")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CLIError(f"--out {args.out} already exists", key="--out", file=args.out,
                       hint="choose a new (or empty) directory (nothing is overwritten)")
    if args.cmd == "hf-to-mcore":
        check_hf_model_dir(args.hf, "--hf", weights=True)
        hf_config = _family_config(args.hf, "--hf")
        check_hf_tensors(args.hf, hf_config, "--hf")
    else:
        check_hf_model_dir(args.config, "--config")
        check_checkpoint_shapes(args.ckpt, _family_config(args.config, "--config"), key="--ckpt")


def _family_config(path: str, key: str):
    """The HF config at ``path`` after its model family's checks (moerl.models.families: supported
    model_type, features the family maps). Raises moerl.errors.ModelError naming ``key``."""
    from transformers import AutoConfig

    from moerl.errors import ModelError
    from moerl.models.families import get_family

    hf_config = AutoConfig.from_pretrained(path)
    family = get_family(hf_config, key=key, file=str(Path(path) / "config.json"))
    try:
        family.check_hf_config(hf_config)
    except ValueError as e:
        raise ModelError(f"{key}={path}: {e}", key=key, file=str(Path(path) / "config.json"),
                         hint=f"moerl's {family.name} builder does not map this; convert a checkpoint without it") from None
    return hf_config


def main(argv=None) -> int:
    """Command line (see the module docstring). Exit 0 done, 2 bad input (one line naming the flag and
    the fix, moerl.errors; argparse's own usage errors are 2 as well)."""
    from moerl.errors import run_entry

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF checkpoint -> Megatron torch_dist checkpoint")
    a.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="output checkpoint directory (must not exist, or be empty)")
    b = sub.add_parser("mcore-to-hf", help="Megatron torch_dist checkpoint -> HF checkpoint")
    b.add_argument("--ckpt", required=True, help="torch_dist checkpoint directory (e.g. runs/x/checkpoints/step_N)")
    b.add_argument("--config", required=True, help="directory with the model's HF config.json")
    b.add_argument("--out", required=True, help="output HF directory (must not exist, or be empty)")
    args = parser.parse_args(argv)
    return run_entry("convert_checkpoint", lambda: _convert(args))


def _convert(args: argparse.Namespace) -> int:
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    check_args(args)
    init_distributed(seed=0)
    try:
        if args.cmd == "hf-to-mcore":
            print(f"wrote {hf_to_mcore(args.hf, args.out)}")
        else:
            print(f"wrote {mcore_to_hf(args.ckpt, args.config, args.out)}")
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
