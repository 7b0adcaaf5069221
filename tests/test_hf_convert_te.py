"""HF <-> Megatron names for the Transformer Engine layer spec (``layer_spec="transformer_engine"``).

Independent references: a hand-written HF state dict of a tiny Qwen3-MoE (random tensors, names and
shapes from the HF layout, not from moerl's rules), the hand-written TE names of one MoE and one dense
layer, the local-spec conversion (tests/test_hf_convert.py checks it against transformers' logits),
and the Megatron-Core 0.16 / Transformer Engine 2.20.2 sources, PARSED (TE from the pinned wheel,
tests/_wheels.py; neither imported: TE needs CUDA) for every TE-side name moerl's rules use.
"""

from __future__ import annotations

import ast
import importlib.util
import zipfile
from pathlib import Path

import pytest
import torch

from moerl.checkpoint.hf_convert import (TE_NAMES, ShardLayout, conversion_rules, detect_layer_spec,
                                         hf_to_megatron, load_megatron_state_dict, megatron_to_hf,
                                         merge_megatron_shards, rename_layer_spec)
from moerl.models.qwen3_moe import make_hf_config
from moerl.precision import te_fp8

H, NH, NKV, D, E, I_MOE, I_DENSE, V = 16, 4, 2, 8, 4, 12, 20, 32


def _config(tied: bool):
    # layer 1 is dense (mlp_only_layers), layers 0 and 2 are MoE
    return make_hf_config(dict(num_hidden_layers=3, hidden_size=H, num_attention_heads=NH, num_key_value_heads=NKV,
                               head_dim=D, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I_MOE,
                               intermediate_size=I_DENSE, vocab_size=V, mlp_only_layers=[1],
                               tie_word_embeddings=tied))


def _hf_state_dict(tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    sd = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": r(H)}
    if not tied:
        sd["lm_head.weight"] = r(V, H)
    for l in range(3):
        p = f"model.layers.{l}."
        sd.update({p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
                   p + "self_attn.q_proj.weight": r(NH * D, H), p + "self_attn.k_proj.weight": r(NKV * D, H),
                   p + "self_attn.v_proj.weight": r(NKV * D, H), p + "self_attn.o_proj.weight": r(H, NH * D),
                   p + "self_attn.q_norm.weight": r(D), p + "self_attn.k_norm.weight": r(D)})
        if l == 1:
            sd.update({p + "mlp.gate_proj.weight": r(I_DENSE, H), p + "mlp.up_proj.weight": r(I_DENSE, H),
                       p + "mlp.down_proj.weight": r(H, I_DENSE)})
        else:
            sd[p + "mlp.gate.weight"] = r(E, H)
            for e in range(E):
                sd.update({p + f"mlp.experts.{e}.gate_proj.weight": r(I_MOE, H),
                           p + f"mlp.experts.{e}.up_proj.weight": r(I_MOE, H),
                           p + f"mlp.experts.{e}.down_proj.weight": r(H, I_MOE)})
    return sd


# the TE spec's names of layer 0 (MoE) and layer 1 (dense), written out by hand
TE_LAYER0 = {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
             "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
             "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight", "mlp.router.weight",
             *(f"mlp.experts.linear_fc{k}.weight{e}" for k in (1, 2) for e in range(E))}
TE_LAYER1 = {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
             "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
             "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
             "mlp.linear_fc2.weight"}


@pytest.mark.parametrize("tied", [False, True])
def test_te_names_and_exact_round_trip(tied):
    cfg, hf = _config(tied), _hf_state_dict(tied)
    te = hf_to_megatron(hf, cfg, layer_spec="transformer_engine")
    local = hf_to_megatron(hf, cfg)
    layer = lambda sd, l: {k[len(f"decoder.layers.{l}."):] for k in sd if k.startswith(f"decoder.layers.{l}.")}  # noqa
    assert layer(te, 0) == TE_LAYER0 == layer(te, 2) and layer(te, 1) == TE_LAYER1
    top = {k for k in te if not k.startswith("decoder.layers.")}
    assert top == {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"} | (
        set() if tied else {"output_layer.weight"})
    # the fused norms are the HF norms, the grouped expert weights the SequentialMLP ones
    assert torch.equal(te["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"],
                       hf["model.layers.0.input_layernorm.weight"])
    assert torch.equal(te["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                       hf["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(te["decoder.layers.2.pre_mlp_layernorm.weight"],
                       hf["model.layers.2.post_attention_layernorm.weight"])
    assert torch.equal(te["decoder.layers.2.mlp.experts.linear_fc1.weight3"],
                       torch.cat([hf["model.layers.2.mlp.experts.3.gate_proj.weight"],
                                  hf["model.layers.2.mlp.experts.3.up_proj.weight"]]))
    assert torch.equal(te["decoder.layers.0.mlp.experts.linear_fc2.weight1"],
                       local["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"])
    assert detect_layer_spec(te) == "transformer_engine" and detect_layer_spec(local) == "local"
    back = megatron_to_hf(te, cfg)  # the spec is read from the keys
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # the renaming (string rules) agrees with the conversion rules both ways, tensors untouched
    renamed = rename_layer_spec(local, "transformer_engine")
    assert set(renamed) == set(te) and all(renamed[k] is local[k2] for k2, k in zip(local, renamed))
    assert rename_layer_spec(te, "local").keys() == local.keys()
    with pytest.raises(ValueError, match="layer_spec must be one of"):
        conversion_rules(cfg, layer_spec="te")


@pytest.mark.parametrize("tp,ep,pp", [(2, 2, 1), (1, 2, 3), (2, 1, 2)])
def test_te_sharded_round_trip_and_local_expert_numbers(tp, ep, pp):
    cfg, hf = _config(False), _hf_state_dict(False, seed=1)
    shards = {}
    for t in range(tp):
        for e in range(ep):
            for p in range(pp):
                lay = ShardLayout(tp_size=tp, tp_rank=t, ep_size=ep, ep_rank=e, pp_size=pp, pp_rank=p,
                                  num_layers_in_first_pipeline_stage=2 if pp == 2 else None)
                sd = hf_to_megatron(hf, cfg, lay, layer_spec="transformer_engine")
                shards[lay] = sd
                local = hf_to_megatron(hf, cfg, lay)
                assert sd.keys() == rename_layer_spec(local, "transformer_engine").keys()
                experts = [k for k in sd if ".mlp.experts.linear_fc1.weight" in k]
                want = [str(j) for j in range(E // ep)] if any(k.endswith(".mlp.router.weight") for k in sd) else []
                assert sorted({k.rsplit("weight", 1)[1] for k in experts}) == want
                for k in experts:  # expert j of this rank = global expert e * E/ep + j, fc1 rows split over tp
                    j = int(k.rsplit("weight", 1)[1])
                    lk = k.replace("mlp.experts.linear_fc1.weight", "mlp.experts.local_experts.") + ".linear_fc1.weight"
                    assert torch.equal(sd[k], local[lk]) and sd[k].shape == (2 * I_MOE // tp, H), (k, j)
    back = merge_megatron_shards(shards, cfg)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_load_renames_local_names_into_a_te_model():
    """load_megatron_state_dict into a module with TE names, from hf_to_megatron's local names."""
    cfg, hf = _config(True), _hf_state_dict(True, seed=2)
    te = hf_to_megatron(hf, cfg, layer_spec="transformer_engine")

    root = torch.nn.Module()
    for key, t in te.items():
        mod = root
        *path, leaf = key.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t)))
    load_megatron_state_dict(root, hf_to_megatron(hf, cfg))
    got = root.state_dict()
    assert all(torch.equal(got[k], te[k]) for k in te)


# ------------------------------------------------------------------ contract: the upstream sources


def _mcore_tree(rel: str) -> ast.Module:
    base = Path(importlib.util.find_spec("megatron.core").submodule_search_locations[0])
    return ast.parse((base / rel).read_text())


def _fn(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _cls(tree: ast.AST, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _kwargs(call_tree: ast.AST, callee: str) -> list[dict[str, str]]:
    return [{k.arg: ast.unparse(k.value) for k in n.keywords} for n in ast.walk(call_tree)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == callee]


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    return {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}


def _registered(cls: ast.ClassDef) -> list[str]:
    """First arguments of self.register_parameter(...) calls in a class (unparsed)."""
    return [ast.unparse(n.args[0]) for n in ast.walk(cls) if isinstance(n, ast.Call)
            and ast.unparse(n.func) == "self.register_parameter" and n.args]


def test_contract_megatron_te_spec_module_names():
    specs = _mcore_tree("models/gpt/gpt_layer_specs.py")
    te_spec = _fn(specs, "get_gpt_layer_with_transformer_engine_spec")
    # the non-MLA branch: the layer has no input_layernorm (fused into linear_qkv), pre_mlp_layernorm only with experts
    layer = [kw for kw in _kwargs(te_spec, "TransformerLayerSubmodules") if "pre_mlp_layernorm" in kw]
    gqa = [kw for kw in layer if "SelfAttention" in kw["self_attention"] and "MLA" not in kw["self_attention"]]
    assert len(gqa) == 1 and "input_layernorm" not in gqa[0], layer
    assert gqa[0]["pre_mlp_layernorm"] == "backend.layer_norm() if num_experts else IdentityOp"
    attn = [kw for kw in _kwargs(te_spec, "SelfAttentionSubmodules")]
    assert len(attn) == 1 and attn[0]["linear_qkv"] == "backend.column_parallel_layer_norm_linear()"
    assert "qk_norm if qk_layernorm" in attn[0]["q_layernorm"] and "qk_norm if qk_layernorm" in attn[0]["k_layernorm"]
    # dense MLP: fc1 is the layernorm-linear when the backend fuses (TE does)
    mlp = ast.unparse(_fn(specs, "get_mlp_module_spec_for_backend"))
    assert "if backend.fuse_layernorm_and_linear():\n            linear_fc1 = backend.column_parallel_layer_norm_linear()" in mlp
    # TE backend: which classes
    prov = _cls(_mcore_tree("extensions/transformer_engine_spec_provider.py"), "TESpecProvider")
    returns = {f.name: [ast.unparse(r.value) for r in ast.walk(f) if isinstance(r, ast.Return) and r.value]
               for f in prov.body if isinstance(f, ast.FunctionDef)}
    assert returns["fuse_layernorm_and_linear"] == ["True"]
    assert returns["column_parallel_layer_norm_linear"] == ["TELayerNormColumnParallelLinear"]
    assert returns["grouped_mlp_modules"][0].startswith("(TEGroupedMLP, MLPSubmodules(linear_fc1="
                                                        "TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear")
    # module attribute names: layer.self_attention.linear_qkv, layer.pre_mlp_layernorm, layer.mlp, mlp.linear_fc1/2,
    # moe.router / moe.experts, TEGroupedMLP.linear_fc1/2
    assert {"self_attention", "pre_mlp_layernorm", "mlp"} <= _self_attrs(_cls(
        _mcore_tree("transformer/transformer_layer.py"), "TransformerLayer"))
    assert "linear_qkv" in _self_attrs(_cls(_mcore_tree("transformer/attention.py"), "SelfAttention"))
    assert {"linear_fc1", "linear_fc2"} <= _self_attrs(_cls(_mcore_tree("transformer/mlp.py"), "MLP"))
    assert {"linear_fc1", "linear_fc2"} <= _self_attrs(_cls(_mcore_tree("transformer/moe/experts.py"), "TEGroupedMLP"))
    assert {"router", "experts"} <= _self_attrs(_cls(_mcore_tree("transformer/moe/moe_layer.py"), "MoELayer"))
    # the TE wrappers' bases, and Megatron's grouped linear keeps TE's per-gemm weights (no single_grouped_weight)
    ext = _mcore_tree("extensions/transformer_engine.py")
    assert [ast.unparse(b) for b in _cls(ext, "TELayerNormColumnParallelLinear").bases] == ["te.pytorch.LayerNormLinear"]
    grouped = _cls(ext, "TEGroupedLinear")
    assert [ast.unparse(b) for b in grouped.bases] == ["te.pytorch.GroupedLinear"]
    assert "single_grouped_weight" not in ast.unparse(grouped)
    assert [ast.unparse(b) for b in _cls(ext, "TEColumnParallelGroupedLinear").bases] == ["TEGroupedLinear"]
    # every TE-side name moerl's rules use is one of these
    assert TE_NAMES == {"input_layernorm": "self_attention.linear_qkv.layer_norm_weight",
                        "dense_pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_weight",
                        "expert_fc1": "mlp.experts.linear_fc1.weight{e}",
                        "expert_fc2": "mlp.experts.linear_fc2.weight{e}"}


def test_contract_transformer_engine_parameter_names():
    from _wheels import cached_wheel

    files = {"lnl": "transformer_engine/pytorch/module/layernorm_linear.py",
             "grouped": "transformer_engine/pytorch/module/grouped_linear.py",
             "rmsnorm_op": "transformer_engine/pytorch/ops/basic/rmsnorm.py"}
    with zipfile.ZipFile(cached_wheel("transformer-engine", te_fp8.TE_PINNED_VERSION, "transformer_engine")) as zf:
        src = {k: ast.parse(zf.read(p).decode()) for k, p in files.items()}
    lnl = _cls(src["lnl"], "LayerNormLinear")
    regs = _registered(lnl)
    assert "'layer_norm_weight'" in regs and "'layer_norm_bias'" in regs  # the bias only for LayerNorm:
    body = ast.unparse(lnl)
    assert "if self.normalization != 'RMSNorm':" in body and "self.layer_norm_bias = None" in body
    assert "self.weight_names = ['weight']" in body  # the GEMM weight stays `weight` (no parameters_split)
    grouped = _cls(src["grouped"], "GroupedLinear")
    assert "f'weight{i}'" in _registered(grouped)
    init = next(f for f in grouped.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    defaults = dict(zip([a.arg for a in init.args.kwonlyargs], init.args.kw_defaults))
    args = [a.arg for a in init.args.args]
    pos_defaults = dict(zip(args[len(args) - len(init.args.defaults):], init.args.defaults))
    default = defaults.get("single_grouped_weight") or pos_defaults.get("single_grouped_weight")
    assert default is not None and ast.unparse(default) == "False"
    # TENorm(RMSNorm) for q/k/final/MoE pre-MLP norms: TE's RMSNorm op registers `weight`
    assert "'weight'" in _registered(_cls(src["rmsnorm_op"], "RMSNorm"))


def test_gpu_check_tool_cpu_dry_run(capsys):
    """tools/check_te_spec.py (the GPU check of the TE spec and FP8): on this machine it checks the local
    model's names against the rules and the exact round trip, and refuses the GPU part naming the install."""
    import importlib.util as iu

    path = Path(__file__).resolve().parents[1] / "tools" / "check_te_spec.py"
    spec = iu.spec_from_file_location("check_te_spec", path)
    tool = iu.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--cpu-dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ok   [local] 57 parameter names = moerl's conversion rules" in out and "HF -> model -> HF exact" in out
    assert tool.main([]) == 2
    assert "pip install transformer-engine[pytorch]" in capsys.readouterr().err
