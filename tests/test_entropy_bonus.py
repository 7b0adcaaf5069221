"""The entropy bonus (algorithm.entropy_coef > 0) needs the entropy's gradient: the vocabulary-parallel
entropy at TP=2 (2 gloo processes, each holding half the vocabulary) against torch's entropy of the
full logits, value and gradient; and the actor keeps the graph only when asked (``entropy_grad``).

Run the TP=2 worker by hand: python -m torch.distributed.run --nproc_per_node 2 tests/test_entropy_bonus.py OUT.pt
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _mp_helpers as h  # noqa: E402

T = 0.7


def _logits_and_weights():
    g = torch.Generator().manual_seed(5)
    return torch.randn(2, 3, 10, generator=g, dtype=torch.float64) * 3, torch.randn(2, 3, generator=g, dtype=torch.float64)


def _reference():
    """Entropy of softmax(x / T) by its definition -sum p log p, and d(sum w*H)/dx, in float64."""
    logits, w = _logits_and_weights()
    x = logits.clone().requires_grad_()
    logp = torch.log_softmax(x / T, -1)
    ent = -(logp.exp() * logp).sum(-1)
    (grad,) = torch.autograd.grad((ent * w).sum(), x)
    return ent.detach(), grad


def _worker(out: str) -> None:
    import torch.distributed as dist

    from moerl.runtime.distributed import destroy_distributed, init_distributed
    from moerl.train.vocab_parallel import vocab_parallel_entropy

    init_distributed(tp_size=2, seed=0, num_threads=1)
    try:
        rank = dist.get_rank()
        logits, w = _logits_and_weights()
        shard = logits[..., rank * 5:(rank + 1) * 5].float().clone().requires_grad_()
        ent = vocab_parallel_entropy(shard, T, grad=True)
        (ent * w.float()).sum().backward()
        no_grad = vocab_parallel_entropy(shard, T)
        parts = [torch.zeros_like(shard) for _ in range(2)]
        dist.all_gather(parts, shard.grad.contiguous())
        if rank == 0:
            torch.save({"entropy": ent.detach(), "grad": torch.cat(parts, -1), "no_grad_requires_grad": no_grad.requires_grad,
                        "no_grad_entropy": no_grad}, out)
    finally:
        destroy_distributed()


def test_vocab_parallel_entropy_gradient_at_tp2(tmp_path):
    out = tmp_path / "tp2.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(h.free_port()), str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, env=h.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = torch.load(out)
    ent, grad = _reference()
    torch.testing.assert_close(got["entropy"].double(), ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["no_grad_entropy"].double(), ent, rtol=1e-5, atol=1e-5)
    assert not got["no_grad_requires_grad"]
    assert float(grad.abs().max()) > 1e-3  # the check is not vacuous
    torch.testing.assert_close(got["grad"].double(), grad, rtol=1e-4, atol=1e-5)


def test_actor_entropy_keeps_its_graph_only_when_asked():
    """MegatronActor._token_log_probs at TP=1: with entropy_grad the entropy's gradient is torch's;
    without it the entropy is a constant (no graph), so an entropy bonus could not train silently."""
    from moerl.train.actor import MegatronActor

    logits, w = _logits_and_weights()
    labels = torch.zeros(2, 3, dtype=torch.long)
    stub = type("A", (), {"tp_size": 1, "dual": False})()
    for flag in (True, False):
        stub.entropy_grad = flag
        x = logits.float().clone().requires_grad_()
        _, ent = MegatronActor._token_log_probs(stub, x, labels, T)
        assert ent.requires_grad is flag
        if flag:
            (g,) = torch.autograd.grad((ent * w.float()).sum(), x)
            torch.testing.assert_close(g.double(), _reference()[1], rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    _worker(sys.argv[1])
    from moerl.cli import exit_without_teardown

    exit_without_teardown(0)  # results written: skip the module teardown (about 1 s of CPU per rank)
