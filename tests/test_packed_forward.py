"""Packed (THD, cu_seqlens) forward through the Megatron GPTModel on CPU
(moerl.models.packed_attention): a packed forward of k sequences equals k separate Megatron
forwards and k separate transformers forwards, per token, in fp32."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _mp_helpers as h  # noqa: E402
from test_hf_convert import FIELDS, random_hf_model  # noqa: E402

from moerl.checkpoint.hf_convert import hf_to_megatron, load_megatron_state_dict  # noqa: E402
from moerl.models.packed_attention import PackedDotProductAttention, make_packed_seq_params  # noqa: E402
from moerl.models.qwen3_moe import build_gpt_model, causal_attention_mask, make_hf_config  # noqa: E402
from moerl.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402
from moerl.train.batching import make_packed_micro_batch, model_forward_args  # noqa: E402
from moerl.types import Sample  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    init_distributed(seed=0, num_threads=2)
    try:
        hf = random_hf_model()
        cfg = make_hf_config(FIELDS)
        model = build_gpt_model(cfg).eval()
        load_megatron_state_dict(model, hf_to_megatron(hf.state_dict(), cfg))
        yield hf, model
    finally:
        destroy_distributed()


def _seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, FIELDS["vocab_size"], (n,), generator=g) for n in lengths]


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@torch.no_grad()
def _separate(model, hf, seq):
    n = len(seq)
    meg = model(seq.unsqueeze(0), torch.arange(n).unsqueeze(0), causal_attention_mask(n))[0]
    ref = hf(seq.unsqueeze(0)).logits[0]
    return meg, ref


def test_builder_uses_packed_core_attention(models):
    _, model = models
    for layer in model.decoder.layers:
        assert isinstance(layer.self_attention.core_attention, PackedDotProductAttention)


@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [12], [2, 2, 2, 2, 2, 7]])
def test_packed_forward_equals_separate_forwards(models, lengths):
    hf, model = models
    seqs = _seqs(lengths)
    cu = _cu(lengths)
    with torch.no_grad():
        packed = model(torch.cat(seqs).unsqueeze(0), None, None, packed_seq_params=make_packed_seq_params(cu))
    assert packed.shape == (1, cu[-1], FIELDS["vocab_size"])
    worst_meg = worst_hf = 0.0
    for seq, start in zip(seqs, cu[:-1]):
        meg, ref = _separate(model, hf, seq)
        got = packed[0, start : start + len(seq)]
        worst_meg = max(worst_meg, float((got - meg).abs().max()))
        worst_hf = max(worst_hf, float((got - ref).abs().max()))
    assert worst_meg <= TOL, worst_meg
    assert worst_hf <= TOL, worst_hf


def test_concatenation_without_cu_seqlens_differs(models):
    """Control: the same row run as ONE causal sequence (no cu_seqlens) is not the k separate
    forwards, so the comparison above can fail."""
    hf, model = models
    lengths = [5, 1, 9, 3]
    seqs = _seqs(lengths)
    row = torch.cat(seqs).unsqueeze(0)
    t = row.shape[1]
    with torch.no_grad():
        joint = model(row, torch.arange(t).unsqueeze(0), causal_attention_mask(t))
    start = lengths[0]
    _, ref = _separate(model, hf, seqs[1])
    assert float((joint[0, start : start + 1] - ref).abs().max()) > 1e-2


def test_packed_micro_batch_with_padding_segment(models):
    """pad_to_multiple_of (sequence parallelism) adds a padding segment that must not change the
    real tokens' logits; model_forward_args is the call the actor makes."""
    hf, model = models
    lengths = [4, 6, 3]
    seqs = _seqs(lengths, seed=5)
    samples = [
        Sample(index=i, group_id=0, prompt="", label="", prompt_ids=s[:2].tolist(), response_ids=s[2:].tolist(),
               loss_mask=[1] * (len(s) - 2), advantage=0.0)
        for i, s in enumerate(seqs)
    ]
    mb = make_packed_micro_batch(samples, [0, 1, 2], pad_id=0, pad_to_multiple_of=8)
    assert mb.num_packed_tokens == 16 and mb.cu_seqlens.tolist() == [0, 4, 10, 13, 16]
    args, kwargs = model_forward_args(mb)
    with torch.no_grad():
        logits = model(*args, **kwargs)
    log_probs = torch.log_softmax(logits.float(), -1).gather(-1, mb.packed_labels.unsqueeze(-1)).squeeze(-1)
    padded = mb.unpack(log_probs)  # [B, S] aligned with mb.labels / mb.loss_mask
    for i, seq in enumerate(seqs):
        _, ref = _separate(model, hf, seq)
        want = torch.log_softmax(ref, -1)[torch.arange(len(seq) - 1), seq[1:]]
        got = padded[i, : len(seq) - 1]
        assert float((got - want).abs().max()) <= TOL
        assert torch.equal(mb.labels[i, : len(seq) - 1], seq[1:])


def test_padded_cu_seqlens_layout(models):
    """Transformer Engine's cu_seqlens_q_padded convention: segments at padded offsets."""
    hf, model = models
    lengths, padded_lengths = [5, 3], [8, 4]
    seqs = _seqs(lengths, seed=9)
    row = torch.zeros(1, sum(padded_lengths), dtype=torch.long)
    offsets = _cu(padded_lengths)
    for seq, o in zip(seqs, offsets):
        row[0, o : o + len(seq)] = seq
    params = make_packed_seq_params(_cu(lengths))
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = torch.tensor(offsets, dtype=torch.int32)
    params.max_seqlen_q = params.max_seqlen_kv = max(padded_lengths)
    with torch.no_grad():
        out = model(row, None, None, packed_seq_params=params)
    for seq, o in zip(seqs, offsets):
        _, ref = _separate(model, hf, seq)
        assert float((out[0, o : o + len(seq)] - ref).abs().max()) <= TOL


def _packed_loss_and_grads(model, seqs, cu):
    model.zero_grad(set_to_none=True)
    logits = model(torch.cat(seqs).unsqueeze(0), None, None, packed_seq_params=make_packed_seq_params(cu))
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def test_flash_kernel_equals_the_parents_math_forward_and_backward(models, monkeypatch):
    """The THD branch's torch scaled_dot_product_attention (GQA: 4 query heads on 2 KV heads) gives
    the logits AND the parameter gradients of the same branch run through Megatron's own
    DotProductAttention math (baddbmm, masked softmax, bmm), in fp32, in training mode."""
    _, model = models
    lengths = [5, 1, 9, 3, 9, 5]  # repeated lengths: batched segments
    seqs, cu = _seqs(lengths, seed=4), _cu(lengths)
    model.train()
    try:
        assert all(layer.self_attention.core_attention.uses_flash_kernel() for layer in model.decoder.layers)
        flash_logits, flash_grads = _packed_loss_and_grads(model, seqs, cu)
        monkeypatch.setattr(PackedDotProductAttention, "uses_flash_kernel", lambda self: False)
        math_logits, math_grads = _packed_loss_and_grads(model, seqs, cu)
    finally:
        model.eval()
    assert float((flash_logits - math_logits).abs().max()) <= TOL
    assert flash_grads.keys() == math_grads.keys() and any("linear_qkv" in n for n in flash_grads)
    for name, g in flash_grads.items():
        scale = float(math_grads[name].abs().max()) + 1e-12
        assert float((g - math_grads[name]).abs().max()) <= 1e-4 * scale, name


def test_flash_kernel_only_where_it_computes_the_same(models):
    """Attention dropout in training, a non-vanilla softmax or a sliding window go through the
    parent's math (dropout under Megatron's RNG tracker); eval mode with dropout configured uses
    the kernel (no dropout applied)."""
    _, model = models
    core = model.decoder.layers[0].self_attention.core_attention
    p = core.attention_dropout.p
    try:
        core.attention_dropout.p = 0.1
        core.train()
        assert not core.uses_flash_kernel()
        core.eval()
        assert core.uses_flash_kernel()
        core.attention_dropout.p = p
        core.scale_mask_softmax.window_size = (4, 0)
        assert not core.uses_flash_kernel()
    finally:
        core.attention_dropout.p = p
        core.scale_mask_softmax.window_size = None
        core.eval()


def test_make_packed_seq_params_checks():
    p = make_packed_seq_params([0, 3, 4, 9])
    assert p.qkv_format == "thd" and p.max_seqlen_q == p.max_seqlen_kv == 5
    assert p.cu_seqlens_q.dtype == torch.int32 and p.cu_seqlens_q.tolist() == [0, 3, 4, 9]
    with pytest.raises(ValueError, match="start at 0"):
        make_packed_seq_params([1, 3])
    with pytest.raises(ValueError, match="strictly increasing"):
        make_packed_seq_params([0, 3, 3])
    with pytest.raises(ValueError, match="at least 2"):
        make_packed_seq_params([0])


def test_packed_forward_tp2_sequence_parallel(tmp_path):
    """TP=2 with sequence parallelism (2 gloo processes): the packed row (padded to a multiple of
    tp_size by a padding segment) gives the logits of separate forwards of the same TP model."""
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(h.free_port()), str(Path(__file__).resolve()), "tp2", str(out)]
    proc = subprocess.run(cmd, env=h.subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["sequence_parallel"] and res["num_packed_tokens"] == 20
    assert res["worst"] <= TOL, res


def _tp2_worker(out_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    info = init_distributed(tp_size=2, seed=0, num_threads=1)
    try:
        model = build_gpt_model(make_hf_config(FIELDS)).eval()
        group = ps.get_tensor_model_parallel_group()

        def full_vocab(logits):  # [1, S, V/2] -> [1, S, V]
            parts = [torch.empty_like(logits) for _ in range(2)]
            dist.all_gather(parts, logits.contiguous(), group=group)
            return torch.cat(parts, dim=-1)

        lengths = [5, 2, 9, 3]  # 19 tokens -> a 1-token padding segment
        seqs = _seqs(lengths, seed=3)
        samples = [Sample(index=i, group_id=0, prompt="", label="", prompt_ids=s[:1].tolist(),
                          response_ids=s[1:].tolist(), loss_mask=[1] * (len(s) - 1), advantage=0.0)
                   for i, s in enumerate(seqs)]
        mb = make_packed_micro_batch(samples, list(range(4)), pad_id=0, pad_to_multiple_of=2)
        args, kwargs = model_forward_args(mb)
        with torch.no_grad():
            packed = full_vocab(model(*args, **kwargs))
            worst = 0.0
            for seq, start in zip(seqs, mb.cu_seqlens.tolist()):
                n = len(seq)
                s = n + n % 2  # sequence parallelism splits the sequence over the 2 TP ranks
                row = torch.zeros(1, s, dtype=torch.long)
                row[0, :n] = seq
                sep = full_vocab(model(row, torch.arange(s).unsqueeze(0), causal_attention_mask(s)))
                worst = max(worst, float((packed[0, start : start + n] - sep[0, :n]).abs().max()))
        if info.rank == 0:
            Path(out_path).write_text(json.dumps({
                "worst": worst, "num_packed_tokens": mb.num_packed_tokens,
                "sequence_parallel": bool(model.config.sequence_parallel),
            }))
    finally:
        destroy_distributed()


if __name__ == "__main__":
    if sys.argv[1] != "tp2":
        raise SystemExit(f"unknown case {sys.argv[1]}")
    _tp2_worker(sys.argv[2])
    from moerl.cli import exit_without_teardown

    exit_without_teardown(0)  # results written: skip the module teardown (about 1 s of CPU per rank)


def test_packed_core_attention_choice_per_device():
    """CPU: moerl's exact packed attention. CUDA: Transformer Engine's fused attention, or, when
    TE is missing, an ImportError that says what to install (never a silent fallback)."""
    from moerl.models import packed_attention as pa

    assert pa.packed_core_attention_class(use_cuda=False) is PackedDotProductAttention
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="Transformer Engine"):
            pa.packed_core_attention_class(use_cuda=True)
    else:  # pragma: no cover - GPU image
        assert pa.packed_core_attention_class(use_cuda=True).__name__ == "TEDotProductAttention"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with Transformer Engine")
def test_packed_forward_on_gpu_with_transformer_engine():  # pragma: no cover - GPU check
    """GPU: the same model with TE's fused attention gives, for a packed row, the logits of
    separate forwards (bf16-free fp32 model; TE fused attention tolerance)."""
    init_distributed(seed=0, num_threads=2)
    try:
        hf = random_hf_model().cuda()
        cfg = make_hf_config(FIELDS)
        model = build_gpt_model(cfg).cuda().eval()
        load_megatron_state_dict(model, hf_to_megatron(hf.state_dict(), cfg))
        lengths = [5, 1, 9, 3]
        seqs = [s.cuda() for s in _seqs(lengths)]
        cu = _cu(lengths)
        with torch.no_grad():
            packed = model(torch.cat(seqs).unsqueeze(0), None, None,
                           packed_seq_params=make_packed_seq_params(cu, device="cuda"))
            for seq, start in zip(seqs, cu[:-1]):
                ref = hf(seq.unsqueeze(0)).logits[0]
                assert float((packed[0, start : start + len(seq)] - ref).abs().max()) <= 2e-2
    finally:
        destroy_distributed()
