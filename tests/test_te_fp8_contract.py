"""Contract tests: every Transformer Engine and Megatron-Core name and argument moerl's FP8 training uses exists.

References: Megatron-Core as installed (TransformerConfig's dataclass fields and their Literal
values; the source of ``megatron.core.fp8_utils.get_fp8_recipe``, parsed), and the Transformer
Engine release moerl pins (moerl.precision.te_fp8.TE_PINNED_VERSION), fetched as a wheel with
``pip download --no-deps`` (tests/_wheels.py, cached) and PARSED with ast, never installed (TE needs
CUDA). Skipped, with the reason, only when the wheel cannot be downloaded.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
import zipfile
from types import SimpleNamespace

import pytest

from moerl.precision import te_fp8


@pytest.fixture(scope="module")
def te_src() -> dict[str, ast.Module]:
    from _wheels import cached_wheel

    files = {"recipe": "transformer_engine/common/recipe/__init__.py",
             "pytorch": "transformer_engine/pytorch/__init__.py",
             "quantization": "transformer_engine/pytorch/quantization.py",
             "fp8": "transformer_engine/pytorch/fp8.py",
             "constants": "transformer_engine/pytorch/constants.py",
             "utils": "transformer_engine/pytorch/utils.py",
             "blockwise": "transformer_engine/pytorch/tensor/float8_blockwise_tensor.py",
             "top": "transformer_engine/__init__.py"}
    with zipfile.ZipFile(cached_wheel("transformer-engine", te_fp8.TE_PINNED_VERSION, "transformer_engine")) as zf:
        return {k: ast.parse(zf.read(p).decode()) for k, p in files.items()}


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _imported(tree: ast.Module) -> set[str]:
    return {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_megatron_transformer_config_has_every_field_and_value_moerl_passes():
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    prec = SimpleNamespace(fp8="hybrid", fp8_recipe="blockwise", fp8_bf16_first_layers=1, fp8_bf16_last_layers=1)
    passed = te_fp8.fp8_transformer_config_kwargs(prec, num_experts=8)
    assert set(passed) <= set(fields), set(passed) - set(fields)

    def literal_values(name):
        args = set()
        for a in typing.get_args(typing.get_type_hints(TransformerConfig)[name]):
            args |= set(typing.get_args(a)) if typing.get_origin(a) is typing.Literal else {a}
        return args

    assert set(te_fp8.FP8_FORMATS) <= literal_values("fp8")
    assert set(te_fp8.FP8_RECIPES) <= literal_values("fp8_recipe")
    assert "fp32" in literal_values("moe_router_dtype")


def test_megatron_maps_each_recipe_to_a_te_class_that_exists(te_src):
    """get_fp8_recipe's branches: Fp8Recipe.<moerl recipe> -> transformer_engine.common.recipe.<Class>
    (delayed through Megatron's TEDelayedScaling, a DelayedScaling subclass); each class and the two
    Format members exist in the pinned TE; the TE versions Megatron gates them on are moerl's."""
    from megatron.core import fp8_utils
    from megatron.core.enums import Fp8Recipe

    src = inspect.getsource(fp8_utils)
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "get_fp8_recipe")
    body = ast.unparse(fn)
    want = {"delayed": "TEDelayedScaling", "tensorwise": "Float8CurrentScaling", "blockwise": "Float8BlockScaling",
            "mxfp8": "MXFP8BlockScaling"}
    for recipe, cls in want.items():
        assert recipe in {r.value for r in Fp8Recipe}
        assert f"Fp8Recipe.{recipe}" in body and cls in body
    classes = {n.name for n in te_src["recipe"].body if isinstance(n, ast.ClassDef)}
    assert {"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "Format"} <= classes
    fmt = next(n for n in te_src["recipe"].body if isinstance(n, ast.ClassDef) and n.name == "Format")
    members = {t.id for n in fmt.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert {"E4M3", "HYBRID"} <= members and "Format.E4M3" in body and "Format.HYBRID" in body
    for recipe, dev in (("tensorwise", "2.2.0.dev0"), ("blockwise", "2.3.0.dev0")):
        assert f"Fp8Recipe.{recipe} and is_te_min_version('{dev}')" in body
        assert te_fp8.TE_MIN_VERSION[recipe] == dev.replace(".dev0", "")
    from megatron.core.transformer import transformer_config

    assert 'is_te_min_version("1.7.0.dev0")' in inspect.getsource(transformer_config)  # MoE FP8
    assert te_fp8.TE_MIN_VERSION["delayed"] == "1.7.0"


def test_te_availability_functions_moerl_calls_exist(te_src):
    """transformer_engine.pytorch exports is_*_available(return_reason=...) (TE >= 2.8) and
    transformer_engine.pytorch.fp8 still re-exports the older check_*_support() names."""
    q = _functions(te_src["quantization"])
    exported = _imported(te_src["pytorch"])
    fp8_reexports = _imported(te_src["fp8"])
    for new, old in te_fp8._TE_CHECK.values():
        assert new in exported and new in q, new
        assert "return_reason" in [a.arg for a in q[new].args.args], new
        assert old in q and old in fp8_reexports, old
    assert any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in n.targets)
               for n in te_src["top"].body)


def test_alignment_table_is_tes(te_src):
    """16: assert_dim_for_fp8_exec's ``% 16`` on the last dim; 32: MXFP8_BLOCK_SCALING_SIZE;
    128: Float8BlockQuantizer's block_len."""
    const = {t.id: n.value.value for n in te_src["constants"].body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    assert const["MXFP8_BLOCK_SCALING_SIZE"] == te_fp8.FP8_ALIGNMENT["mxfp8"] == 32
    check = ast.unparse(_functions(te_src["utils"])["assert_dim_for_fp8_exec"])
    assert "tensor.shape[-1] % 16 != 0" in check and te_fp8.FP8_ALIGNMENT["delayed"] == te_fp8.FP8_ALIGNMENT[
        "tensorwise"] == 16
    quant = next(n for n in te_src["blockwise"].body if isinstance(n, ast.ClassDef) and n.name == "Float8BlockQuantizer")
    assert "self.block_len = 128" in ast.unparse(quant) and te_fp8.FP8_ALIGNMENT["blockwise"] == 128
