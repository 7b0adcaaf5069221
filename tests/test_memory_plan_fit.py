"""`moerl plan` answers "does this recipe fit, and if not which layout does" (issue 21): sequence lengths
from the recipe, the GPU table, FITS / DOES NOT FIT verdicts, reference policy and critic on the
trainer's ranks, colocated SGLang engines' KV cache, DualPipe(V) memory, the layout search with its
step-time model, and one-line exit-2 errors for bad values. Expected numbers are worked by hand from
the recipes' shapes (Qwen/Qwen3-30B-A3B and deepseek-ai/DeepSeek-V3 config.json) and the formulas'
sources; the critic's parameter count is checked against the built Megatron critic."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_convert import FIELDS  # noqa: E402

from moerl.config import load_config  # noqa: E402
from moerl.parallel.hardware import GPUS, gpu_spec  # noqa: E402
from moerl.parallel.memory_plan import (  # noqa: E402
    GIB,
    ModelShape,
    critic_param_counts,
    format_plan,
    kv_bytes_per_token,
    main,
    plan_memory,
    plan_recipe,
    rank_param_counts,
    total_params,
)
from moerl.parallel.plan_search import pipeline_split, search_layouts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DS = REPO / "configs" / "deepseek_v3_671b.yaml"
QWEN = REPO / "configs" / "qwen3_30b_a3b.yaml"
MATH = REPO / "configs" / "qwen3_30b_a3b_math.yaml"


def test_gpu_table():
    assert (gpu_spec("h100").memory_gib, gpu_spec("H100_SXM").bf16_tflops, gpu_spec("H100").fp8_tflops) == (80, 989, 1979)
    assert gpu_spec("h200").memory_gib == 141 and gpu_spec("B200").bf16_tflops == 2250 and gpu_spec("A100").fp8_tflops is None
    assert all(g.source and g.memory_gib > 0 and g.bf16_tflops > 0 for g in GPUS.values())
    with pytest.raises(ValueError, match=r"hardware.gpu 'H1000' is not a known GPU; known: A100-40GB, A100, H100"):
        gpu_spec("H1000")


def test_sequence_length_comes_from_the_recipe():
    ds = plan_recipe(load_config(DS))  # pp 16: padded micro-batches of train.micro_batch_size samples
    w = ds.workload
    assert (w.sample_tokens, w.seq_length, w.micro_batch_size, w.packed) == (2048 + 4096, 6144, 1, False)
    assert w.num_microbatches == 512 // 16 and ds.memory.seq_length == 6144  # not max_position_embeddings (163840)
    qwen = plan_recipe(load_config(QWEN))  # pp 1, train.pack: a sample longer than the 2048-token cap is alone
    assert (qwen.workload.seq_length, qwen.workload.packed) == (2048 + 8192, True)
    assert qwen.workload.num_microbatches == math.ceil(256 * 10240 / (2 * 10240))
    big = plan_recipe(load_config(QWEN, ["train.max_tokens_per_micro_batch=32768"])).workload
    assert (big.seq_length, big.num_microbatches) == (32768, math.ceil(256 * 10240 / (2 * 32768)))
    padded = plan_recipe(load_config(QWEN, ["train.pack=false", "train.micro_batch_size=2"])).workload
    assert (padded.seq_length, padded.micro_batch_size, padded.num_microbatches) == (10240, 2, 64)
    assert plan_recipe(load_config(QWEN), seq_length=300).workload.seq_length == 2048  # --seq-length: the sample


def test_verdicts_per_stage_and_headroom():
    plan = plan_recipe(load_config(DS, ["hardware.gpu=H100"]), recipe="ds")
    usable = 80 * GIB * 0.9
    assert plan.hardware.usable_bytes == usable
    text = format_plan(plan)
    for st in plan.memory.stages:  # one verdict per pipeline stage, with its headroom
        total = st.total("full")
        word = "FITS (+" if total <= usable else "DOES NOT FIT (-"
        assert f"{word}{abs(usable - total) / GIB:.2f} GiB headroom)" in text
    assert plan.fits() == (plan.memory.worst().total("full") <= usable)
    small = plan_recipe(load_config(DS, ["hardware.gpu=A100-40GB"]))
    assert small.fits() is False and "answer: DOES NOT FIT on 256 x A100-40GB" in format_plan(small)
    assert plan_recipe(load_config(DS, ["hardware.gpu=H200"])).fits() is True
    assert plan_recipe(load_config(DS)).fits() is None  # no GPU named: sizes only


def test_reference_and_critic_memory(dist):
    from moerl.models.qwen3_moe import make_hf_config
    from moerl.train.critic import MegatronCritic

    for tied in (False, True):
        cfg = make_hf_config({**FIELDS, "num_hidden_layers": 2, "tie_word_embeddings": tied})
        critic = MegatronCritic(cfg, lr=1e-3)
        built = sum(p.numel() for p in critic.model.parameters())
        from moerl.checkpoint.hf_convert import ShardLayout

        assert critic_param_counts(cfg, ShardLayout())["total"] == built
        # the critic: policy minus the LM head (untied: the output layer; tied: nothing extra) plus H + 1
        policy = rank_param_counts(cfg, ShardLayout())["total"]
        assert built == policy - (0 if tied else cfg.vocab_size * cfg.hidden_size) + cfg.hidden_size + 1
    shape = ModelShape.from_hf_config(cfg)
    base = plan_memory(shape, world_size=1, params_dtype="bfloat16", seq_length=8).stages[0]
    both = plan_memory(shape, world_size=1, params_dtype="bfloat16", seq_length=8, reference_policy=True,
                       critic=True).stages[0]
    c = critic_param_counts(shape, ShardLayout())["total"]
    assert both.reference == 2 * base.params  # bf16 frozen copy
    assert both.critic == c * (2 + 4 + 12)  # bf16 weights, fp32 grads, fp32 master + 2 Adam moments
    assert both.total("none") == pytest.approx(base.total("none") + both.reference + both.critic)


def test_dualpipe_holds_mirrored_stages():
    shape = ModelShape.from_hf_config(__import__("moerl.models.qwen3_moe", fromlist=["x"]).make_hf_config(
        {**FIELDS, "num_hidden_layers": 4}))
    whole = total_params(shape)["total"]
    dual = plan_memory(shape, world_size=2, pp_size=2, seq_length=8, num_microbatches=8, pipeline_schedule="dualpipe")
    assert [st.params for st in dual.stages] == [whole, whole]  # stage r + stage 1 - r = the model, twice over 2 ranks
    v = plan_memory(shape, world_size=2, pp_size=2, seq_length=8, num_microbatches=8, pipeline_schedule="dualpipev")
    assert sum(st.params for st in v.stages) == whole and [st.layers for st in v.stages] == [2, 2]
    h, vocab = shape.hidden_size, shape.vocab_size
    assert v.stages[0].params - v.stages[1].params == 2 * vocab * h + h  # rank 0: embedding, output layer, final norm
    assert [st.in_flight for st in v.stages] == [1.5, 1.5]  # pp + 1 = 3 micro-batches of half a stage
    one = plan_memory(shape, world_size=2, pp_size=2, seq_length=8, num_microbatches=8)
    assert one.stages[0].activations["none"] > v.stages[1].activations["none"]


def test_colocated_rollout_kv_cache_by_hand():
    qwen = ModelShape.from_recipe(load_config(QWEN), 151936)
    assert kv_bytes_per_token(qwen, 4) == 2 * 48 * 1 * 128 * 2  # K and V, 4 KV heads over 4 GPUs
    assert kv_bytes_per_token(qwen, 1) == 2 * 48 * 4 * 128 * 2
    assert kv_bytes_per_token(qwen, 8) == 2 * 48 * 1 * 128 * 2  # SGLang replicates a KV head past nkv
    ds = ModelShape.from_recipe(load_config(DS), 129280)
    assert kv_bytes_per_token(ds, 8) == 61 * (512 + 64) * 2  # MLA latent + rope key: 70,272 B per token
    plan = plan_recipe(load_config(MATH, ["hardware.gpu=H100"]))
    ro = plan.rollout
    # 8 GPUs / server_tp_size 4 = 2 replicas; 32 prompts x 8 samples = 128 sequences each of 1024 + 8192 tokens
    assert (ro.replicas, ro.sequences, ro.sample_tokens) == (2, 128, 9216)
    assert ro.kv_needed == 128 * 9216 * 24576 and ro.weights == total_params(qwen)["total"] * 2 / 4
    assert ro.static_budget == 0.7 * 80 * GIB and ro.fits == (ro.kv_needed <= 0.7 * 80 * GIB - ro.weights)
    tight = plan_recipe(load_config(MATH, ["hardware.gpu=H100", "rollout.mem_fraction_static=0.3"])).rollout
    assert tight.fits is False and tight.sequences_held == int((0.3 * 80 * GIB - tight.weights) // (9216 * 24576))
    assert "holds" in format_plan(plan_recipe(load_config(MATH, ["hardware.gpu=H100",
                                                                 "rollout.mem_fraction_static=0.3"])))


def test_pipeline_split_rules():
    assert pipeline_split(48, 4) == (None, None)
    assert pipeline_split(61, 16, 3, 2) == (3, 2)  # the recipe's own split is kept
    f, la = pipeline_split(61, 8)
    sizes = [f] + [(61 - f - la) // 6] * 6 + [la]
    assert sum(sizes) == 61 and max(sizes) == 8  # ceil(61 / 8): as even as Megatron's rule allows
    assert pipeline_split(5, 2) == (3, 2) or pipeline_split(5, 2) == (2, 3)


def test_search_qwen_32_h100():
    cfg = load_config(QWEN, ["hardware.gpu=H100"])
    res = search_layouts(cfg, 32)
    assert res.fitting and res.valid > len(res.fitting)
    times = [c.time["total"] for c in res.fitting]
    assert times == sorted(times)
    usable = 80 * GIB * 0.9
    for c in res.fitting[:5]:
        lay = c.layout
        # the recipe's own loader accepts the layout at 32 GPUs, and it fits
        overrides = [f"parallel.{k}={v if v is not None else 'null'}" for k, v in lay.items()
                     if k != "pipeline_schedule"] + [f"train.pipeline_schedule={lay['pipeline_schedule']}",
                                                      "parallel.world_size=32"]
        if lay["pipeline_schedule"] != "1f1b":
            overrides.append("train.pack=false")
        again = load_config(QWEN, ["hardware.gpu=H100", *overrides])
        assert again.check_world_size(32, trainable=False) == 32 // (lay["tp_size"] * lay["pp_size"])
        assert c.peak <= usable and c.peak == plan_recipe(again).memory.worst().total(lay["recompute"])
    # the recipe's layout (tp 4, ep 8, etp 1, full recompute) at dp 8: its step time worked by hand
    cur = res.current
    assert cur is not None and cur.plan.memory.dp_size == 8
    S, T, h = 10240, 256 * 10240, 2048
    active = total_params(ModelShape.from_recipe(cfg, 151936))["active"] - 151936 * h
    fwd = T * (2 * active + 48 * 2 * 32 * (128 + 128) * S / 2)
    flops = 6 * fwd  # old log-probs, reference, update (3), full recompute
    assert cur.time["flops"] == pytest.approx(flops)
    assert cur.time["compute"] == pytest.approx(flops / (32 * 989e12 * 0.35))
    m, passes = math.ceil(256 * 10240 / (8 * 10240)), 5
    assert cur.time["tp"] == pytest.approx(passes * m * 48 * 4 * 0.75 * 10240 * h * 2 / 450e9)
    assert cur.time["ep"] == pytest.approx(passes * m * 48 * 2 * 8 * (10240 / 4) * h * 2 * 7 / 8 / 450e9)
    assert cur.time["bubble"] == 0 and cur.time["pp"] == 0


def test_search_deepseek_256_h100():
    res = search_layouts(load_config(DS, ["hardware.gpu=H100"]), 256)
    assert res.fitting and res.current is not None
    assert all(c.peak <= 72 * GIB for c in res.fitting)
    assert all(c.layout["pipeline_schedule"] != "dualpipe" for c in res.fitting)  # 61 layers: no even split
    none_fit = search_layouts(load_config(DS, ["hardware.gpu=A100-40GB"]), 256)
    assert not none_fit.fitting and none_fit.closest


@pytest.mark.parametrize("argv,needle", [
    ([str(DS), "--seq-length", "0"], "--seq-length must be a positive"),
    ([str(DS), "--seq-length", "-5"], "--seq-length must be a positive"),
    ([str(DS), "hardware.max_prompt_tokens=0"], "hardware.max_prompt_tokens"),
    ([str(DS), "rollout.max_new_tokens=-1"], "rollout.max_new_tokens"),
    ([str(DS), "hardware.max_prompt_tokens=160000"], "model.hf_config.max_position_embeddings"),
    ([str(DS), "hardware.gpu=H1000"], "hardware.gpu 'H1000' is not a known GPU; known: A100-40GB"),
    ([str(REPO / "configs" / "tiny_arith.yaml")], "hardware.max_prompt_tokens is not set"),
    ([str(QWEN), "hardware.gpu=H100", "--search", "--world-size", "257"], "no layout of this recipe tiles 257"),
    ([str(QWEN), "--search", "--world-size", "8"], "--search needs the GPU: set hardware.gpu"),
    ([str(QWEN), "hardware.gpu=H100", "--search"], "--search needs --world-size"),
    ([str(QWEN), "--world-size", "0"], "--world-size must be a positive"),
    ([str(QWEN), "parallel.world_size=null", "--world-size", "12"], "world_size (12) must be divisible"),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_fp8_gemms_at_the_fp8_peak():
    """precision.fp8: the transformer layers' GEMMs (minus BF16 first/last layers) at H100's dense FP8 peak
    (1979 TFLOP/s), attention's core and the output layer at BF16 (989), worked by hand."""
    from moerl.parallel.plan_search import estimate_step_time

    over = ["hardware.gpu=H100", "parallel.world_size=32", "precision.fp8=e4m3", "precision.fp8_recipe=tensorwise",
            "precision.fp8_bf16_first_layers=1", "precision.fp8_bf16_last_layers=1"]
    cfg = load_config(QWEN, over)
    t = estimate_step_time(plan_recipe(cfg), cfg)
    bf16 = estimate_step_time(plan_recipe(load_config(QWEN, over[:2])), load_config(QWEN, over[:2]))
    T, h, V = 256 * 10240, 2048, 151936
    active = total_params(ModelShape.from_recipe(cfg, V))["active"] - V * h
    fp8 = 6 * T * 2 * (active - V * h) * 46 / 48  # 6 forward equivalents, 46 of 48 layers in FP8
    assert t["flops"] == bf16["flops"] and t["fp8_flops"] == pytest.approx(fp8) and bf16["fp8_flops"] == 0
    rate = 32 * 1e12 * 0.35
    assert t["compute"] == pytest.approx((t["flops"] - fp8) / (989 * rate) + fp8 / (1979 * rate))
    a100 = load_config(QWEN, ["hardware.gpu=A100", "parallel.world_size=32", "precision.fp8=e4m3"])
    assert estimate_step_time(plan_recipe(a100), a100)["fp8_flops"] == 0  # no FP8 tensor cores: all BF16


def test_pipeline_bubble_equals_the_simulated_schedule():
    """The step-time model's bubble (DualPipe README formula) against moerl's discrete-event simulation
    of the very schedules the trainer runs (moerl.pipeline.schedules), per-chunk F = 1, B = 2, W = 1
    (DualPipeV chunks are half stages: 0.5 / 1 / 0.5)."""
    from moerl.pipeline.schedules import build_schedule
    from moerl.pipeline.simulator import Costs, simulate

    res = search_layouts(load_config(QWEN, ["hardware.gpu=H100"]), 32)
    smallest = {}  # per schedule, the layout with the fewest pp x micro-batches (the simulation's cost)
    for c in res.fitting + res.closest:
        mem = c.plan.memory
        size = mem.pp_size * mem.num_microbatches
        if mem.pp_size > 1 and size < smallest.get(mem.pipeline_schedule, (1 << 60, None))[0]:
            smallest[mem.pipeline_schedule] = (size, c)
    assert set(smallest) == {"1f1b", "dualpipe", "dualpipev"}
    for name, (_, c) in smallest.items():
        key = (name, c.plan.memory.pp_size, c.plan.memory.num_microbatches)
        half = name == "dualpipev"
        sim = simulate(build_schedule(*key), Costs(F=0.5, B=1.0, W=0.5) if half else Costs(F=1.0, B=2.0, W=1.0))
        assert c.time["bubble"] / c.time["compute"] == pytest.approx(sim.makespan / max(sim.busy) - 1), key
