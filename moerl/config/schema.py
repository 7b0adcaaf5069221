"""Typed recipe schema: one frozen pydantic object passed down the whole run, never mutated.

Every section forbids unknown keys and is strict about types (an ``int`` field rejects ``true`` and
``8.5``; a ``str`` field rejects ``5``; a ``float`` field accepts ints). Field constraints (positive
ints, probabilities...) are declared on the fields; rules that tie several fields together live in
``model_validator``s and name every dotted key they involve. Errors are turned into one readable
:class:`moerl.config.errors.ConfigError` by :func:`moerl.config.loader.load_config`.

The defaults are those of ``configs/tiny_arith.yaml`` (a 2-core CPU demo: 3-digit addition, a
1.4M-parameter Qwen3-MoE), so a recipe only lists what it changes.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from moerl.config.errors import ConfigError

# allow_inf_nan=False: every float key is finite (.inf and .nan are refused naming the key)
_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, validate_default=True, allow_inf_nan=False)

PORT_MIN = 1024
PORT_MAX = 65535
VOCAB_MULTIPLE = 64

# dtype spellings accepted by every dtype key (model.params_dtype, model.export_dtype, rollout.dtype,
# rollout.weight_dtype), case-insensitive; each key keeps its own canonical spelling (rollout.weight_dtype: bf16)
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                 "fp16": "float16", "float16": "float16", "half": "float16"}


def normalize_dtype(value: Any) -> Any:
    """``bf16``/``BF16``/``bfloat16`` -> ``"bfloat16"``, ``fp32``/``float32`` -> ``"float32"``, ``fp16``/``half``/
    ``float16`` -> ``"float16"``; other values (``auto``, ``fp8``, None, non-strings) are returned as they are,
    for the key's own type check to accept or refuse with its list of choices."""
    if isinstance(value, str):
        return DTYPE_ALIASES.get(value.strip().lower(), value)
    return value


class _Section(BaseModel):
    model_config = _STRICT


# model.hf_config keys of DeepSeek-V3 (model_type: deepseek_v3) that Qwen3-MoE does not have
_DEEPSEEK_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
                  "num_nextn_predict_layers")


class HFModelConfig(_Section):
    """The Hugging Face ``config.json`` fields of the policy (Qwen3-MoE naming; ``model_type`` picks the
    model family, moerl.models.families).

    ``vocab_size = None`` means "the tokenizer size rounded up to a multiple of 64"; resolve it with
    :meth:`resolve_vocab_size` once the tokenizer is known.

    ``model_type: deepseek_v3`` (moerl.models.families.deepseek_v3) builds the HF config from the keys the
    recipe sets (``num_experts`` = n_routed_experts) plus the DeepSeek-V3 keys below (multi-latent
    attention, shared experts, group-limited routing, routed_scaling_factor, first_k_dense_replace,
    num_nextn_predict_layers); they are refused for qwen3_moe.
    """

    model_type: str = "qwen3_moe"  # HF config.json model_type: qwen3_moe | deepseek_v3 | mixtral (moerl.models.families)
    num_hidden_layers: int = Field(3, ge=1)
    hidden_size: int = Field(128, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    head_dim: int = Field(32, ge=1)
    num_experts: int = Field(8, ge=1)
    num_experts_per_tok: int = Field(2, ge=1)
    moe_intermediate_size: int = Field(128, ge=1)
    intermediate_size: int = Field(256, ge=1)
    max_position_embeddings: int = Field(64, ge=2)
    rope_theta: float = Field(10000.0, gt=0)
    rms_norm_eps: float = Field(1.0e-6, gt=0)
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = True
    vocab_size: Optional[int] = Field(None, ge=1)
    initializer_range: float = Field(0.02, gt=0)  # base std of the normal weight init (Megatron init_method_std; output projections / sqrt(2 * layers))
    mlp_only_layers: list[int] = []  # layers with a dense MLP (width intermediate_size) instead of MoE
    # DeepSeek-V3 only (model_type: deepseek_v3; null = not set)
    q_lora_rank: Optional[int] = Field(None, ge=1)  # query LoRA rank (null = one query projection)
    kv_lora_rank: Optional[int] = Field(None, ge=1)  # compressed KV latent width
    qk_nope_head_dim: Optional[int] = Field(None, ge=1)
    qk_rope_head_dim: Optional[int] = Field(None, ge=1)
    v_head_dim: Optional[int] = Field(None, ge=1)
    n_shared_experts: Optional[int] = Field(None, ge=0)  # shared experts of width moe_intermediate_size
    n_group: Optional[int] = Field(None, ge=1)  # expert groups of group-limited routing
    topk_group: Optional[int] = Field(None, ge=1)  # groups chosen per token
    routed_scaling_factor: Optional[float] = Field(None, gt=0)  # scale of the routed experts' gates
    first_k_dense_replace: Optional[int] = Field(None, ge=0)  # the first k layers have a dense MLP
    num_nextn_predict_layers: Optional[int] = Field(None, ge=0)  # DeepSeek-V3 MTP layers (trained in SFT)

    @model_serializer(mode="wrap")
    def _drop_unused_family_keys(self, handler):
        """Dumps of a qwen3_moe model leave out the (unset) DeepSeek-V3 keys: callers hand the dict to the
        Qwen3-MoE config builder, which knows only its own fields."""
        out = handler(self)
        if self.model_type == "qwen3_moe":
            for k in _DEEPSEEK_KEYS:
                out.pop(k, None)
        return out

    def family_fields(self) -> dict:
        """The fields the model family's ``make_hf_config`` takes: every Qwen3-MoE field for qwen3_moe; for
        deepseek_v3 the keys DeepSeek-V3 has (not num_key_value_heads / head_dim, which multi-latent attention
        does not use, nor mlp_only_layers: first_k_dense_replace says which layers are dense), unset
        DeepSeek-V3 keys left to the family's defaults or its missing-field error."""
        if self.model_type == "qwen3_moe":
            return self.model_dump()
        if self.model_type == "mixtral":  # Qwen3-MoE naming -> MixtralConfig fields (moerl.models.families.mixtral)
            from moerl.models.families.mixtral import recipe_fields

            return recipe_fields(self.model_dump())
        out = self.model_dump(exclude={"num_key_value_heads", "head_dim", "mlp_only_layers"}, exclude_none=True)
        out["vocab_size"] = self.vocab_size
        return out

    @model_validator(mode="after")
    def _cross_fields(self) -> "HFModelConfig":
        p = "model.hf_config"
        if self.model_type not in ("qwen3_moe", "deepseek_v3", "mixtral"):
            raise ValueError(f"{p}.model_type {self.model_type!r} is not one moerl trains from a recipe: use qwen3_moe, "
                             "deepseek_v3 or mixtral (moerl.models.families)")
        ds_set = [k for k in _DEEPSEEK_KEYS if getattr(self, k) is not None]
        if self.model_type != "deepseek_v3" and ds_set:
            raise ValueError(f"{p}.{ds_set[0]} is a DeepSeek-V3 key; set {p}.model_type: deepseek_v3 or remove "
                             f"{', '.join(p + '.' + k for k in ds_set)}")
        if self.model_type == "deepseek_v3" and self.mlp_only_layers:
            raise ValueError(f"{p}.mlp_only_layers is a Qwen3-MoE key; DeepSeek-V3's dense layers are the first "
                             f"{p}.first_k_dense_replace ones: set that and remove mlp_only_layers")
        if self.model_type == "mixtral":
            from moerl.models.families.mixtral import recipe_problem

            why = recipe_problem(self.model_dump())
            if why:
                raise ValueError(why)
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad or len(set(self.mlp_only_layers)) != len(self.mlp_only_layers):
            raise ValueError(
                f"{p}.mlp_only_layers {self.mlp_only_layers} must list distinct layer indices in "
                f"0..{p}.num_hidden_layers-1 ({self.num_hidden_layers - 1})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{p}.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"{p}.num_key_value_heads ({self.num_key_value_heads}) (grouped-query attention)"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"{p}.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"{p}.num_experts ({self.num_experts})"
            )
        return self

    def resolve_vocab_size(self, tokenizer_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
        """The embedding rows to build for a tokenizer of ``tokenizer_size`` tokens (``len(tokenizer)``).

        Returns ``vocab_size`` when set, else ``tokenizer_size`` rounded up to ``multiple``.

        Raises:
            ValueError: ``vocab_size`` is set but smaller than the tokenizer.
        """
        if tokenizer_size < 1:
            raise ValueError(f"tokenizer_size must be >= 1, got {tokenizer_size}")
        if self.vocab_size is None:
            return int(math.ceil(tokenizer_size / multiple) * multiple)
        if self.vocab_size < tokenizer_size:
            raise ValueError(
                f"model.hf_config.vocab_size ({self.vocab_size}) is smaller than the tokenizer "
                f"({tokenizer_size} tokens); set it to >= {tokenizer_size} or null"
            )
        return self.vocab_size


class MLAConfig(_Section):
    """Multi-head latent attention shapes (DeepSeek-V2/V3 naming). Planner only (``moerl plan``)."""

    q_lora_rank: Optional[int] = Field(1536, ge=1)  # None = no query compression
    kv_lora_rank: int = Field(512, ge=1)
    qk_nope_head_dim: int = Field(128, ge=1)
    qk_rope_head_dim: int = Field(64, ge=1)
    v_head_dim: int = Field(128, ge=1)


class PlannerExtras(_Section):
    """Shapes the Qwen3-MoE trainer cannot build yet, for ``moerl plan`` of other architectures
    (DeepSeek-V3): shared experts and multi-head latent attention. A recipe that sets them is
    shape-only: ``moerl train`` rejects it (check_world_size)."""

    shared_expert_intermediate_size: int = Field(0, ge=0)  # total width of the shared experts; 0 = none
    mla: Optional[MLAConfig] = None  # None = grouped-query attention from hf_config


class ModelConfig(_Section):
    """Policy model: HF config, optional HF checkpoint to start from, parameter dtype."""

    hf_config: HFModelConfig = HFModelConfig()
    init_from: Optional[str] = None  # HF checkpoint dir; None = random init (then SFT warm start)
    # bfloat16 = Megatron-Core mixed precision (BF16 weights/compute, FP32 main params, grads, Adam);
    # float16 is refused by moerl train (needs loss scaling) but sized by `moerl plan`
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # dtype of the HF exports (hf_export, hf_warm_start, hf_critic); None = params_dtype
    export_dtype: Optional[Literal["float32", "bfloat16"]] = None
    # Megatron-Core layer spec (moerl.models.qwen3_moe.build_gpt_model): local = Megatron's own layers (CPU
    # and GPU); transformer_engine = TE layers (CUDA + `pip install transformer-engine[pytorch]`; needed by
    # precision.fp8); auto = transformer_engine when TE is importable and a CUDA GPU is visible, else local
    layer_spec: Literal["auto", "local", "transformer_engine"] = "auto"
    planner_extras: Optional[PlannerExtras] = None  # shape-only recipes (moerl plan), see PlannerExtras

    @field_validator("params_dtype", "export_dtype", mode="before")
    @classmethod
    def _dtype_aliases(cls, v: Any) -> Any:
        return normalize_dtype(v)  # bf16 / fp32 / fp16 spellings


class ParallelConfig(_Section):
    """Megatron-Core parallel layout; dp_size is derived from the world size (see check_world_size).

    Megatron-Core's rules (initialize_model_parallel, cp_size = 1): world_size is a multiple of
    tp_size * pp_size (dp_size = world_size / (tp_size * pp_size)) and of etp_size * ep_size *
    pp_size (the expert layers' own tiling; expert data parallelism = world_size / (etp_size *
    ep_size * pp_size)).
    """

    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    ep_size: int = Field(1, ge=1)
    etp_size: Optional[int] = Field(None, ge=1)  # expert tensor parallel; None = tp_size (Megatron's default)
    world_size: Optional[int] = Field(None, ge=1)  # None = the launch decides; set for `moerl plan`
    sequence_parallel: bool = True  # Megatron sequence parallelism at tp_size > 1 (required with MoE)
    use_distributed_optimizer: bool = False  # shard Adam moments and master weights over DP
    recompute: Literal["none", "full", "selective"] = "none"  # activation recomputation
    num_layers_in_first_pipeline_stage: Optional[int] = Field(None, ge=1)  # None = even split
    num_layers_in_last_pipeline_stage: Optional[int] = Field(None, ge=1)  # None = even split

    @property
    def expert_tp_size(self) -> int:
        """etp_size, or tp_size when unset."""
        return self.tp_size if self.etp_size is None else self.etp_size


class ReasoningGymConfig(_Section):
    """data.task=reasoning_gym: a procedurally generated reasoning-gym dataset (offline)."""

    name: str = Field("chain_sum", min_length=1)  # a reasoning_gym dataset name (reasoning_gym.factory)
    config: dict[str, Any] = {}  # the dataset's config fields, e.g. {min_terms: 2, max_terms: 3}
    size: int = Field(2000, ge=1)  # training prompts (eval: data.num_eval more, from another seed)
    seed: Optional[int] = Field(None, ge=0)  # None = the recipe seed


class DataConfig(_Section):
    """Prompt data: the built-in arithmetic generator, a reasoning-gym dataset, or the user's jsonl /
    parquet files (prompt = text or a list of chat messages)."""

    task: Literal["arithmetic", "jsonl", "reasoning_gym"] = "arithmetic"
    train_path: Optional[str] = None  # jsonl only (.jsonl / .json / .parquet)
    eval_path: Optional[str] = None  # jsonl only
    prompt_key: str = Field("prompt", min_length=1)
    label_key: str = Field("label", min_length=1)
    num_train: int = Field(20000, ge=1)  # arithmetic only
    num_eval: int = Field(300, ge=1)  # arithmetic and reasoning_gym
    digits: int = Field(3, ge=1, le=9)  # arithmetic only
    reasoning_gym: Optional[ReasoningGymConfig] = None  # reasoning_gym only
    # seeds the generated prompt sets (arithmetic; reasoning_gym unless data.reasoning_gym.seed); None = the
    # recipe seed. Fix it and vary `seed` to repeat RL (sampling, batch order) on one train/eval split, e.g.
    # from a warm start whose SFT trained on this split's train prompts
    seed: Optional[int] = Field(None, ge=0)
    system_prompt: Optional[str] = None  # prepended as a system message (the tokenizer's chat template)
    # None = the tokenizer saved in model.init_from if it has one, else moerl's byte-level tokenizer
    tokenizer_path: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reward" in data:
            raise ValueError(f"data.reward moved to reward.function (got data.reward={data['reward']!r}): write "
                             f"reward: {{function: {data['reward']}}} in the recipe or reward.function=... on the "
                             "command line")
        return data

    @model_validator(mode="after")
    def _cross_fields(self) -> "DataConfig":
        if self.task == "jsonl":
            missing = [k for k in ("train_path", "eval_path") if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    " and ".join(f"data.{k}" for k in missing)
                    + " must be set when data.task is 'jsonl' (paths to jsonl or parquet files of "
                    f"{{\"{self.prompt_key}\": ..., \"{self.label_key}\": ...}} rows)"
                )
        elif self.task == "reasoning_gym":
            if self.reasoning_gym is None:
                raise ValueError("data.task=reasoning_gym needs data.reasoning_gym: {name: <dataset>, config: {...}, "
                                 "size: N} (e.g. data.reasoning_gym.name=chain_sum)")
        else:
            space = 10 ** (2 * self.digits)
            if self.num_train + self.num_eval > space:
                raise ValueError(
                    f"data.num_train + data.num_eval ({self.num_train + self.num_eval}) exceeds the "
                    f"{space} distinct {self.digits}-digit addition problems; lower them or raise data.digits"
                )
        if self.task == "jsonl" and self.seed is not None:
            raise ValueError(f"data.seed={self.seed} seeds generated prompts, but data.task is 'jsonl' (your files): "
                             "remove data.seed")
        if self.task != "jsonl":
            given = [k for k in ("train_path", "eval_path") if getattr(self, k) is not None]
            if given:
                raise ValueError(" and ".join(f"data.{k}" for k in given) + f" given but data.task is {self.task!r} "
                                 "(which generates its own prompts): set data.task=jsonl to train on your files")
        if self.task != "reasoning_gym" and self.reasoning_gym is not None:
            raise ValueError(f"data.reasoning_gym is set but data.task is {self.task!r}: set data.task=reasoning_gym "
                             "or remove data.reasoning_gym")
        return self


class RewardConfig(_Section):
    """How responses are scored (moerl.rewards): a rule function in a sandboxed process pool, optionally
    plus a reward model. ``function`` is a registered name (arithmetic, math, exact_match, countdown,
    reasoning_gym) or user code ``package.module:function`` / ``/path/to/file.py:function``; it is
    resolved (and a wrong path or signature refused) before any work."""

    function: str = Field("arithmetic", min_length=1)
    group: bool = False  # function scores a whole group: fn(responses, label, metadata) -> list
    num_workers: int = Field(2, ge=0)  # worker processes; 0 = inline in the rollout thread (no timeout)
    timeout_s: float = Field(10.0, gt=0)  # per-sample (per-group with group=true) wall-clock limit
    error_value: float = 0.0  # the score of a sample whose verifier timed out, raised or crashed
    model_path: Optional[str] = None  # HF sequence-classification reward model (scored by its own worker)
    model_weight: float = 1.0  # final = rule_weight * rule + model_weight * reward model
    rule_weight: float = 1.0
    model_batch_size: int = Field(16, ge=1)
    # where the pool's dispatcher runs (moerl.rewards.broker): true = a child process that owns the workers
    # (the trainer sends one message per group), so its interpreter-lock time stays out of the trainer
    # process; false = a thread of the trainer; null = a child process in train.mode one_step_off / async
    # (where scoring overlaps training) unless num_workers is 0 (inline), the thread in sync.
    pool_process: Optional[bool] = None

    @model_validator(mode="after")
    def _cross_fields(self) -> "RewardConfig":
        if ":" not in self.function:
            from moerl.rewards import available_reward_fns  # light import (no torch/transformers)

            if self.function not in available_reward_fns():
                raise ValueError(
                    f"reward.function {self.function!r} is not a registered reward function; choose one of "
                    f"{available_reward_fns()} or give your own as package.module:function or /path/file.py:function"
                )
        if self.model_path is None and (self.model_weight != 1.0 or self.rule_weight != 1.0):
            raise ValueError("reward.model_weight / reward.rule_weight weigh a reward model against the rule reward, "
                             "but reward.model_path is not set: set it to a HF sequence-classification checkpoint or "
                             "drop the weights")
        return self


def _check_cores(key: str, cores: list[int]) -> None:
    """Every core of ``key`` exists and is usable by this process (os.sched_getaffinity)."""
    import os

    if not cores:
        return
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    bad = [c for c in cores if c not in usable]
    if bad or len(set(cores)) != len(cores):
        raise ValueError(f"{key} {cores} must list distinct usable CPU cores; this process may use {usable}")


class RolloutConfig(_Section):
    """Rollout servers behind sglang-router and the sampling parameters."""

    num_servers: int = Field(2, ge=1)
    threads_per_server: int = Field(1, ge=1)
    # dtype the servers load and serve the model in (moerl serve --dtype, SGLang's --dtype); weight
    # updates are cast to it. auto: reference servers float32, SGLang its own auto (no --dtype)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    host: str = Field("127.0.0.1", min_length=1)
    base_port: int = 30000  # server i listens on base_port + i
    router_port: int = 29000
    router_policy: Literal["round_robin", "cache_aware", "random", "power_of_two"] = "round_robin"
    n_samples_per_prompt: int = Field(8, ge=1)
    rollout_batch_size: int = Field(16, ge=1)  # prompts per step
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    max_new_tokens: int = Field(8, ge=1)
    request_timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(2, ge=0)
    startup_timeout_s: float = Field(120.0, gt=0)
    # disk: HF safetensors dir per weight_version; tensor: serialized buckets over HTTP; distributed:
    # init_weights_update_group once, then a broadcast per bucket from trainer rank 0 (NCCL on GPU,
    # gloo with the reference server). moerl.rollout.weight_sync.
    weight_sync: Literal["disk", "tensor", "distributed"] = "disk"
    weight_sync_bucket_mb: float = Field(64.0, ge=0.001)  # bucket (disk: shard) size in MiB (>= ~1 KiB)
    weight_sync_backend: Literal["gloo", "nccl"] = "gloo"  # distributed mode only
    weight_sync_master_address: Optional[str] = None  # where servers reach trainer rank 0; None = host
    # What the trainer sends at every weight sync (every mode; moerl.precision.fp8_checkpoint): auto = the
    # exported dtype (the servers cast to their serving dtype); bf16 = floating tensors cast to bfloat16;
    # fp8 = DeepSeek-V3 blockwise FP8 (HF/SGLang layout: weight float8_e4m3fn + weight_scale_inv per 128x128
    # block; router, norms, embeddings, lm_head kept), dequantised by the reference server.
    weight_dtype: Literal["auto", "bf16", "fp8"] = "auto"

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_aliases(cls, v: Any) -> Any:
        return normalize_dtype(v)  # bf16 / fp32 spellings

    @field_validator("weight_dtype", mode="before")
    @classmethod
    def _weight_dtype_aliases(cls, v: Any) -> Any:
        v = normalize_dtype(v)
        return {"bfloat16": "bf16"}.get(v, v.lower() if isinstance(v, str) else v)  # canonical here: bf16
    # Servers: reference = moerl's CPU server (moerl.rollout.server), sglang = real SGLang (GPU image,
    # moerl.rollout.sglang_launcher: local rank 0 of each node starts servers on rollout.gpu_ids).
    backend: Literal["reference", "sglang"] = "reference"
    # HybridFlow resource pools (moerl.rollout.placement): colocated = rollout and training share GPUs
    # (release / resume memory around training); disaggregated = separate GPUs or nodes.
    placement: Literal["colocated", "disaggregated"] = "disaggregated"
    gpu_ids: list[int] = Field(default_factory=list)  # sglang: rollout GPUs of every node
    server_tp_size: int = Field(1, ge=1)  # sglang: --tp-size / --dp-size / --ep-size per server
    server_dp_size: int = Field(1, ge=1)
    server_ep_size: int = Field(1, ge=1)
    mem_fraction_static: float = Field(0.8, gt=0, lt=1)  # sglang --mem-fraction-static
    external_urls: list[str] = Field(default_factory=list)  # servers started elsewhere, put behind the router
    failover: bool = True  # restart dead servers, restore current weights, route around them
    max_restarts: int = Field(3, ge=0)  # per server, with failover
    # DAPO dynamic sampling (arXiv 2503.14476): keep drawing prompt groups until rollout_batch_size groups
    # with reward variance are collected, at most max_oversample_factor * rollout_batch_size groups drawn
    # per step (moerl.rollout.manager). Off: a step trains on the rollout_batch_size groups it drew.
    dynamic_sampling: bool = False
    max_oversample_factor: float = Field(3.0, ge=1.0)
    # CPU cores the processes of the rollout side are pinned to (os.sched_setaffinity; [] = not pinned): the
    # servers and router moerl starts (restarts too), the RolloutManager's HTTP worker, the reward workers and
    # broker. The trainer's own threads (producer, weight push, reward dispatcher) stay on its cores: they
    # share its interpreter lock. With train.cpu_affinity this emulates separate rollout and training devices
    # on one machine.
    cpu_affinity: list[int] = Field(default_factory=list)
    # train.mode=async: how a weight update pauses the servers (SGLang /pause_generation mode). abort cuts
    # the running responses, which resume from their prefix under the new weights (partial rollouts, exact
    # per-token versions); in_place suspends the reference server's running batch at its next decode step
    # and continues it on the new weights with the old KV cache after the push (no resumes; the server
    # reports every token's version). Real SGLang's in_place does the same but reports one version for
    # tokens of two: refused with sglang.
    # auto = in_place with the reference server, abort with sglang.
    pause_mode: Literal["auto", "abort", "in_place"] = "auto"
    # where the rollout producer's HTTP requests run (moerl.rollout.http_worker): true = a child process
    # (pinned to rollout.cpu_affinity), so their CPU and interpreter-lock time stay out of the trainer process;
    # false = the producer thread itself; null = a child process in train.mode one_step_off / async (where the
    # producer runs while the trainer trains), the thread in sync
    client_process: Optional[bool] = None
    # where the whole rollout producer runs (moerl.rollout.producer_process): true = a child process with its own
    # HTTP client and reward workers (the sampler's draws, prompt encoding,
    # requests, parsing, decoding and reward dispatch leave the trainer's core and interpreter lock; the
    # weight push and the cluster's failover stay in the trainer; client_process then does not apply);
    # false = a thread of the trainer; null = a child process in train.mode one_step_off / async, the
    # thread in sync
    producer_process: Optional[bool] = None
    # cores of that producer process (os.sched_setaffinity); null = the trainer's (it is the trainer's host-side
    # helper, as the producer thread was), e.g. [1] to put it beside the servers. Its reward workers go to
    # rollout.cpu_affinity either way.
    producer_cpu_affinity: Optional[list[int]] = None
    # groups generating at once in one_step_off / async (AReaL's max_concurrent_rollouts); null =
    # rollout_batch_size. The servers batch every request they hold, so groups of the NEXT batch started while
    # the current one runs share its decode steps and delay it; one batch's worth keeps each batch's
    # latency that of a sync rollout (tools/bench_async.py: async s/step 0.671 -> 0.563 at staleness 1).
    # Below rollout_batch_size a batch is generated in several waves (every mode, sync included).
    max_inflight_groups: Optional[int] = Field(None, ge=1)
    # one_step_off / async: the weight push after an update (pause, send, continue) runs on a background
    # thread of rank 0 while the trainer takes and trains the next batch; the trainer only exports (and
    # waits for the previous push before the next export, a checkpoint or an eval). The staleness gate counts
    # an update as done when its push has landed, so the bound holds as before. null = on in one_step_off /
    # async (except weight_sync=distributed with weight_sync_backend=nccl: that broadcast must not run beside the
    # trainer's own NCCL collectives), false = the trainer waits for every push (sync always does).
    background_push: Optional[bool] = None
    # one_step_off / async: the groups of one draw (rollout_batch_size prompts) start together, once at most
    # max_inflight_groups - rollout_batch_size groups are in flight, instead of one by one as slots free
    # up. The reference server runs one model.generate per prompt length at a time, so groups that trickle in
    # while a batch finishes ran as small separate batches (tools/bench_async.py, async staleness 2: server CPU
    # per 40 steps 23.9 s, 18.6-20.3 s with whole batches, 14.7-15.3 s in sync).
    # SGLang batches continuously (a request joins the running batch), so there trickling costs nothing.
    # null = on with rollout.backend=reference, off with sglang; never below max_inflight_groups =
    # rollout_batch_size (a batch is generated in waves then).
    aligned_batches: Optional[bool] = None
    # One /generate per prompt group (SGLang's batch form: n copies of the prompt, one sampling_params and one
    # rid per sample, each with its own sampling_seed, so the samples are the same as with one request per
    # sample), sent straight to a server (groups round-robin; a failed server's group is re-sent to the next
    # one) instead of n requests through sglang-router (which refuses list sampling_params). The reference
    # server's HTTP handling costs about 2 ms of server + router CPU per request, more than generating the
    # batch: tools/bench_async.py (pinned, 128 samples per step) measured sync 1.12 -> 0.72 s/step and server
    # CPU per step 0.48 -> 0.18 s with it. Bypasses the router's policy (cache_aware etc.). null = on with
    # rollout.backend=reference, off with sglang (true works there too: SGLang serves the same batch form).
    group_requests: Optional[bool] = None

    @model_validator(mode="after")
    def _cross_fields(self) -> "RolloutConfig":
        _check_cores("rollout.cpu_affinity", self.cpu_affinity)
        if self.producer_cpu_affinity is not None:
            _check_cores("rollout.producer_cpu_affinity", self.producer_cpu_affinity)
        if self.pause_mode == "in_place" and self.backend == "sglang":
            raise ValueError("rollout.pause_mode=in_place with rollout.backend=sglang would attribute tokens of two "
                             "weight versions to one (SGLang keeps the running requests and their KV cache): use "
                             "rollout.pause_mode=abort")
        last = self.base_port + self.num_servers - 1
        if not (PORT_MIN <= self.base_port and last <= PORT_MAX):
            raise ValueError(
                f"rollout.base_port ({self.base_port}) .. base_port + num_servers - 1 ({last}) must lie "
                f"in {PORT_MIN}..{PORT_MAX}"
            )
        if not PORT_MIN <= self.router_port <= PORT_MAX:
            raise ValueError(f"rollout.router_port ({self.router_port}) must lie in {PORT_MIN}..{PORT_MAX}")
        if self.base_port <= self.router_port <= last:
            raise ValueError(
                f"rollout.router_port ({self.router_port}) collides with the server ports "
                f"rollout.base_port..base_port+num_servers-1 ({self.base_port}..{last}); pick another"
            )
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"rollout.top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.backend == "sglang" and not self.gpu_ids and not self.external_urls:
            raise ValueError("rollout.backend=sglang needs rollout.gpu_ids (GPUs each node's servers use) "
                             "or rollout.external_urls (servers started elsewhere)")
        if self.server_tp_size % self.server_ep_size:
            raise ValueError(f"rollout.server_ep_size ({self.server_ep_size}) must divide rollout.server_tp_size "
                             f"({self.server_tp_size})")
        for u in self.external_urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"rollout.external_urls entry {u!r} must be an http(s):// URL")
        if self.backend == "sglang":
            per = self.server_tp_size * self.server_dp_size
            if len(set(self.gpu_ids)) != len(self.gpu_ids) or any(g < 0 for g in self.gpu_ids):
                raise ValueError(f"rollout.gpu_ids must be distinct GPU indices >= 0, got {self.gpu_ids}")
            if len(self.gpu_ids) % per:
                raise ValueError(
                    f"rollout.gpu_ids ({len(self.gpu_ids)} GPUs {self.gpu_ids}) must be a multiple of "
                    f"rollout.server_tp_size * rollout.server_dp_size ({per}): one SGLang server per {per} GPUs")
            if self.weight_sync == "tensor":
                raise ValueError(
                    "rollout.weight_sync=tensor sends SGLang's serialized payload of CPU tensors (shared-memory "
                    "handles on this host, inline bytes otherwise: moerl/rollout/tensor_serde.py), checked against "
                    "the reference server only; SGLang's own "
                    "trainers pass CUDA-IPC handles between co-located GPUs instead: use "
                    "rollout.weight_sync=distributed (NCCL) or disk with rollout.backend=sglang")
        return self


TOKEN_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")


class CriticConfig(_Section):
    """The value model of algorithm.advantage_estimator=gae (PPO with a critic): the policy's architecture
    with a scalar head (moerl.train.critic), initialised from the policy's weights at the start of RL,
    trained with the clipped value loss (algorithm.value_clip) and its own Adam."""

    lr: float = Field(1.0e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    clip_grad: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)  # RL steps that train only the critic (the policy waits)


class AlgorithmConfig(_Section):
    """Advantage estimator, policy loss, KL and MoE balancing loss."""

    # grpo | dr_grpo | rloo (per response) | reinforce_plus_plus | reinforce_plus_plus_baseline | gae (per
    # token; gae trains a critic, see the critic section): moerl.algorithms.estimators
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                 "gae"] = "grpo"
    # whiten the advantages over the response tokens of the global batch (always on for reinforce_plus_plus*)
    whiten_advantages: bool = False
    gamma: float = Field(1.0, ge=0, le=1)  # discount of per-token returns (reinforce_plus_plus*, gae)
    lam: float = Field(1.0, ge=0, le=1)  # GAE lambda
    # gspo (sequence ratio) | gspo_token (sequence ratio, token advantages) | ppo (token ratio) | cispo
    # (clipped, detached IS weight x log-prob: MiniMax-M1)
    policy_loss: Literal["gspo", "ppo", "gspo_token", "cispo"] = "gspo"
    dual_clip_c: Optional[float] = Field(None, gt=1)  # dual-clip PPO bound for negative advantages (ppo only)
    entropy_coef: float = Field(0.0, ge=0)  # entropy bonus: loss -= entropy_coef * aggregated entropy
    kl_in_reward: bool = False  # KL (kl_coef, kl_estimator) as a per-token reward penalty instead of a loss term
    overlong_buffer_len: Optional[int] = Field(None, ge=1)  # DAPO soft overlong punishment over this many tokens
    overlong_penalty_factor: float = Field(1.0, ge=0)  # ... down to -factor at rollout.max_new_tokens
    reference_reset_every: int = Field(0, ge=0)  # steps between resets of the reference policy to the current one
    value_clip: Optional[float] = Field(0.2, gt=0)  # gae: PPO value clipping range (null = unclipped)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
    eps_clip_low: float = Field(3.0e-4, ge=0)
    eps_clip_high: float = Field(4.0e-4, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    # a frozen copy of the policy RL starts from: the KL to it is logged every step (and enters the
    # loss when kl_coef > 0); costs one extra forward per step
    reference_policy: bool = True
    filter_uniform_groups: bool = True
    # Off-policy correction between the behaviour policy mu (the rollout server's per-token log-probs, of
    # the weight version that generated each token) and the proximal policy pi_prox (the trainer's
    # recomputed old_log_probs), w = pi_prox / mu (moerl.algorithms.off_policy: AReaL arXiv 2505.24298,
    # Yao et al. 2025 TIS, IcePop):
    # none | tis (truncated IS: loss x min(w, is_cap)) | decoupled (AReaL: loss x w, tokens with
    # w > is_cap dropped) | mis (masked IS: w kept inside [is_lower, is_cap], 0 outside) | icepop (w kept
    # inside [1/icepop_beta, icepop_beta], 0 outside). is_level: token | sequence | geo_mean.
    off_policy_correction: Literal["none", "decoupled", "tis", "mis", "icepop"] = "none"
    is_level: Literal["token", "sequence", "geo_mean"] = "token"  # where the IS weight is taken
    is_cap: float = Field(2.0, gt=0)  # C: upper cap (tis, decoupled) / upper bound (mis)
    is_lower: float = Field(0.0, ge=0)  # lower bound of mis (0 = none)
    icepop_beta: float = Field(2.0, gt=1)  # icepop keeps tokens with w in [1/beta, beta]
    # The proximal (old) log-probs: a forward of the policy before the step's updates. When the step makes ONE
    # optimizer update (rollout_batch_size x n_samples_per_prompt < 2 x train.global_batch_size) from those
    # same weights, the update's own forward computes exactly them (the weights change only at the optimizer
    # step), so the separate pass can be skipped and the loss takes them from that forward, detached (ratio 1,
    # the same loss and gradient; tests/test_actor.py checks it bit for bit). Needed (recomputed) with several
    # updates per step, moe.routing_replay=r2 (it replays that pass's routing) and kl_in_reward (the rewards
    # need them before the update). null = skip when not needed; true = always recompute (the step-0 ratio
    # check then compares two passes instead of holding by construction); false = never (refused where
    # needed). Skipping saves one forward per step (the demo: time/log_prob 0.21 -> ~0.10 s).
    recompute_old_log_probs: Optional[bool] = None

    @model_validator(mode="after")
    def _kl_needs_reference(self) -> "AlgorithmConfig":
        if self.kl_coef > 0 and not self.reference_policy:
            raise ValueError(
                f"algorithm.kl_coef ({self.kl_coef}) > 0 needs algorithm.reference_policy=true "
                "(the KL is taken to the reference policy)"
            )
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("algorithm.kl_in_reward=true puts kl_coef * KL into the per-token rewards: set "
                             "algorithm.kl_coef > 0")
        if self.kl_in_reward and self.advantage_estimator not in TOKEN_ESTIMATORS:
            raise ValueError(f"algorithm.kl_in_reward=true needs a per-token estimator (algorithm.advantage_estimator "
                             f"one of {list(TOKEN_ESTIMATORS)}); {self.advantage_estimator} scores whole responses")
        if self.advantage_estimator in TOKEN_ESTIMATORS and self.policy_loss == "gspo":
            raise ValueError(f"algorithm.advantage_estimator={self.advantage_estimator} gives per-token advantages but "
                             "algorithm.policy_loss=gspo takes one per response: use gspo_token, ppo or cispo")
        if self.dual_clip_c is not None and self.policy_loss != "ppo":
            raise ValueError(f"algorithm.dual_clip_c applies to algorithm.policy_loss=ppo (got {self.policy_loss}); "
                             "set it to null")
        if self.reference_reset_every and not self.reference_policy:
            raise ValueError("algorithm.reference_reset_every needs algorithm.reference_policy=true")
        return self
    moe_aux_loss_coeff: float = Field(1.0e-3, ge=0)
    moe_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "aux_loss"


class TrainConfig(_Section):
    """RL actor optimisation (AdamW)."""

    num_steps: int = Field(600, ge=1)
    global_batch_size: int = Field(128, ge=1)  # samples per optimizer step
    micro_batch_size: int = Field(32, ge=1)
    lr: float = Field(1.0e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    clip_grad: float = Field(1.0, gt=0)
    num_threads: int = Field(2, ge=1)  # torch threads of the trainer process
    save_every: int = Field(0, ge=0)  # steps; 0 = only at the end
    save_every_minutes: float = Field(0.0, ge=0)  # wall-clock minutes between checkpoints; 0 = off (seed: 30)
    keep_checkpoints: int = Field(3, ge=0)  # newest complete checkpoints kept; 0 = keep all
    # best-fit packing of RL samples into THD micro-batches (moerl.parallel.packing); pp_size 1 only
    pack: bool = True
    # log-probs / entropies straight from the final hidden states and the output weight (moerl.kernels.fused_logprob:
    # online log-sum-exp over vocab blocks, no [tokens, vocab] logits) in the old-log-prob, reference and update
    # passes; null (default) = on when the native csrc kernel builds here, true = on (torch reference if it does not),
    # false = materialise the logits. 1F1B only (DualPipe(V) keeps the logits path).
    fused_logprob: Optional[bool] = None
    max_tokens_per_micro_batch: int = Field(2048, ge=1)  # token cap of one packed micro-batch
    pack_balance: Literal["tokens", "flops"] = "tokens"  # DP balancing load: L or a*L + L^2
    # pipeline schedule at parallel.pp_size > 1 (moerl.pipeline): Megatron's 1F1B, or moerl's interpreter
    # running DeepSeek's DualPipe (2 mirrored model copies, even pp) / DualPipeV (2*pp stages in a V)
    pipeline_schedule: Literal["1f1b", "dualpipe", "dualpipev"] = "1f1b"
    # DualPipe(V)'s F&B steps overlapped on two CUDA streams through Megatron-Core's schedule plans (MoE
    # all-to-all of one micro-batch hidden behind the other's compute; moerl.pipeline.overlap): GPU only,
    # parallel.ep_size >= 2
    pipeline_overlap: bool = False
    # how DualPipe(V)'s split backward gets the weight gradients (moerl.pipeline.interpreter): store = B computes
    # the input gradients and queues the weight GEMMs of Megatron's linear layers and experts, W runs exactly
    # those (moerl.pipeline.wgrad_store; B + W = one backward); retrace / torch = W re-traverses the autograd
    # graph (for modules the store cannot split; W costs about a backward with retrace)
    split_backward: Literal["store", "retrace", "torch"] = "store"
    # Rollout / training overlap (moerl.rollout.manager, moerl.train.loop): sync = generate, then train;
    # one_step_off = the rollout of step k+1 runs while step k trains (weights change between batches);
    # async = a producer keeps every server busy and fills a buffer, weight updates land in flight
    # (pause, push, continue; unfinished responses resume from their prefix).
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    # staleness of a trained token = version of the weights the update starts from minus the version that
    # generated it; the bound is never exceeded (0 = on-policy). one_step_off needs >= 1.
    max_staleness: int = Field(1, ge=0)
    # wait: the producer waits instead of generating data that would exceed the bound; drop: it keeps
    # generating and samples over the bound are dropped at consumption (both counted)
    staleness_policy: Literal["wait", "drop"] = "wait"
    # partial rollouts (async): tokens of a response generated by a version older than its newest one
    # are kept out of the loss (loss_mask 0) when true
    partial_rollout_mask_old: bool = False
    # CPU cores the trainer process is pinned to (os.sched_setaffinity; [] = not pinned); see
    # rollout.cpu_affinity
    cpu_affinity: list[int] = Field(default_factory=list)
    # at the start of RL, move every object alive in the trainer processes, the rollout producer process
    # (one_step_off / async) and the rollout servers moerl
    # started (SGLang's POST /freeze_gc) to Python's permanent GC generation, so that the cyclic collector
    # no longer walks the model, tokenizer and start-up state: on the demo a full collection paused the
    # server for ~0.3 s every ~9 s and the trainer for ~0.25 s (moerl.train.components.freeze_gc)
    freeze_gc: bool = True
    # MiB of fresh memory each trainer process touches and frees just before RL (moerl.train.components
    # .warm_page_pool; CPU training only); null = 512 in one_step_off / async, 0 (off) in sync. On the 2-core
    # Firecracker VMs this project is measured on, a page the trainer touched for the first time while the
    # rollout core was busy cost 30-40 us instead of ~2.5 us, and the async update stalled 0.1-0.65 s at the
    # steps where its memory grew; after touching 512 MiB first those steps ran at normal speed
    warm_memory_mb: Optional[int] = Field(None, ge=0)

    @model_validator(mode="after")
    def _cross_fields(self) -> "TrainConfig":
        _check_cores("train.cpu_affinity", self.cpu_affinity)
        if self.mode == "one_step_off" and self.max_staleness < 1:
            raise ValueError("train.mode=one_step_off trains on data one version old: train.max_staleness must "
                             f"be >= 1 (got {self.max_staleness}); use train.mode=sync for on-policy")
        if self.mode == "async" and self.max_staleness == 0 and self.staleness_policy == "drop":
            raise ValueError("train.staleness_policy=drop lets the producer run one batch ahead, and at "
                             "train.max_staleness=0 every group made ahead is one version old when taken: half of the "
                             "generation would be dropped. Use train.staleness_policy=wait (async at 0 is sync) or "
                             "train.max_staleness >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"train.micro_batch_size ({self.micro_batch_size})"
            )
        return self


class SFTConfig(_Section):
    """Supervised warm start on the task's gold answers, stopped at a held-out greedy accuracy."""

    enabled: bool = True
    lr: float = Field(1.0e-3, gt=0)
    global_batch_size: int = Field(128, ge=1)
    micro_batch_size: int = Field(128, ge=1)
    max_steps: int = Field(3000, ge=1)
    warmup_steps: int = Field(0, ge=0)  # the lr rises linearly from sft.lr / warmup_steps to sft.lr over these steps
    eval_every: int = Field(25, ge=1)  # steps
    eval_prompts: int = Field(100, ge=1)
    target_accuracy: float = Field(0.3, gt=0, le=1)  # stop when greedy eval accuracy first reaches it

    @model_validator(mode="after")
    def _cross_fields(self) -> "SFTConfig":
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"sft.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"sft.micro_batch_size ({self.micro_batch_size})"
            )
        return self


class EvalConfig(_Section):
    """Greedy held-out evaluation during RL."""

    num_prompts: int = Field(300, ge=1)
    every_steps: int = Field(25, ge=0)  # 0 = only before and after training
    # end RL at the first periodic eval whose greedy accuracy is at least this much (a fraction, 0.15 = 15
    # points) above the warm start's, on the same eval.num_prompts prompts; null = run all train.num_steps
    # (as does every_steps 0: no periodic evals). Default null: a recipe runs all its steps unless it asks
    # (configs/tiny_arith.yaml sets 0.15 for the demo's time, issue #17)
    stop_at_gain: Optional[float] = Field(None, gt=0.0, le=1.0)


class LogConfig(_Section):
    tensorboard: bool = True
    wandb_project: Optional[str] = None
    log_every: int = Field(1, ge=1)
    # one line per trained sample in <output_dir>/samples.jsonl: step, uid (draw-group-sample), reward,
    # status, trainer version, per-token weight versions and loss mask (off: ~150 bytes per sample)
    samples: bool = False


class ProfileConfig(_Section):
    """torch.profiler Chrome traces of chosen RL steps (moerl.observe.profiling.StepProfiler): one
    ``<output_dir>/profile/trace_rank<r>.json`` per listed rank, the step phases (rollout, log_prob,
    update, weight_sync, ...) as named ranges; on CUDA the phases are NVTX ranges too (nsys)."""

    steps: Optional[list[int]] = None  # [first, last] RL steps, inclusive (e.g. [2, 2]); null = no profiling
    ranks: list[int] = [0]  # global trainer ranks that write a trace

    @model_validator(mode="after")
    def _cross_fields(self) -> "ProfileConfig":
        if self.steps is not None and (len(self.steps) != 2 or min(self.steps) < 0 or self.steps[0] > self.steps[1]):
            raise ValueError(f"profile.steps {self.steps} must be [first, last] with 0 <= first <= last (RL steps, "
                             "inclusive), e.g. [2, 3]; or null for no profiling")
        if not self.ranks or min(self.ranks) < 0 or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"profile.ranks {self.ranks} must list distinct global ranks >= 0, e.g. [0]")
        return self


class MoEConfig(_Section):
    """MoE routing, balancing, dispatcher and telemetry keys (REFERENCE.md sec. 2), mapped onto
    Megatron-Core by moerl.moe.config.moe_transformer_overrides. The balancing type and coefficient
    stay in ``algorithm`` (moe_load_balancing_type, moe_aux_loss_coeff)."""

    z_loss_coeff: float = Field(0.0, ge=0)  # ST-MoE router z-loss; 0 = off
    score_function: Literal["softmax", "sigmoid"] = "softmax"  # router scores (sigmoid: DeepSeek-V3)
    expert_bias: bool = False  # aux-loss-free balancing bias (arXiv 2408.15664); needs sigmoid
    bias_update_rate: float = Field(1.0e-3, gt=0)  # b_i += rate * sign(mean_count - count_i) per step
    topk_scaling_factor: Optional[float] = Field(None, gt=0)  # scale of the top-k gates; None = 1
    num_groups: Optional[int] = Field(None, ge=1)  # group-limited routing: expert groups
    group_topk: Optional[int] = Field(None, ge=1)  # group-limited routing: groups chosen per token
    capacity_factor: Optional[float] = Field(None, gt=0)  # None = no token dropping
    pad_to_capacity: bool = False  # pad every expert's input to its capacity (needs capacity_factor)
    token_drop_policy: Literal["probs", "position"] = "probs"
    token_dispatcher: Literal["alltoall", "allgather", "flex"] = "alltoall"  # flex = DeepEP, GPU only
    telemetry: bool = True  # per-layer tokens_per_expert, imbalance, entropy -> <output_dir>/moe_telemetry.jsonl
    entropy_threshold: float = Field(0.5, ge=0, le=1)  # alert below this fraction of ln(num_experts)
    dead_expert_steps: int = Field(10, ge=0)  # alert when an expert gets no tokens this many steps; 0 = off
    # routing replay (moerl.moe.routing_replay): none | r3 (force the rollout server's routing, SGLang
    # return_routed_experts, in the old-log-prob and update passes) | r2 (record the trainer's routing in
    # the old-log-prob pass, force it in the update passes)
    routing_replay: Literal["none", "r2", "r3"] = "none"

    @model_validator(mode="after")
    def _cross_fields(self) -> "MoEConfig":
        from moerl.moe.config import validate_moe  # light import (no torch)

        validate_moe(self)
        return self


class HardwareConfig(_Section):
    """What ``moerl plan`` sizes the recipe for: the GPU, the network, the MFU assumption of its
    step-time estimate and the longest prompt. ``moerl train`` reads only the peak (``peak_bf16_tflops``,
    else ``gpu``'s row, else the CUDA device name) for the MFU it logs (moerl.observe.flops.peak_tflops).

    ``gpu`` names a row of moerl.parallel.hardware.GPUS (memory, peak dense BF16/FP8 TFLOP/s, NVLink
    bandwidth, each from the vendor datasheet); ``gpu_memory_gib`` / ``peak_bf16_tflops`` /
    ``nvlink_gbs`` override that row or describe a GPU that is not in it.
    """

    gpu: Optional[str] = None  # e.g. H100, H200, B200, A100 (moerl.parallel.hardware.known_gpus())
    gpu_memory_gib: Optional[float] = Field(None, gt=0)  # overrides the table's memory
    peak_bf16_tflops: Optional[float] = Field(None, gt=0)  # dense BF16 tensor-core peak, overrides the table
    nvlink_gbs: Optional[float] = Field(None, gt=0)  # GB/s per GPU and direction inside a node
    gpus_per_node: int = Field(8, ge=1)
    inter_node_gbs: float = Field(50.0, gt=0)  # GB/s per GPU and direction between nodes (one 400 Gb/s NIC)
    mfu: float = Field(0.35, gt=0, le=1)  # model-FLOPs utilisation the step-time estimate assumes
    reserved_fraction: float = Field(0.1, ge=0, lt=1)  # of GPU memory kept for CUDA context, NCCL, fragmentation
    # the longest prompt in tokens: training sequences are max_prompt_tokens + rollout.max_new_tokens
    # (None: `moerl plan` asks for it or --seq-length)
    max_prompt_tokens: Optional[int] = Field(None, ge=1)

    @model_validator(mode="after")
    def _known_gpu(self) -> "HardwareConfig":
        if self.gpu is not None:
            from moerl.parallel.hardware import gpu_spec  # pure python

            gpu_spec(self.gpu)
        return self


class PrecisionConfig(_Section):
    """FP8 training through NVIDIA Transformer Engine (GPU only), mapped onto Megatron-Core's
    TransformerConfig by moerl.precision.te_fp8 (fp8, fp8_recipe, first_last_layers_bf16, ...).
    FP8 runs inside BF16 mixed precision (model.params_dtype: bfloat16). The word embedding and the
    output layer always stay BF16 and the MoE router FP32 (not TE layers / moe_router_dtype)."""

    fp8: Optional[Literal["e4m3", "hybrid"]] = None  # null = no FP8; hybrid = E4M3 forward, E5M2 gradients
    # delayed (amax history) | tensorwise (current scaling) | blockwise (DeepSeek-V3 1x128 / 128x128,
    # Hopper) | mxfp8 (32-element blocks, Blackwell)
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    fp8_bf16_first_layers: int = Field(0, ge=0)  # transformer layers kept in BF16 at the start (not with delayed)
    fp8_bf16_last_layers: int = Field(0, ge=0)  # ... and at the end

    @model_validator(mode="after")
    def _fp8_recipe_needs_fp8(self) -> "PrecisionConfig":
        """precision.fp8_recipe given while precision.fp8 is null would be ignored: refuse (a dumped recipe
        holds the default, delayed, with fp8 null: accepted). The BF16-layer keys: te_fp8.validate_fp8_recipe."""
        if self.fp8 is None and "fp8_recipe" in self.model_fields_set and self.fp8_recipe != "delayed":
            raise ValueError(f"precision.fp8_recipe={self.fp8_recipe!r} is set but precision.fp8 is null, so FP8 "
                             "training is off and it would be ignored: set precision.fp8=e4m3 (or hybrid) to train "
                             "in FP8, or remove precision.fp8_recipe")
        return self


def producer_in_process(cfg) -> bool:
    """Whether the rollout producer runs as a child process (moerl.rollout.producer_process) rather than a
    thread of the trainer: rollout.producer_process, null = in one_step_off and async."""
    use = cfg.rollout.producer_process
    return cfg.train.mode != "sync" if use is None else bool(use)


def async_keys_without_effect(cfg) -> list[str]:
    """One note per asynchronous-RL key set to a non-default value that ``cfg``'s train.mode ignores (the main
    job logs them at the start of RL, as it does for eval.stop_at_gain without evals)."""
    tr, ro = cfg.train, cfg.rollout
    notes = []
    if tr.mode != "async" and tr.staleness_policy == "drop":
        notes.append(f"train.staleness_policy=drop has no effect: train.mode={tr.mode} (the policy acts in async only)")
    if tr.mode != "async" and tr.partial_rollout_mask_old:
        notes.append(f"train.partial_rollout_mask_old=true has no effect: train.mode={tr.mode} cuts no response "
                     "(partial rollouts happen in async only)")
    if tr.mode != "async" and ro.pause_mode == "abort":
        notes.append(f"rollout.pause_mode=abort has no effect: train.mode={tr.mode} pauses no generation for a "
                     "weight update (async only)")
    if ro.producer_cpu_affinity and not producer_in_process(cfg):
        notes.append(f"rollout.producer_cpu_affinity has no effect: the producer is a thread of the trainer (train.mode="
                     f"{tr.mode}, rollout.producer_process={ro.producer_process}), on its cores")
    return notes


def old_log_probs_pass_reason(cfg, n_updates: Optional[int] = None) -> Optional[str]:
    """Why a step needs its own old (proximal) log-prob pass before the update (see
    ``algorithm.recompute_old_log_probs``), or None when the update's own forward gives them.

    Args:
        cfg: the recipe (algorithm, moe, rollout, train sections read).
        n_updates: optimizer updates this step makes; None = the recipe's
            (rollout_batch_size x n_samples_per_prompt) // train.global_batch_size.
    """
    if n_updates is None:
        n_updates = max(1, cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
                        // cfg.train.global_batch_size)
    if n_updates > 1:
        return (f"each step makes {n_updates} optimizer updates (rollout_batch_size x n_samples_per_prompt >= 2 x "
                "train.global_batch_size): the later ones start from other weights")
    if cfg.moe.routing_replay == "r2":
        return "moe.routing_replay=r2 replays that pass's routing in the update"
    if cfg.algorithm.kl_in_reward:
        return "algorithm.kl_in_reward=true puts the KL into the rewards before the update"
    return None


class RecipeConfig(_Section):
    """The whole run recipe (see configs/tiny_arith.yaml for every key with a comment)."""

    seed: int = Field(1234, ge=0)
    output_dir: str = Field("runs/tiny_arith", min_length=1)
    # an output_dir that already holds a moerl run (recipe.yaml, weights/ or checkpoints/) is refused with
    # resume=none unless this is true (HF Trainer's overwrite_output_dir): the old run's weights,
    # checkpoints, logs and exports are removed before the new run writes
    overwrite_output_dir: bool = False
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    critic: CriticConfig = CriticConfig()
    moe: MoEConfig = MoEConfig()
    train: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    hardware: HardwareConfig = HardwareConfig()  # moerl plan; moerl train: the peak of its MFU
    precision: PrecisionConfig = PrecisionConfig()  # FP8 training (moerl.precision.te_fp8)
    profile: ProfileConfig = ProfileConfig()  # torch.profiler traces of chosen steps (moerl.observe.profiling)
    # "none" = start fresh; "auto" = continue from the newest complete checkpoint in
    # <output_dir>/checkpoints (fresh start when there is none); or a checkpoint directory path
    resume: str = Field("none", min_length=1)

    @model_validator(mode="after")
    def _fp8_rules(self) -> "RecipeConfig":
        """precision.* against the model shape and layout (TE's alignment, BF16 layers); the machine
        (TE installed, GPU) is checked by ``moerl train`` before any work (te_fp8.check_fp8_environment)."""
        from moerl.precision.te_fp8 import validate_fp8_recipe  # light import (no torch)

        p = self.parallel
        validate_fp8_recipe(self.precision, hf_config=self.model.hf_config, params_dtype=self.model.params_dtype,
                            tp_size=p.tp_size, etp_size=p.etp_size, pp_size=p.pp_size,
                            token_dispatcher=self.moe.token_dispatcher, layer_spec=self.model.layer_spec)
        return self

    @model_validator(mode="after")
    def _moe_rules(self) -> "RecipeConfig":
        from moerl.moe.config import validate_moe  # light import (no torch)

        h = self.model.hf_config
        validate_moe(self.moe, num_experts=h.num_experts, topk=h.num_experts_per_tok, algorithm=self.algorithm,
                     train_pack=self.train.pack, ep_size=self.parallel.ep_size)
        from moerl.moe.routing_replay import validate_routing_replay  # light import (no torch)

        validate_routing_replay(self.moe.routing_replay, pp_size=self.parallel.pp_size,
                                recompute=self.parallel.recompute)
        return self

    @model_validator(mode="after")
    def _profile_rules(self) -> "RecipeConfig":
        steps = self.profile.steps
        if steps is not None and steps[1] > self.train.num_steps:
            raise ValueError(f"profile.steps {steps} ends after the last RL step (train.num_steps={self.train.num_steps}): "
                             f"choose steps within 1..{self.train.num_steps}")
        return self

    @model_validator(mode="after")
    def _async_rules(self) -> "RecipeConfig":
        """train.mode / rollout / algorithm keys of asynchronous RL that only make sense together."""
        tr, ro, algo = self.train, self.rollout, self.algorithm
        if tr.mode != "sync" and ro.placement == "colocated":
            raise ValueError(f"train.mode={tr.mode} overlaps rollout and training, which needs separate devices: "
                             "set rollout.placement=disaggregated or train.mode=sync")
        overlap = sorted(set(tr.cpu_affinity) & set(ro.cpu_affinity))
        if overlap:
            raise ValueError(f"train.cpu_affinity {tr.cpu_affinity} and rollout.cpu_affinity {ro.cpu_affinity} share "
                             f"cores {overlap}: give the trainer and the rollout servers separate cores")
        if algo.off_policy_correction in ("tis", "decoupled", "mis") and algo.is_cap < 1:
            what = "scales every token's loss down by it" if algo.off_policy_correction == "tis" else "masks it"
            raise ValueError(f"algorithm.is_cap={algo.is_cap} < 1 with algorithm.off_policy_correction="
                             f"{algo.off_policy_correction}: an on-policy token has importance weight 1, which this cap "
                             f"{what}; set algorithm.is_cap >= 1 (AReaL and TIS use 2 to 5)")
        if algo.off_policy_correction == "mis" and algo.is_lower > algo.is_cap:
            raise ValueError(f"algorithm.is_lower ({algo.is_lower}) must be <= algorithm.is_cap ({algo.is_cap}) for "
                             "algorithm.off_policy_correction=mis (the kept band is [is_lower, is_cap])")
        why = old_log_probs_pass_reason(self)
        if algo.recompute_old_log_probs is False and why:
            raise ValueError(f"algorithm.recompute_old_log_probs=false, but {why}: the old log-probs need their own "
                             "forward pass there; set algorithm.recompute_old_log_probs=null")
        return self

    @model_validator(mode="after")
    def _pipeline_schedule_rules(self) -> "RecipeConfig":
        """train.pipeline_schedule rules that involve other sections (world-size independent; the
        micro-batch count rule needs dp_size and is in ``check_world_size``).  TP (with sequence
        parallelism) and EP inside the stages are allowed: each TP/EP/DP position runs its own copy of
        the schedule over its pipeline group (moerl.pipeline.megatron_stages)."""
        sched, p, hf = self.train.pipeline_schedule, self.parallel, self.model.hf_config
        if self.train.pipeline_overlap:
            if sched == "1f1b":
                raise ValueError("train.pipeline_overlap=true overlaps DualPipe's F&B steps: set "
                                 "train.pipeline_schedule=dualpipe or dualpipev (or pipeline_overlap=false)")
            if p.ep_size < 2:
                raise ValueError(f"train.pipeline_overlap=true hides the MoE all-to-all and needs parallel.ep_size >= 2 "
                                 f"(got {p.ep_size}); set train.pipeline_overlap=false")
            if self.moe.token_dispatcher not in ("alltoall", "flex"):
                raise ValueError(f"train.pipeline_overlap=true needs moe.token_dispatcher alltoall or flex (got "
                                 f"{self.moe.token_dispatcher})")
            if hf.num_hidden_layers - 1 in hf.mlp_only_layers:
                raise ValueError("train.pipeline_overlap=true needs an MoE last layer (Megatron's schedule plan applies "
                                 "the final norm after an MoE layer only): remove the last layer from "
                                 "model.hf_config.mlp_only_layers or set train.pipeline_overlap=false")
        if sched == "1f1b":
            if self.train.split_backward != "store":
                raise ValueError(f"train.split_backward={self.train.split_backward} chooses how DualPipe(V) splits the "
                                 "backward; train.pipeline_schedule=1f1b runs unsplit backwards: remove "
                                 "train.split_backward or set train.pipeline_schedule=dualpipe or dualpipev")
            return self
        key = f"train.pipeline_schedule={sched}"
        if p.pp_size < 2:
            raise ValueError(f"{key} needs parallel.pp_size > 1 (got {p.pp_size}); use train.pipeline_schedule=1f1b "
                             "or set parallel.pp_size >= 2")
        if sched == "dualpipe" and p.pp_size % 2:
            raise ValueError(f"{key} needs an even parallel.pp_size (got {p.pp_size}); use dualpipev or an even pp_size")
        if self.train.pack:
            raise ValueError(f"{key} needs train.pack=false (padded micro-batches between pipeline stages)")
        if p.num_layers_in_first_pipeline_stage is not None or p.num_layers_in_last_pipeline_stage is not None:
            raise ValueError(f"{key} splits the layers evenly: unset parallel.num_layers_in_first_pipeline_stage / "
                             "num_layers_in_last_pipeline_stage")
        stages = 2 * p.pp_size if sched == "dualpipev" else p.pp_size
        if hf.num_hidden_layers % stages:
            raise ValueError(f"{key} cuts the model into {stages} stages of equal size: "
                             f"model.hf_config.num_hidden_layers ({hf.num_hidden_layers}) must be divisible by "
                             f"{stages} ({'2 * ' if sched == 'dualpipev' else ''}parallel.pp_size)")
        if sched == "dualpipe" and hf.tie_word_embeddings:
            raise ValueError(f"{key} keeps the first and last stage on different ranks: set "
                             "model.hf_config.tie_word_embeddings=false, or use dualpipev")
        if self.moe.routing_replay != "none":
            raise ValueError(f"{key} does not support moe.routing_replay={self.moe.routing_replay}: set "
                             "moe.routing_replay=none or train.pipeline_schedule=1f1b")
        if p.recompute == "full":
            raise ValueError(f"{key} does not support parallel.recompute=full; use none or selective")
        if sched == "dualpipe" and self.moe.expert_bias:
            raise ValueError(f"{key} does not support moe.expert_bias=true (the two model copies would count "
                             "different tokens per expert); use dualpipev")
        return self

    @model_validator(mode="after")
    def _cross_sections(self) -> "RecipeConfig":
        r, t = self.rollout, self.train
        samples = r.rollout_batch_size * r.n_samples_per_prompt
        if samples % t.global_batch_size:
            raise ValueError(
                f"rollout.rollout_batch_size * rollout.n_samples_per_prompt ({r.rollout_batch_size} * "
                f"{r.n_samples_per_prompt} = {samples}) must be divisible by train.global_batch_size "
                f"({t.global_batch_size})"
            )
        if r.n_samples_per_prompt < 2:
            raise ValueError(
                f"rollout.n_samples_per_prompt must be >= 2 with algorithm.advantage_estimator "
                f"'{self.algorithm.advantage_estimator}': a group of 1 response has no group baseline, "
                "so every advantage would be 0 (and filter_uniform_groups would drop every group)"
            )
        if self.data.task in ("arithmetic", "reasoning_gym") and self.eval.num_prompts > self.data.num_eval:
            raise ValueError(
                f"eval.num_prompts ({self.eval.num_prompts}) must be <= data.num_eval ({self.data.num_eval})"
            )
        if self.sft.eval_prompts > self.eval.num_prompts:
            raise ValueError(
                f"sft.eval_prompts ({self.sft.eval_prompts}) must be <= eval.num_prompts ({self.eval.num_prompts})"
            )
        mtp = self.model.hf_config.num_nextn_predict_layers
        if mtp and (self.algorithm.advantage_estimator == "gae" or self.parallel.pp_size > 1
                    or self.train.pipeline_schedule != "1f1b"):
            raise ValueError(f"model.hf_config.num_nextn_predict_layers={mtp} (MTP layers) needs parallel.pp_size=1, "
                             "train.pipeline_schedule=1f1b and no critic (algorithm.advantage_estimator != gae); "
                             "change those or set num_nextn_predict_layers=0")
        if self.algorithm.advantage_estimator == "gae" and self.train.pipeline_schedule != "1f1b":
            raise ValueError(f"algorithm.advantage_estimator=gae trains a critic, which runs Megatron's 1F1B schedule "
                             f"only: set train.pipeline_schedule=1f1b (got {self.train.pipeline_schedule})")
        buf = self.algorithm.overlong_buffer_len
        if buf is not None and buf >= self.rollout.max_new_tokens:
            raise ValueError(f"algorithm.overlong_buffer_len ({buf}) must be < rollout.max_new_tokens "
                             f"({self.rollout.max_new_tokens}): the penalty ramps over the last buffer tokens before it")
        if (self.algorithm.entropy_coef > 0 and self.parallel.tp_size > 1
                and self.train.pipeline_schedule in ("dualpipe", "dualpipev")):
            raise ValueError("algorithm.entropy_coef > 0 with parallel.tp_size > 1 needs train.pipeline_schedule=1f1b "
                             "(DualPipe's split backward has no vocabulary-parallel entropy gradient); or set "
                             "algorithm.entropy_coef=0")
        if self.train.fused_logprob and self.train.pipeline_schedule != "1f1b":
            raise ValueError(f"train.fused_logprob=true needs train.pipeline_schedule=1f1b (DualPipe(V)'s stage chunks "
                             f"keep the logits path; got {self.train.pipeline_schedule}): set train.fused_logprob=false "
                             "or leave it unset (auto)")
        ep, ne = self.parallel.ep_size, self.model.hf_config.num_experts
        if ne % ep:
            raise ValueError(f"parallel.ep_size ({ep}) must divide model.hf_config.num_experts ({ne})")
        self._check_model_layout()
        if r.max_new_tokens >= self.model.hf_config.max_position_embeddings:
            raise ValueError(
                f"rollout.max_new_tokens ({r.max_new_tokens}) must be < "
                f"model.hf_config.max_position_embeddings ({self.model.hf_config.max_position_embeddings})"
            )
        if self.data.task == "arithmetic" and r.max_new_tokens < self.data.digits + 2:
            raise ValueError(
                f"rollout.max_new_tokens ({r.max_new_tokens}) must be >= data.digits + 2 "
                f"({self.data.digits + 2}): the sum of two {self.data.digits}-digit numbers plus the eos token"
            )
        return self

    @model_validator(mode="after")
    def _fp8_rollout_rules(self) -> "RecipeConfig":
        r = self.rollout
        if r.weight_dtype == "fp8" and r.backend == "sglang":
            from moerl.precision.fp8_checkpoint import sglang_fp8_shape_errors  # pure torch, no GPU

            errors = sglang_fp8_shape_errors(self.model.hf_config.model_dump(), r.server_tp_size, r.server_ep_size)
            if errors:
                raise ValueError(
                    f"rollout.weight_dtype=fp8 with rollout.backend=sglang: SGLang's block-FP8 loader (128x128 blocks, "
                    f"rollout.server_tp_size={r.server_tp_size}, server_ep_size={r.server_ep_size}) would refuse "
                    f"this model: {'; '.join(errors)}. Use rollout.weight_dtype=auto|bf16, another server "
                    f"tp/ep size, or model.hf_config dims that are multiples of 128")
        return self

    def _check_model_layout(self) -> None:
        """World-size-independent layout rules: how the model splits over tp / etp / pp / ep."""
        p, hf = self.parallel, self.model.hf_config
        has_moe = len(set(hf.mlp_only_layers)) < hf.num_hidden_layers
        if p.tp_size > 1 and has_moe and not p.sequence_parallel:
            raise ValueError(
                f"parallel.tp_size ({p.tp_size}) > 1 with MoE layers requires parallel.sequence_parallel=true "
                "(Megatron-Core's MoE layer with tensor parallelism runs on sequence-parallel input); "
                "set parallel.sequence_parallel=true or parallel.tp_size=1"
            )
        mla = self.model.planner_extras.mla if self.model.planner_extras else None
        heads = [("model.hf_config.num_attention_heads", hf.num_attention_heads)]
        if mla is None:  # Megatron splits whole query groups over TP ranks
            heads.append(("model.hf_config.num_key_value_heads", hf.num_key_value_heads))
        for key, value in heads:
            if value % p.tp_size:
                raise ValueError(f"parallel.tp_size ({p.tp_size}) must divide {key} ({value})")
        if hf.vocab_size is not None and hf.vocab_size % p.tp_size:
            raise ValueError(
                f"parallel.tp_size ({p.tp_size}) must divide model.hf_config.vocab_size ({hf.vocab_size}) "
                "(vocabulary-parallel embedding and output layer)"
            )
        if has_moe and hf.moe_intermediate_size % p.expert_tp_size:
            raise ValueError(
                f"the expert tensor-parallel size (parallel.etp_size, default parallel.tp_size: {p.expert_tp_size}) "
                f"must divide model.hf_config.moe_intermediate_size ({hf.moe_intermediate_size})"
            )
        if hf.mlp_only_layers and hf.intermediate_size % p.tp_size:
            raise ValueError(
                f"parallel.tp_size ({p.tp_size}) must divide model.hf_config.intermediate_size "
                f"({hf.intermediate_size}) of the dense layers (model.hf_config.mlp_only_layers)"
            )
        first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
        if p.pp_size == 1 and (first is not None or last is not None):
            raise ValueError(
                "parallel.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage need "
                f"parallel.pp_size > 1 (got {p.pp_size})"
            )
        from moerl.parallel.layout import pipeline_layer_range  # pure python

        if first is None and last is None:
            if hf.num_hidden_layers % p.pp_size:
                raise ValueError(
                    f"parallel.pp_size ({p.pp_size}) must divide model.hf_config.num_hidden_layers "
                    f"({hf.num_hidden_layers}) for an even pipeline split; or give the first/last stage their "
                    "own layer counts with parallel.num_layers_in_first_pipeline_stage / "
                    "num_layers_in_last_pipeline_stage"
                )
            return
        try:
            for rank in range(p.pp_size):
                pipeline_layer_range(hf.num_hidden_layers, p.pp_size, rank, first, last)
        except ValueError as e:
            raise ValueError(
                f"model.hf_config.num_hidden_layers ({hf.num_hidden_layers}) does not split over parallel.pp_size "
                f"({p.pp_size}) stages with parallel.num_layers_in_first_pipeline_stage={first} and "
                f"parallel.num_layers_in_last_pipeline_stage={last}: {e}"
            ) from None

    # ------------------------------------------------------------------ layout
    def check_world_size(self, world_size: int, trainable: bool = True) -> int:
        """Validate the parallel layout for ``world_size`` ranks and return dp_size (``trainable=False``:
        every rule but the last, for ``moerl plan`` of shape-only recipes).

        Rules (Megatron-Core's initialize_model_parallel, cp_size = 1):

        * world_size % (tp_size * pp_size) == 0; dp_size = world_size / (tp_size * pp_size);
        * world_size % (etp_size * ep_size * pp_size) == 0 (the expert layers tile the same ranks:
          expert data parallelism = world_size / (etp_size * ep_size * pp_size));
        * parallel.world_size, when set, equals world_size;
        * every optimizer step splits into whole micro-batches on each DP rank:
          train/sft global_batch_size % (micro_batch_size * dp_size) == 0;
        * the recipe builds a trainable model (no model.planner_extras);
        * profile.ranks lie in 0..world_size-1.

        The world-size-independent rules (experts divisible by ep_size, layers by pp_size, heads /
        vocabulary / FFN widths by tp_size, sequence parallelism with tp_size > 1 and MoE) are
        checked when the recipe is loaded.

        Raises:
            ConfigError-compatible ValueError naming the parallel.* / *.global_batch_size key.
        """
        dp = self.layout_dp_size(world_size, launch_hint=trainable)
        for name, sec in (("train", self.train), ("sft", self.sft)):
            if sec.global_batch_size % (sec.micro_batch_size * dp):
                raise ConfigError(
                    f"{name}.global_batch_size ({sec.global_batch_size}) must be divisible by "
                    f"{name}.micro_batch_size * dp_size ({sec.micro_batch_size} * {dp}) for world_size {world_size}"
                )
        t = self.train
        if t.pipeline_schedule != "1f1b":
            m, need = t.global_batch_size // (t.micro_batch_size * dp), 2 * self.parallel.pp_size
            if m < need:
                raise ConfigError(
                    f"train.pipeline_schedule={t.pipeline_schedule} needs >= 2 * parallel.pp_size ({need}) "
                    f"micro-batches per step on each DP rank; train.global_batch_size / (train.micro_batch_size "
                    f"* dp_size) = {t.global_batch_size} / ({t.micro_batch_size} * {dp}) = {m}: lower "
                    "train.micro_batch_size or raise train.global_batch_size"
                )
            if t.pipeline_schedule == "dualpipe" and m % 2:
                raise ConfigError(
                    f"train.pipeline_schedule=dualpipe needs an even number of micro-batches per step (got {m} = "
                    "train.global_batch_size / (train.micro_batch_size * dp_size)): change train.micro_batch_size")
        bad = [r for r in self.profile.ranks if r >= world_size]
        if bad:
            raise ConfigError(f"profile.ranks {self.profile.ranks}: ranks {bad} do not exist in a job of {world_size} "
                              f"processes; list ranks in 0..{world_size - 1}")
        if trainable and self.model.planner_extras is not None:
            raise ConfigError(
                "model.planner_extras (shared experts / multi-head latent attention) is only understood by "
                "`moerl plan`; the Qwen3-MoE trainer cannot build it: remove model.planner_extras to train"
            )
        return dp

    def layout_dp_size(self, world_size: int, launch_hint: bool = False) -> int:
        """The tiling rules of ``check_world_size`` only (no batch or trainability rules);
        returns dp_size. Used by ``moerl plan``. ``launch_hint`` (``moerl train``): a broken rule also says
        how to launch the layout (``torchrun --nproc-per-node N``, N the fewest processes it tiles).

        Raises:
            ConfigError naming the parallel.* keys and the rule.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        p = self.parallel
        if p.world_size is not None and p.world_size != world_size:
            raise ConfigError(
                f"parallel.world_size ({p.world_size}) says the job has {p.world_size} processes but it "
                f"runs on {world_size}; launch {p.world_size} processes or change parallel.world_size"
            )
        mp = p.tp_size * p.pp_size
        expert_mp = p.expert_tp_size * p.ep_size * p.pp_size
        n = math.lcm(mp, expert_mp)  # the fewest processes the layout runs on
        launch = (f"; launch with torchrun --nproc-per-node {n} -m moerl.cli train <recipe> (any multiple of "
                  f"{n} processes in all)") if launch_hint else ""
        if world_size % mp:
            raise ConfigError(
                f"world_size ({world_size}) must be divisible by parallel.tp_size * parallel.pp_size "
                f"({p.tp_size} * {p.pp_size} = {mp}){launch}"
            )
        if world_size % expert_mp:
            raise ConfigError(
                f"world_size ({world_size}) must be divisible by etp_size * parallel.ep_size * parallel.pp_size "
                f"({p.expert_tp_size} * {p.ep_size} * {p.pp_size} = {expert_mp}; etp_size is "
                "parallel.etp_size, default parallel.tp_size): the expert layers tile the same ranks; lower "
                f"parallel.ep_size, or set parallel.etp_size=1 to combine tp_size > 1 with ep_size > 1{launch}"
            )
        return world_size // mp

    @property
    def data_seed(self) -> int:
        """Seed of the generated train/eval prompt split: ``data.seed``, or the run ``seed`` when it is null."""
        return self.seed if self.data.seed is None else self.data.seed

    # ------------------------------------------------------------------ dump
    def to_dict(self) -> dict[str, Any]:
        """Plain-python nested dict (JSON/YAML-safe) of every resolved value."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """The resolved recipe as YAML; ``load_config`` of it gives back an equal RecipeConfig."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def save(self, path: str) -> None:
        """Write :meth:`to_yaml` to ``path`` (e.g. ``<output_dir>/recipe.yaml``)."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_yaml())
