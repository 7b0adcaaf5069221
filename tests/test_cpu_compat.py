"""CPU compatibility layer and runtime init for megatron-core 0.16.1 (moerl.runtime).

Each patch test first undoes that one patch (``without_patch``) and reproduces the original
megatron-core error, then shows the patched behaviour against an independent reference.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compatibility layer tests")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _mp_helpers as h  # noqa: E402

from moerl.models.qwen3_moe import build_gpt_model, causal_attention_mask, make_hf_config  # noqa: E402
from moerl.runtime import cpu_compat  # noqa: E402
from moerl.runtime.distributed import DistInfo, destroy_distributed, init_distributed, validate_layout  # noqa: E402

CUDA_ERROR = "CUDA"  # "Torch not compiled with CUDA enabled" / "requires CUDA support"


@pytest.fixture
def dist():
    info = init_distributed(seed=1234)
    try:
        yield info
    finally:
        destroy_distributed()


def _hf(**changes):
    return make_hf_config({**h.TINY_FIELDS, **changes})


def _model(**overrides):
    torch.manual_seed(0)
    return build_gpt_model(_hf(), **overrides)


def _batch(b=2, s=10, vocab=h.TINY_FIELDS["vocab_size"]):
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(5))
    return tokens, torch.arange(s).unsqueeze(0).expand(b, s)


# ------------------------------------------------------------------------------------------
# apply_cpu_patches itself
# ------------------------------------------------------------------------------------------


def test_apply_is_idempotent_and_sets_dynamo_flag(dist):
    assert set(cpu_compat.applied_patches()) == set(cpu_compat.PATCH_NAMES)
    current_device = torch.cuda.current_device
    assert cpu_compat.apply_cpu_patches() is True
    assert torch.cuda.current_device is current_device  # nothing re-wrapped
    assert os.environ.get("TORCHDYNAMO_DISABLE") == "1"
    with pytest.raises(ValueError, match="unknown patch"):
        with cpu_compat.without_patch("no_such_patch"):
            pass


# ------------------------------------------------------------------------------------------
# 1. RNG tracker
# ------------------------------------------------------------------------------------------


def test_rng_tracker_patch(dist, caplog):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    with cpu_compat.without_patch("rng_tracker"):
        with pytest.raises((AssertionError, RuntimeError), match=CUDA_ERROR):
            model_parallel_cuda_manual_seed(77)

    model_parallel_cuda_manual_seed(77)
    tracker = get_cuda_rng_tracker()
    expected_seeds = {"data-parallel-rng": 77, "model-parallel-rng": 77 + 2718, "expert-parallel-rng": 77 + 1024}
    for name, seed in expected_seeds.items():
        assert torch.equal(tracker.get_states()[name], torch.Generator().manual_seed(seed).get_state()), name

    torch.manual_seed(5)
    ref_outside = torch.Generator().manual_seed(5)
    ref_mp = torch.Generator().manual_seed(77 + 2718)
    a = torch.rand(3)
    caplog.set_level(logging.WARNING)
    with tracker.fork():
        inside1 = torch.rand(4)
    b = torch.rand(3)
    with tracker.fork():
        inside2 = torch.rand(4)
    # the fork draws from the model-parallel stream and continues it across forks ...
    assert torch.equal(inside1, torch.rand(4, generator=ref_mp))
    assert torch.equal(inside2, torch.rand(4, generator=ref_mp))
    # ... while the default CPU stream outside is untouched by the forks
    assert torch.equal(a, torch.rand(3, generator=ref_outside))
    assert torch.equal(b, torch.rand(3, generator=ref_outside))
    assert "CPU RNG state changed" not in caplog.text


# ------------------------------------------------------------------------------------------
# 2. torch.cuda.current_device
# ------------------------------------------------------------------------------------------


def test_current_device_patch(dist):
    tokens, pos = _batch()
    mask = causal_attention_mask(tokens.shape[1])
    with cpu_compat.without_patch("current_device"):
        with pytest.raises((AssertionError, RuntimeError), match=CUDA_ERROR):
            torch.cuda.current_device()
        model = _model()
        with pytest.raises((AssertionError, RuntimeError), match=CUDA_ERROR):
            model(tokens, pos, mask)  # rotary embedding moves inv_freq to current_device()
        with pytest.raises((AssertionError, RuntimeError), match=CUDA_ERROR):
            h.build_ddp_and_optimizer(model, use_distributed_optimizer=False)  # DDP buffers
    assert torch.cuda.current_device() == "cpu"
    model = _model()
    logits = model(tokens, pos, mask)
    assert logits.shape == (*tokens.shape, h.TINY_FIELDS["vocab_size"])
    ddp, _ = h.build_ddp_and_optimizer(model, use_distributed_optimizer=False)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert all(p.main_grad.device.type == "cpu" for p in model.parameters())


# ------------------------------------------------------------------------------------------
# 3. te_general_gemm
# ------------------------------------------------------------------------------------------


def test_te_general_gemm_patch(dist):
    from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 8, generator=g, requires_grad=True)
    with cpu_compat.without_patch("te_general_gemm"):
        with pytest.raises(NameError, match="te_general_gemm"):
            RouterGatingLinearFunction.apply(x, w, None, torch.float32)
    out = RouterGatingLinearFunction.apply(x, w, None, torch.float32)
    ref = x.detach() @ w.detach().T
    assert torch.allclose(out, ref, atol=1e-6)
    out.sum().backward()
    assert torch.allclose(x.grad, w.detach().sum(0).expand(5, 8), atol=1e-6)
    assert torch.allclose(w.grad, x.detach().sum(0).expand(3, 8), atol=1e-6)
    # and the router of a whole model with moe_router_dtype="fp32" runs
    tokens, pos = _batch()
    logits = _model(moe_router_dtype="fp32")(tokens, pos, causal_attention_mask(tokens.shape[1]))
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------------
# 4. alltoall dispatcher streams
# ------------------------------------------------------------------------------------------


def test_alltoall_streams_patch(dist):
    with cpu_compat.without_patch("alltoall_streams"):
        with pytest.raises(RuntimeError, match="torch.cuda.Stream requires CUDA"):
            _model(moe_token_dispatcher_type="alltoall")
    alltoall = _model(moe_token_dispatcher_type="alltoall")
    allgather = _model(moe_token_dispatcher_type="allgather")
    allgather.load_state_dict(alltoall.state_dict())
    tokens, pos = _batch()
    mask = causal_attention_mask(tokens.shape[1])
    a, b = alltoall(tokens, pos, mask), allgather(tokens, pos, mask)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    a.float().pow(2).mean().backward()
    assert all(p.grad is not None for n, p in alltoall.named_parameters() if "local_experts" in n)


# ------------------------------------------------------------------------------------------
# 5. device="cuda" in the default causal mask and the schedules
# ------------------------------------------------------------------------------------------


def test_cuda_factories_patch_mask_and_schedule(dist):
    model = _model()
    tokens, pos = _batch()
    with cpu_compat.without_patch("cuda_factories"):
        with pytest.raises((AssertionError, RuntimeError), match=CUDA_ERROR):
            model(tokens, pos, None)
        ddp, opt = h.build_ddp_and_optimizer(model, use_distributed_optimizer=False)
        labels = torch.zeros_like(tokens)
        with pytest.raises((AssertionError, RuntimeError), match=CUDA_ERROR):
            h.megatron_train_step(ddp, opt, tokens, labels, forward_only=True)
    # patched: the default mask is the causal mask
    explicit = model(tokens, pos, causal_attention_mask(tokens.shape[1]))
    assert torch.equal(model(tokens, pos, None), explicit)
    from megatron.core.transformer.utils import get_default_causal_mask

    assert torch.equal(get_default_causal_mask(6), causal_attention_mask(6)[0, 0])
    # and the no-pipelining schedule runs a forward-only step (value checked in the optimizer test)
    loss, _ = h.megatron_train_step(ddp, opt, tokens, labels, forward_only=True)
    assert loss > 0


# ------------------------------------------------------------------------------------------
# 7. torch norm with sequence parallelism
# ------------------------------------------------------------------------------------------


def test_torch_norm_sequence_parallel_patch(dist):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = copy.copy(_model().config)
    config.sequence_parallel = True  # (TransformerConfig refuses SP at tp=1, so set it afterwards)
    with cpu_compat.without_patch("torch_norm_sequence_parallel"):
        with pytest.raises(AssertionError, match="sequence parallel not supported"):
            WrappedTorchNorm(config=config, hidden_size=16, eps=1e-6)
    norm = WrappedTorchNorm(config=config, hidden_size=16, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert config.sequence_parallel is True  # the caller's config is not modified
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 16)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.allclose(norm(x), ref, atol=1e-6)


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_tp1(tmp_path):
    """torchrun, 2 gloo processes, TP=2 + sequence parallel + distributed optimizer: the losses
    and grad norms of two train steps equal the single-process TP=1 run (same CPU init)."""
    tp2 = h.run_torchrun("tp2", 2, tmp_path / "tp2.json")
    tp1 = h.tp_sp_case(tp_size=1)
    assert tp2["world_size"] == 2 and tp2["dp_size"] == 1
    assert tp2["losses"][0] == pytest.approx(tp1["losses"][0], rel=1e-6)
    assert tp2["grad_norms"][0] == pytest.approx(tp1["grad_norms"][0], rel=1e-5)
    # after Adam steps (lr 1e-2) reduction-order rounding is amplified (Adam normalises tiny
    # gradients to ~lr-sized updates), measured ~3e-6 after one step and ~1e-4 after two
    assert tp2["losses"][1] == pytest.approx(tp1["losses"][1], rel=1e-4)
    assert tp2["grad_norms"][1] == pytest.approx(tp1["grad_norms"][1], rel=1e-4)
    assert tp2["losses"][2] == pytest.approx(tp1["losses"][2], rel=1e-3)


# ------------------------------------------------------------------------------------------
# 8. optimizer: clip_grad and distributed optimizer type checks; one full train step
# ------------------------------------------------------------------------------------------


def _reference_step(model, tokens, labels, lr=1e-2, clip=1.0):
    """Plain torch: loss, backward, clip_grad_norm_, AdamW (no weight decay) on ``model``."""
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss = model(tokens, pos, causal_attention_mask(tokens.shape[1]), labels=labels).float().mean()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0).step()
    return loss.item(), grad_norm.item()


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_optimizer_cuda_checks_patch_full_train_step(dist, use_distributed_optimizer):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    with cpu_compat.without_patch("optimizer_cuda_checks"):
        from megatron.core.optimizer import clip_grads

        with pytest.raises(AssertionError):
            clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=10.0)
        # FP32Optimizer / MixedPrecisionOptimizer allocate their scales with device='cuda'
        with pytest.raises((AssertionError, RuntimeError), match=CUDA_ERROR):
            h.build_ddp_and_optimizer(_model(), use_distributed_optimizer=use_distributed_optimizer)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=10.0)
    assert torch.allclose(p.grad, torch.full((3,), 2.0 / (10.0 + 1e-6)))
    assert torch.zeros(2).type() == "torch.FloatTensor"  # scoped: no leak outside the calls
    with cpu_compat.cuda_type_names():
        assert torch.nn.Parameter(torch.zeros(2)).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(2).type(torch.float64).dtype == torch.float64  # conversions untouched
    _full_train_step_equals_reference(use_distributed_optimizer, fused=False)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_fused_cpu_adam_full_train_step(dist, use_distributed_optimizer):
    """moerl.runtime.cpu_compat.fused_cpu_adam (what every actor's optimizer gets on CPU) switches Megatron's
    torch AdamW to the fused kernel and keeps the step equal to plain torch's single-tensor AdamW."""
    _full_train_step_equals_reference(use_distributed_optimizer, fused=True)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_fused_cpu_adam_survives_a_checkpoint_load(dist, tmp_path, use_distributed_optimizer):
    """torch's load_state_dict replaces the param groups (kernel flags included) with the saved ones:
    loading a checkpoint written by a single-tensor optimizer (the previous version, a GPU run) keeps the
    running optimizer fused, and the next step still matches the single-tensor one."""
    from moerl.checkpoint.dist_ckpt import load_dist_checkpoint, save_dist_checkpoint
    from moerl.runtime.cpu_compat import fused_cpu_adam

    tokens, labels = h.fixed_batch(h.TINY_FIELDS["vocab_size"])
    model = _model()
    ddp, opt = h.build_ddp_and_optimizer(model, use_distributed_optimizer=use_distributed_optimizer)
    h.megatron_train_step(ddp, opt, tokens, labels)
    path = save_dist_checkpoint(ddp, opt, tmp_path / "ckpt")
    fresh = _model()
    fresh_ddp, fresh_opt = h.build_ddp_and_optimizer(fresh, use_distributed_optimizer=use_distributed_optimizer)
    assert fused_cpu_adam(fresh_opt) >= 1
    load_dist_checkpoint(fresh_ddp, fresh_opt, path)
    inner = [w.optimizer for w in getattr(fresh_opt, "chained_optimizers", None) or [fresh_opt]]
    assert all(g["fused"] is True and g["foreach"] is False for o in inner for g in o.param_groups)
    h.megatron_train_step(ddp, opt, tokens, labels)
    h.megatron_train_step(fresh_ddp, fresh_opt, tokens, labels)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def _full_train_step_equals_reference(use_distributed_optimizer: bool, fused: bool) -> None:
    from moerl.runtime.cpu_compat import fused_cpu_adam

    model = _model()
    reference = _model()
    reference.load_state_dict(model.state_dict())
    ddp, opt = h.build_ddp_and_optimizer(model, use_distributed_optimizer=use_distributed_optimizer)
    if fused:
        assert fused_cpu_adam(opt) >= 1
        inner = [w.optimizer for w in getattr(opt, "chained_optimizers", None) or [opt]]
        assert all(g["fused"] for o in inner for g in o.param_groups)
    tokens, labels = h.fixed_batch(h.TINY_FIELDS["vocab_size"])
    fwd_loss, _ = h.megatron_train_step(ddp, opt, tokens, labels, forward_only=True)
    loss, grad_norm = h.megatron_train_step(ddp, opt, tokens, labels)
    ref_loss, ref_grad_norm = _reference_step(reference, tokens, labels)
    assert fwd_loss == pytest.approx(ref_loss, rel=1e-6)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grad_norm == pytest.approx(ref_grad_norm, rel=1e-5)
    assert grad_norm > 1.0  # so clipping was active
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    after, _ = h.megatron_train_step(ddp, opt, tokens, labels, forward_only=True)
    assert after < fwd_loss


# ------------------------------------------------------------------------------------------
# cuda_synchronize (found while wiring dist_checkpointing)
# ------------------------------------------------------------------------------------------


def test_cuda_synchronize_patch(dist, tmp_path):
    from megatron.core import dist_checkpointing

    model = _model()
    with cpu_compat.without_patch("cuda_synchronize"):
        with pytest.raises((AssertionError, RuntimeError), match=CUDA_ERROR):
            torch.cuda.synchronize()
    assert torch.cuda.synchronize() is None
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path), sharded_strategy=("torch_dist", 1))
    assert (tmp_path / "metadata.json").exists()


# ------------------------------------------------------------------------------------------
# init_distributed / destroy_distributed
# ------------------------------------------------------------------------------------------


def test_init_destroy_twice_and_seeding():
    import random

    import numpy as np
    from megatron.core import parallel_state as ps

    for _ in range(2):
        info = init_distributed(seed=42, num_threads=1)
        try:
            assert isinstance(info, DistInfo)
            assert (info.rank, info.world_size, info.dp_size, info.tp_size, info.pp_size) == (0, 1, 1, 1, 1)
            assert info.backend == "gloo" and info.device == torch.device("cpu")
            assert ps.model_parallel_is_initialized()
            assert torch.get_num_threads() == 1
            assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(42)))
            assert random.random() == random.Random(42).random()
            assert np.random.rand() == np.random.RandomState(42).rand()
            with pytest.raises(RuntimeError, match="already initialised"):
                init_distributed()
        finally:
            destroy_distributed()
        assert not ps.model_parallel_is_initialized()
        assert not torch.distributed.is_initialized()
    destroy_distributed()  # no-op when nothing is initialised


def test_bad_layouts_raise_with_the_rule():
    with pytest.raises(ValueError, match=r"not divisible by tp_size\*pp_size"):
        init_distributed(tp_size=2)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"etp_size\*ep_size\*pp_size"):
        validate_layout(4, tp_size=2, pp_size=1, ep_size=4, etp_size=2)
    assert validate_layout(4, tp_size=2, pp_size=1, ep_size=2, etp_size=1) == 2
    assert validate_layout(8, tp_size=2, pp_size=2, ep_size=4, etp_size=1) == 2
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        init_distributed(tp_size=0)
    with pytest.raises(TypeError, match="ep_size"):
        init_distributed(ep_size=1.5)


def test_torchrun_env_single_rank(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    info = init_distributed(seed=3, num_threads=1)
    try:
        assert info.world_size == 1 and torch.distributed.get_world_size() == 1
    finally:
        destroy_distributed()
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        init_distributed()


# ------------------------------------------------------------------------------------------
# thd_rope (speed): packed RoPE without the per-sequence Python loop
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,mscale", [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float32, 1.3)])
def test_thd_rope_equals_megatrons_bit_for_bit(dtype, mscale):
    """moerl.models.packed_attention.packed_rotary_pos_emb gives megatron's unfused THD RoPE
    (rope_utils.apply_rotary_pos_emb with cu_seqlens) bit for bit, for q- and k-shaped inputs, and
    neither a new cu_seqlens nor one changed in place is served from the cache; the cases it does not
    vectorise go to the fallback."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    from moerl.models.packed_attention import packed_rotary_pos_emb

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    cfg = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    g = torch.Generator().manual_seed(0)
    inv = 1.0 / (5000.0 ** (torch.arange(0, 16, 2).float() / 16))
    for lengths in ([5, 1, 9, 3], [2, 7, 7, 1, 4]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        angles = torch.outer(torch.arange(max(lengths)).float(), inv)
        freqs = torch.cat([angles, angles], -1)[:, None, None, :]
        for heads in (4, 2):  # query, key (GQA)
            t = torch.randn(int(cu[-1]), heads, 16, generator=g).to(dtype)
            want = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, mscale=mscale, cp_group=OneRank())
            got = packed_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, mscale=mscale, cp_group=OneRank())
            assert got.dtype == want.dtype and torch.equal(got, want), (lengths, heads)
    cu.copy_(torch.tensor([0, 3, 6, 13, 14, 21], dtype=torch.int32))  # in place: not served from the cache
    want = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, mscale=mscale, cp_group=OneRank())
    assert torch.equal(packed_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, mscale=mscale, cp_group=OneRank()), want)
    calls = []
    for case in ({"cu_seqlens": None}, {"cfg": SimpleNamespace(**{**vars(cfg), "rotary_interleaved": True})}):
        packed_rotary_pos_emb(t, freqs, case.get("cfg", cfg), cu_seqlens=case.get("cu_seqlens", cu),
                              fallback=lambda *a, **k: calls.append(k) or t)
    assert len(calls) == 2


def test_thd_rope_patch_is_installed(dist):
    from megatron.core.transformer import attention

    assert "thd_rope" in cpu_compat.applied_patches()
    assert attention.apply_rotary_pos_emb.__wrapped__ is not attention.apply_rotary_pos_emb
    with cpu_compat.without_patch("thd_rope"):
        assert not hasattr(attention.apply_rotary_pos_emb, "__wrapped__")


# ------------------------------------------------------------------------------------------
# identity_chunk_sort (speed): no split + cat of the tokens when the local-expert order is the identity
# ------------------------------------------------------------------------------------------


def test_identity_chunk_sort_gives_megatrons_logits_and_gradients_bit_for_bit(dist):
    """One EP x TP rank with several local experts: the alltoall dispatcher's sort / unsort by local expert
    is skipped, and the logits and every parameter gradient equal the unpatched model's exactly (the reference:
    Megatron's own split + cat). The patched function really skips: the token dispatcher's
    sort_chunks_by_idxs returns its input object."""
    from megatron.core.transformer.moe import token_dispatcher

    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCat(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountCat.n += func is torch.ops.aten.cat.default
            return func(*args, **(kwargs or {}))

    tokens, pos = _batch()
    mask = causal_attention_mask(tokens.shape[1])
    out, cats = {}, {}
    for patched in (True, False):
        model = _model(moe_token_dispatcher_type="alltoall")
        CountCat.n = 0
        with contextlib.ExitStack() as stack:
            if not patched:
                stack.enter_context(cpu_compat.without_patch("identity_chunk_sort"))
            with CountCat():
                logits = model(tokens, pos, mask)
                logits.float().pow(2).mean().backward()
        cats[patched] = CountCat.n
        out[patched] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    # the patch really ran in the model: per MoE layer 3 forward cats (tokens, probs, outputs) and 3 backward fewer
    assert cats[False] - cats[True] == 6 * _hf().num_hidden_layers, cats
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][1].keys() == out[False][1].keys() and any("local_experts" in n for n in out[True][1])
    for n, g in out[True][1].items():
        assert torch.equal(g, out[False][1][n]), n
    x, probs = torch.randn(6, 4), torch.rand(6)
    got, got_probs = token_dispatcher.sort_chunks_by_idxs(x, torch.tensor([2, 1, 3]), torch.arange(3), probs=probs)
    assert got is x and got_probs is probs


def test_identity_chunk_sort_leaves_a_real_permutation_to_megatron(dist):
    """A non-identity order (tp * ep > 1) is Megatron's own result: chunks [2, 1, 3] of the rows in order 2, 0, 1."""
    from megatron.core.transformer.moe import token_dispatcher

    assert "identity_chunk_sort" in cpu_compat.applied_patches()
    x, probs = torch.arange(12.0).view(6, 2), torch.arange(6.0)
    got, got_probs = token_dispatcher.sort_chunks_by_idxs(x, torch.tensor([2, 1, 3]), torch.tensor([2, 0, 1]),
                                                          probs=probs)
    rows = [3, 4, 5, 0, 1, 2]  # chunk 2 = rows 3..5, chunk 0 = rows 0..1, chunk 1 = row 2
    assert torch.equal(got, x[rows]) and torch.equal(got_probs, probs[rows])
    with cpu_compat.without_patch("identity_chunk_sort"):
        assert not hasattr(token_dispatcher.sort_chunks_by_idxs, "__wrapped__")
