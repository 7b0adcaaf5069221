"""MegatronCritic (moerl.train.critic): values against transformers' Qwen3MoeForTokenClassification,
HF round trips (policy -> critic -> token-classification export), a clipped value-loss step that is
independent of the micro-batch cut, checkpoint round trips, and (slow) TP=2 / PP=2 / DP=2 / EP=2 on
gloo against one process.

Run one layout by hand (writes OUT_DIR/<case>.json and <case>.pt from rank 0):
    python -m torch.distributed.run --nproc_per_node 2 tests/test_critic.py tp2 OUT_DIR
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _mp_helpers as h  # noqa: E402
from test_actor import make_samples  # noqa: E402
from test_hf_convert import FIELDS, on_disk_state_dict, random_hf_model  # noqa: E402
from test_parallel_layouts import ADAM_EPS, GLOBAL_SAMPLES, MICRO_BATCH, MODEL, global_samples  # noqa: E402

from moerl.checkpoint.hf_convert import (  # noqa: E402
    ShardLayout,
    fused_experts_to_per_expert,
    hf_to_megatron,
    merge_megatron_shards,
)
from moerl.models.value_head import value_model_hf_config  # noqa: E402
from moerl.runtime.distributed import destroy_distributed, init_distributed  # noqa: E402
from moerl.train.batching import split_micro_batches, split_packed_micro_batches  # noqa: E402
from moerl.train.critic import MegatronCritic  # noqa: E402

VALUE_CLIP = 0.2


def token_classification_state_dict(hf_model, seed: int = 11) -> dict:
    """The policy's transformer weights (on-disk names, no lm_head) plus a random value head
    ``score.weight`` [1, H], ``score.bias`` [1]: a Qwen3MoeForTokenClassification(num_labels=1)."""
    sd = on_disk_state_dict(hf_model)
    sd.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(seed)
    sd["score.weight"] = 0.3 * torch.randn(1, hf_model.config.hidden_size, generator=g)
    sd["score.bias"] = torch.tensor([0.25])
    return sd


def critic_from(sd: dict, hf_config, **kw) -> MegatronCritic:
    kw.setdefault("lr", 1e-3)
    critic = MegatronCritic(hf_config, **kw)
    critic.load_hf_state_dict(sd)
    return critic


def clipped_value_loss(global_num_tokens: int, clip: float = VALUE_CLIP):
    """PPO's clipped value loss, token-mean over the GLOBAL batch:
    0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) summed over loss tokens / N."""

    def loss_fn(values, mb):
        old, ret = mb.extras["old_values"], mb.extras["returns"]
        v_clip = old + (values - old).clamp(-clip, clip)
        per_token = 0.5 * torch.maximum((values - ret) ** 2, (v_clip - ret) ** 2)
        loss = (per_token * mb.loss_mask).sum() / global_num_tokens
        clipped = ((v_clip - ret) ** 2 > (values - ret) ** 2).float() * mb.loss_mask
        return loss, {"vf_loss": float(loss.detach()), "vf_clipped": float(clipped.sum())}

    return loss_fn


def targets(samples) -> dict:
    """Layout-independent old values and returns per response token (some outside the clip range)."""
    old = [[0.3 * math.sin(s.index + 0.7 * j) for j in range(len(s.response_ids))] for s in samples]
    ret = [[0.6 * math.cos(1.3 * s.index + j) for j in range(len(s.response_ids))] for s in samples]
    return {"old_values": old, "returns": ret}


def response_values(critic, samples, mbs: int) -> dict[int, list[float]]:
    """sample index -> the critic's values at its response tokens' label positions."""
    batches = split_micro_batches(samples, mbs, 0)
    out = {}
    for mb, v in zip(batches, critic.compute_values(batches)):
        for i, resp in zip(mb.sample_indices, mb.gather_response(v)):
            out[samples[i].index] = resp.tolist()
    return out


def eval_loss(critic, samples) -> float:
    """The clipped value loss of ``samples`` under the critic's current weights (forward only)."""
    fields = targets(samples)
    batches = split_micro_batches(samples, len(samples), 0, fields)
    n_tok = int(sum(mb.loss_mask.sum() for mb in batches))
    fn = clipped_value_loss(n_tok)
    return sum(float(fn(v, mb)[0]) for mb, v in zip(batches, critic.compute_values(batches)))


def train(critic, samples, mbs: int) -> dict:
    batches = split_micro_batches(samples, mbs, 0, targets(samples))
    n_tok = int(sum(mb.loss_mask.sum() for mb in batches))
    return critic.train_step(batches, clipped_value_loss(n_tok))


def _restart():
    destroy_distributed()
    init_distributed(seed=0, num_threads=2)


# ----------------------------------------------------------------------------- fast
@pytest.mark.parametrize("packed", [False, True])
def test_values_match_transformers_token_classification(dist, tmp_path, packed):
    """Values of the exported critic, reloaded by transformers as Qwen3MoeForTokenClassification
    (num_labels=1), equal the critic's at every real position of every sample (padded and packed
    THD micro-batches)."""
    from transformers import AutoModelForTokenClassification

    from moerl.checkpoint.hf_io import save_hf_checkpoint

    hf = random_hf_model()
    critic = critic_from(token_classification_state_dict(hf), hf.config)
    save_hf_checkpoint(critic.export_hf_state_dict(), value_model_hf_config(hf.config), tmp_path / "critic")
    ref = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3MoeForTokenClassification" and ref.config.num_labels == 1

    samples = make_samples(FIELDS["vocab_size"])
    if packed:
        batches = split_packed_micro_batches(samples, [[0, 1, 2], [3, 4, 5]], 0)
    else:
        batches = split_micro_batches(samples, 4, 0)
    values = critic.compute_values(batches)
    worst, checked = 0.0, 0
    for mb, v in zip(batches, values):
        assert v.dtype == torch.float32 and v.shape == mb.loss_mask.shape
        for row, i in enumerate(mb.sample_indices):
            s = samples[i]
            with torch.no_grad():
                want = ref(torch.tensor([s.tokens])).logits[0, :, 0].double()
            worst = max(worst, float((v[row, : len(s.tokens)].double() - want).abs().max()))
            checked += len(s.tokens)
    assert checked == sum(len(s.tokens) for s in samples)
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("tied", [False, True])
def test_policy_to_critic_to_transformers_keeps_weights_bitwise(dist, tmp_path, tied):
    """HF policy (Qwen3MoeForCausalLM) -> critic -> export -> transformers
    Qwen3MoeForTokenClassification: every transformer weight bit for bit, the fresh value head zero."""
    from transformers import Qwen3MoeForTokenClassification

    from moerl.checkpoint.hf_io import save_hf_checkpoint

    hf = random_hf_model(tie_word_embeddings=tied)
    policy = on_disk_state_dict(hf)
    critic = critic_from(hf.state_dict(), hf.config)  # fused in-memory expert keys, lm_head included
    out = critic.export_hf_state_dict()
    assert set(out) == (set(policy) - {"lm_head.weight"}) | {"score.weight", "score.bias"}
    for k, v in policy.items():
        if k != "lm_head.weight":
            assert torch.equal(out[k], v), k
    assert torch.equal(out["score.weight"], torch.zeros(1, hf.config.hidden_size))
    assert torch.equal(out["score.bias"], torch.zeros(1))
    # a fresh critic predicts 0 everywhere
    assert all(float(v.abs().max()) == 0.0 for v in critic.compute_values(split_micro_batches(make_samples(100), 3, 0)))

    save_hf_checkpoint(out, value_model_hf_config(hf.config), tmp_path / "critic")
    loaded = Qwen3MoeForTokenClassification.from_pretrained(tmp_path / "critic", dtype=torch.float32)
    back = fused_experts_to_per_expert(loaded.state_dict(), loaded.config)
    assert set(back) == set(out)
    for k, v in out.items():
        assert torch.equal(back[k], v), k
    # and back into a critic from transformers' own (fused, in-memory) token-classification state dict
    again = critic_from(loaded.state_dict(), hf.config)
    assert all(torch.equal(v, out[k]) for k, v in again.export_hf_state_dict().items())


def test_train_step_lowers_the_loss_independently_of_the_cut(dist):
    """One clipped value-loss step lowers the loss on the same batch; cutting the global batch into 6
    micro-batches of 1 or one of 6 gives the same gradient and the same updated weights."""
    hf = random_hf_model()
    sd = token_classification_state_dict(hf)
    samples = make_samples(FIELDS["vocab_size"])
    results = []
    for mbs in (1, len(samples)):
        # the per-micro-batch aux loss depends on the cut by design (Megatron "aux_loss"): left out
        critic = critic_from(sd, hf.config, lr=1e-3, adam_eps=ADAM_EPS, moe_aux_loss_coeff=0.0)
        before = eval_loss(critic, samples)
        m = train(critic, samples, mbs)
        after = eval_loss(critic, samples)
        assert m["vf_loss"] == pytest.approx(before, rel=1e-5)  # metrics summed over micro-batches
        assert m["vf_clipped"] > 0 and m["update_successful"] == 1.0
        assert after < before, (before, after)
        grads = torch.cat([p.main_grad.detach().flatten() for p in critic.model.parameters()])
        results.append((m["grad_norm"], grads, critic.export_hf_state_dict()))
        _restart()
    (g0, p0, w0), (g1, p1, w1) = results
    assert g0 > 0 and g1 == pytest.approx(g0, rel=1e-5)
    assert float((p1 - p0).abs().max() / p0.abs().max()) <= 1e-5  # fp32 summation order
    moved = max(float((w0[k] - sd[k]).abs().max()) for k in sd)
    assert moved > 1e-4
    worst = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
    assert worst <= 1e-6, worst


def test_trunk_trains_through_a_zero_head(dist):
    """From a policy (zero head) the first step moves the head only, the second the trunk too (without
    the MoE balancing loss, which moves the routers and what feeds them from the first step on)."""
    hf = random_hf_model()
    policy = on_disk_state_dict(hf)
    critic = critic_from(hf.state_dict(), hf.config, lr=1e-3, moe_aux_loss_coeff=0.0)
    samples = make_samples(FIELDS["vocab_size"])
    train(critic, samples, 3)
    w1 = critic.export_hf_state_dict()
    assert float(w1["score.weight"].abs().max()) > 0
    assert all(torch.equal(w1[k], v) for k, v in policy.items() if k != "lm_head.weight")
    train(critic, samples, 3)
    w2 = critic.export_hf_state_dict()
    assert not torch.equal(w2["model.norm.weight"], policy["model.norm.weight"])


def test_save_load_restores_values_and_optimizer(dist, tmp_path):
    """A critic restored from save() predicts the same values and its next step (Adam moments and
    step count restored) gives the same weights as the critic that saved it."""
    hf = random_hf_model()
    sd = token_classification_state_dict(hf)
    samples = make_samples(FIELDS["vocab_size"])
    a = critic_from(sd, hf.config, lr=1e-3, moe_aux_loss_coeff=1e-2)
    train(a, samples, 2)
    a.save(tmp_path / "ckpt" / "critic", extra={"step": 1})
    values_a = response_values(a, samples, 3)
    train(a, samples, 2)
    after_a = a.export_hf_state_dict()
    _restart()

    b = critic_from(hf.state_dict(), hf.config, lr=1e-3, moe_aux_loss_coeff=1e-2)  # other weights, fresh Adam
    assert response_values(b, samples, 3) != values_a
    assert b.load(tmp_path / "ckpt" / "critic") == {"step": 1}
    assert response_values(b, samples, 3) == values_a
    train(b, samples, 2)
    after_b = b.export_hf_state_dict()
    assert all(torch.equal(after_b[k], after_a[k]) for k in after_a)


def test_refuses_dualpipe_and_log_probs(dist):
    hf = random_hf_model()
    with pytest.raises(ValueError, match="train.pipeline_schedule='dualpipev'"):
        MegatronCritic(hf.config, lr=1e-3, pipeline_schedule="dualpipev")
    critic = critic_from(hf.state_dict(), hf.config)
    with pytest.raises(TypeError, match="compute_values"):
        critic.compute_log_probs(split_micro_batches(make_samples(100), 3, 0), 1.0)
    bad = token_classification_state_dict(hf)
    bad["score.weight"] = torch.zeros(2, hf.config.hidden_size)
    with pytest.raises(ValueError, match="num_labels=1"):
        critic.load_hf_state_dict(bad)


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_value_head_shards_merge_back_bit_for_bit(tp, pp, ep):
    """hf_convert's head="value": the score layer sits whole on every TP rank of the last stage and
    the shards of a layout merge back into the token-classification state dict bit for bit."""
    model = random_hf_model(**MODEL)
    sd = token_classification_state_dict(model)
    shards = {}
    for tr in range(tp):
        for pr in range(pp):
            for er in range(ep):
                layout = ShardLayout(tp_size=tp, tp_rank=tr, pp_size=pp, pp_rank=pr, ep_size=ep, ep_rank=er)
                shard = hf_to_megatron(sd, model.config, layout, head="value")
                has_head = {"output_layer.weight", "output_layer.bias"} <= set(shard)
                assert has_head == layout.is_last_stage and not any(k.startswith("output_layer.") and k not in (
                    "output_layer.weight", "output_layer.bias") for k in shard)
                if has_head:
                    assert torch.equal(shard["output_layer.weight"], sd["score.weight"])
                    assert torch.equal(shard["output_layer.bias"], sd["score.bias"])
                shards[layout] = shard
    back = merge_megatron_shards(shards, model.config, head="value")
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="unexpected"):  # a policy's LM head is not a value head
        hf_to_megatron(on_disk_state_dict(model), model.config, head="value")


# ----------------------------------------------------------------------------- slow: layouts on gloo
LAYOUTS = {
    "ref": dict(nproc=1),
    "tp2": dict(nproc=2, tp=2),  # sequence parallel
    "pp2": dict(nproc=2, pp=2, tied=True),  # 1F1B; a tied policy (the critic unties it)
    "dp2": dict(nproc=2, distopt=True),
    "ep2": dict(nproc=2, ep=2),  # experts split, dense weights data-parallel over the 2 ranks
}


def run_layout(case: str, out_dir: Path) -> None:
    import torch.distributed as dist

    spec = LAYOUTS[case]
    info = init_distributed(tp_size=spec.get("tp", 1), pp_size=spec.get("pp", 1), ep_size=spec.get("ep", 1), seed=0,
                            num_threads=1)
    try:
        hf = random_hf_model(seed=0, tie_word_embeddings=spec.get("tied", False), **MODEL)
        critic = critic_from(token_classification_state_dict(hf), hf.config, lr=1e-3, adam_eps=ADAM_EPS,
                             clip_grad=1.0, moe_aux_loss_coeff=1e-2,
                             use_distributed_optimizer=spec.get("distopt", False))
        samples = global_samples()
        per_rank = GLOBAL_SAMPLES // info.dp_size
        mine = samples[info.dp_rank * per_rank:(info.dp_rank + 1) * per_rank]
        values0 = response_values(critic, mine, MICRO_BATCH)
        batches = split_micro_batches(mine, MICRO_BATCH, 0, targets(mine))
        n_tok = sum(sum(s.loss_mask) for s in samples)
        metrics = critic.train_step(batches, clipped_value_loss(n_tok))
        values1 = response_values(critic, mine, MICRO_BATCH)
        export = critic.export_hf_state_dict(dst=0)
        everything = [None] * info.world_size
        dist.all_gather_object(everything, dict(rank=info.rank, dp_rank=info.dp_rank, values0=values0,
                                                values1=values1, metrics=metrics, export_keys=len(export)))
        if info.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(export, out_dir / f"{case}.pt")
            (out_dir / f"{case}.json").write_text(json.dumps(everything))
    finally:
        destroy_distributed()


def launch(case: str, out_dir: Path, timeout: float = 300.0) -> tuple[list[dict], dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(LAYOUTS[case]["nproc"]),
           "--master_addr", "127.0.0.1", "--master_port", str(h.free_port()), str(Path(__file__).resolve()),
           case, str(out_dir)]
    proc = subprocess.run(cmd, env=h.subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {case} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return json.loads((out_dir / f"{case}.json").read_text()), torch.load(out_dir / f"{case}.pt")


@pytest.fixture(scope="module")
def ref_layout(tmp_path_factory):
    out = tmp_path_factory.mktemp("critic_layouts")
    return out, launch("ref", out)


@pytest.mark.slow
# tp2 and pp2 are slow_extra (CI's 30-min budget): the critic's DP 2 and EP 2 against one process stay in CI, and TP 2
# / PP 2 of the same Megatron model are the actor's (test_parallel_layouts). What leaves CI: the value head under TP
# and PP.
@pytest.mark.parametrize("case", [pytest.param("tp2", marks=pytest.mark.slow_extra),
                                  pytest.param("pp2", marks=pytest.mark.slow_extra), "dp2", "ep2"])
def test_layout_matches_one_process(ref_layout, case):
    """Values before and after one step, the loss, grad norm, aux loss and the updated weights of a
    2-process layout equal one process's (the tolerances of tests/test_parallel_layouts.py)."""
    out, ((ref,), ref_export) = ref_layout
    ranks, export = launch(case, out)
    assert len(ranks) == LAYOUTS[case]["nproc"]
    assert ref["metrics"]["vf_clipped"] > 0 and ref["metrics"]["grad_norm"] > 0 and ref["metrics"]["aux_loss"] > 0
    for r in ranks:
        m = r["metrics"]
        assert abs(m["vf_loss"] - ref["metrics"]["vf_loss"]) <= 1e-5, (m["vf_loss"], ref["metrics"]["vf_loss"])
        assert m["vf_clipped"] == ref["metrics"]["vf_clipped"]
        assert m["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
        assert m["aux_loss"] == pytest.approx(ref["metrics"]["aux_loss"], rel=1e-5)
        assert r["export_keys"] == (len(ref_export) if r["rank"] == 0 else 0)
        for key in ("values0", "values1"):  # every rank (all pipeline stages) has its DP rank's samples
            assert set(r[key]) <= set(ref[key])
            assert len(r[key]) == GLOBAL_SAMPLES // (2 if case in ("dp2", "ep2") else 1)
            worst = max(abs(a - b) for k, v in r[key].items() for a, b in zip(v, ref[key][k]))
            assert worst <= 1e-5, (r["rank"], key, worst)
    assert max(abs(a - b) for k, v in ref["values1"].items() for a, b in zip(v, ref["values0"][k])) > 1e-3
    assert set(export) == set(ref_export)
    for k, want in ref_export.items():
        rel = float((export[k] - want).abs().max() / want.abs().max().clamp_min(1e-30))
        assert rel <= 1e-5, (k, rel)


if __name__ == "__main__":
    run_layout(sys.argv[1], Path(sys.argv[2]))
    from moerl.cli import exit_without_teardown

    exit_without_teardown(0)  # results written: skip the module teardown (about 1 s of CPU per rank)
