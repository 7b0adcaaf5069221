"""moerl.observe.flops against hand counts written out below and against torch's FLOP counter
(torch.utils.flop_counter.FlopCounterMode) on CPU forwards of tiny transformers models."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moerl.observe.flops import flop_breakdown, forward_flops, logprob_flops, mfu, peak_tflops, training_flops


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                          intermediate_size=24, mlp_only_layers=[0], vocab_size=32, tie_word_embeddings=False)


def _deepseek_v3():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=16, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
                            num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4,
                            qk_rope_head_dim=2, v_head_dim=3, n_routed_experts=4, num_experts_per_tok=2,
                            n_group=1, topk_group=1, n_shared_experts=1, moe_intermediate_size=5,
                            intermediate_size=10, vocab_size=20, tie_word_embeddings=False)


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=12, vocab_size=32)


def test_qwen3_moe_hand_count():
    # two sequences packed: lengths 5 and 3 -> 8 tokens, causal pairs 5*6/2 + 3*4/2 = 15 + 6 = 21
    # attention MACs per token and layer: q 16*32=512, k 16*16=256, v 256, o 32*16=512 -> 1536
    #   2 layers * 8 tokens * 1536 = 24576
    # core attention: per pair 4 heads * (8 + 8) = 64; 2 layers * 21 * 64 = 2688
    # layer 0 dense (mlp_only_layers): 8 * 3*16*24 = 9216
    # layer 1 MoE: routed 8 tokens * top-2 * 3*16*12 = 9216; router 8*16*4 = 512
    # output layer: 8 * 16*32 = 4096
    # total 50304 MACs -> forward 100608 FLOPs, training (x3) 301824
    cfg = _qwen3_moe()
    parts = flop_breakdown(cfg, [5, 3])
    assert parts == {"attn_proj": 2 * 24576, "attn_core": 2 * 2688, "mlp_dense": 2 * 9216, "moe_routed": 2 * 9216,
                     "moe_shared": 0, "router": 2 * 512, "output": 2 * 4096}
    assert forward_flops(cfg, [5, 3]) == logprob_flops(cfg, [5, 3]) == 100608
    assert training_flops(cfg, [5, 3]) == 301824
    # packed lengths, not the padded length: one sequence of 8 has 36 pairs instead of 21
    assert forward_flops(cfg, [8]) - forward_flops(cfg, [5, 3]) == 2 * 2 * (36 - 21) * 64


def test_deepseek_v3_like_hand_count():
    # one sequence of 4 tokens: causal pairs 4*5/2 = 10
    # MLA per token and layer: q 16*8 + 8*2*(4+2) = 128 + 96 = 224; kv down 16*(6+2) = 128;
    #   kv up 6*2*(4+3) = 84; o 2*3*16 = 96 -> 532; 2 layers * 4 tokens * 532 = 4256
    # core: per pair 2 heads * ((4+2) + 3) = 18; 2 layers * 10 * 18 = 360
    # layer 0 dense (first_k_dense_replace=1): 4 * 3*16*10 = 1920
    # layer 1 MoE: routed 4 * 2 * 3*16*5 = 1920; shared (1 expert of 5) 4 * 3*16*5 = 960; router 4*16*4 = 256
    # output: 4 * 16*20 = 1280
    # total 10952 MACs -> forward 21904 FLOPs, training 65712
    cfg = _deepseek_v3()
    parts = flop_breakdown(cfg, [4])
    assert parts == {"attn_proj": 2 * 4256, "attn_core": 2 * 360, "mlp_dense": 2 * 1920, "moe_routed": 2 * 1920,
                     "moe_shared": 2 * 960, "router": 2 * 256, "output": 2 * 1280}
    assert forward_flops(cfg, [4]) == 21904 and training_flops(cfg, [4]) == 65712
    # without query compression: q is 16 * 2*6 = 192 MACs per token instead of 224
    cfg.q_lora_rank = None
    assert forward_flops(cfg, [4]) == 21904 - 2 * 2 * 4 * (224 - 192)


def _counted(model, ids: torch.Tensor) -> dict:
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=ids)
    return {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("make", [_qwen3_moe, _deepseek_v3, _mixtral], ids=["qwen3_moe", "deepseek_v3", "mixtral"])
def test_matches_torch_flop_counter(make):
    """FlopCounterMode counts the matmuls a CPU forward of the transformers model really runs. Eager
    attention and eager experts (a loop over experts on their routed tokens only): the counter has no
    formula for torch._grouped_mm nor for the CPU flash-attention op. Eager attention computes the whole
    s x s score matrix (no causal discount), so the comparison uses causal=False. Tolerance: exact (the
    counts are integers well below 2^53)."""
    from transformers import AutoModelForCausalLM

    cfg = make()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager").eval()
    for batch, lens in ((1, [7]), (2, [7, 7])):  # two sequences of 7 in a batch: twice the FLOPs of one
        counted = _counted(model, torch.randint(0, cfg.vocab_size, (batch, 7)))
        ours = flop_breakdown(cfg, lens, causal=False)
        assert counted["aten.bmm"] == ours["attn_core"]  # scores and weighted values
        assert counted["aten.mm"] == sum(v for k, v in ours.items() if k != "attn_core")  # every Linear
        assert sum(counted.values()) == forward_flops(cfg, lens, causal=False)


def test_mfu_and_peak():
    # 1e15 FLOPs in 2 s on 4 devices of 250 TFLOP/s peak: 1.25e14 FLOP/s per device / 2.5e14 = 0.5
    assert mfu(1e15, 2.0, 4, 250.0) == pytest.approx(0.5)
    assert mfu(1e15, 2.0, 4, None) is None
    from types import SimpleNamespace

    assert peak_tflops(SimpleNamespace(peak_bf16_tflops=123.0, gpu="H100")) == 123.0
    assert peak_tflops(SimpleNamespace(peak_bf16_tflops=None, gpu="H100")) == 989.0
    assert peak_tflops(None, device_name="NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops(None, device_name="NVIDIA H100 PCIe") == 756.0
    assert peak_tflops(None, device_name="NVIDIA H200") == 989.0
    assert peak_tflops(None, device_name="NVIDIA A100-SXM4-40GB") == 312.0
    assert peak_tflops(None, device_name="NVIDIA GeForce GTX 1080") is None
