"""FP8 training through Transformer Engine: the recipe's ``precision`` keys mapped onto Megatron-Core.

Recipe keys (moerl.config.schema.PrecisionConfig) and the Megatron-Core ``TransformerConfig`` fields
they set (megatron/core/transformer/transformer_config.py; Megatron-Core turns them into a TE recipe
in ``megatron.core.fp8_utils.get_fp8_recipe`` and wraps each layer in TE's fp8 autocast):

=================================  =========================================================
``precision.fp8``                  ``fp8``: ``e4m3`` (every FP8 GEMM in E4M3) or ``hybrid``
                                   (E4M3 forward, E5M2 gradients); null = no FP8
``precision.fp8_recipe``           ``fp8_recipe``: ``delayed`` (TE ``DelayedScaling``, amax
                                   history), ``tensorwise`` (``Float8CurrentScaling``),
                                   ``blockwise`` (``Float8BlockScaling``, DeepSeek-V3 1x128 /
                                   128x128 blocks), ``mxfp8`` (``MXFP8BlockScaling``, 32-element
                                   blocks)
``precision.fp8_bf16_first_layers`` /  ``first_last_layers_bf16``, ``num_layers_at_start_in_bf16``,
``precision.fp8_bf16_last_layers`` ``num_layers_at_end_in_bf16``: transformer layers kept in BF16
=================================  =========================================================

What stays in BF16 (or higher), always: FP8 applies to Transformer Engine linear layers only. The
word embedding (``VocabParallelEmbedding``) and the output layer (``tensor_parallel.ColumnParallelLinear``
in Megatron's GPTModel, also with the TE spec) are never TE layers, so they run in BF16; the MoE
router runs in FP32 (``moe_router_dtype="fp32"``, set here); norms, softmax and the loss are not
GEMMs. With MoE, ``moe_router_padding_for_quantization=True`` pads each expert's token count to the
FP8 GEMM alignment (Megatron-Core; not with the allgather dispatcher).

Rules checked from the recipe alone (:func:`validate_fp8_recipe`, at load time, also on CPU so that
``moerl plan`` can check a GPU recipe): FP8 runs on Transformer Engine layers (``model.layer_spec``
transformer_engine or auto, not local: moerl.models.qwen3_moe.build_gpt_model); inside BF16 mixed precision
(``model.params_dtype: bfloat16``); every GEMM dimension per tensor-parallel shard is a multiple of
TE's alignment for the recipe (:data:`FP8_ALIGNMENT`: 16 for delayed / tensorwise, TE
``assert_dim_for_fp8_exec``; 32 for mxfp8, ``MXFP8_BLOCK_SCALING_SIZE``; 128 for blockwise,
``Float8BlockQuantizer.block_len``); BF16 first/last layers are not allowed with delayed scaling
and at most the layers of one pipeline stage (Megatron-Core's rules); no allgather dispatcher.
Rules of the machine (:func:`check_fp8_environment`, ``moerl train`` before any work): Transformer
Engine importable (else: ``pip install transformer-engine[pytorch]`` and a CUDA GPU), a CUDA GPU,
the recipe supported by it (TE's own ``is_fp8_available`` / ``is_fp8_block_scaling_available`` /
``is_mxfp8_available``: FP8 needs compute capability 8.9+, blockwise 9.0+ (Hopper) with CUDA 12.9+,
mxfp8 10.x (Blackwell)), and a TE version Megatron-Core maps the recipe with
(:data:`TE_MIN_VERSION`, from ``get_fp8_recipe``).

Sources: Megatron-Core 0.16 ``TransformerConfig`` and ``fp8_utils``; Transformer Engine 2.20
``transformer_engine.common.recipe`` and ``transformer_engine.pytorch.quantization`` (the pinned
version the contract tests parse: tests/test_te_fp8_contract.py); PRECISION.md.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["FP8_ALIGNMENT", "FP8_FORMATS", "FP8_RECIPES", "TE_INSTALL", "TE_LAYER_SPEC_BUILT", "TE_MIN_VERSION",
           "TE_PINNED_VERSION", "apply_fp8_transformer_config", "check_fp8_environment", "check_fp8_training",
           "fp8_transformer_config_kwargs", "validate_fp8_recipe"]

#: precision.fp8 values (Megatron-Core TransformerConfig.fp8)
FP8_FORMATS = ("e4m3", "hybrid")
#: precision.fp8_recipe values (Megatron-Core Fp8Recipe names)
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
#: GEMM dimension multiple TE needs per recipe (see the module docstring for the TE source of each)
FP8_ALIGNMENT = {"delayed": 16, "tensorwise": 16, "mxfp8": 32, "blockwise": 128}
#: oldest TE version Megatron-Core's get_fp8_recipe maps each recipe with (older TE: delayed only)
TE_MIN_VERSION = {"delayed": "1.7.0", "tensorwise": "2.2.0", "mxfp8": "2.1.0", "blockwise": "2.3.0"}
#: the Transformer Engine release moerl's contract tests parse (PyPI ``transformer-engine``)
TE_PINNED_VERSION = "2.20.2"
TE_INSTALL = "pip install transformer-engine[pytorch]"
#: TE availability function per recipe (transformer_engine.pytorch, TE >= 2.8), and the older name
_TE_CHECK = {"delayed": ("is_fp8_available", "check_fp8_support"),
             "tensorwise": ("is_fp8_available", "check_fp8_support"),
             "blockwise": ("is_fp8_block_scaling_available", "check_fp8_block_scaling_support"),
             "mxfp8": ("is_mxfp8_available", "check_mxfp8_support")}
_GPU_NEED = {"delayed": "compute capability 8.9+ (Ada, Hopper, Blackwell)",
             "tensorwise": "compute capability 8.9+ (Ada, Hopper, Blackwell)",
             "blockwise": "compute capability 9.0+ (Hopper) and CUDA 12.9+",
             "mxfp8": "compute capability 10.x (Blackwell)"}


def _gemm_dims(hf: Any, tp: int, etp: int) -> list[tuple[str, int]]:
    """(what, size per TP shard) of every GEMM dimension of a Qwen3-MoE-like HF config."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    qkv = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * head_dim
    dims = [("model.hf_config.hidden_size", hf.hidden_size),
            ("(num_attention_heads + 2 * num_key_value_heads) * head_dim / tp_size (fused QKV)", qkv // tp),
            ("num_attention_heads * head_dim / tp_size", hf.num_attention_heads * head_dim // tp),
            ("moe_intermediate_size / etp_size", hf.moe_intermediate_size // etp)]
    if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1 or not hf.num_experts:
        dims.append(("intermediate_size / tp_size", hf.intermediate_size // tp))
    return dims


def validate_fp8_recipe(precision: Any, *, hf_config: Any, params_dtype: str, tp_size: int = 1,
                        etp_size: Optional[int] = None, pp_size: int = 1,
                        token_dispatcher: str = "alltoall", layer_spec: str = "auto") -> None:
    """Check a recipe's FP8 keys against the model and layout (no import of TE or torch).

    Args:
        precision: the ``precision`` section (fp8, fp8_recipe, fp8_bf16_first_layers,
            fp8_bf16_last_layers); nothing is checked when ``precision.fp8`` is None.
        hf_config: the model's HF config section (hidden_size, num_attention_heads,
            num_key_value_heads, head_dim, moe_intermediate_size, intermediate_size, num_experts,
            num_hidden_layers, mlp_only_layers).
        params_dtype: ``model.params_dtype``.
        tp_size, etp_size, pp_size: parallel sizes (etp None = tp_size, Megatron's default).
        token_dispatcher: ``moe.token_dispatcher``.
        layer_spec: ``model.layer_spec``; FP8 needs Transformer Engine layers, so "local" is refused.
    Raises:
        ValueError: the first rule broken, naming the recipe key and the fix.
    """
    fp8 = getattr(precision, "fp8", None)
    if fp8 is None:
        if getattr(precision, "fp8_bf16_first_layers", 0) or getattr(precision, "fp8_bf16_last_layers", 0):
            raise ValueError("precision.fp8_bf16_first_layers / fp8_bf16_last_layers keep layers out of FP8 and "
                             "need precision.fp8 (e4m3 | hybrid); set them to 0 or enable precision.fp8")
        return
    recipe = precision.fp8_recipe
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"precision.fp8 must be null, e4m3 or hybrid, got {fp8!r}")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"precision.fp8_recipe must be one of {list(FP8_RECIPES)}, got {recipe!r}")
    if layer_spec == "local":
        raise ValueError(f"precision.fp8={fp8} runs on Transformer Engine layers; model.layer_spec=local builds "
                         "Megatron-Core's local spec, whose linears ignore FP8: set model.layer_spec=transformer_engine "
                         "(or auto)")
    if params_dtype != "bfloat16":
        raise ValueError(f"precision.fp8={fp8} runs FP8 GEMMs inside BF16 mixed precision (Megatron-Core bf16=True); "
                         f"set model.params_dtype=bfloat16 (got {params_dtype})")
    etp = tp_size if etp_size is None else etp_size
    align = FP8_ALIGNMENT[recipe]
    for what, size in _gemm_dims(hf_config, tp_size, etp):
        if size % align:
            raise ValueError(f"precision.fp8_recipe={recipe}: Transformer Engine needs every FP8 GEMM dimension "
                             f"(per tensor-parallel shard) to be a multiple of {align}, but {what} = {size}; "
                             f"change the model shape or parallel sizes, or pick a recipe with a smaller alignment "
                             f"({', '.join(f'{r}: {a}' for r, a in FP8_ALIGNMENT.items())})")
    first, last = int(precision.fp8_bf16_first_layers), int(precision.fp8_bf16_last_layers)
    if (first or last) and recipe == "delayed":
        raise ValueError("precision.fp8_bf16_first_layers / fp8_bf16_last_layers are not supported with "
                         "precision.fp8_recipe=delayed (Megatron-Core: delayed scaling does not support first / last "
                         "layers in BF16); use tensorwise, blockwise or mxfp8, or set them to 0")
    per_stage = hf_config.num_hidden_layers // max(1, pp_size)
    for key, n in (("fp8_bf16_first_layers", first), ("fp8_bf16_last_layers", last)):
        if n > per_stage:
            raise ValueError(f"precision.{key} ({n}) must be at most the layers of one pipeline stage "
                             f"({per_stage}; Megatron-Core's rule)")
    if hf_config.num_experts and token_dispatcher == "allgather":
        raise ValueError("precision.fp8 with MoE pads each expert's tokens to the FP8 alignment "
                         "(Megatron-Core moe_router_padding_for_quantization), which the allgather dispatcher does not "
                         "support; set moe.token_dispatcher=alltoall (or flex)")


def fp8_transformer_config_kwargs(precision: Any, *, num_experts: int = 0) -> dict[str, Any]:
    """Megatron-Core TransformerConfig fields for the recipe's ``precision`` section ({} without FP8).

    Returns: {fp8, fp8_recipe, first_last_layers_bf16, num_layers_at_start_in_bf16,
    num_layers_at_end_in_bf16, moe_router_dtype: "fp32"} plus ``moe_router_padding_for_quantization``
    when the model has experts. Call :func:`validate_fp8_recipe` first (this function maps only).
    """
    if precision is None or getattr(precision, "fp8", None) is None:
        return {}
    first, last = int(precision.fp8_bf16_first_layers), int(precision.fp8_bf16_last_layers)
    out: dict[str, Any] = dict(fp8=precision.fp8, fp8_recipe=precision.fp8_recipe,
                               first_last_layers_bf16=bool(first or last), num_layers_at_start_in_bf16=first,
                               num_layers_at_end_in_bf16=last, moe_router_dtype="fp32")
    if num_experts:
        out["moe_router_padding_for_quantization"] = True
    return out


def apply_fp8_transformer_config(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The TransformerConfig keyword arguments ``kwargs`` with FP8's companions made consistent;
    unchanged (a copy) when ``kwargs`` has no ``fp8``. moerl.models.qwen3_moe calls it on the
    arguments it builds the TransformerConfig from, so FP8 passed as config overrides (see
    :func:`fp8_transformer_config_kwargs`) always comes with: bf16, the router in FP32, expert
    padding for MoE, and the environment check (:func:`check_fp8_environment`).

    Raises:
        ValueError: fp8 without bf16=True, or the environment cannot run the recipe (message says
            what to install / which GPU is needed).
    """
    out = dict(kwargs)
    fp8 = out.get("fp8")
    if fp8 is None:
        return out
    recipe = out.get("fp8_recipe", "delayed")
    if not out.get("bf16"):
        raise ValueError(f"fp8={fp8!r} needs bf16=True (FP8 GEMMs inside BF16 mixed precision): set "
                         "model.params_dtype=bfloat16")
    out.setdefault("moe_router_dtype", "fp32")
    if out.get("num_moe_experts"):
        out.setdefault("moe_router_padding_for_quantization", True)
    check_fp8_environment(recipe)
    return out


#: Does moerl.models build Transformer Engine layers? Yes: build_gpt_model builds Megatron-Core's TE
#: layer spec (get_gpt_decoder_block_spec(..., use_transformer_engine=True)) when the config's
#: transformer_impl is "transformer_engine" (model.layer_spec: transformer_engine, or auto on a CUDA
#: machine with TE), and moerl.checkpoint.hf_convert maps its parameter names (TE_NAMES). FP8 needs that
#: spec: the local spec's linears ignore TransformerConfig.fp8. tests/test_te_fp8.py checks this flag
#: against the builder's source. Not run on a GPU yet (see the README's Precision section).
TE_LAYER_SPEC_BUILT = True


def check_fp8_training(recipe: str, layer_spec: str = "auto") -> None:
    """Everything ``moerl train`` checks for ``precision.fp8`` before any work: the machine
    (:func:`check_fp8_environment`: TE importable, CUDA GPU, the recipe on this GPU), then that the
    model is built with Transformer Engine layers (``model.layer_spec`` not "local"; FP8 would otherwise
    silently train in BF16).
    Raises: ValueError naming ``precision.fp8`` / ``model.layer_spec`` and the fix."""
    check_fp8_environment(recipe)
    if not TE_LAYER_SPEC_BUILT or layer_spec == "local":
        raise ValueError("precision.fp8 needs Transformer Engine layers (the local layer spec's linears ignore "
                         "TransformerConfig.fp8, so FP8 would silently train in BF16): set model.layer_spec="
                         "transformer_engine (or auto), or precision.fp8=null")


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) or "0"
        out.append(int(digits))
    return tuple(out)


def check_fp8_environment(recipe: str) -> None:
    """Can this machine train with ``precision.fp8_recipe=recipe``? (TE imported lazily, here only.)

    Order: Transformer Engine importable, a CUDA GPU, TE recent enough for the recipe
    (:data:`TE_MIN_VERSION`), and TE's own availability check for the recipe on this GPU.
    Raises:
        ValueError: the first unmet need, naming ``precision.fp8`` / ``precision.fp8_recipe``, what
            to install (``pip install transformer-engine[pytorch]``) or which GPU the recipe needs.
    """
    if recipe not in FP8_RECIPES:
        raise ValueError(f"precision.fp8_recipe must be one of {list(FP8_RECIPES)}, got {recipe!r}")
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch as te
    except Exception as e:  # ImportError, or TE's own load errors (no CUDA libraries)
        raise ValueError(f"precision.fp8 trains through NVIDIA Transformer Engine, which is not importable here "
                         f"({type(e).__name__}: {e}); install it with `{TE_INSTALL}` on a machine with a CUDA GPU "
                         f"(FP8 needs {_GPU_NEED['delayed']}), or set precision.fp8=null") from None
    import torch

    if not torch.cuda.is_available():
        raise ValueError("precision.fp8 needs a CUDA GPU (FP8 GEMMs run on Ada / Hopper / Blackwell tensor cores); "
                         "none is visible here: set precision.fp8=null to train on this machine")
    from importlib.metadata import PackageNotFoundError, version

    have = None
    for dist in ("transformer_engine", "transformer-engine"):
        try:
            have = version(dist)
            break
        except PackageNotFoundError:
            continue
    have = have or getattr(transformer_engine, "__version__", None)
    if have is not None and _version_tuple(have) < _version_tuple(TE_MIN_VERSION[recipe]):
        raise ValueError(f"precision.fp8_recipe={recipe} needs Transformer Engine >= {TE_MIN_VERSION[recipe]} "
                         f"(Megatron-Core maps it only from there); installed: {have}. Upgrade TE or pick another "
                         f"precision.fp8_recipe")
    new, old = _TE_CHECK[recipe]
    if hasattr(te, new):
        ok, reason = getattr(te, new)(return_reason=True)
    else:  # TE < 2.8: transformer_engine.pytorch.fp8.check_*_support() -> (bool, reason)
        from transformer_engine.pytorch import fp8 as te_fp8_mod

        ok, reason = getattr(te_fp8_mod, old)()
    if not ok:
        cc = ".".join(map(str, torch.cuda.get_device_capability()))
        raise ValueError(f"precision.fp8_recipe={recipe} needs {_GPU_NEED[recipe]}; this GPU "
                         f"({torch.cuda.get_device_name()}, compute capability {cc}) cannot run it: "
                         f"Transformer Engine says: {reason or 'not supported'}. Pick another precision.fp8_recipe")
