"""GPU check of the Transformer Engine layer spec and FP8 training (model.layer_spec, precision.fp8).

For a tiny Qwen3-MoE (MoE and dense layers, untied, every GEMM dimension a multiple of 16) with random
HF weights, on one GPU with Transformer Engine:

1. for the local and the TE spec: the built model's parameter names equal moerl's conversion rules
   (``hf_to_megatron(..., layer_spec=...)``), the HF weights load, and ``megatron_to_hf`` of the loaded
   model gives them back bit for bit (in the model's dtype); the TE model also loads local names
   (``load_megatron_state_dict`` renames);
2. the TE model's logits equal the local model's within BF16 tolerance (same weights);
3. FP8 (``precision.fp8=hybrid``, ``--fp8-recipe``, default tensorwise) through Megatron-Core's TE
   integration: forward and backward run, logits stay near BF16's (the figure is printed), every
   expert / linear weight gets a finite gradient.

Prints one line per check and exits 1 at the first failure (2 without TE / CUDA, naming the install). ``--cpu-dry-run`` runs step 1 for the local
spec only (what a machine without TE/CUDA can do; tests/test_te_fp8.py runs it).

Usage: python tools/check_te_spec.py [--fp8-recipe tensorwise|delayed|blockwise|mxfp8] [--cpu-dry-run]
Sources: moerl.models.qwen3_moe.build_gpt_model, moerl.checkpoint.hf_convert, moerl.precision.te_fp8.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

FIELDS = dict(num_hidden_layers=3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=256,
              vocab_size=256, mlp_only_layers=[1], tie_word_embeddings=False, max_position_embeddings=128)


def _fail(msg: str) -> None:
    print(f"FAIL {msg}", flush=True)
    raise SystemExit(1)


def _hf_weights(hf_config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random on-disk HF tensors (norms around 1, router non-trivial) from transformers' own model."""
    from transformers import Qwen3MoeForCausalLM

    from moerl.checkpoint.hf_convert import fused_experts_to_per_expert

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_config).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale, base = (0.3, 1.0) if "norm" in name else ((0.5, 0.0) if name.endswith("mlp.gate.weight") else (0.08, 0.0))
            p.copy_(base + scale * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in fused_experts_to_per_expert(model.state_dict(), hf_config).items()}


def _build(hf_config, spec: str, dtype: torch.dtype, **overrides):
    from moerl.models.qwen3_moe import build_gpt_model, transformer_config_from_hf

    cfg = transformer_config_from_hf(hf_config, params_dtype=dtype, tp_size=1, pp_size=1, ep_size=1,
                                     layer_spec=spec, **overrides)
    return build_gpt_model(hf_config, cfg)


def _logits(model, tokens):
    from moerl.models.qwen3_moe import causal_attention_mask

    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, pos, causal_attention_mask(tokens.shape[1], device=tokens.device))


def check_names_and_round_trip(hf_config, hf_sd, spec: str, dtype: torch.dtype):
    """Step 1 for one spec; returns the loaded model."""
    from moerl.checkpoint.hf_convert import hf_to_megatron, load_megatron_state_dict, megatron_to_hf

    model = _build(hf_config, spec, dtype)
    names = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    conv = hf_to_megatron(hf_sd, hf_config, layer_spec=spec)
    if names != set(conv):
        _fail(f"[{spec}] model names != conversion rules: model only {sorted(names - set(conv))[:8]}, "
              f"rules only {sorted(set(conv) - names)[:8]}")
    print(f"ok   [{spec}] {len(names)} parameter names = moerl's conversion rules", flush=True)
    load_megatron_state_dict(model, conv)
    back = megatron_to_hf(model.state_dict(), hf_config)
    bad = [k for k in hf_sd if not torch.equal(back[k].cpu(), hf_sd[k].to(back[k].dtype))]
    if set(back) != set(hf_sd) or bad:
        _fail(f"[{spec}] HF -> model -> HF not exact: {bad[:8]}, key sets equal: {set(back) == set(hf_sd)}")
    print(f"ok   [{spec}] HF -> model -> HF exact ({len(back)} tensors, params {dtype}, cast to each tensor's "
          "dtype)", flush=True)
    if spec == "transformer_engine":
        load_megatron_state_dict(model, hf_to_megatron(hf_sd, hf_config))  # local names, renamed on load
        back = megatron_to_hf(model.state_dict(), hf_config)
        if not all(torch.equal(back[k].cpu(), hf_sd[k].to(back[k].dtype)) for k in hf_sd):
            _fail("[transformer_engine] loading local names (renamed) changed the weights")
        print("ok   [transformer_engine] local names load into the TE model (renamed)", flush=True)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8-recipe", default="tensorwise", choices=["delayed", "tensorwise", "blockwise", "mxfp8"])
    ap.add_argument("--cpu-dry-run", action="store_true", help="local spec, step 1 only (no TE / CUDA needed)")
    args = ap.parse_args(argv)

    from moerl.models.qwen3_moe import make_hf_config, resolve_layer_spec
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    if not args.cpu_dry_run:
        try:
            resolve_layer_spec("transformer_engine")  # TE importable and CUDA, else the install hint
        except ValueError as e:
            print(f"check_te_spec: {e}", file=sys.stderr)
            return 2
    hf_config = make_hf_config(FIELDS)
    hf_sd = _hf_weights(hf_config)
    init_distributed(seed=0, num_threads=None if torch.cuda.is_available() else 2)
    try:
        dtype = torch.bfloat16
        local = check_names_and_round_trip(hf_config, hf_sd, "local", dtype)
        if args.cpu_dry_run:
            return 0
        te = check_names_and_round_trip(hf_config, hf_sd, "transformer_engine", dtype)
        tokens = torch.randint(0, FIELDS["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(3)).cuda()
        with torch.no_grad():
            ref, got = _logits(local.eval(), tokens).float(), _logits(te.eval(), tokens).float()
        diff, scale = (got - ref).abs().max().item(), ref.abs().max().item()
        print(f"{'ok  ' if diff <= 0.05 * scale else 'FAIL'} TE vs local logits (BF16): max |diff| {diff:.4g} "
              f"(max |logit| {scale:.4g}, tolerance 5%)", flush=True)
        if diff > 0.05 * scale:
            return 1
        del local
        from moerl.checkpoint.hf_convert import hf_to_megatron, load_megatron_state_dict
        from moerl.precision.te_fp8 import fp8_transformer_config_kwargs, validate_fp8_recipe

        prec = SimpleNamespace(fp8="hybrid", fp8_recipe=args.fp8_recipe, fp8_bf16_first_layers=0,
                               fp8_bf16_last_layers=0)
        validate_fp8_recipe(prec, hf_config=hf_config, params_dtype="bfloat16", layer_spec="transformer_engine")
        fp8 = _build(hf_config, "transformer_engine", dtype,
                     **fp8_transformer_config_kwargs(prec, num_experts=FIELDS["num_experts"]))
        load_megatron_state_dict(fp8, hf_to_megatron(hf_sd, hf_config, layer_spec="transformer_engine"))
        fp8.train()
        out = _logits(fp8, tokens)
        out.float().logsumexp(-1).mean().backward()
        fdiff = (out.detach().float() - got).abs().max().item()
        grads = {n: p.grad for n, p in fp8.named_parameters() if "weight" in n}
        missing = [n for n, gr in grads.items() if gr is None or not torch.isfinite(gr).all()]
        print(f"{'ok  ' if not missing else 'FAIL'} FP8 hybrid/{args.fp8_recipe} forward+backward: max |logit - BF16| "
              f"{fdiff:.4g} (max |logit| {scale:.4g}); weights without a finite gradient: {missing[:8]}", flush=True)
        return 1 if missing else 0
    finally:
        destroy_distributed()


if __name__ == "__main__":
    raise SystemExit(main())
