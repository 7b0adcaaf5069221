"""FP8 training keys (precision.*) -> Megatron-Core TransformerConfig, and the rules checked before any work.

Independent references: hand-worked GEMM dimensions of the recipes' models, Megatron-Core's own
TransformerConfig validation (the same rule refused by Megatron), the moerl CLI's exit code and
message on this CPU machine (no Transformer Engine), and the source of moerl's model builder.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from moerl.config.loader import ConfigError, load_config
from moerl.precision.te_fp8 import (FP8_ALIGNMENT, TE_LAYER_SPEC_BUILT, apply_fp8_transformer_config,
                                    fp8_transformer_config_kwargs, validate_fp8_recipe)

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_arith.yaml")
BF16 = ["model.params_dtype=bfloat16"]


def _load(*ov):
    return load_config(TINY, list(ov))


def test_recipe_keys_default_off_and_map_onto_megatron_fields():
    cfg = _load()
    assert cfg.precision.fp8 is None and fp8_transformer_config_kwargs(cfg.precision) == {}
    cfg = _load(*BF16, "precision.fp8=hybrid", "precision.fp8_recipe=tensorwise", "precision.fp8_bf16_last_layers=1")
    assert fp8_transformer_config_kwargs(cfg.precision, num_experts=8) == {
        "fp8": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 0,
        "num_layers_at_end_in_bf16": 1, "moe_router_dtype": "fp32", "moe_router_padding_for_quantization": True}
    from moerl.moe.config import moe_actor_kwargs
    from moerl.train.components import actor_kwargs

    over = actor_kwargs(cfg, moe_actor_kwargs(cfg))["config_overrides"]
    assert over["fp8"] == "hybrid" and over["fp8_recipe"] == "tensorwise" and over["moe_router_dtype"] == "fp32"


@pytest.mark.parametrize("overrides,message", [
    (["precision.fp8=e4m3"], "model.params_dtype=bfloat16"),
    (["precision.fp8_bf16_first_layers=1"], "need precision.fp8"),
    ([*BF16, "precision.fp8=e4m3", "precision.fp8_bf16_first_layers=1"], "not supported with precision.fp8_recipe=delayed"),
    ([*BF16, "precision.fp8=e4m3", "precision.fp8_recipe=tensorwise", "precision.fp8_bf16_last_layers=4"],
     r"at most the layers of one pipeline stage \(3"),
    ([*BF16, "precision.fp8=e4m3", "moe.token_dispatcher=allgather"], "moe.token_dispatcher=alltoall"),
    # tiny_arith: hidden 128, 4 heads x 32, 2 KV heads, experts 128 wide. tp=2: attention output
    # projection 4*32/2 = 64 columns per shard, not a multiple of blockwise's 128 (fine for 16 / 32)
    ([*BF16, "precision.fp8=e4m3", "precision.fp8_recipe=blockwise", "parallel.tp_size=2"],
     r"multiple of 128, but num_attention_heads \* head_dim / tp_size = 64"),
    ([*BF16, "precision.fp8=e4m3", "model.hf_config.hidden_size=120"], r"multiple of 16, but model.hf_config.hidden_size = 120"),
    ([*BF16, "precision.fp8=e4m3", "precision.fp8_recipe=mxfp8", "model.hf_config.moe_intermediate_size=48"],
     r"multiple of 32, but moe_intermediate_size / etp_size = 48"),
])
def test_bad_fp8_recipes_fail_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_good_fp8_recipes_load_on_cpu(recipe):
    """Shape rules only at load time (moerl plan checks GPU recipes on CPU). tiny_arith at tp=1: fused
    QKV (4 + 2*2) * 32 = 256, output projection 128, hidden 128, experts 128: multiples of 128."""
    cfg = _load(*BF16, "precision.fp8=e4m3", f"precision.fp8_recipe={recipe}")
    assert cfg.precision.fp8_recipe == recipe and FP8_ALIGNMENT[recipe] <= 128


def test_alignment_rule_on_the_30b_recipe_hand_worked():
    """Qwen3-30B-A3B: hidden 2048, 32 heads x 128, 4 KV heads, experts 768 wide. etp=8 gives
    768/8 = 96 per shard: a multiple of 16 and 32 but not of 128."""
    hf = SimpleNamespace(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_hidden_layers=48,
                         mlp_only_layers=[], decoder_sparse_step=1)
    for recipe in ("delayed", "tensorwise", "mxfp8"):
        validate_fp8_recipe(SimpleNamespace(fp8="e4m3", fp8_recipe=recipe, fp8_bf16_first_layers=0,
                                            fp8_bf16_last_layers=0), hf_config=hf, params_dtype="bfloat16",
                            tp_size=1, etp_size=8)
    with pytest.raises(ValueError, match=r"moe_intermediate_size / etp_size = 96"):
        validate_fp8_recipe(SimpleNamespace(fp8="e4m3", fp8_recipe="blockwise", fp8_bf16_first_layers=0,
                                            fp8_bf16_last_layers=0), hf_config=hf, params_dtype="bfloat16",
                            tp_size=1, etp_size=8)


def test_megatron_itself_refuses_what_moerl_refuses():
    """Megatron-Core's TransformerConfig rejects BF16 first/last layers with delayed scaling and accepts
    moerl's mapping for a tensorwise recipe (dense model: no TE needed to construct the config)."""
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=4, hidden_size=128, num_attention_heads=4, bf16=True)
    prec = SimpleNamespace(fp8="e4m3", fp8_recipe="tensorwise", fp8_bf16_first_layers=1, fp8_bf16_last_layers=1)
    tc = TransformerConfig(**base, **fp8_transformer_config_kwargs(prec))
    assert (tc.fp8, tc.fp8_recipe, tc.first_last_layers_bf16, tc.num_layers_at_start_in_bf16) == ("e4m3", "tensorwise",
                                                                                                 True, 1)
    with pytest.raises(ValueError, match="Delayed scaling does not support first / last layer in BF16"):
        TransformerConfig(**base, **fp8_transformer_config_kwargs(SimpleNamespace(**{**vars(prec),
                                                                                     "fp8_recipe": "delayed"})))
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(fp8_transformer_config_kwargs(prec, num_experts=8)) <= names


def test_cpu_machine_refuses_fp8_before_any_work(tmp_path, capsys):
    """moerl train exits 2 naming what to install (no Transformer Engine here) and writes nothing."""
    from moerl.cli import main

    out = tmp_path / "run"
    code = main(["train", TINY, *BF16, "precision.fp8=e4m3", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install transformer-engine[pytorch]" in err and "CUDA GPU" in err, err
    assert "precision.fp8" in err and not out.exists()
    with pytest.raises(ValueError, match=r"pip install transformer-engine\[pytorch\]"):
        apply_fp8_transformer_config({"fp8": "e4m3", "fp8_recipe": "delayed", "bf16": True})
    with pytest.raises(ValueError, match="needs bf16=True"):
        apply_fp8_transformer_config({"fp8": "e4m3", "bf16": False})
    assert apply_fp8_transformer_config({"bf16": False, "hidden_size": 8}) == {"bf16": False, "hidden_size": 8}


def test_te_layer_spec_flag_matches_the_model_builder():
    """TE_LAYER_SPEC_BUILT (which lets moerl train accept FP8) must say what build_gpt_model does: it calls
    get_gpt_decoder_block_spec with use_transformer_engine=True (the TE branch, never wrapped with moerl's
    packed core attention) as well as False (the local branch, wrapped)."""
    # build_gpt_model (moerl.models.gpt) takes the layer spec from the model family; the GQA families
    # (Qwen3-MoE, Mixtral) build it in moerl.models.families.common.gpt_block_spec (issue #16)
    tree = ast.parse((REPO / "moerl" / "models" / "families" / "common.py").read_text())
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "gpt_block_spec")
    calls = [n for n in ast.walk(build) if isinstance(n, ast.Call) and getattr(n.func, "id", None) ==
             "get_gpt_decoder_block_spec"]
    assert calls, "build_gpt_model no longer calls get_gpt_decoder_block_spec: update te_fp8.TE_LAYER_SPEC_BUILT"
    values = {kw.value.value for c in calls for kw in c.keywords
              if kw.arg == "use_transformer_engine" and isinstance(kw.value, ast.Constant)}
    assert values == ({True, False} if TE_LAYER_SPEC_BUILT else {False}), (values, TE_LAYER_SPEC_BUILT)
    branches = [n for n in ast.walk(build) if isinstance(n, ast.If) and "transformer_engine" in ast.unparse(n.test)]
    te_branch = ast.unparse(ast.Module(body=branches[0].body, type_ignores=[]))
    assert "use_transformer_engine=True" in te_branch and "with_packed_core_attention" not in te_branch
    assert "normalization='RMSNorm'" in te_branch
    assert os.path.exists(REPO / "moerl" / "precision" / "te_fp8.py")


def test_layer_spec_key_on_a_cpu_machine(tmp_path, capsys, dist):
    """model.layer_spec: auto resolves to local here (no TE, no CUDA); transformer_engine makes moerl train
    exit 2 naming what to install before any work; precision.fp8 with layer_spec=local is a recipe error; the TE
    TransformerConfig (built without TE) selects TEGroupedMLP experts; the builder refuses it here, clearly."""
    import torch

    from moerl.cli import main
    from moerl.models.qwen3_moe import build_gpt_model, make_hf_config, resolve_layer_spec, transformer_config_from_hf

    assert _load().model.layer_spec == "auto" and resolve_layer_spec("auto") == "local" == resolve_layer_spec("local")
    with pytest.raises(ValueError, match=r"model.layer_spec=transformer_engine .*pip install transformer-engine\[pytorch\]"):
        resolve_layer_spec("transformer_engine")
    out = tmp_path / "run"
    code = main(["train", TINY, "model.layer_spec=transformer_engine", f"output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and "model.layer_spec" in err and "pip install transformer-engine[pytorch]" in err, err
    assert not out.exists()
    with pytest.raises(ConfigError, match="model.layer_spec"):
        _load("model.layer_spec=te")
    with pytest.raises(ConfigError, match="model.layer_spec=transformer_engine"):
        _load(*BF16, "precision.fp8=e4m3", "model.layer_spec=local")
    hf = make_hf_config(dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, vocab_size=64))
    local = transformer_config_from_hf(hf, tp_size=1, pp_size=1, ep_size=1)
    assert local.transformer_impl == "local" and local.moe_grouped_gemm is False
    te = transformer_config_from_hf(hf, tp_size=1, pp_size=1, ep_size=1, transformer_impl="transformer_engine")
    assert te.transformer_impl == "transformer_engine" and te.moe_grouped_gemm is True
    assert transformer_config_from_hf(hf, tp_size=1, pp_size=1, ep_size=1, layer_spec="auto").transformer_impl == "local"
    with pytest.raises(ValueError, match=r"pip install transformer-engine\[pytorch\]"):
        build_gpt_model(hf, te)
    model = build_gpt_model(hf, local)  # the local path is unchanged: its names are the local spec's
    names = {n for n, _ in model.named_parameters()}
    assert "decoder.layers.0.input_layernorm.weight" in names and all("layer_norm_weight" not in n for n in names)
    assert isinstance(next(model.parameters()), torch.Tensor)
