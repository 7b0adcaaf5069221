"""Shared helpers for the runtime / model tests: a tiny Qwen3-MoE recipe, a Megatron train step,
and a torchrun launcher whose workers run the cases at the bottom of this file.

Run a worker by hand:  python -m torch.distributed.run --nproc_per_node 2 tests/_mp_helpers.py tp2 OUT.json
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from moerl.rollout.common import free_port_block  # noqa: F401 - tests import it from here

REPO_ROOT = Path(__file__).resolve().parents[1]

TINY_FIELDS = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    intermediate_size=96,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    vocab_size=96,
)


def gspo_micro_batches(n: int, vocab: int, *, batch: int = 2, seq: int = 10, prompt: int = 4, seed: int = 3,
                       unique_ids: bool = False, ragged: bool = False) -> list:
    """n padded GSPO micro-batches [batch, seq] for the pipeline tests: random tokens, labels = tokens shifted
    by one, loss mask 0 on the first ``prompt`` positions, random advantages [batch] and old log-probs
    (``extras["old_log_probs"]``, [batch, seq], in (-5, 0]).  Sample indices 0..batch-1 per micro-batch,
    or numbered across micro-batches with ``unique_ids``.  ``ragged``: responses 1-3 tokens shorter than
    the row in a cycle, so rows end in padding (``moerl.train.batching.padding_mask`` is not empty)."""
    import torch

    from moerl.train.batching import MicroBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.roll(tokens, -1, dims=1)
        lengths = [seq - prompt - (1 + (i + j) % 3 if ragged else 0) for j in range(batch)]
        mask = torch.zeros(batch, seq)
        for j, n in enumerate(lengths):
            mask[j, prompt:prompt + n] = 1.0
        old = -torch.rand(batch, seq, generator=g) * 5
        adv = torch.randn(batch, generator=g)
        ids = [i * batch + j for j in range(batch)] if unique_ids else list(range(batch))
        out.append(MicroBatch(tokens, labels, mask, adv, ids, [prompt] * batch, lengths,
                              extras={"old_log_probs": old}))
    return out


def to_float64(mbs: list) -> list:
    """The micro-batches of :func:`gspo_micro_batches` with float64 advantages and old log-probs (in place),
    for float64 models."""
    for mb in mbs:
        mb.advantages = mb.advantages.double()
        mb.extras["old_log_probs"] = mb.extras["old_log_probs"].double()
    return mbs




def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_torchrun(case: str, nproc: int, out_path: Path, timeout: float = 240.0) -> dict:
    """Run ``case`` on ``nproc`` gloo processes with torchrun; return rank 0's JSON result."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(Path(__file__).resolve()), case, str(out_path),
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {case} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return json.loads(Path(out_path).read_text())


def fixed_batch(vocab_size: int, batch: int = 2, seq: int = 12, seed: int = 123):
    """(tokens [B,S] int64, labels [B,S] int64), deterministic."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, vocab_size, (batch, seq), generator=g)
    return tokens, labels


def megatron_train_step(ddp_model, optimizer, tokens, labels, forward_only: bool = False):
    """One Megatron step through get_forward_backward_func (PP=1, one micro-batch); the loss is
    the mean token cross entropy. Returns (loss, grad_norm or None)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from moerl.models.qwen3_moe import causal_attention_mask

    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = causal_attention_mask(s)

    def forward_step(data_iterator, model):
        tok, lab = next(data_iterator)
        per_token = model(tok, position_ids, mask, labels=lab)  # [B, S] cross entropy

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return per_token, loss_func

    if not forward_only:
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([(tokens, labels)]),
        model=[ddp_model],
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=forward_only,
    )
    loss = float(out[0]["loss"])
    if forward_only:
        return loss, None
    ok, grad_norm, _ = optimizer.step()
    assert ok, "optimizer step was skipped"
    return loss, float(grad_norm)


def build_ddp_and_optimizer(model, use_distributed_optimizer: bool, lr: float = 1e-2, clip_grad: float = 1.0):
    """Megatron DDP + get_megatron_optimizer(Adam, no weight decay, clip_grad) for ``model``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
        ),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=clip_grad,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        [ddp],
    )
    return ddp, opt


def tp_sp_case(tp_size: int, seed: int = 7) -> dict:
    """Build the tiny model at tp_size (sequence parallel when > 1), run forward, two train steps
    (distributed optimizer, clip_grad=1.0) and return losses and grad norms."""
    from moerl.models.qwen3_moe import build_gpt_model, make_hf_config
    from moerl.runtime.distributed import destroy_distributed, init_distributed

    info = init_distributed(tp_size=tp_size, seed=seed, num_threads=1)
    try:
        hf = make_hf_config(TINY_FIELDS)
        model = build_gpt_model(hf)
        assert model.config.sequence_parallel == (tp_size > 1)
        ddp, opt = build_ddp_and_optimizer(model, use_distributed_optimizer=True)
        tokens, labels = fixed_batch(hf.vocab_size)
        loss0, gn0 = megatron_train_step(ddp, opt, tokens, labels)
        loss1, gn1 = megatron_train_step(ddp, opt, tokens, labels)
        loss2, _ = megatron_train_step(ddp, opt, tokens, labels, forward_only=True)
        return {"rank": info.rank, "world_size": info.world_size, "dp_size": info.dp_size,
                "losses": [loss0, loss1, loss2], "grad_norms": [gn0, gn1]}
    finally:
        destroy_distributed()


if __name__ == "__main__":
    case, out = sys.argv[1], Path(sys.argv[2])
    if case == "tp2":
        result = tp_sp_case(tp_size=2)
    else:
        raise SystemExit(f"unknown case {case}")
    if result["rank"] == 0:
        out.write_text(json.dumps(result))
    from moerl.cli import exit_without_teardown

    exit_without_teardown(0)  # results written: skip the module teardown (about 1 s of CPU per rank)
