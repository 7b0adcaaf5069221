"""Recipe MoE keys -> Megatron-Core ``TransformerConfig`` router / dispatcher fields, validated together.

The recipe's ``moe:`` section (:class:`moerl.config.schema.MoEConfig`) names the routing and
balancing choices of REFERENCE.md sec. 2; this module maps them onto Megatron-Core 0.16.1's fields:

=============================  ===========================================================
recipe key                     TransformerConfig field(s)
=============================  ===========================================================
algorithm.moe_load_balancing_  moe_router_load_balancing_type (aux_loss | seq_aux_loss |
type [*]                       global_aux_loss | none)
algorithm.moe_aux_loss_coeff   moe_aux_loss_coeff
moe.z_loss_coeff               moe_z_loss_coeff (0 -> None = off)
moe.score_function             moe_router_score_function (softmax | sigmoid)
moe.expert_bias                moe_router_enable_expert_bias (aux-loss-free, needs sigmoid)
moe.bias_update_rate           moe_router_bias_update_rate (gamma of arXiv 2408.15664)
moe.topk_scaling_factor        moe_router_topk_scaling_factor (DeepSeek-V3: 2.5)
moe.num_groups, moe.group_topk moe_router_num_groups, moe_router_group_topk (group-limited)
moe.capacity_factor            moe_expert_capacity_factor (None = no token dropping)
moe.pad_to_capacity            moe_pad_expert_input_to_capacity
moe.token_drop_policy          moe_token_drop_policy (probs | position)
moe.token_dispatcher           moe_token_dispatcher_type (alltoall | allgather | flex);
                               flex also sets moe_flex_dispatcher_backend="deepep"
=============================  ===========================================================

[*] The balancing type and coefficient stay in the ``algorithm`` section (one source of truth;
the RL loop already reads them). :func:`resolve_balancing` also accepts ``load_balancing_type`` /
``aux_loss_coeff`` attributes on the ``moe`` object (None = inherit), for callers that build their
own settings object.

The module imports no torch at import time (the recipe schema calls :func:`validate_moe` while
loading a YAML file); the hardware check of the flex dispatcher (:func:`check_dispatcher_available`)
runs when the TransformerConfig fields are built (:func:`moe_transformer_overrides`), i.e. in the
trainer process, so ``moerl plan`` of a GPU recipe still works on a CPU machine.
"""

from __future__ import annotations

from typing import Any, Optional

BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DISPATCHERS = ("alltoall", "allgather", "flex")
DEEPEP_MAX_VERSION = "1.2.1"  # Megatron-Core's flex dispatcher uses the DeepEP V1 API

DEEPEP_HELP = (
    "the flex token dispatcher runs on DeepEP (deepseek-ai/DeepEP V1, <= v" + DEEPEP_MAX_VERSION + "), "
    "which needs NVIDIA GPUs with NVSHMEM: build it from source in the GPU image "
    "(git clone https://github.com/deepseek-ai/DeepEP && git checkout v" + DEEPEP_MAX_VERSION + " && "
    "NVSHMEM_DIR=... python setup.py install); never `pip install deep-ep` (PyPI's deep-ep is a different "
    "package). On CPU use moe.token_dispatcher=alltoall (or allgather)"
)


def resolve_balancing(moe: Any, algorithm: Any = None) -> tuple[str, float]:
    """The effective (load_balancing_type, aux_loss_coeff): ``moe.*`` when set, else
    ``algorithm.moe_load_balancing_type`` / ``algorithm.moe_aux_loss_coeff`` (else aux_loss / 1e-3).

    Args:
        moe: a MoEConfig-like object (attributes ``load_balancing_type``, ``aux_loss_coeff``) or None.
        algorithm: an AlgorithmConfig-like object or None.

    Raises:
        ValueError: both places set to different values (names both keys).
    """
    lb_alg = getattr(algorithm, "moe_load_balancing_type", None)
    coeff_alg = getattr(algorithm, "moe_aux_loss_coeff", None)
    lb_moe = getattr(moe, "load_balancing_type", None)
    coeff_moe = getattr(moe, "aux_loss_coeff", None)
    set_alg = getattr(algorithm, "model_fields_set", None)
    set_alg = set(set_alg) if set_alg is not None else {"moe_load_balancing_type", "moe_aux_loss_coeff"}
    if lb_moe is not None and lb_alg is not None and "moe_load_balancing_type" in set_alg and lb_moe != lb_alg:
        raise ValueError(
            f"moe.load_balancing_type ({lb_moe!r}) and algorithm.moe_load_balancing_type ({lb_alg!r}) disagree; "
            "set only moe.load_balancing_type (the algorithm.* key is the older spelling)"
        )
    if coeff_moe is not None and coeff_alg is not None and "moe_aux_loss_coeff" in set_alg and coeff_moe != coeff_alg:
        raise ValueError(
            f"moe.aux_loss_coeff ({coeff_moe}) and algorithm.moe_aux_loss_coeff ({coeff_alg}) disagree; "
            "set only moe.aux_loss_coeff (the algorithm.* key is the older spelling)"
        )
    lb = lb_moe if lb_moe is not None else (lb_alg if lb_alg is not None else "aux_loss")
    coeff = coeff_moe if coeff_moe is not None else (coeff_alg if coeff_alg is not None else 1e-3)
    return str(lb), float(coeff)


def validate_moe(
    moe: Any,
    *,
    num_experts: Optional[int] = None,
    topk: Optional[int] = None,
    algorithm: Any = None,
    train_pack: bool = False,
    ep_size: int = 1,
) -> None:
    """Check the MoE keys together (and against the model / parallel / train keys when given).

    Rules (each error names the dotted recipe keys involved and the fix):

    * load_balancing_type in BALANCING_TYPES; score_function in SCORE_FUNCTIONS; token_dispatcher in
      DISPATCHERS; coefficients >= 0; bias_update_rate > 0;
    * moe.expert_bias needs moe.score_function == "sigmoid" (Megatron's aux-loss-free routing);
    * moe.num_groups and moe.group_topk are set together; num_experts % num_groups == 0;
      group_topk <= num_groups; group_topk <= topk (each chosen group contributes topk // group_topk
      experts) and topk // group_topk <= num_experts / num_groups;
    * moe.pad_to_capacity needs moe.capacity_factor; capacity_factor > 0; flex (DeepEP) cannot pad;
    * top-k = 1 with softmax scores needs model.hf_config.norm_topk_prob = false (Megatron's
      moe_router_pre_softmax) - checked by Megatron itself;
    * seq_aux_loss with train.pack = true is refused: Megatron's seq_aux_loss treats each [S, B] row
      as a sequence, and a packed THD row holds many samples, so the loss would not be per sequence;
    * algorithm.moe_* and moe.* agree (:func:`resolve_balancing`).

    Raises:
        ValueError: the first broken rule.
    """
    g = lambda name, default=None: getattr(moe, name, default)  # noqa: E731
    lb, coeff = resolve_balancing(moe, algorithm)
    if lb not in BALANCING_TYPES:
        raise ValueError(f"moe.load_balancing_type {lb!r} must be one of {BALANCING_TYPES}")
    if coeff < 0:
        raise ValueError(f"moe.aux_loss_coeff must be >= 0, got {coeff}")
    z = g("z_loss_coeff")
    if z is not None and z < 0:
        raise ValueError(f"moe.z_loss_coeff must be >= 0 (0 or null = off), got {z}")
    score = g("score_function", "softmax")
    if score not in SCORE_FUNCTIONS:
        raise ValueError(f"moe.score_function {score!r} must be one of {SCORE_FUNCTIONS}")
    if g("expert_bias", False):
        if score != "sigmoid":
            raise ValueError(
                "moe.expert_bias (aux-loss-free balancing) needs moe.score_function=sigmoid "
                f"(got {score!r}); Megatron adds the bias to sigmoid scores only"
            )
        rate = g("bias_update_rate", 1e-3)
        if not rate > 0:
            raise ValueError(f"moe.bias_update_rate must be > 0 when moe.expert_bias is true, got {rate}")
    ng, gk = g("num_groups"), g("group_topk")
    if (ng is None) != (gk is None):
        raise ValueError(
            f"moe.num_groups ({ng}) and moe.group_topk ({gk}) must be set together (group-limited routing) "
            "or both left null"
        )
    if ng is not None:
        if ng < 1 or gk < 1:
            raise ValueError(f"moe.num_groups ({ng}) and moe.group_topk ({gk}) must be >= 1")
        if gk > ng:
            raise ValueError(f"moe.group_topk ({gk}) must be <= moe.num_groups ({ng})")
        if num_experts is not None and num_experts % ng:
            raise ValueError(
                f"model.hf_config.num_experts ({num_experts}) must be divisible by moe.num_groups ({ng})"
            )
        if topk is not None:
            if gk > topk:
                raise ValueError(
                    f"moe.group_topk ({gk}) must be <= model.hf_config.num_experts_per_tok ({topk}): each "
                    "chosen group contributes num_experts_per_tok // group_topk experts"
                )
            if num_experts is not None and topk // gk > num_experts // ng:
                raise ValueError(
                    f"model.hf_config.num_experts_per_tok // moe.group_topk ({topk} // {gk}) exceeds the "
                    f"experts per group (model.hf_config.num_experts / moe.num_groups = {num_experts // ng})"
                )
    cf = g("capacity_factor")
    if cf is not None and not cf > 0:
        raise ValueError(f"moe.capacity_factor must be > 0 or null (no token dropping), got {cf}")
    if g("pad_to_capacity", False) and cf is None:
        raise ValueError("moe.pad_to_capacity needs moe.capacity_factor (set it, or pad_to_capacity=false)")
    disp = g("token_dispatcher", "alltoall")
    if disp not in DISPATCHERS:
        raise ValueError(f"moe.token_dispatcher {disp!r} must be one of {DISPATCHERS}")
    if disp == "flex" and g("pad_to_capacity", False):
        raise ValueError("moe.token_dispatcher=flex (DeepEP) does not support moe.pad_to_capacity")
    if g("token_drop_policy", "probs") not in ("probs", "position"):
        raise ValueError(f"moe.token_drop_policy must be 'probs' or 'position', got {g('token_drop_policy')!r}")
    if lb == "seq_aux_loss" and coeff > 0 and train_pack:
        raise ValueError(
            "moe.load_balancing_type (or algorithm.moe_load_balancing_type) = seq_aux_loss with train.pack=true: "
            "Megatron computes seq_aux_loss per [S, B] row and a packed row holds many samples; set "
            "train.pack=false or use aux_loss / global_aux_loss"
        )
    for name in ("entropy_threshold",):
        v = g(name)
        if v is not None and not 0 <= v <= 1:
            raise ValueError(f"moe.{name} is a fraction of ln(num_experts) in [0, 1], got {v}")


def check_rollout_routing_matches(moe, router: Any = None, family: str = "Qwen3-MoE") -> None:
    """Refuse router settings the rollout engines cannot reproduce (checked by ``moerl train``).

    The rollout engines run the policy's Hugging Face architecture (the reference server: transformers'
    forward; SGLang: its model class), whose router is fixed by the model family
    (``moerl.models.families.ModelFamily.router`` -> ``RouterFacts``). A Megatron router configured
    differently would train a policy other than the one that samples, so every ratio pi_theta / pi_old
    would carry a systematic error (REFERENCE.md sec. 1-2). So the recipe's ``moe.*`` router keys must
    equal the family's router: Qwen3-MoE (``router=None``, the default): softmax top-k, no bias, no groups,
    scale 1; DeepSeek-V3: sigmoid scores with ``e_score_correction_bias`` (moe.expert_bias=true),
    group-limited routing (moe.num_groups / moe.group_topk = n_group / topk_group when n_group > 1) and
    moe.topk_scaling_factor = routed_scaling_factor. No family drops tokens (moe.capacity_factor null).
    The keys stay valid for ``moerl plan`` whatever their values.

    Args:
        moe: the recipe's ``moe`` section.
        router: the family's ``RouterFacts`` (None = Qwen3-MoE's: softmax, no bias / groups / scaling).
        family: the family's display name for the message.

    Raises:
        ValueError: naming each offending ``moe.*`` key and the value the rollout engines use.
    """
    g = lambda name, default=None: getattr(moe, name, default)  # noqa: E731
    want_score = getattr(router, "score_function", "softmax")
    want_bias = bool(getattr(router, "expert_bias", False))
    want_groups = (getattr(router, "num_groups", None), getattr(router, "group_topk", None))
    want_scale = float(getattr(router, "scaling_factor", None) or 1.0)
    bad = []
    if g("score_function", "softmax") != want_score:
        bad.append(f"moe.score_function={g('score_function')} (rollout: {want_score})")
    if bool(g("expert_bias", False)) != want_bias:
        bad.append(f"moe.expert_bias={str(bool(g('expert_bias', False))).lower()} (rollout: "
                   f"{'e_score_correction_bias' if want_bias else 'no e_score_correction_bias'})")
    if (g("num_groups"), g("group_topk")) != want_groups:
        bad.append(f"moe.num_groups={g('num_groups')}/moe.group_topk={g('group_topk')} (rollout: "
                   + (f"{want_groups[0]}/{want_groups[1]})" if want_groups[0] is not None else "no groups)"))
    if g("capacity_factor") is not None:
        bad.append(f"moe.capacity_factor={g('capacity_factor')} (rollout: no token dropping)")
    tsf = g("topk_scaling_factor")
    if float(tsf if tsf is not None else 1.0) != want_scale:
        bad.append(f"moe.topk_scaling_factor={tsf} (rollout: {want_scale:g})")
    if bad:
        if router is None:
            fix = "Set them back to the defaults in configs/tiny_arith.yaml (they remain valid for `moerl plan`)."
            what = "the Qwen3-MoE router (softmax top-k, no bias, groups or dropping)"
        else:
            fix = f"Set them to the {family} model's router values above (they remain valid for `moerl plan`)."
            what = f"the {family} router of model.hf_config"
        raise ValueError(
            f"moerl train: the rollout engines run {what}, so these router settings would make the trained "
            "policy differ from the sampling policy: " + "; ".join(bad) + ". " + fix
        )


def check_dispatcher_available(token_dispatcher: str) -> None:
    """Fail early when the chosen token dispatcher cannot run on this machine.

    ``flex`` needs CUDA and DeepEP V1 (``import deep_ep``, version <= DEEPEP_MAX_VERSION);
    alltoall and allgather run anywhere (alltoall over gloo on CPU with moerl's CPU patches).

    Raises:
        ValueError: naming moe.token_dispatcher, DeepEP and how to install it in the GPU image.
    """
    if token_dispatcher != "flex":
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"moe.token_dispatcher=flex needs a GPU (no CUDA device here): {DEEPEP_HELP}")
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        raise ValueError(f"moe.token_dispatcher=flex but DeepEP is not importable ({e}): {DEEPEP_HELP}") from None
    try:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.version import Version

        try:
            v = version("deep_ep")
        except PackageNotFoundError:
            v = None
        if v is not None and Version(Version(v).base_version) > Version(DEEPEP_MAX_VERSION):
            raise ValueError(
                f"moe.token_dispatcher=flex: DeepEP {v} is newer than v{DEEPEP_MAX_VERSION} (V2 API); {DEEPEP_HELP}"
            )
    except ImportError:  # packaging missing: skip the version check
        pass


def moe_transformer_overrides(moe: Any, algorithm: Any = None, *, check_hardware: bool = True) -> dict[str, Any]:
    """Megatron-Core TransformerConfig fields for the recipe's MoE keys (table in the module docstring).

    Pass the result to ``moerl.models.qwen3_moe.transformer_config_from_hf(hf_config, **fields)``
    (its ``moe_aux_loss_coeff`` / ``moe_router_load_balancing_type`` parameters are included), or
    use :func:`moe_actor_kwargs` for MegatronActor.

    Args:
        moe: MoEConfig (or any object with its attributes; None = defaults).
        algorithm: AlgorithmConfig for the older balancing keys, or None.
        check_hardware: run :func:`check_dispatcher_available` (flex needs CUDA + DeepEP).

    Raises:
        ValueError: a broken rule of :func:`validate_moe` or an unavailable dispatcher.
    """
    validate_moe(moe, algorithm=algorithm)
    g = lambda name, default=None: getattr(moe, name, default)  # noqa: E731
    lb, coeff = resolve_balancing(moe, algorithm)
    disp = g("token_dispatcher", "alltoall")
    if check_hardware:
        check_dispatcher_available(disp)
    z = g("z_loss_coeff")
    out: dict[str, Any] = dict(
        moe_router_load_balancing_type=lb,
        moe_aux_loss_coeff=coeff,
        moe_z_loss_coeff=float(z) if z else None,
        moe_router_score_function=g("score_function", "softmax"),
        moe_router_enable_expert_bias=bool(g("expert_bias", False)),
        moe_router_bias_update_rate=float(g("bias_update_rate", 1e-3)),
        moe_router_num_groups=g("num_groups"),
        moe_router_group_topk=g("group_topk"),
        moe_expert_capacity_factor=g("capacity_factor"),
        moe_pad_expert_input_to_capacity=bool(g("pad_to_capacity", False)),
        moe_token_drop_policy=g("token_drop_policy", "probs"),
        moe_token_dispatcher_type=disp,
    )
    if g("topk_scaling_factor") is not None:
        out["moe_router_topk_scaling_factor"] = float(g("topk_scaling_factor"))
    if disp == "flex":
        out["moe_flex_dispatcher_backend"] = "deepep"
    return out


def moe_actor_kwargs(recipe: Any, *, check_hardware: bool = True) -> dict[str, Any]:
    """MegatronActor keyword arguments for a RecipeConfig's MoE keys:
    ``moe_aux_loss_coeff``, ``moe_load_balancing_type`` and ``config_overrides`` (the other fields).

    Merge ``config_overrides`` with other overrides (e.g. from ``actor_parallel_kwargs``) before
    passing them. Raises ValueError as :func:`moe_transformer_overrides`.
    """
    fields = moe_transformer_overrides(getattr(recipe, "moe", None), getattr(recipe, "algorithm", None),
                                       check_hardware=check_hardware)
    return dict(
        moe_aux_loss_coeff=fields.pop("moe_aux_loss_coeff"),
        moe_load_balancing_type=fields.pop("moe_router_load_balancing_type"),
        config_overrides=fields,
    )
