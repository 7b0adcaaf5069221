"""Conformance: the control and weight-update calls that slime, verl, AReaL and NeMo-RL make to
SGLang 0.5.9, replayed against a live reference server (a real uvicorn process), each checked for
acceptance, SGLang's answer shape and its effect (the served weights, version, model path).

Payloads are written from the clients' documented field names (SGLang io_struct / protocol);
SGLang's FlattenedTensorBucket is the wheel's own tensor_bucket.py (it imports only torch)."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import httpx
import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("MOERL_WEIGHT_SYNC_TIMEOUT_S", "60")


from moerl.rollout import client as api  # noqa: E402
from moerl.rollout.launcher import wait_healthy  # noqa: E402
from moerl.rollout.server import load_safetensors_dir  # noqa: E402
from moerl.rollout.weight_sync import DistributedWeightUpdater, make_buckets  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _mp_helpers import free_port_block  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [4, 5, 13, 6, 15]


@pytest.fixture(scope="module")
def live(ckpts, tmp_path_factory):
    """(url, httpx client) of one `python -m moerl.rollout.server` process serving checkpoint A."""
    port = free_port_block(1)
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-m", "moerl.rollout.server", "--model-path", ckpts[0], "--port",
                             str(port), "--log-file", log], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=120.0, what="reference server", log_path=log)
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
            yield url, c
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tensor_bucket_module():
    """sglang.srt.weight_sync.tensor_bucket from the pinned wheel, importable under its own name
    (so pickles name SGLang's class, as slime / NeMo-RL payloads do)."""
    import tempfile

    cache = Path(os.environ.get("MOERL_WHEEL_CACHE", Path(tempfile.gettempdir()) / "moerl_wheel_cache"))
    wheels = sorted(cache.glob(f"sglang-{api.SGLANG_VERSION}-*.whl"))
    if not wheels:
        pytest.skip("the sglang wheel is not cached (tests/test_sglang_contract.py downloads it)")
    with zipfile.ZipFile(wheels[-1]) as zf:
        src = zf.read("sglang/srt/weight_sync/tensor_bucket.py").decode()
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names[:-1]:
        sys.modules.setdefault(n, types.ModuleType(n))
    mod = types.ModuleType(names[-1])
    sys.modules[names[-1]] = mod
    exec(compile(src, "tensor_bucket.py", "exec"), mod.__dict__)
    yield mod
    for n, m in saved.items():
        if m is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = m


def _mp_serialize(obj) -> str:
    """SGLang MultiprocessingSerializer.serialize(obj, output_str=True) on CPU tensors: ForkingPickler
    with torch's reducers, file_system sharing (the CPU analogue of CUDA IPC), base64 text."""
    import torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
    finally:
        tmp.set_sharing_strategy(old)
    return base64.b64encode(buf.getvalue()).decode()


def _greedy(c: httpx.Client) -> tuple[list[int], str]:
    r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 6,
                                                                          "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["weight_version"]


def _ref_greedy(model) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=6, min_new_tokens=6,
                              pad_token_id=0)[0, len(PROMPT):].tolist()


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) <= {"success", "message", "num_paused_requests"} and body["success"] is True, body
    return body


def _reset(c: httpx.Client, path_a: str) -> None:
    _ok(c.post("/update_weights_from_disk", json={"model_path": path_a, "weight_version": "reset"}))


def test_slime_style(live, ckpts, ref_models, tensor_bucket_module):
    url, c = live
    _reset(c, ckpts[0])
    sd_b = dict(load_safetensors_dir(ckpts[1]))
    # distributed: master_port as a string, weight_version on every bucket (slime's update_weights)
    port = free_port_block(1)
    updater = DistributedWeightUpdater([url], master_port=str(port), timeout_s=60)
    try:
        updater.init_group()
        buckets = make_buckets(sd_b, 20_000)
        assert len(buckets) > 2
        for b in buckets:
            updater.update_bucket(b, weight_version="slime-1", flush_cache=False)
            assert c.get("/get_model_info").json()["weight_version"] == "slime-1"
        assert _greedy(c) == (_ref_greedy(ref_models[1]), "slime-1")
    finally:
        updater.close()
    # colocated tensor path: flattened buckets per TP rank, weight_version on every call
    sd_a = dict(load_safetensors_dir(ckpts[0]))
    for part in make_buckets(sd_a, 30_000):
        bucket = tensor_bucket_module.FlattenedTensorBucket(named_tensors=list(part.items()))
        payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
        _ok(c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [_mp_serialize(payload)], "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": "slime-2"}))
    assert _ok(c.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [_mp_serialize([])], "weight_version": "slime-2"}))
    assert c.get("/flush_cache").status_code == 200
    assert _greedy(c) == (_ref_greedy(ref_models[0]), "slime-2")
    # control calls around rollouts
    assert c.post("/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
    assert c.post("/continue_generation", json={}).json()["status"] == "ok"
    assert c.post("/abort_request", json={"abort_all": True}).status_code == 200
    assert c.post("/release_memory_occupation", json={}).status_code == 200
    assert c.post("/resume_memory_occupation", json={}).status_code == 200
    assert c.get("/health_generate").status_code == 200


def test_verl_style(live, ckpts, ref_models):
    url, c = live
    _reset(c, ckpts[0])

    @dataclasses.dataclass
    class LocalSerializedTensor:  # sglang.srt.model_executor.model_runner.LocalSerializedTensor
        values: list

    mod = types.ModuleType("sglang.srt.model_executor.model_runner")
    LocalSerializedTensor.__module__ = mod.__name__
    LocalSerializedTensor.__qualname__ = "LocalSerializedTensor"
    mod.LocalSerializedTensor = LocalSerializedTensor
    # pickle imports the class's module by name, which imports its parent packages first: register them
    # too (stand-ins unless real ones are loaded), so the test does not depend on what ran before it
    names = ["sglang", "sglang.srt", "sglang.srt.model_executor", mod.__name__]
    saved_all = {n: sys.modules.get(n) for n in names}
    for n in names[:-1]:
        sys.modules.setdefault(n, types.ModuleType(n))
    sys.modules[mod.__name__] = mod
    try:
        sd_b = dict(load_safetensors_dir(ckpts[1]))
        for k, part in enumerate(make_buckets(sd_b, 40_000)):
            named = [(n, LocalSerializedTensor(values=[_mp_serialize(t)])) for n, t in part.items()]
            _ok(c.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [_mp_serialize(named)], "load_format": None, "flush_cache": True}))
    finally:
        for n, m in saved_all.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    out, version = _greedy(c)
    assert out == _ref_greedy(ref_models[1]) and version == "reset"  # no version sent: the old one stays
    assert c.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
    assert c.post("/generate", json={"input_ids": PROMPT}).status_code == 503
    assert c.post("/resume_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
    info = c.get("/server_info").json()
    assert info == c.get("/get_server_info").json() and info["tp_size"] == 1
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == ckpts[0]
    assert c.post("/flush_cache").status_code == 200


def test_areal_style(live, ckpts, ref_models):
    url, c = live
    _reset(c, ckpts[0])
    r = _ok(c.post("/update_weights_from_disk", json={"model_path": ckpts[1], "abort_all_requests": True,
                                                       "weight_version": "areal-1"}))
    assert r["num_paused_requests"] == 0
    for path in ("/get_model_info", "/model_info"):
        info = c.get(path).json()
        assert info["model_path"] == ckpts[1] and info["weight_version"] == "areal-1"
    assert c.get("/v1/models").json()["data"][0]["id"] == ckpts[1]
    assert _greedy(c) == (_ref_greedy(ref_models[1]), "areal-1")
    # distributed update: ints, one version at the end
    updater = DistributedWeightUpdater([url], timeout_s=60)
    try:
        updater.sync(make_buckets(dict(load_safetensors_dir(ckpts[0])), 1 << 30), "areal-2")
    finally:
        updater.close()
    assert _greedy(c) == (_ref_greedy(ref_models[0]), "areal-2")
    assert c.post("/pause_generation", json={}).json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert c.post("/continue_generation", json={}).json()["status"] == "ok"
    r = c.post("/v1/completions", json={"model": "default", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6


def test_nemo_rl_style(live, ckpts, ref_models, tensor_bucket_module, tmp_path):
    url, c = live
    _reset(c, ckpts[0])
    sd_b = dict(load_safetensors_dir(ckpts[1]))
    bucket = tensor_bucket_module.FlattenedTensorBucket(named_tensors=list(sd_b.items()))
    blob = _mp_serialize({"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()})
    _ok(c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [blob], "load_format":
                                                    "flattened_bucket", "flush_cache": True, "weight_version": "n1"}))
    assert _greedy(c) == (_ref_greedy(ref_models[1]), "n1")
    assert c.post("/weights_checker", json={"action": "snapshot"}).json() == {"success": True, "message": "Success."}
    assert c.post("/weights_checker", json={"action": "compare"}).json()["success"] is True
    assert c.post("/start_profile", json={"output_dir": str(tmp_path), "activities": ["CPU"]}).text == "Start profiling.\n"
    _greedy(c)
    assert c.post("/stop_profile").status_code == 200
    traces = list(tmp_path.glob("*-TP-0.trace.json.gz"))
    assert len(traces) == 1
    import gzip
    import json

    events = json.load(gzip.open(traces[0]))["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    loads = c.get("/v1/loads").json()
    assert loads["dp_rank_count"] == 1 and loads["loads"][0]["num_running_reqs"] == 0


@pytest.mark.parametrize("path,body,field", [
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
                                    "world_size": 2, "backend": "gloo"}, "master_port"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "abc"}, "serialized_named_tensors"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]}, "serialized_named_tensors"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["eA=="], "load_format": "bogus"}, "load_format"),
    ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [], "load_format": "x"}, "load_format"),
    ("/weights_checker", {}, "action"),
    ("/start_profile", {"num_steps": 3}, "num_steps"),
])
def test_bad_control_input_is_a_400_naming_the_field(live, path, body, field):
    _, c = live
    r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    assert field in r.text


def test_pickles_naming_other_globals_are_refused(live):
    import pickle

    _, c = live
    evil = base64.b64encode(pickle.dumps([("x", os.getcwd)])).decode()
    r = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": [evil]})
    assert r.status_code == 400 and "does not unpickle" in r.json()["message"]


def test_update_weight_version_and_memory_occupation_by_get(live, ckpts, ref_models):
    """SGLang 0.5.9 routes found missing by an outside review: POST /update_weight_version sets the
    version without touching the weights (UpdateWeightVersionReqInput), and /release_memory_occupation /
    /resume_memory_occupation answer GET as well as POST."""
    _, c = live
    _reset(c, ckpts[0])
    r = c.post("/update_weight_version", json={"new_version": "v-renamed"})
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Weight version updated to v-renamed",
                                                 "new_version": "v-renamed"}
    assert c.get("/get_model_info").json()["weight_version"] == "v-renamed"
    assert _greedy(c)[0] == _ref_greedy(ref_models[0])  # weights unchanged
    assert c.post("/update_weight_version", json={"version": "x"}).status_code == 400
    assert c.get("/release_memory_occupation").status_code == 200
    assert c.post("/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 1}}).status_code == 503
    assert c.get("/resume_memory_occupation").status_code == 200
    assert _greedy(c)[0] == _ref_greedy(ref_models[0])
