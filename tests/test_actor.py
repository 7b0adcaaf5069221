"""MegatronActor (moerl.train.actor): log-probs against a transformers forward, the step-0 ratio
check, and gradients that do not depend on how the batch is cut into micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_convert import FIELDS, random_hf_model  # noqa: E402

from moerl.checkpoint.hf_convert import fused_experts_to_per_expert  # noqa: E402
from moerl.models.qwen3_moe import make_hf_config  # noqa: E402
from moerl.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402
from moerl.train.actor import MegatronActor  # noqa: E402
from moerl.train.batching import split_micro_batches, split_packed_micro_batches  # noqa: E402
from moerl.train.losses import policy_loss, sft_loss  # noqa: E402
from moerl.types import Sample  # noqa: E402

ALGO = SimpleNamespace(policy_loss="gspo", eps_clip_low=3e-4, eps_clip_high=4e-4,
                       loss_agg_mode="seq-mean-token-mean", kl_coef=0.0, kl_estimator="k3")


def make_samples(vocab, n=6, seed=3):
    """Samples of different prompt and response lengths (1..4 response tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(2, 7, (1,), generator=g))
        r = 1 + i % 4
        ids = torch.randint(1, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(index=i, group_id=i // 2, prompt="", label="", prompt_ids=ids[:p],
                          response_ids=ids[p:], loss_mask=[1] * r, advantage=float(i % 3) - 1.0))
    return out


def actor_with(hf_model, **kw):
    actor = MegatronActor(make_hf_config(FIELDS), **kw)
    actor.load_hf_state_dict(hf_model.state_dict())
    return actor


def test_log_probs_match_transformers(dist):
    hf = random_hf_model()
    actor = actor_with(hf, trainable=False)
    samples = make_samples(FIELDS["vocab_size"])
    temperature = 0.7
    results = actor.compute_log_probs(split_micro_batches(samples, 4, pad_id=0), temperature)
    worst = 0.0
    for mb, lp, _ in results:
        for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
            s = samples[i]
            with torch.no_grad():
                logits = hf(torch.tensor([s.tokens])).logits[0].double() / temperature
            ref = torch.log_softmax(logits, -1)
            start = len(s.prompt_ids) - 1
            want = torch.stack([ref[start + t, tok] for t, tok in enumerate(s.response_ids)])
            worst = max(worst, float((resp.double() - want).abs().max()))
    assert worst <= 1e-5, worst


def test_export_round_trips_hf_weights(dist):
    hf = random_hf_model()
    actor = actor_with(hf, trainable=False)
    ref = fused_experts_to_per_expert(hf.state_dict(), make_hf_config(FIELDS))
    out = actor.export_hf_state_dict()
    assert set(out) == set(ref) - {"lm_head.weight"} or set(out) == set(ref)
    for k, v in out.items():
        assert torch.equal(v, ref[k]), k


def _old_log_probs(actor, samples, mbs):
    old = [None] * len(samples)
    for mb, lp, _ in actor.compute_log_probs(split_micro_batches(samples, mbs, 0), 1.0):
        for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
            old[i] = resp.tolist()
    return old


def _policy_step(actor, samples, old, mbs):
    mbatches = split_micro_batches(samples, mbs, 0, {"old_log_probs": old})
    n_tok = int(sum(mb.loss_mask.sum() for mb in mbatches))
    return actor.train_step(mbatches, policy_loss(ALGO, global_num_tokens=n_tok, global_num_seqs=len(samples)), 1.0)


def test_ratio_is_exactly_one_before_first_update(dist):
    hf = random_hf_model()
    actor = actor_with(hf, lr=1e-3)
    samples = make_samples(FIELDS["vocab_size"])
    old = _old_log_probs(actor, samples, 3)
    m = _policy_step(actor, samples, old, 3)
    assert m["logratio_abs_sum"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    # after the update the same data no longer gives ratio 1: the check can fail
    m2 = _policy_step(actor, samples, old, 3)
    assert m2["logratio_abs_sum"] > 0.0


@pytest.mark.parametrize("loss", ["gspo", "sft"])
def test_update_independent_of_micro_batch_cut(dist, loss):
    hf = random_hf_model()
    samples = make_samples(FIELDS["vocab_size"])
    results = []
    for mbs in (1, 2, len(samples)):
        # the per-micro-batch aux loss depends on the cut by design (Megatron "aux_loss"): leave it out
        actor = actor_with(hf, lr=1e-2, clip_grad=0.0, moe_aux_loss_coeff=0.0)
        if loss == "gspo":
            old = [[x - 0.05 * (j + 1) for j, x in enumerate(v)] for v in _old_log_probs(actor, samples, 6)]
            m = _policy_step(actor, samples, old, mbs)
        else:
            mbatches = split_micro_batches(samples, mbs, 0)
            n_tok = int(sum(mb.loss_mask.sum() for mb in mbatches))
            m = actor.train_step(mbatches, sft_loss(n_tok), 1.0)
        grads = torch.cat([p.main_grad.detach().flatten() for p in actor.model.parameters()])
        results.append((m["grad_norm"], grads))
        destroy_distributed()
        init_distributed(seed=0, num_threads=2)
    (g0, p0) = results[0]
    assert g0 > 0
    for g, p in results[1:]:
        assert g == pytest.approx(g0, rel=1e-5)
        assert float((p - p0).abs().max() / p0.abs().max()) <= 1e-5  # fp32 summation order


def test_padding_does_not_change_the_update_aux_loss_included(dist):
    """The same micro-batch, once as cut and once padded to a longer sequence with two extra
    all-padding rows (what pipeline padding does), gives the same aux loss and the same updated
    parameters: padded tokens stay out of Megatron's load-balancing loss (padding_mask)."""
    from moerl.train.actor import _pad_micro_batch
    from moerl.train.batching import padding_mask

    hf = random_hf_model()
    samples = make_samples(FIELDS["vocab_size"], n=4)
    results = []
    for extra in (False, True):
        actor = actor_with(hf, lr=1e-2, moe_aux_loss_coeff=1e-1)
        old = _old_log_probs(actor, samples, 4)
        (mb,) = split_micro_batches(samples, 4, 0, {"old_log_probs": old})
        if extra:
            b, s = mb.tokens.shape
            mb = _pad_micro_batch(mb, b + 2, s + 5)
            mask = padding_mask(mb)
            assert mask.shape == (b + 2, s + 5) and mask[b:].all() and mask[:, s:].all()
            assert int((~mask).sum()) == sum(len(x.prompt_ids) + len(x.response_ids) for x in samples)
        n_tok = int(mb.loss_mask.sum())
        m = actor.train_step([mb], policy_loss(ALGO, global_num_tokens=n_tok, global_num_seqs=len(samples)), 1.0)
        results.append((m["aux_loss"], torch.cat([p.main_grad.detach().flatten() for p in actor.model.parameters()])))
        destroy_distributed()
        init_distributed(seed=0, num_threads=2)
    (a0, g0), (a1, g1) = results
    assert a0 > 0 and a1 == pytest.approx(a0, rel=1e-6)
    assert float((g1 - g0).abs().max()) <= 1e-5 * float(g0.abs().max())  # fp32 summation order


@pytest.mark.parametrize("correction", ["none", "decoupled"])
def test_old_log_probs_from_the_update_forward_give_the_same_update(dist, correction):
    """algorithm.recompute_old_log_probs: ONE update without an old-log-prob pass (the loss takes the proximal
    log-probs from its own forward, detached) gives the loss, metrics and updated weights of the update after
    a separate pass, bit for bit, with and without an off-policy correction; its train/rollout mismatch metrics
    equal moerl.algorithms.off_policy.rollout_mismatch_metrics of that pass (the reference)."""
    from moerl.algorithms.off_policy import rollout_mismatch_metrics
    from moerl.train.losses import update_mismatch_metrics

    hf = random_hf_model()
    samples = make_samples(FIELDS["vocab_size"])
    g = torch.Generator().manual_seed(5)
    behaviour = [(-1.0 - torch.rand(len(s.response_ids), generator=g, dtype=torch.float64)).tolist() for s in samples]
    algo = SimpleNamespace(**vars(ALGO), off_policy_correction=correction, is_level="token", is_cap=2.0,
                           is_lower=0.0, icepop_beta=2.0)
    runs = {}
    for recompute in (True, False):
        actor = actor_with(hf, lr=1e-2, clip_grad=0.0)
        fields = {"behaviour_log_probs": behaviour}
        if recompute:
            old = fields["old_log_probs"] = _old_log_probs(actor, samples, 3)
        mbatches = split_micro_batches(samples, 3, 0, fields)
        n_tok = int(sum(mb.loss_mask.sum() for mb in mbatches))
        m = actor.train_step(mbatches, policy_loss(algo, global_num_tokens=n_tok, global_num_seqs=len(samples)), 1.0)
        runs[recompute] = m, actor.export_hf_state_dict()
    (m_pass, w_pass), (m_fused, w_fused) = runs[True], runs[False]
    assert m_pass["logratio_abs_sum"] == 0.0 and float(m_pass["grad_norm"]) > 0
    for k, v in m_pass.items():
        assert m_fused[k] == v, k
    for k, v in w_pass.items():
        assert torch.equal(w_fused[k], v), k
    want = rollout_mismatch_metrics(old, behaviour)
    got = update_mismatch_metrics({f"train/{k}": v for k, v in m_fused.items()})
    assert got["train/old_log_probs_from_update"] == 1.0
    for k, v in want.items():  # the micro-batch holds the behaviour log-probs in float32: rounding ~1e-7
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


@pytest.mark.parametrize("packed", [False, True])
def test_fused_log_probs_on_response_rows_only_give_the_same_update(dist, monkeypatch, packed):
    """A training forward with the fused log-prob computes it only at the response rows
    (moerl.train.batching.response_rows): the loss, metrics and gradients equal those of the
    same step over every row (prompt rows included), with an entropy bonus so the entropy's gradient
    is checked too; packed THD and padded micro-batches. The rows are exactly the response labels."""
    from moerl.train import actor as actor_mod
    from moerl.train.batching import make_packed_micro_batch, response_rows

    hf = random_hf_model()
    samples = make_samples(FIELDS["vocab_size"])
    algo = SimpleNamespace(**vars(ALGO), entropy_coef=0.01)
    fields = None
    runs = []
    for restrict in (True, False):
        actor = actor_with(hf, lr=1e-2, clip_grad=0.0, fused_logprob=True)
        actor.entropy_grad = True  # what moerl.train.components sets for algorithm.entropy_coef > 0
        if fields is None:
            fields = {"old_log_probs": [[x - 0.05 for x in v] for v in _old_log_probs(actor, samples, 6)]}
        if packed:
            mbatches = [make_packed_micro_batch(samples[:4], [0, 1, 2, 3], 0, {k: v[:4] for k, v in fields.items()}),
                        make_packed_micro_batch(samples[4:], [4, 5], 0, {k: v[4:] for k, v in fields.items()})]
        else:
            mbatches = split_micro_batches(samples, 2, 0, fields)
        if restrict:  # the rows: every response label, nothing else
            for mb in mbatches:
                rows = response_rows(mb)
                labels = (mb.packed_labels if packed else mb.labels).reshape(-1)
                want = [tok for i in mb.sample_indices for tok in samples[i].response_ids]
                assert labels[rows].tolist() == want
        else:
            monkeypatch.setattr(actor_mod, "response_rows", lambda mb: None)
        n_tok = int(sum(mb.loss_mask.sum() for mb in mbatches))
        m = actor.train_step(mbatches, policy_loss(algo, global_num_tokens=n_tok, global_num_seqs=len(samples)), 1.0)
        runs.append((m, torch.cat([p.main_grad.detach().flatten() for p in actor.model.parameters()])))
        monkeypatch.undo()
        destroy_distributed()
        init_distributed(seed=0, num_threads=2)
    (m_rows, g_rows), (m_all, g_all) = runs
    assert float(m_all["grad_norm"]) > 0 and m_all["entropy_loss"] != 0
    for k, v in m_all.items():
        assert m_rows[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert float((g_rows - g_all).abs().max()) <= 1e-5 * float(g_all.abs().max())  # fp32 summation order


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_log_prob_ratio_is_exactly_one_on_small_micro_batches(dist, dtype, packed):
    """The step-0 check with the fused log-prob: micro-batches of 3 samples hold 6-7 response tokens, where CPU
    BLAS takes another GEMM path than for all B x S rows (found by review: an old-log-prob pass over every row
    then differed from the update's response rows by an ulp, ratio != 1). compute_log_probs computes the same
    response rows as train_step, so the ratio is exactly 1; with response_only=False it computes every row and
    agrees with the rows to rounding."""
    hf = random_hf_model()
    actor = actor_with(hf, lr=1e-3, fused_logprob=True, params_dtype=dtype)
    samples = make_samples(FIELDS["vocab_size"], n=6, seed=5)

    def micro_batches(fields=None):
        if packed:
            return split_packed_micro_batches(samples, [[0, 1, 2], [3, 4, 5]], 0, fields)
        return split_micro_batches(samples, 3, 0, fields)

    old, every_row = [None] * 6, [None] * 6
    for target, response_only in ((old, True), (every_row, False)):
        for mb, lp, _ in actor.compute_log_probs(micro_batches(), 1.0, response_only=response_only):
            for i, resp in zip(mb.sample_indices, mb.gather_response(lp)):
                target[i] = resp.tolist()
    for a, b in zip(old, every_row):
        assert a == pytest.approx(b, abs=1e-5)
    mbs = micro_batches({"old_log_probs": old})
    n_tok = int(sum(mb.loss_mask.sum() for mb in mbs))
    m = actor.train_step(mbs, policy_loss(ALGO, global_num_tokens=n_tok, global_num_seqs=len(samples)), 1.0)
    assert m["logratio_abs_sum"] == 0.0


def test_set_step_lr_sets_the_size_of_the_next_adam_step(dist):
    """Adam's first step moves every parameter by lr * g / (|g| + eps) (bias-corrected moments m = g, v = g^2):
    about lr for a parameter with |g| >> eps. An actor built at lr 1 and set to 1e-3 by set_step_lr (the SFT
    warm-up, moerl.train.sft) moves them by 1e-3; the Adam moments are those of the same optimizer."""
    hf = random_hf_model()
    samples = make_samples(FIELDS["vocab_size"])
    actor = actor_with(hf, lr=1.0, clip_grad=0.0, moe_aux_loss_coeff=0.0)
    optimizer = actor.optimizer
    actor.set_step_lr(1e-3)
    assert actor.optimizer is optimizer and all(g["lr"] == 1e-3 for g in optimizer.param_groups)
    before = [p.detach().clone() for p in actor.model.parameters()]
    mbatches = split_micro_batches(samples, len(samples), 0)
    actor.train_step(mbatches, sft_loss(int(sum(mb.loss_mask.sum() for mb in mbatches))), 1.0)
    steps, grads = [], []
    for p, b in zip(actor.model.parameters(), before):
        steps.append((p.detach() - b).flatten())
        grads.append(p.main_grad.detach().flatten())
    step, grad = torch.cat(steps), torch.cat(grads)
    big = grad.abs() > 1e-5  # |g| >> eps = 1e-8: the step is lr to within 0.1%
    assert int(big.sum()) > 1000
    torch.testing.assert_close(step[big].abs(), torch.full_like(step[big], 1e-3), rtol=1e-3, atol=0)
    assert bool((torch.sign(step[big]) == -torch.sign(grad[big])).all())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_recipe_initializer_range_is_the_init_std(dist, model_type):
    """model.hf_config.initializer_range (the tiny recipe's 0.08) reaches Megatron's init_method_std in every
    model family: the word embedding and a QKV projection (4096+ entries each) have that sample std (+-5%; DeepSeek-V3: the MLA query up-projection)."""
    from moerl.config import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "tiny_arith.yaml"),
                      [f"model.hf_config.model_type={model_type}", "model.hf_config.vocab_size=128"]
                      + (["model.hf_config.kv_lora_rank=32", "model.hf_config.qk_nope_head_dim=16",
                          "model.hf_config.qk_rope_head_dim=16", "model.hf_config.v_head_dim=32"]
                         if model_type == "deepseek_v3" else []))
    assert cfg.model.hf_config.initializer_range == 0.08
    family = __import__(f"moerl.models.families.{model_type}", fromlist=["make_hf_config"])
    actor = MegatronActor(family.make_hf_config(cfg.model.hf_config.family_fields()))
    stds = {name: float(p.detach().std()) for name, p in actor.model.named_parameters()
            if name.endswith(("word_embeddings.weight", "layers.0.self_attention.linear_qkv.weight",
                              "layers.0.self_attention.linear_q_up_proj.weight"))}
    assert len(stds) == 2, sorted(stds)
    for name, std in stds.items():
        assert std == pytest.approx(0.08, rel=0.05), (name, std)
