"""FP8 rollout (rollout.weight_dtype): the trainer quantises block-wise during weight sync, the
reference server dequantises; after a sync the served weights equal the trainer's quantise-dequantise
BITWISE in every sync mode. The FP8 checkpoint layout is checked against the HF/SGLang layout and
loaded by transformers' own FineGrainedFP8 loader; the mismatch metrics against hand-worked values."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")

from fastapi.testclient import TestClient  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from moerl.precision.fp8 import dequantize_weight, quantize_weight  # noqa: E402
from moerl.precision.fp8_checkpoint import (is_quantized_weight_name, rollout_hf_config,  # noqa: E402
                                            rollout_state_dict, sglang_fp8_shape_errors)
from moerl.rollout.server import ReferenceEngine, create_app, load_safetensors_dir  # noqa: E402
from moerl.rollout.testing import make_tiny_moe_checkpoint  # noqa: E402
from moerl.rollout.weight_sync import DistributedWeightUpdater, sync_weights, write_hf_version_dir  # noqa: E402

TINY, HUGE = 64, 1 << 40  # bytes: every tensor its own bucket (weight and scale apart) / one bucket
# dims that are NOT multiples of 128 and larger than one block: hidden 160 (128 + 32), q rows 4*48 = 192
# (128 + 64), kv rows 96, expert width 136 (128 + 8): ragged edge blocks everywhere
RAGGED = dict(hidden_size=160, head_dim=48, moe_intermediate_size=136, intermediate_size=136)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    a, b = str(tmp_path_factory.mktemp("fa")), str(tmp_path_factory.mktemp("fb"))
    make_tiny_moe_checkpoint(a, seed=0, **RAGGED)
    make_tiny_moe_checkpoint(b, seed=1, **RAGGED)
    return a, b


@pytest.fixture(scope="module")
def trainer_sd(ckpts):
    return dict(load_safetensors_dir(ckpts[1]))


def expected_fp8(sd: dict) -> dict:
    """Independent of the server's pairing code: each quantised Linear weight through
    quantize_weight -> dequantize_weight (128 x 128), everything else unchanged (fp32 served)."""
    return {n: dequantize_weight(*quantize_weight(t)) if is_quantized_weight_name(n, t) else t for n, t in sd.items()}


def served(engine: ReferenceEngine, name: str, t: torch.Tensor) -> torch.Tensor:
    return engine.mapper.resolve(name, t)[0]


def test_fp8_layout_of_the_state_dict(trainer_sd):
    sent = rollout_state_dict(trainer_sd, "fp8")
    quantised = sorted(n for n in trainer_sd if n + "_scale_inv" in sent)
    # 2 layers x (q, k, v, o + 4 experts x gate, up, down) = 2 x 16; router, norms, embeddings stay
    assert len(quantised) == 32 and all(sent[n].dtype == torch.float8_e4m3fn for n in quantised)
    for n in quantised:
        out, inp = trainer_sd[n].shape
        assert sent[n + "_scale_inv"].dtype == torch.float32
        assert tuple(sent[n + "_scale_inv"].shape) == (math.ceil(out / 128), math.ceil(inp / 128))
    kept = [n for n in trainer_sd if n not in quantised]
    assert any(n.endswith("mlp.gate.weight") for n in kept) and "model.embed_tokens.weight" in kept
    assert all(sent[n] is trainer_sd[n] for n in kept)
    assert tuple(sent["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == (2, 2)  # [192, 160]
    assert tuple(sent["model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"].shape) == (2, 2)  # [160, 136]
    with pytest.raises(ValueError, match="rollout.weight_dtype"):
        rollout_state_dict(trainer_sd, "fp4")


@pytest.mark.parametrize("bucket", [TINY, HUGE], ids=["pairs-split", "one-bucket"])
@pytest.mark.parametrize("mode", ["disk", "tensor", "tensor-bytes", "distributed"])
def test_served_weights_equal_the_trainers_quantise_dequantise_bitwise(mode, bucket, ckpts, trainer_sd, tmp_path):
    engine = ReferenceEngine(ckpts[0])
    client = TestClient(create_app(engine))
    url = str(client.base_url)
    updater = DistributedWeightUpdater([url], http_client=client, timeout_s=60) if mode == "distributed" else None
    want = expected_fp8(trainer_sd)
    try:
        sent = rollout_state_dict(trainer_sd, "fp8")
        # tensor: the shared-memory transport (what a local server gets; the in-process engine can open it);
        # tensor-bytes: tensors inline (a server on another host): FP8 buckets go as SGLang flattened buckets
        sync_weights(mode.split("-")[0], [url], sent, f"fp8-{mode}", bucket_bytes=bucket, out_root=tmp_path,
                     updater=updater, hf_config=rollout_hf_config(AutoConfig.from_pretrained(ckpts[1]), "fp8"),
                     http_client=client, tensor_transport="bytes" if mode == "tensor-bytes" else "shm")
        bad = [n for n, t in want.items() if not torch.equal(served(engine, n, t), t)]
        assert bad == []
        # quantisation really changed the matrices (and only them)
        changed = {n for n, t in trainer_sd.items() if not torch.equal(served(engine, n, t), t)}
        assert changed == {n for n, t in trainer_sd.items() if is_quantized_weight_name(n, t)}
        assert engine._fp8.pending == {}
        assert client.get("/get_model_info").json()["weight_version"] == f"fp8-{mode}"
        if mode == "disk":
            d = tmp_path / f"weights_fp8-{mode}"
            qc = json.loads((d / "config.json").read_text())["quantization_config"]
            assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]}
    finally:
        if updater is not None:
            updater.close()
        engine.close()


def test_fp8_into_a_bfloat16_server_is_the_bf16_cast_of_the_dequantised_weights(ckpts, trainer_sd):
    """rollout.dtype=bfloat16 + weight_dtype=fp8: q * scale in float32, then ONE cast to bfloat16."""
    engine = ReferenceEngine(ckpts[0], dtype="bfloat16")
    client = TestClient(create_app(engine))
    try:
        sync_weights("tensor", [str(client.base_url)], rollout_state_dict(trainer_sd, "fp8"), "fp8-bf16",
                     bucket_bytes=TINY, http_client=client, tensor_transport="shm")
        want = {n: t.to(torch.bfloat16) for n, t in expected_fp8(trainer_sd).items()}
        assert [n for n, t in want.items() if not torch.equal(served(engine, n, t), t)] == []
    finally:
        engine.close()


def test_bf16_weight_dtype_serves_the_bf16_cast(ckpts, trainer_sd, tmp_path):
    engine = ReferenceEngine(ckpts[0])
    client = TestClient(create_app(engine))
    try:
        sync_weights("tensor", [str(client.base_url)], rollout_state_dict(trainer_sd, "bf16"), "bf16",
                     bucket_bytes=HUGE, http_client=client)
        assert all(torch.equal(served(engine, n, t), t.to(torch.bfloat16).float()) for n, t in trainer_sd.items())
    finally:
        engine.close()


def test_fp8_checkpoint_starts_a_server_and_an_unpaired_weight_is_refused(ckpts, trainer_sd, tmp_path):
    cfg = AutoConfig.from_pretrained(ckpts[1])
    d = write_hf_version_dir(rollout_state_dict(trainer_sd, "fp8"), rollout_hf_config(cfg, "fp8"), tmp_path, "1")
    engine = ReferenceEngine(d, tokenizer_path=ckpts[1])  # moerl serve of an FP8 checkpoint
    try:
        assert all(torch.equal(served(engine, n, t), t) for n, t in expected_fp8(trainer_sd).items())
        sd = rollout_state_dict(trainer_sd, "fp8")
        del sd["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        bad = write_hf_version_dir(sd, rollout_hf_config(cfg, "fp8"), tmp_path, "2")
        ok, msg = engine.update_weights_from_disk(bad)
        assert not ok and "weight_scale_inv" in msg and "q_proj" in msg
    finally:
        engine.close()


def test_fp8_checkpoint_loads_in_transformers_finegrained_fp8(tmp_path):
    """transformers (5.x) reads moerl's FP8 checkpoint with its own FineGrainedFP8 quantizer: on a CPU it
    dequantises (needs `accelerate`; FP8 compute needs a GPU). Its weights equal moerl's dequantisation
    cast to bf16 on the demo-sized model (every dim <= 128: one block per dim). Limitation found: on
    CPU transformers derives the block size as rows // scale_rows, which is wrong for dims that are
    not multiples of 128 and larger than one block (e.g. 300 rows -> 100, not 128), so the ragged
    model above is not checked with it."""
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs `pip install accelerate`")
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    make_tiny_moe_checkpoint(str(src), seed=3)
    sd = dict(load_safetensors_dir(str(src)))
    d = write_hf_version_dir(rollout_state_dict(sd, "fp8"), rollout_hf_config(AutoConfig.from_pretrained(src), "fp8"),
                             tmp_path, "fp8")
    # FineGrainedFP8HfQuantizer with dequantize=True on CPU (weight * weight_scale_inv, in bf16): had it
    # ignored the scales, the raw FP8 values (up to 448) would be loaded and the comparison below fail
    model = AutoModelForCausalLM.from_pretrained(d)
    engine = ReferenceEngine(d, tokenizer_path=str(src))
    try:
        hf = dict(model.named_parameters())
        want = {n: engine.mapper.params[n].detach() for n in engine.mapper.params}
        assert set(hf) == set(want)
        bad = [n for n in want if not torch.equal(hf[n].detach().to(torch.bfloat16), want[n].to(torch.bfloat16))]
        assert bad == []
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(want[q], sd[q])  # the weights really went through FP8
    finally:
        engine.close()


def test_sglang_block_rules_refuse_the_demo_model_at_config_time():
    from moerl.config.errors import ConfigError
    from moerl.config.loader import load_config

    # tiny_arith: k_proj/v_proj have 2 heads x 32 = 64 rows, not a multiple of 128 (merged qkv_proj)
    with pytest.raises(ConfigError, match=r"rollout.weight_dtype=fp8 with rollout.backend=sglang.*k_proj/v_proj rows"):
        load_config("configs/tiny_arith.yaml", ["rollout.weight_dtype=fp8", "rollout.backend=sglang",
                                                "rollout.gpu_ids=[0]"])
    load_config("configs/tiny_arith.yaml", ["rollout.weight_dtype=fp8"])  # the reference server takes it
    qwen3_30b = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     moe_intermediate_size=768, num_experts=128, intermediate_size=6144)
    assert sglang_fp8_shape_errors(qwen3_30b) == []
    # TP=4 splits each expert's 768 rows into 192 (the "output_size of gate's and up's weight = 192 is not
    # divisible by weight quantization block_n = 128" users meet); EP=4 keeps experts whole
    (err,) = sglang_fp8_shape_errors(qwen3_30b, tp_size=4, ep_size=1)
    assert "moe_intermediate_size" in err and "768/4" in err
    assert sglang_fp8_shape_errors(qwen3_30b, tp_size=4, ep_size=4) == []


def test_rollout_mismatch_metrics_hand_worked():
    from moerl.algorithms.off_policy import rollout_mismatch_metrics
    from moerl.observe.report import step_line

    # token 1: trainer -1.0, rollout -1.5 -> |diff| 0.5, w = pi/mu = e^0.5, k3 = w - 1 - log w = e^0.5 - 1.5
    # token 2: equal -> 0; token 3 (second sample): trainer -0.2, rollout -0.1 -> 0.1, k3 = e^-0.1 - 0.9
    m = rollout_mismatch_metrics([[-1.0, -2.0], [-0.2]], [[-1.5, -2.0], [-0.1]])
    assert m["logprob_abs_diff_mean"] == pytest.approx(0.6 / 3)
    assert m["logprob_abs_diff_max"] == pytest.approx(0.5)
    k3 = (math.exp(0.5) - 1.5 + 0.0 + math.exp(-0.1) - 0.9) / 3
    assert m["rollout/mismatch_kl_k3"] == pytest.approx(k3, rel=1e-12)
    assert rollout_mismatch_metrics([], [])["rollout/mismatch_kl_k3"] == 0.0
    line = step_line(3, 10, m, 1.0)
    assert "lp_diff 2.0e-01" in line and f"mis_kl {k3:.1e}" in line


def test_step0_logprob_tolerance_of_fp8_and_bf16_rollout_weights():
    from moerl.config.loader import load_config
    from moerl.observe.report import (STEP0_LOGPROB_TOL_BF16, STEP0_LOGPROB_TOL_FP8, step0_check,
                                      step0_logprob_tolerance)

    assert step0_logprob_tolerance(load_config("configs/tiny_arith.yaml", ["rollout.weight_dtype=fp8"])) == 2.0 ** -3
    assert step0_logprob_tolerance(load_config("configs/tiny_arith.yaml", ["rollout.weight_dtype=bf16"])) == \
        STEP0_LOGPROB_TOL_BF16
    # the fp8 demo's first step (mean 1.73e-2) passes the fp8 tolerance and fails the fp32 one; its
    # step 60 (3.3e-2) would fail the bf16 one
    m = {"logprob_abs_diff_mean": 1.73e-2, "logprob_abs_diff_max": 0.422, "train/logratio_abs_sum": 0.0}
    assert step0_check(m, STEP0_LOGPROB_TOL_FP8)["logprob_pass"] and not step0_check(m)["logprob_pass"]
    assert not step0_check(dict(m, logprob_abs_diff_mean=3.3e-2), STEP0_LOGPROB_TOL_BF16)["logprob_pass"]


@pytest.mark.slow
# slow_extra (CI's 30-min budget): FP8 block quantisation, its round trip into the server and the step-0 check's FP8
# tolerance are fast tests in this file; what leaves CI is `moerl train` with rollout.weight_dtype=fp8 end to end
@pytest.mark.slow_extra
def test_moerl_train_with_fp8_rollout_end_to_end(tmp_path):
    """`moerl train ... rollout.weight_dtype=fp8 rollout.weight_sync=tensor`: the servers start from an FP8
    checkpoint, every sync sends FP8 (shared-memory tensor transport), the step-0 check passes with the FP8
    tolerance and the mismatch metrics are logged (non-zero: the servers really run FP8 weights)."""
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_main_job import FAST, RECIPE, _tb_scalars, moerl_train, port_args

    r = moerl_train(RECIPE, *port_args(tmp_path), *FAST, "rollout.weight_dtype=fp8", "rollout.weight_sync=tensor",
                    timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "run"
    qc = json.loads((run / "weights" / "init" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    init = dict(load_safetensors_dir(str(run / "weights" / "init")))
    assert init["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn  # [64, 128]: one block
    assert tuple(init["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape) == (1, 1)
    m = re.search(r"STEP-0 CHECK: .*mean \|diff\| (\S+) .*tolerance (\S+)\): (PASS|FAIL)", r.stdout)
    assert m and float(m.group(2)) == 0.125 and m.group(3) == "PASS", r.stdout[-3000:]
    assert 1e-5 < float(m.group(1)) <= 0.125  # far above fp32's ~1e-6: the servers run FP8 weights
    kl = _tb_scalars(run, "rollout/mismatch_kl_k3")
    assert len(kl) == 3 and all(0 < v < 1 for v in kl.values()), kl
    assert "mis_kl" in r.stdout


@pytest.mark.demo
def test_fp8_rollout_full_demo_rl_gain(tmp_path):
    """The README's main job with FP8 rollout weights (rollout.weight_dtype=fp8, reference servers in
    float32 computing with the dequantised FP8 weights): RL still raises greedy accuracy by >= 10 points
    within 20 minutes, and the step-0 check passes with the FP8 tolerance."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_main_job import RECIPE, _demo_gain

    summary = _demo_gain(RECIPE, tmp_path, ["rollout.weight_dtype=fp8"], minutes=20)
    assert summary["step0_check"]["logprob_pass"] and summary["step0_check"]["logprob_tolerance"] == 0.125
