"""Tiny Qwen3-MoE checkpoints for tests and smoke runs of the rollout side (not used in training), and a port
that refuses connections (tests of dead servers)."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Optional

import torch


@contextlib.contextmanager
def refusing_port(host: str = "127.0.0.1"):
    """Yield a TCP port (int) on ``host`` that nothing answers on while the context is open: a socket bound
    to it that does not listen, so every connection is refused and no other process can take the port
    meanwhile. A port that was merely free when picked is not enough on a busy machine: under pytest-xdist
    another worker's rollout server once answered /health on one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        yield s.getsockname()[1]
    finally:
        s.close()


TINY_SYMBOLS = list("0123456789+-=*abcdefghijklmnopqrstuvwxyz")
TINY_SPECIALS = ["<pad>", "<eos>", "<unk>"]


def make_tiny_tokenizer(path: Optional[str] = None):
    """A WordLevel tokenizer (tokenizers library) over single characters split by whitespace.

    Ids: <pad>=0, <eos>=1, <unk>=2, then the characters of TINY_SYMBOLS (vocab 43). Returned as a
    transformers PreTrainedTokenizerFast; saved to ``path`` when given.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + TINY_SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")
    if path is not None:
        fast.save_pretrained(path)
    return fast


def make_tiny_moe_config(vocab_size: int = 43, **overrides):
    """Qwen3-MoE config: 2 layers, hidden 64, 4 heads (2 kv, head_dim 16), 4 experts top-2, width 32."""
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
              tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
              eos_token_id=1, pad_token_id=0, bos_token_id=None)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def make_tiny_moe_checkpoint(path: str, seed: int = 0, init_scale: float = 1.0, **config_overrides):
    """Write a random tiny Qwen3-MoE (fp32) plus the tiny tokenizer to ``path``; returns the model.

    Matrices are drawn from N(0, (init_scale / sqrt(fan_in))^2), far above HF's 0.02, so that
    next-token distributions are visibly non-uniform (logits of a few units).
    """
    from transformers import AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    tok = make_tiny_tokenizer(path)
    cfg = make_tiny_moe_config(vocab_size=len(tok), **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_scale / p.shape[-1] ** 0.5)
    model.eval()
    model.save_pretrained(path)
    return model
