"""Everything a run needs before the first step: run dir, tokenizer, data, model config, reward.

All checks that can fail on user input happen here, before any model is built or server started.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from moerl.checkpoint.hf_io import load_hf_state_dict
from moerl.checkpoint.input_checks import check_hf_model_dir, check_hf_tensors
from moerl.data.dataset import DatasetError, PromptSampler, load_prompt_dataset
from moerl.data.fingerprint import describe_change, file_fingerprint, tokenizer_fingerprint
from moerl.data.tasks import prepare_task_data
from moerl.data.tokenizer import PromptEncoder, decode_response, encode_prompt, tokenizer_from_config
from moerl.models.families import get_family
from moerl.moe.config import check_rollout_routing_matches
from moerl.rewards import check_label, resolve_reward_fn
from moerl.rollout.launcher import check_ports_free as check_rollout_ports


@dataclass
class RunContext:
    """The resolved, read-only inputs of one run (the recipe is never mutated)."""

    cfg: Any
    dist: Any
    run_dir: Path
    tokenizer: Any
    hf_config: Any
    train_ds: Any
    eval_rows: list[dict]
    init_hf_state_dict: Optional[dict]
    inputs: dict = field(default_factory=dict)  # fingerprints of the data and tokenizer (resume safety)
    rewards: Any = None  # the RewardPool (rank 0, while the job runs: moerl.train.loop opens it)
    encoder: Optional[PromptEncoder] = None  # memoized prompt encoding, built on first use (prompt_encoder)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def prompt_encoder(self) -> PromptEncoder:
        """The run's memoized encoder (moerl.data.tokenizer.PromptEncoder) of the tokenizer and data.system_prompt."""
        if self.encoder is None:
            self.encoder = PromptEncoder(self.tokenizer, self.cfg.data.system_prompt)
        return self.encoder

    def encode(self, prompt) -> list[int]:
        """Chat-templated prompt ids of a prompt (text or a list of chat messages), with data.system_prompt."""
        return self.prompt_encoder()(prompt)

    def decode(self, response_ids: list[int]) -> str:
        """Response text without special tokens."""
        return decode_response(self.tokenizer, response_ids)

    @staticmethod
    def make_sampler(dataset, batch_size: int, seed: int) -> PromptSampler:
        return PromptSampler(dataset, batch_size, seed)


def check_ports_free(rollout) -> None:
    """Fail before any compute when a rollout port is taken: ``rollout.host`` resolved ("auto": this
    node's address), then moerl.rollout.launcher.check_ports_free (the check the cluster repeats at start).

    Raises:
        PortInUseError: naming the port and the recipe key to change.
        moerl.errors.PortError: rollout.host does not resolve or is not an address of this machine.
    """
    from moerl.errors import PortError
    from moerl.rollout.sglang_launcher import resolve_host

    try:
        host = resolve_host(rollout.host)  # "auto": this node's address
    except OSError as e:
        raise PortError(f"rollout.host={rollout.host!r} does not resolve ({e})", key="rollout.host",
                        hint="give rollout.host an address of this machine (127.0.0.1, auto)") from None
    check_rollout_ports(host, rollout.base_port, rollout.num_servers, rollout.router_port)


def prepare_run(cfg, dist) -> RunContext:
    """Resolve the recipe into a RunContext: checks every input, then writes <output_dir>/recipe.yaml,
    the tokenizer and generated data, and resolves the HF model config.

    Every check that can fail on user input runs *before the first write into output_dir*: the rollout
    ports, the reward function, ``model.init_from`` (architecture, config, tensor names and shapes),
    every data row (encoding, fields, metadata, length against the context), the resume checkpoint
    (tensor shapes against the recipe, data and tokenizer fingerprints). Generated data and moerl's
    tokenizer are first built in a temporary directory for those checks; only when all pass is the run
    directory written (files with unchanged content are left as they are). A failed start therefore
    leaves an existing run directory byte for byte as it was.

    Collective when ``dist.world_size > 1`` (every rank calls it): global rank 0 checks and prepares
    first, then the other ranks read what it wrote. An error on rank 0 is re-raised on every rank (no
    rank hangs).

    Raises:
        moerl.errors.InputError (ConfigError, DatasetError, ModelError, CheckpointError), PortInUseError,
        RewardConfigError, FileNotFoundError: any bad input, with the recipe key (and file / row) named.
    """
    cfg.check_world_size(dist.world_size)
    if cfg.model.hf_config.model_type == "qwen3_moe":  # other families: against their HF router, in _resolve
        check_rollout_routing_matches(cfg.moe)
    if dist.world_size <= 1:
        return _checked(_prepare_main, cfg, dist)
    import torch.distributed as tdist

    ctx, err = None, None
    if dist.is_main:
        try:
            ctx = _checked(_prepare_main, cfg, dist)
        except Exception as e:  # noqa: BLE001 - handed to the other ranks, then re-raised
            err = e
    box = [err]
    tdist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]
    if not dist.is_main:
        ctx = _checked(_resolve, cfg, dist, Path(cfg.output_dir), False)
    tdist.barrier()
    return ctx


def _checked(fn, *args):
    """Run a preparation step; a ValueError it raises that is not already a named input error is a bad
    recipe input, re-raised as ConfigError so that ``moerl train`` exits 2 with one line."""
    from moerl.config.loader import ConfigError
    from moerl.errors import InputError

    try:
        return fn(*args)
    except InputError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _prepare_main(cfg, dist) -> RunContext:
    """Global rank 0: every check against a scratch copy of what the run would write, then the writes."""
    import tempfile

    check_ports_free(cfg.rollout)
    resolve_reward_fn(cfg.reward.function, group=cfg.reward.group)  # user code: path and signature
    run_dir = Path(cfg.output_dir)
    from moerl.config.loader import ConfigError
    from moerl.errors import check_writable_path

    check_writable_path(run_dir, "output_dir", ConfigError)
    check_logging_packages(cfg.log)
    with tempfile.TemporaryDirectory(prefix="moerl-start-") as scratch:
        try:
            _resolve(cfg, dist, Path(scratch), True)
        except ValueError as e:  # name the file where the run will keep it, not the scratch copy
            e.args = tuple(a.replace(scratch, str(run_dir)) if isinstance(a, str) else a for a in e.args)
            if getattr(e, "file", None):
                e.file = e.file.replace(scratch, str(run_dir))
            raise
    check_existing_run(cfg, run_dir)
    if cfg.overwrite_output_dir and cfg.resume == "none":
        clear_run_outputs(run_dir)  # start over: no stale weights / checkpoints / logs mix with the new run
    run_dir.mkdir(parents=True, exist_ok=True)  # every check passed: the first write into output_dir
    _note_recipe_changes(cfg, run_dir)
    cfg.save(str(run_dir / "recipe.yaml"))
    return _resolve(cfg, dist, run_dir, False)


def recipe_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``"key: old -> new"`` for every dotted key whose value differs between two recipe dicts (a key only
    one side has shows ``<unset>`` on the other), in the order of ``new`` then ``old``."""
    out = []
    for k in list(new) + [k for k in old if k not in new]:
        key, a, b = f"{prefix}{k}", old.get(k, "<unset>"), new.get(k, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += recipe_changes(a, b, key + ".")
        elif a != b:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def _note_recipe_changes(cfg, run_dir: Path) -> None:
    """A resumed run whose recipe differs from the one in ``run_dir/recipe.yaml`` (the run it continues): log
    each changed key and keep the earlier file as recipe.previous.yaml before it is overwritten."""
    import shutil

    import yaml

    from moerl.runtime.world import log

    path = run_dir / "recipe.yaml"
    if cfg.resume == "none" or not path.is_file():
        return
    try:
        old = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return
    skip = {"resume", "overwrite_output_dir"}
    changes = [c for c in recipe_changes(old, cfg.to_dict()) if c.split(":")[0] not in skip]
    if changes:
        shutil.copyfile(path, run_dir / "recipe.previous.yaml")
        log(f"resume: the recipe differs from the run's recipe.yaml in {len(changes)} key(s) (the earlier one is "
            f"kept as recipe.previous.yaml): " + "; ".join(changes))


# what marks a directory as holding a moerl run, and what a run writes there besides data/ and tokenizer/
RUN_MARKERS = ("recipe.yaml", "checkpoints", "weights")
RUN_OUTPUTS = ("recipe.yaml", "recipe.previous.yaml", "checkpoints", "weights", "logs", "tensorboard", "hf_export",
               "hf_critic", "hf_warm_start", "reference_resets", "moe_telemetry.jsonl", "samples.jsonl", "summary.json")


def check_existing_run(cfg, run_dir: Path) -> None:
    """A fresh start (``resume=none``) must not write over a run already in ``output_dir`` unless the
    recipe says so (``overwrite_output_dir=true``).

    Raises:
        ConfigError: naming output_dir, what marks it as a run, and the three ways on.
    """
    from moerl.config.loader import ConfigError

    if cfg.resume != "none" or cfg.overwrite_output_dir or not run_dir.is_dir():
        return
    found = [m for m in RUN_MARKERS if (run_dir / m).exists()]
    if found:
        raise ConfigError(f"output_dir={cfg.output_dir} already holds a moerl run ({', '.join(found)}) and "
                          "resume=none would write over it", key="output_dir", file=str(run_dir),
                          hint="resume=auto to continue it, another output_dir, or overwrite_output_dir=true to "
                               "start over (removes its weights, checkpoints and logs)")


def clear_run_outputs(run_dir: Path) -> None:
    """Remove what an earlier run wrote into ``run_dir`` (:data:`RUN_OUTPUTS`); data/ and tokenizer/ are
    rewritten by the new run."""
    import shutil

    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def check_logging_packages(log_cfg) -> None:
    """The packages the ``log`` section asks for are installed (found without importing them).

    Raises:
        ConfigError: ``log.wandb_project`` set without wandb, or ``log.tensorboard`` without tensorboard,
            naming the key and what to install.
    """
    import importlib.util

    from moerl.config.loader import ConfigError

    if log_cfg.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"log.wandb_project={log_cfg.wandb_project!r} is set but wandb is not installed",
                          key="log.wandb_project", hint="pip install wandb (or moerl[wandb]), or unset log.wandb_project")
    if log_cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("log.tensorboard=true but the tensorboard package is not installed", key="log.tensorboard",
                          hint="pip install tensorboard, or set log.tensorboard=false")


def _resolve(cfg, dist, run_dir: Path, check: bool) -> RunContext:
    """Generate (or find) the data, tokenizer and HF config under ``run_dir``. With ``check``, also run
    every input check (rows, resume checkpoint, init_from tensors) and load no weights; without, load
    ``model.init_from``'s weights (the checks have passed on rank 0)."""
    d = cfg.data
    if check and cfg.model.init_from:
        check_hf_model_dir(cfg.model.init_from, "model.init_from")  # a directory of a Qwen3-MoE model
    train_path, eval_path = prepare_task_data(
        d.task, run_dir / "data", cfg.data_seed,
        train_path=d.train_path, eval_path=d.eval_path,
        num_train=d.num_train, num_eval=d.num_eval, digits=d.digits,
        reasoning_gym=d.reasoning_gym.model_dump() if d.reasoning_gym is not None else None,
    )
    cache = str(run_dir / "data" / "hf_cache")
    train_ds = load_prompt_dataset(train_path, d.prompt_key, d.label_key, recipe_key="data.train_path", cache_dir=cache)
    eval_ds = load_prompt_dataset(eval_path, d.prompt_key, d.label_key, recipe_key="data.eval_path", cache_dir=cache)
    if len(eval_ds) < cfg.eval.num_prompts:
        raise ValueError(
            f"eval.num_prompts ({cfg.eval.num_prompts}) exceeds the {len(eval_ds)} rows of {eval_path}; lower it"
        )
    tokenizer = tokenizer_from_config(d.tokenizer_path, run_dir, init_from=cfg.model.init_from)
    hf_fields = cfg.model.hf_config.family_fields()  # the model family's fields (model.hf_config.model_type)
    hf_fields["vocab_size"] = cfg.model.hf_config.resolve_vocab_size(len(tokenizer))
    family = get_family(cfg.model.hf_config.model_type, key="model.hf_config.model_type")
    hf_config = family.make_hf_config(hf_fields)
    if cfg.model.hf_config.model_type != "qwen3_moe":  # Qwen3-MoE: checked in prepare_run already
        check_rollout_routing_matches(cfg.moe, family.router(hf_config), family.name)
    inputs = {"train_data": file_fingerprint(train_path), "eval_data": file_fingerprint(eval_path),
              "train_rows": len(train_ds), "eval_rows": len(eval_ds), "tokenizer": tokenizer_fingerprint(tokenizer)}
    init_sd = None
    if check:
        for ds, path, key in ((train_ds, train_path, "data.train_path"), (eval_ds, eval_path, "data.eval_path")):
            check_rows(ds, path, key, prompt_key=d.prompt_key, label_key=d.label_key, reward_spec=cfg.reward.function,
                       encode=lambda prompt: encode_prompt(tokenizer, prompt, d.system_prompt),
                       max_positions=hf_config.max_position_embeddings, max_new_tokens=cfg.rollout.max_new_tokens)
        # the checkpoint a resume would load sits in the real output_dir (resume=auto) or at resume=<path>
        check_resume_inputs(cfg, Path(cfg.output_dir), inputs)
        check_resume_shapes(cfg, Path(cfg.output_dir), hf_config)
        if cfg.model.init_from:
            check_init_config(cfg.model.init_from, hf_config)
            check_hf_tensors(cfg.model.init_from, hf_config, "model.init_from")
    elif cfg.model.init_from:
        init_sd = load_hf_state_dict(cfg.model.init_from)
    return RunContext(
        cfg=cfg, dist=dist, run_dir=run_dir, tokenizer=tokenizer, hf_config=hf_config, train_ds=train_ds,
        eval_rows=[eval_ds[i] for i in range(len(eval_ds))], init_hf_state_dict=init_sd, inputs=inputs,
    )


def check_rows(ds, path, recipe_key: str, *, prompt_key: str, label_key: str, encode, reward_spec: str,
               max_positions: int, max_new_tokens: int) -> None:
    """Every row of a prompt dataset, in one pass before any compute (a bad row would otherwise surface
    only at the first RL step, after the SFT warm start):

    * its ``metadata`` parses (moerl.data.tasks.row_metadata);
    * its rendered prompt leaves room for the response: ``len(encode(prompt)) + max_new_tokens <
      max_positions`` (rollout.max_new_tokens, model.hf_config.max_position_embeddings; SGLang refuses
      a request that reaches the context length);
    * its label (and metadata) can be scored by ``reward_spec`` (moerl.rewards.check_label; only
      built-in verifiers declare a check, user functions are not called here).

    Raises:
        DatasetError: naming the 1-based row, the file, the recipe keys and the fix.
    """
    from moerl.data.tasks import row_metadata

    for i, row in enumerate(ds):
        where = f"row {i + 1} of {path} ({recipe_key})"
        try:
            meta = row_metadata(row)
        except ValueError as e:
            raise DatasetError(f"{where}: field 'metadata': {e}; give a JSON object (or its text), or leave it out") from None
        try:
            n = len(encode(row[prompt_key]))
        except ValueError as e:
            raise DatasetError(f"{where}: {e}") from None
        if n + max_new_tokens >= max_positions:  # SGLang refuses a request that reaches the context length
            raise DatasetError(
                f"{where}: the prompt has {n} tokens; with rollout.max_new_tokens ({max_new_tokens}) it reaches "
                f"model.hf_config.max_position_embeddings ({max_positions}), which SGLang refuses: raise "
                "model.hf_config.max_position_embeddings, lower rollout.max_new_tokens or shorten the prompt")
        label = row[label_key]
        try:
            check_label(reward_spec, label, meta)
        except ValueError as e:
            raise DatasetError(f"{where}: label {label!r} cannot be scored by reward.function={reward_spec}: {e}") from None


def _resume_checkpoint(cfg, run_dir: Path) -> Optional[Path]:
    """The checkpoint ``resume`` names (moerl.checkpoint.run_state.resolve_resume), as a checkpoint error."""
    from moerl.checkpoint.run_state import resolve_resume
    from moerl.errors import CheckpointError

    try:
        return resolve_resume(cfg, run_dir, announce=False)  # the main job announces it once (train.loop)
    except FileNotFoundError as e:
        raise CheckpointError(str(e), key="resume", file=str(cfg.resume),
                              hint="resume=auto (latest complete checkpoint of output_dir), resume=none, or a "
                                   "<output_dir>/checkpoints/step_N directory") from None


def check_resume_inputs(cfg, run_dir: Path, inputs: dict) -> None:
    """A resume must see the data and tokenizer its checkpoint was trained with (content, not only row
    counts): compare the checkpoint's recorded fingerprints with this run's before any work.
    Checkpoints written before fingerprints were recorded are resumed with a warning.

    Raises:
        CheckpointError: ``resume`` is a path without a complete checkpoint, or what changed (training /
            eval data, tokenizer), with the fix.
    """
    from moerl.checkpoint.run_state import COMPLETE_MARKER
    from moerl.errors import CheckpointError
    from moerl.runtime.world import log

    path = _resume_checkpoint(cfg, run_dir)
    if path is None:
        return
    import json

    saved = json.loads((path / COMPLETE_MARKER).read_text()).get("inputs")
    if not saved:
        log(f"WARNING: checkpoint {path} records no data/tokenizer fingerprints (written by an older moerl); "
            "resuming without checking that the data and tokenizer are unchanged")
        return
    gen = {"arithmetic": "data.num_train / data.digits / seed", "reasoning_gym": "data.reasoning_gym"}.get(cfg.data.task)
    change = describe_change(saved, inputs, sources={"train_data": gen, "eval_data": gen} if gen else None)
    if change:
        raise CheckpointError(f"resume from {path}: {change}", key="resume", file=str(path),
                              hint="resume with the data and tokenizer the run was trained with, or start a new "
                                   "run (resume=none, another output_dir)")


def check_resume_shapes(cfg, run_dir: Path, hf_config) -> None:
    """The checkpoint a resume would load must hold the recipe's model shape (its recorded tensor
    shapes, moerl.checkpoint.input_checks.check_checkpoint_shapes) before any model is built.

    Raises:
        CheckpointError: naming ``resume``, each differing field with both values, and the fix.
    """
    from moerl.checkpoint.input_checks import check_checkpoint_shapes

    path = _resume_checkpoint(cfg, run_dir)
    if path is not None:
        check_checkpoint_shapes(path, hf_config, key="resume")


_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "moe_intermediate_size", "num_experts_per_tok", "vocab_size", "tie_word_embeddings")


def check_init_config(init_from: str, hf_config) -> None:
    """The checkpoint in ``model.init_from`` must be a Qwen3-MoE with the recipe's model shape
    (compared on its config.json) before any model is built.

    Raises:
        ModelError: not a model directory / not Qwen3-MoE, or listing each differing field with both values.
    """
    from moerl.checkpoint.input_checks import check_hf_model_dir
    from moerl.errors import ModelError
    from moerl.models.gpt import hf_num_experts

    saved = check_hf_model_dir(init_from, "model.init_from")
    diffs = []
    for f in _SHAPE_FIELDS:
        if f in saved and saved[f] != getattr(hf_config, f, None):
            diffs.append(f"{f}: checkpoint {saved[f]!r} vs recipe {getattr(hf_config, f, None)!r}")
    saved_experts = saved.get("num_experts", saved.get("num_local_experts"))
    if saved_experts is not None and saved_experts != hf_num_experts(hf_config):
        diffs.append(f"num_experts: checkpoint {saved_experts!r} vs recipe {hf_num_experts(hf_config)!r}")
    if diffs:
        raise ModelError(f"model.init_from={init_from} does not match the recipe's model.hf_config: " + "; ".join(diffs),
                         key="model.init_from", file=str(init_from),
                         hint="set model.hf_config.* to the checkpoint's values")
