"""Contract: moerl's FP8 rollout layout and block-shape rules against SGLang's own source.

The pinned SGLang wheel (moerl.rollout.client.SGLANG_VERSION, downloaded, never installed) is PARSED:
``Fp8Config.from_config`` must read the quantization_config keys moerl writes, ``Fp8LinearMethod`` must
register ``weight_scale_inv`` and raise the block-divisibility errors that
moerl.precision.fp8_checkpoint.sglang_fp8_shape_errors predicts (merged / column-parallel outputs by
block_n, row-parallel inputs by block_k at TP > 1; the MoE gate/up width per partition by block_n,
and by block_k at TP > 1), and the distributed update request must take ``load_format`` (moerl's gloo
FP8 buckets travel as "flattened_bucket"). Skipped, with the reason, when the wheel cannot be had.
"""

from __future__ import annotations

import ast
import zipfile

import pytest

from moerl.precision.fp8_checkpoint import fp8_quantization_config
from moerl.rollout import client as api

FP8 = "sglang/srt/layers/quantization/fp8.py"
IO = "sglang/srt/managers/io_struct.py"


@pytest.fixture(scope="module")
def src() -> dict[str, str]:
    from _wheels import cached_wheel

    with zipfile.ZipFile(cached_wheel("sglang", api.SGLANG_VERSION, "sglang")) as zf:
        return {p: zf.read(p).decode() for p in (FP8, IO)}


def _func(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return f
    raise KeyError(f"{cls}.{name} not in sglang {FP8}")


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_quantization_config_keys_are_read_by_sglang(src):
    tree = ast.parse(src[FP8])
    read = _strings(_func(tree, "Fp8Config", "from_config"))
    qc = fp8_quantization_config()
    assert {"quant_method", "activation_scheme", "weight_block_size"} <= read
    assert set(qc) - read == {"fmt"}  # fmt is informational (DeepSeek-V3's config has it; SGLang ignores it)
    assert qc["activation_scheme"] in _strings(tree)  # "dynamic": the only scheme block-wise FP8 allows
    init = _strings(_func(tree, "Fp8Config", "__init__"))
    assert any("block-wise quantization only supports dynamic activation" in s for s in init)


def test_block_shape_rules_match_sglang(src):
    tree = ast.parse(src[FP8])
    lin = ast.unparse(_func(tree, "Fp8LinearMethod", "validate_block_quant_shapes"))
    assert "input_size_per_partition % block_k" in lin and "tp_size > 1" in lin  # row parallel, TP > 1
    assert "output_partition_size % block_n" in lin and "len(output_partition_sizes) > 1" in lin  # merged
    moe = ast.unparse(_func(tree, "Fp8MoEMethod", "create_weights"))
    assert "intermediate_size_per_partition % block_n" in moe and "intermediate_size_per_partition % block_k" in moe
    assert "weight_scale_inv" in _strings(_func(tree, "Fp8LinearMethod", "create_weights"))


def test_distributed_update_takes_flattened_buckets(src):
    tree = ast.parse(src[IO])
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "UpdateWeightsFromDistributedReqInput")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert {"names", "dtypes", "shapes", "load_format"} <= fields
