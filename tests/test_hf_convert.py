"""Qwen3-MoE: transformers <-> Megatron-Core GPTModel conversion, HF checkpoint I/O and
Megatron distributed checkpoints (moerl.models.qwen3_moe, moerl.checkpoint.*).

The reference is transformers' own Qwen3MoeForCausalLM forward on the same weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _mp_helpers as h  # noqa: E402

from moerl.checkpoint import hf_convert  # noqa: E402
from moerl.checkpoint.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint  # noqa: E402
from moerl.checkpoint.hf_convert import (  # noqa: E402
    fused_experts_to_per_expert,
    hf_to_megatron,
    load_megatron_state_dict,
    megatron_to_hf,
)
from moerl.checkpoint.hf_io import load_hf_state_dict, save_hf_checkpoint  # noqa: E402
from moerl.models.qwen3_moe import (  # noqa: E402
    build_gpt_model,
    causal_attention_mask,
    hf_num_experts,
    hf_rope_theta,
    make_hf_config,
    transformer_config_from_hf,
)

FIELDS = dict(h.TINY_FIELDS, vocab_size=100, rope_theta=5000.0)
ATOL = 1e-4


def random_hf_model(seed=0, **changes):
    """A tiny fp32 transformers Qwen3-MoE in eval mode with non-trivial weights everywhere
    (transformers initialises the router to zeros and norms to ones, which would hide mapping
    mistakes: ties in routing, norms that do nothing)."""
    from transformers import Qwen3MoeForCausalLM

    config = make_hf_config({**FIELDS, **changes})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float().eval()
    randomize_weights_(model, seed)
    return model


def randomize_weights_(model, seed: int, router_suffix: str = "mlp.gate.weight") -> torch.Generator:
    """Non-trivial weights, in place, for a transformers MoE model: norms 1 + 0.3 N(0, 1), router weights
    (names ending in ``router_suffix``) 0.5 N(0, 1) so routing logits are spread out, everything else
    0.08 N(0, 1), drawn from a generator seeded ``seed + 1``; returns that generator (for buffers)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(router_suffix):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return g


def batch(vocab, b=3, s=11, seed=7):
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(s).unsqueeze(0).expand(b, s)


def megatron_logits(model, tokens, position_ids):
    with torch.no_grad():
        return model(tokens, position_ids, causal_attention_mask(tokens.shape[1]))


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def on_disk_state_dict(hf_model) -> dict:
    """What save_pretrained writes: per-expert keys, no lm_head for tied embeddings."""
    sd = fused_experts_to_per_expert(hf_model.state_dict(), hf_model.config)
    if hf_model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


CASES = [
    pytest.param(dict(tie_word_embeddings=False, norm_topk_prob=True), id="untied-normtopk"),
    pytest.param(dict(tie_word_embeddings=True, norm_topk_prob=True), id="tied-normtopk"),
    pytest.param(dict(tie_word_embeddings=False, norm_topk_prob=False), id="untied-no-normtopk"),
    pytest.param(dict(tie_word_embeddings=True, norm_topk_prob=False, mlp_only_layers=[0]), id="tied-dense-layer0"),
]


@pytest.mark.parametrize("changes", CASES)
def test_logits_match_transformers_and_round_trip_is_exact(dist, changes):
    ref = random_hf_model(**changes)
    cfg = ref.config
    model = build_gpt_model(cfg).eval()
    assert model.share_embeddings_and_output_weights == cfg.tie_word_embeddings
    assert model.embedding.word_embeddings.weight.shape[0] == cfg.vocab_size

    # transformers 5 fused in-memory keys
    load_megatron_state_dict(model, hf_to_megatron(ref.state_dict(), cfg))
    tokens, pos = batch(cfg.vocab_size)
    ours, theirs = megatron_logits(model, tokens, pos), hf_logits(ref, tokens)
    assert ours.shape == theirs.shape == (*tokens.shape, cfg.vocab_size)
    assert theirs.abs().max() > 1.0  # logits are not trivially small
    assert (ours - theirs).abs().max().item() <= ATOL

    # Megatron -> HF on-disk names: every tensor bitwise equal, nothing missing or extra
    expected = on_disk_state_dict(ref)
    exported = megatron_to_hf(model.state_dict(), cfg)
    assert set(exported) == set(expected)
    assert ("lm_head.weight" in exported) == (not cfg.tie_word_embeddings)
    for key, value in expected.items():
        assert torch.equal(exported[key], value), key
    if changes.get("mlp_only_layers"):
        assert "model.layers.0.mlp.gate_proj.weight" in exported
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in exported

    # per-expert on-disk keys convert to the same Megatron tensors as the fused ones
    from_disk = hf_to_megatron(expected, cfg)
    from_memory = hf_to_megatron(ref.state_dict(), cfg)
    assert set(from_disk) == set(from_memory)
    assert all(torch.equal(from_disk[k], from_memory[k]) for k in from_disk)


def _swap_gate_up(tensors, cfg):
    gate, up = tensors
    return torch.cat([up, gate], dim=0)


@pytest.mark.parametrize(
    "corruption",
    ["qkv_not_grouped", "fc1_up_first", "router_pre_softmax_flipped"],
)
def test_known_mapping_mistakes_are_visible(dist, monkeypatch, corruption):
    """The logit comparison is sensitive to each mistake listed in CPU_MEGATRON.md."""
    ref = random_hf_model()
    cfg = ref.config
    overrides = {}
    if corruption == "qkv_not_grouped":
        monkeypatch.setitem(
            hf_convert._PACKERS, "qkv", (lambda t, c: torch.cat(t, dim=0), hf_convert._PACKERS["qkv"][1])
        )
    elif corruption == "fc1_up_first":
        monkeypatch.setitem(hf_convert._PACKERS, "gate_up", (_swap_gate_up, hf_convert._PACKERS["gate_up"][1]))
    else:
        overrides["moe_router_pre_softmax"] = cfg.norm_topk_prob  # the wrong way round
    model = build_gpt_model(cfg, **overrides).eval()
    load_megatron_state_dict(model, hf_to_megatron(ref.state_dict(), cfg))
    tokens, pos = batch(cfg.vocab_size)
    diff = (megatron_logits(model, tokens, pos) - hf_logits(ref, tokens)).abs().max().item()
    assert diff > 100 * ATOL


def test_save_hf_checkpoint_loads_with_from_pretrained(dist, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    ref = random_hf_model(seed=3, tie_word_embeddings=True)
    cfg = ref.config
    model = build_gpt_model(cfg).eval()
    load_megatron_state_dict(model, hf_to_megatron(ref.state_dict(), cfg))
    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    raw = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")

    out = tmp_path / "hf"
    save_hf_checkpoint(megatron_to_hf(model.state_dict(), cfg), cfg, out, tokenizer=tokenizer)
    # writing again replaces the directory atomically and leaves no temporary directories
    save_hf_checkpoint(megatron_to_hf(model.state_dict(), cfg), cfg, out, tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert (out / "model.safetensors").exists()
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config_json["model_type"] == "qwen3_moe"

    on_disk = load_hf_state_dict(out)
    assert set(on_disk) == set(on_disk_state_dict(ref))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk and "lm_head.weight" not in on_disk

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens, pos = batch(cfg.vocab_size, seed=11)
    reloaded_logits = hf_logits(loaded, tokens)
    assert torch.equal(reloaded_logits, hf_logits(ref, tokens))
    assert (reloaded_logits - megatron_logits(model, tokens, pos)).abs().max().item() <= ATOL
    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"] == [1, 2]


def test_sharded_hf_checkpoint_round_trip(tmp_path):
    ref = random_hf_model(seed=4)
    sd = on_disk_state_dict(ref)
    save_hf_checkpoint(sd, ref.config, tmp_path / "sharded", max_shard_size=20_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    back = load_hf_state_dict(tmp_path / "sharded")
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(FileNotFoundError):
        load_hf_state_dict(tmp_path)


def test_conversion_errors_name_the_problem(dist):
    ref = random_hf_model()
    cfg = ref.config
    sd = on_disk_state_dict(ref)
    missing = dict(sd)
    missing.pop("model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(ValueError, match="k_norm"):
        hf_to_megatron(missing, cfg)
    extra = dict(sd, **{"model.layers.9.mlp.gate.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="layers.9"):
        hf_to_megatron(extra, cfg)
    wrong_shape = dict(sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(ValueError, match="k_proj"):
        hf_to_megatron(wrong_shape, cfg)
    tied = random_hf_model(tie_word_embeddings=True)
    bad_tie = dict(tied.state_dict())
    bad_tie["lm_head.weight"] = bad_tie["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="lm_head"):
        hf_to_megatron(bad_tie, tied.config)
    model = build_gpt_model(cfg)
    converted = hf_to_megatron(sd, cfg)
    converted.pop("decoder.final_layernorm.weight")
    with pytest.raises(ValueError, match="final_layernorm"):
        load_megatron_state_dict(model, converted)


def test_make_hf_config_and_transformer_config():
    cfg = make_hf_config({**FIELDS, "num_local_experts": FIELDS["num_experts"]})
    assert hf_num_experts(cfg) == 4 and hf_rope_theta(cfg) == 5000.0 and cfg.head_dim == 16
    no_head_dim = {k: v for k, v in FIELDS.items() if k != "head_dim"}
    assert make_hf_config(no_head_dim).head_dim == 64 // 4
    with pytest.raises(ValueError, match="num_experts_per_tokk"):
        make_hf_config({**FIELDS, "num_experts_per_tokk": 2})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        make_hf_config({k: v for k, v in FIELDS.items() if k != "moe_intermediate_size"})
    with pytest.raises(ValueError, match="num_local_experts=8 disagrees"):
        make_hf_config({**FIELDS, "num_local_experts": 8})
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds"):
        make_hf_config({**FIELDS, "num_experts_per_tok": 5})
    with pytest.raises(TypeError):
        make_hf_config([("hidden_size", 64)])

    tc = transformer_config_from_hf(cfg, tp_size=1, pp_size=1, ep_size=1)
    assert (tc.num_query_groups, tc.kv_channels, tc.layernorm_epsilon) == (2, 16, 1e-6)
    assert tc.moe_router_pre_softmax is False and tc.moe_aux_loss_coeff == 1e-3
    assert tc.add_bias_linear is False and tc.rotary_interleaved is False
    assert tc.moe_ffn_hidden_size == 48 and tc.num_moe_experts == 4 and tc.moe_router_topk == 2
    bf16 = transformer_config_from_hf(cfg, params_dtype=torch.bfloat16, tp_size=1)
    assert bf16.bf16 and bf16.params_dtype == torch.bfloat16
    assert transformer_config_from_hf(cfg, tp_size=1, moe_router_dtype="fp32").moe_router_dtype == "fp32"


def test_causal_attention_mask():
    m = causal_attention_mask(4)
    assert m.shape == (1, 1, 4, 4) and m.dtype == torch.bool
    assert m[0, 0].tolist() == [[j > i for j in range(4)] for i in range(4)]
    with pytest.raises(ValueError):
        causal_attention_mask(0)


def test_dist_checkpoint_round_trip(dist, tmp_path):
    cfg = make_hf_config(h.TINY_FIELDS)
    torch.manual_seed(1)
    model = build_gpt_model(cfg)
    ddp, opt = h.build_ddp_and_optimizer(model, use_distributed_optimizer=True)
    tokens, labels = h.fixed_batch(cfg.vocab_size)
    h.megatron_train_step(ddp, opt, tokens, labels)
    path = save_dist_checkpoint(ddp, opt, tmp_path / "ckpt", extra={"step": 1, "weight_version": "v1"})
    assert path.is_dir() and not (tmp_path / "ckpt.tmp").exists()

    torch.manual_seed(2)  # a differently initialised fresh model
    fresh = build_gpt_model(cfg)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    fresh_ddp, fresh_opt = h.build_ddp_and_optimizer(fresh, use_distributed_optimizer=True)
    extra = load_dist_checkpoint(fresh_ddp, fresh_opt, path)
    assert extra == {"step": 1, "weight_version": "v1"}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    # the optimizer state came back too: one more step is identical
    assert h.megatron_train_step(ddp, opt, tokens, labels) == h.megatron_train_step(fresh_ddp, fresh_opt, tokens, labels)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_expert_bias_round_trips_as_e_score_correction_bias(dist):
    """Megatron's aux-loss-free ``mlp.router.expert_bias`` <-> HF ``mlp.gate.e_score_correction_bias``
    (DeepSeek-V3's name): unsharded and EP/TP-sharded round trips are exact, and an HF checkpoint
    without the bias (plain Qwen3) still loads, leaving the model's bias unchanged."""
    from moerl.checkpoint.hf_convert import ShardLayout, merge_megatron_shards

    cfg = make_hf_config(FIELDS)
    model = build_gpt_model(cfg, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    sd = model.state_dict()
    biases = {k: v for k, v in sd.items() if k.endswith("mlp.router.expert_bias")}
    assert len(biases) == cfg.num_hidden_layers
    g = torch.Generator().manual_seed(5)
    for v in biases.values():
        v.copy_(torch.randn(v.shape, generator=g))
    sd = model.state_dict()
    hf = megatron_to_hf(sd, cfg)
    for layer in range(cfg.num_hidden_layers):
        got = hf[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert torch.equal(got, sd[f"decoder.layers.{layer}.mlp.router.expert_bias"])
        assert got.dtype == torch.float32 and got.shape == (hf_num_experts(cfg),)
    gathered = hf_convert.gather_megatron_to_hf(sd, cfg)  # the collective export path (world of 1)
    assert set(gathered) == set(hf) and all(torch.equal(gathered[k], hf[k]) for k in hf)
    back = hf_to_megatron(hf, cfg)
    fresh = build_gpt_model(cfg, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    load_megatron_state_dict(fresh, back)
    for k, v in fresh.state_dict().items():
        if not k.endswith("_extra_state"):
            assert torch.equal(v, sd[k]), k
    # sharded: every (tp, ep) shard carries its replicated bias; merging gives the same HF dict
    layouts = [ShardLayout(tp_size=2, tp_rank=t, ep_size=2, ep_rank=e) for t in range(2) for e in range(2)]
    shards = {lay: hf_to_megatron(hf, cfg, lay) for lay in layouts}
    for lay, shard in shards.items():
        assert torch.equal(shard["decoder.layers.1.mlp.router.expert_bias"], sd["decoder.layers.1.mlp.router.expert_bias"])
    merged = merge_megatron_shards(shards, cfg)
    assert set(merged) == set(hf) and all(torch.equal(merged[k], hf[k]) for k in hf)
    # a plain Qwen3 checkpoint (no bias) loads into a bias model; the bias stays as it was
    plain = {k: v for k, v in hf.items() if not k.endswith("e_score_correction_bias")}
    load_megatron_state_dict(fresh, hf_to_megatron(plain, cfg))
    assert torch.equal(fresh.state_dict()["decoder.layers.0.mlp.router.expert_bias"],
                       sd["decoder.layers.0.mlp.router.expert_bias"])
    # and a model without the bias converts exactly as before (no bias names)
    assert not any("e_score_correction_bias" in k for k in megatron_to_hf(build_gpt_model(cfg).state_dict(), cfg))
