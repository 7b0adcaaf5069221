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

from moerl.config import ConfigError, load_config  # noqa: E402
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
from moerl.parallel.plan_search import format_search, pipeline_split, search_layouts  # noqa: E402

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
    ([str(QWEN), "--search", "--world-size", "8"], "--search needs the GPU: hardware.gpu is not set"),
    ([str(QWEN), "hardware.gpu=H100", "--search"], "--search needs --world-size"),
    ([str(QWEN), "--world-size", "0"], "--world-size must be a positive"),
    ([str(QWEN), "parallel.world_size=null", "--world-size", "12"], "world_size (12) must be divisible"),
    # --seq-length is checked against max_position_embeddings like the recipe's own lengths (40960 / 64)
    ([str(QWEN), "--seq-length", "50000"], "--seq-length 50000 must be < model.hf_config.max_position_embeddings (40960)"),
    ([str(QWEN), "--seq-length", "40960"], "--seq-length 40960 must be < model.hf_config.max_position_embeddings"),
    ([str(REPO / "configs" / "tiny_arith.yaml"), "--seq-length", "1000"], "max_position_embeddings (64)"),
    ([str(QWEN), "hardware.gpu=H100", "--search", "--world-size", "8", "--seq-length", "50000"], "--seq-length 50000"),
    # precision.fp8 on a GPU of the table without that FP8 recipe's tensor cores
    ([str(QWEN), "hardware.gpu=A100", "precision.fp8=e4m3"],
     "precision.fp8=e4m3 (precision.fp8_recipe=delayed, needs compute capability 8.9+) cannot run on "
     "hardware.gpu=A100, which has no FP8 tensor cores"),
    ([str(QWEN), "hardware.gpu=L40S", "precision.fp8=e4m3", "precision.fp8_recipe=blockwise"],
     "cannot run on hardware.gpu=L40S, which is compute capability 8.9"),
    ([str(QWEN), "hardware.gpu=H100", "precision.fp8=e4m3", "precision.fp8_recipe=mxfp8"],
     "cannot run on hardware.gpu=H100, which is compute capability 9.0"),
    ([str(QWEN), "hardware.gpu=A100", "precision.fp8=hybrid", "--search", "--world-size", "32"],
     "cannot run on hardware.gpu=A100"),
])
def test_bad_values_exit_2_with_one_line(capsys, argv, needle):
    """README convention (moerl.errors.run_entry): ``moerl plan: bad <kind> input: ...`` naming the key or flag,
    then one ``fix:`` line; no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert needle in err and "Traceback" not in err, err
    assert lines[0].startswith(("moerl plan: bad recipe input: ", "moerl plan: bad CLI input: ")), err
    assert lines[-1].startswith("  fix: ") or "invalid recipe" in lines[0], err


def test_debug_prints_the_traceback(capsys, monkeypatch):
    """``moerl --debug plan`` (MOERL_DEBUG=1) adds the traceback of a plan's bad-input error, exit still 2."""
    from moerl.cli import main as cli_main

    monkeypatch.setenv("MOERL_DEBUG", "0")  # recorded, so the "1" that --debug sets is undone after the test
    assert cli_main(["--debug", "plan", str(QWEN), "--seq-length", "50000"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "CLIError" in err
    assert err.rstrip().splitlines()[-2].startswith("moerl plan: bad CLI input: --seq-length 50000"), err
    assert "fix: give --seq-length below 40960" in err


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
    with pytest.raises(ConfigError, match=r"precision.fp8=e4m3 .* cannot run on hardware.gpu=A100") as err:
        plan_recipe(a100)  # no FP8 tensor cores: refused, not planned as BF16
    assert err.value.key == "precision.fp8" and "precision.fp8=null" in err.value.hint
    out = format_plan(plan_recipe(cfg))
    assert "FP8 GEMMs e4m3 (tensorwise)" in out.splitlines()[2]  # the layout line says FP8
    assert "BF16 GEMMs" in format_plan(plan_recipe(load_config(QWEN, over[:2]))).splitlines()[2]


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


def test_vocab_size_and_its_source_are_printed():
    """model.hf_config.vocab_size=null with no data.tokenizer_path plans moerl's byte tokenizer: 260 tokens
    rounded up to a multiple of 64 = 320 rows. The output names it as a DEFAULT, on the answer line too."""
    real = plan_recipe(load_config(QWEN, ["hardware.gpu=H100"]))
    assert (real.vocab_size, real.vocab_source) == (151936, "model.hf_config.vocab_size")
    assert "vocab 151936 from model.hf_config.vocab_size" in format_plan(real).splitlines()[1]
    byte = plan_recipe(load_config(QWEN, ["hardware.gpu=H100", "model.hf_config.vocab_size=null"]))
    assert byte.vocab_size == 320 and byte.vocab_source.startswith("DEFAULT: moerl's built-in byte tokenizer (260")
    # 2 x 320 x 2048 instead of 2 x 151936 x 2048 parameters (untied embedding + output layer)
    assert byte.memory.model_params["total"] == real.memory.model_params["total"] - 2 * (151936 - 320) * 2048
    out = format_plan(byte)
    assert "WARNING: vocab 320 from DEFAULT: moerl's built-in byte tokenizer" in out
    assert "set model.hf_config.vocab_size to the real model's vocabulary" in out
    assert out.splitlines()[-1] == ("answer: FITS on 8 x H100 (with the DEFAULT vocab 320, not the model's: set "
                                    "model.hf_config.vocab_size)")
    assert byte.to_dict()["vocab_source"] == byte.vocab_source
    res = search_layouts(load_config(QWEN, ["hardware.gpu=H100", "model.hf_config.vocab_size=null"]), 8)
    assert "WARNING: vocab 320 from DEFAULT" in format_search(res, 1)


def test_world_size_alone_plans_the_recipe_layout_there(capsys):
    """--world-size 32 without --search: the recipe's tp 4 / ep 8 at 32 GPUs, dp = 32 / 4 = 8, exactly the
    plan of parallel.world_size=32 (README table: 44.98 GiB, FITS)."""
    assert main([str(QWEN), "hardware.gpu=H100", "--world-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "world size: 32 from --world-size (the recipe's parallel.world_size is 8)" in out
    assert "layout: world_size 32 = tp 4 x pp 1 x dp 8; ep 8, etp 1 (expert dp 4)" in out
    same = plan_recipe(load_config(QWEN, ["hardware.gpu=H100", "parallel.world_size=32"]))
    peak = same.memory.worst().total("full")
    assert f"peak: {peak / GIB:.2f} GiB per GPU" in out and round(peak / GIB, 2) == 44.98
    assert main([str(QWEN), "hardware.gpu=H100", "--world-size", "12"]) == 2
    err = capsys.readouterr().err
    assert "world_size (12) must be divisible" in err and "fix: plan a world size this layout tiles" in err
    assert "launch" not in err  # not the torchrun advice


def _printed_overrides(text: str) -> list[list[str]]:
    return [line.split("overrides:", 1)[1].split() for line in text.splitlines() if line.lstrip().startswith("overrides:")]


@pytest.mark.parametrize("recipe,gpu,world", [(QWEN, "H100", 32), (MATH, "H200", 8)])
def test_printed_overrides_reproduce_each_layout(capsys, recipe, gpu, world):
    """--search prints, under every layout, the overrides that reproduce it: each loads with the recipe
    (load_config) and plans to the same layout and peak; DualPipe(V) rows carry train.pack=false."""
    assert main([str(recipe), f"hardware.gpu={gpu}", "--search", "--world-size", str(world), "--top", "5"]) == 0
    printed = _printed_overrides(capsys.readouterr().out)
    res = search_layouts(load_config(recipe, [f"hardware.gpu={gpu}"]), world)
    assert len(printed) == 5 and any("train.pipeline_schedule=dualpipev" in o for o in printed)
    for c, over in zip(res.fitting[:5], printed):
        assert over == c.overrides
        assert ("train.pack=false" in over) == (c.layout["pipeline_schedule"] != "1f1b")
        cfg = load_config(recipe, [f"hardware.gpu={gpu}", *over])
        again = plan_recipe(cfg)
        lay = c.layout
        assert (cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.parallel.ep_size, cfg.parallel.etp_size or
                cfg.parallel.tp_size, cfg.parallel.recompute) == (lay["tp_size"], lay["pp_size"], lay["ep_size"],
                                                                  lay["etp_size"], lay["recompute"])
        assert again.memory.world_size == world and again.memory.pipeline_schedule == lay["pipeline_schedule"]
        assert again.memory.worst().total(lay["recompute"]) == c.peak
        assert main([str(recipe), f"hardware.gpu={gpu}", *over]) == 0  # the CLI accepts the printed string
        assert "answer: FITS" in capsys.readouterr().out


def test_search_headline_counts_the_colocated_engines():
    """The colocated engines' KV cache does not depend on the layout: the headline says whether the layouts
    that fit the trainer fit as a whole. rollout.max_new_tokens=32000 on 8 x H200 (math recipe, worked by
    hand): 128 sequences per replica (32 x 8 / 2) of 1024 + 32000 tokens at 2 x 48 x 1 x 128 x 2 = 24576
    B/token = 96.75 GiB of KV cache for a pool of 0.7 x 141 - 30.53 B x 2 / 4 = 84.48 GiB."""
    ok = search_layouts(load_config(MATH, ["hardware.gpu=H200"]), 8)
    assert ok.rollout_fits is True and ok.fitting_everything == ok.fitting
    assert f"{len(ok.fitting)} fit (trainer, and the colocated rollout engines fit at every layout)" in format_search(ok)
    long = search_layouts(load_config(MATH, ["hardware.gpu=H200", "rollout.max_new_tokens=32000"]), 8)
    ro = long.fitting[0].plan.rollout
    assert ro.kv_needed == 128 * 33024 * 24576 and ro.kv_per_token == 24576
    assert round(ro.kv_needed / GIB, 2) == 96.75 and round(ro.kv_pool / GIB, 2) == 84.48 and ro.sequences_held == 111
    assert long.rollout_fits is False and long.fitting and long.fitting_everything == []
    head = format_search(long).splitlines()[1]
    assert head.endswith(f"{len(long.fitting)} fit the trainer's memory but NONE fits as a whole: the colocated "
                         "rollout engines' KV cache DOES NOT FIT at any layout (last line)")
    d = long.to_dict(1)
    assert d["rollout_fits"] is False and d["fitting_layouts_with_rollout"] == 0
    assert d["fitting_layouts"] == len(long.fitting)
