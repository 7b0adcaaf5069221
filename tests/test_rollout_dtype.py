"""rollout.dtype (issue 14): the reference server loads and serves the model in bfloat16 (``moerl serve
--dtype``, like SGLang's --dtype), weight updates are cast to the serving dtype, the launchers pass the key
on, and HF exports are written in model.export_dtype. References: transformers' own bf16 model and
generate(), and the fp32 checkpoint's tensors rounded with torch."""

from __future__ import annotations

import json

import pytest
import torch

from moerl.rollout.engine import ReferenceEngine

PROMPT = [4, 5, 13, 6, 15]
U_BF16 = 2.0 ** -8


@pytest.fixture(scope="module")
def bf16_engine(ckpts):
    engine = ReferenceEngine(ckpts[0], dtype="bfloat16")
    yield engine
    engine.close()


def test_bf16_server_generates_as_transformers_bf16(bf16_engine, ckpts):
    from transformers import AutoModelForCausalLM

    assert {p.dtype for p in bf16_engine.model.parameters()} == {torch.bfloat16}
    out = bf16_engine.generate({"input_ids": PROMPT, "return_logprob": True,
                                "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}})
    ref = AutoModelForCausalLM.from_pretrained(ckpts[0], dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                            pad_token_id=0)[0, len(PROMPT):].tolist()
        logits = ref(torch.tensor([PROMPT + out["output_ids"]])).logits[0].float()
    assert out["output_ids"] == want
    # log-probs: the server's decode (KV cache) and this full forward round differently in bf16; both are
    # within 2u max|z| of the exact value per rounding of the logits, so they agree within 4u max|z|
    ref_lp = torch.log_softmax(logits, -1)
    got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    want_lp = [float(ref_lp[len(PROMPT) - 1 + t, tok]) for t, tok in enumerate(out["output_ids"])]
    tol = 4 * U_BF16 * float(logits.abs().max())
    assert max(abs(a - b) for a, b in zip(got, want_lp)) <= tol


def test_bf16_server_casts_weight_updates_to_its_dtype(bf16_engine, ckpts):
    from safetensors.torch import load_file

    ok, msg = bf16_engine.update_weights_from_disk(ckpts[1], weight_version="b")
    assert ok, msg
    on_disk = {}
    for f in sorted(__import__("pathlib").Path(ckpts[1]).glob("*.safetensors")):
        on_disk.update(load_file(f))
    assert all(t.dtype == torch.float32 for t in on_disk.values())
    for name, t in on_disk.items():  # the served tensor (or fused-expert slice) each HF name maps to
        served, _ = bf16_engine.mapper.resolve(name, t)
        assert served.dtype == torch.bfloat16 and torch.equal(served, t.to(torch.bfloat16)), name
    ok, msg = bf16_engine.update_weights_from_disk(ckpts[0], weight_version="a")  # back for the other tests
    assert ok, msg


def test_serving_dtype_rules_and_launch_arguments(tmp_path):
    from moerl.models.dtypes import serving_torch_dtype
    from moerl.rollout.launcher import RolloutCluster
    from moerl.rollout.server import build_arg_parser
    from moerl.rollout.sglang_launcher import SGLangServerSpec

    assert serving_torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="rollout.dtype"):
        serving_torch_dtype("float16")
    assert build_arg_parser().parse_args(["--model-path", "m", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--model-path", "m", "--dtype", "int8"])
    cluster = RolloutCluster(str(tmp_path), 1, dtype="bfloat16", log_dir=str(tmp_path))
    argv = cluster._server_argv(0, 31000)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert "--dtype" not in RolloutCluster(str(tmp_path), 1, log_dir=str(tmp_path))._server_argv(0, 31000)
    with pytest.raises(ValueError, match="rollout.dtype"):
        RolloutCluster(str(tmp_path), 1, dtype="half")
    # rollout.dtype=auto: the reference server's float32, SGLang's own auto (no --dtype)
    from types import SimpleNamespace

    from moerl.models.dtypes import rollout_serving_dtype

    assert rollout_serving_dtype(SimpleNamespace(dtype="auto", backend="reference")) == "float32"
    assert rollout_serving_dtype(SimpleNamespace(dtype="auto", backend="sglang")) is None
    assert rollout_serving_dtype(SimpleNamespace(dtype="bfloat16", backend="sglang")) == "bfloat16"
    sg = SGLangServerSpec("m", 30000, [0], dtype="bfloat16").argv()
    assert sg[sg.index("--dtype") + 1] == "bfloat16"
    assert "--dtype" not in SGLangServerSpec("m", 30000, [0]).argv()


def test_hf_export_is_written_in_the_export_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    from moerl.checkpoint.hf_io import load_hf_state_dict, save_hf_checkpoint
    from moerl.models.dtypes import export_torch_dtype
    from moerl.rollout.testing import make_tiny_moe_checkpoint

    assert export_torch_dtype(None, "bfloat16") is torch.bfloat16
    assert export_torch_dtype("float32", "bfloat16") is torch.float32
    with pytest.raises(ValueError, match="model.export_dtype"):
        export_torch_dtype("float16", "float32")
    cfg = make_tiny_moe_checkpoint(str(tmp_path / "src")).config
    sd = load_hf_state_dict(tmp_path / "src")  # fp32, on-disk names
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        out = save_hf_checkpoint(sd, cfg, tmp_path / name, dtype=dtype)
        assert json.loads((out / "config.json").read_text())["dtype"] == name
        back = load_hf_state_dict(out)
        assert {t.dtype for t in back.values()} == {dtype}
        # values: torch's rounding of the fp32 weights (an independent cast), per on-disk name
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert next(loaded.parameters()).dtype == dtype  # transformers follows config.json's dtype
        for k, v in back.items():
            if k in sd:
                assert torch.equal(v, sd[k].to(dtype)), k
    with pytest.raises(ValueError, match="model.export_dtype"):
        save_hf_checkpoint(sd, cfg, tmp_path / "bad", dtype=torch.int8)
