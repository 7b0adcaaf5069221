"""/generate conformance: the calls the RL clients of slime, verl, AReaL, NeMo-RL (and SGLang's own
tests) make, against a live reference server (uvicorn in a thread, real HTTP on a local port).

Each payload is written from the field names those projects document for SGLang's native
/generate (GenerateReqInput / SamplingParams of sglang 0.5.9), not copied from their code; each is
checked for acceptance (HTTP 200) and for the response shape the client reads back:
  * slime: input_ids, sampling_params {temperature, top_p, top_k, max_new_tokens, stop,
    stop_token_ids, skip_special_tokens, no_stop_trim, spaces_between_special_tokens, sampling_seed},
    return_logprob, return_routed_experts; reads text, output_ids, output_token_logprobs[i][0],
    finish_reason.type, weight_version, routed_experts.
  * verl: input_ids, sampling_params {n, max_new_tokens, presence_penalty, frequency_penalty,
    repetition_penalty, temperature, top_p, top_k, ignore_eos}, return_logprob; reads
    output_token_logprobs (logprob, token id) and finish_reason.
  * AReaL: input_ids, sampling_params {top_p, top_k, max_new_tokens, temperature, stop_token_ids,
    stop, frequency_penalty, ignore_eos}, return_logprob, stream false; reads output_token_logprobs,
    finish_reason.type ("stop" / "length" / "abort") and, on abort, continues from the prefix.
  * NeMo-RL: input_ids (a batch), sampling_params {temperature, top_p, top_k, max_new_tokens,
    stop_token_ids, stop, skip_special_tokens}, return_logprob, logprob_start_len.
  * SGLang's own tests: text, logprob_start_len 0, top_logprobs_num, return_text_in_logprobs,
    token_ids_logprob, stream true (server-sent events).
"""

from __future__ import annotations

import json
import os

import pytest
import httpx

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from moerl.rollout.inprocess import serve_in_thread  # noqa: E402
from moerl.rollout.server import ReferenceEngine  # noqa: E402

EOS = 1
PROMPT = [4, 5, 13, 6, 15]


@pytest.fixture(scope="module")
def url(ckpts):
    engine = ReferenceEngine(ckpts[0])
    try:
        with serve_in_thread(engine) as base:
            yield base
    finally:
        engine.close()


def _post(url, body):
    r = httpx.post(f"{url}/generate", json=body, timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    return r


def _check_item(item, *, logprob=True, n_prompt=None):
    """The keys every client reads: text, output_ids, meta_info{id, finish_reason, prompt_tokens,
    completion_tokens, weight_version, output_token_logprobs as [logprob, id, text|None]}."""
    assert isinstance(item["text"], str) and isinstance(item["output_ids"], list)
    meta = item["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
            "e2e_latency"} <= set(meta)
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert meta["completion_tokens"] == len(item["output_ids"])
    if n_prompt is not None:
        assert meta["prompt_tokens"] == n_prompt
    if logprob:
        lps = meta["output_token_logprobs"]
        assert [e[1] for e in lps] == item["output_ids"]
        assert all(isinstance(e[0], float) and e[0] <= 0.0 and len(e) == 3 for e in lps)
        assert meta["input_token_logprobs"][0][0] is None


CLIENT_CALLS = {
    "slime": {"input_ids": PROMPT, "return_logprob": True, "return_routed_experts": True,
              "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12,
                                  "stop": ["=="], "stop_token_ids": [EOS], "skip_special_tokens": False,
                                  "no_stop_trim": True, "spaces_between_special_tokens": False,
                                  "sampling_seed": 7}},
    "verl": {"input_ids": PROMPT, "return_logprob": True,
             "sampling_params": {"n": 1, "max_new_tokens": 12, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                 "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                 "ignore_eos": False}},
    "verl-penalized": {"input_ids": PROMPT, "return_logprob": True,
                       "sampling_params": {"n": 1, "max_new_tokens": 12, "presence_penalty": 0.5,
                                           "frequency_penalty": 0.3, "repetition_penalty": 1.1,
                                           "temperature": 0.9, "top_p": 0.95, "top_k": 20, "ignore_eos": True}},
    "areal": {"input_ids": PROMPT, "return_logprob": True, "stream": False,
              "sampling_params": {"top_p": 1.0, "top_k": 100, "max_new_tokens": 12, "temperature": 1.0,
                                  "stop_token_ids": [EOS], "stop": ["7", "x"], "frequency_penalty": 0.0,
                                  "ignore_eos": False}},
    "nemo-rl": {"input_ids": [PROMPT, PROMPT[:3]], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12,
                                    "stop_token_ids": [EOS], "stop": None, "skip_special_tokens": True}},
    "sglang-tests": {"text": "12+3=", "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5,
                     "return_text_in_logprobs": True, "token_ids_logprob": [4, 5],
                     "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
}


@pytest.mark.parametrize("kind", sorted(CLIENT_CALLS))
def test_client_payload_is_accepted_with_sglang_shape(url, kind):
    body = CLIENT_CALLS[kind]
    out = _post(url, body).json()
    items = out if isinstance(out, list) else [out]
    prompts = body["input_ids"] if isinstance(body.get("input_ids", [None])[0], list) else [body.get("input_ids")]
    assert len(items) == len(prompts)
    for item, prompt in zip(items, prompts):
        _check_item(item, n_prompt=None if prompt is None else len(prompt))
        meta = item["meta_info"]
        start = body.get("logprob_start_len", -1)
        n_in = meta["prompt_tokens"] - (meta["prompt_tokens"] - 1 if start == -1 else start)
        assert len(meta["input_token_logprobs"]) == n_in
    if kind == "slime":
        assert isinstance(out["meta_info"]["routed_experts"], str)  # base64 int32, SGLang's format
        if isinstance(out["meta_info"]["finish_reason"].get("matched"), str):
            assert out["text"].endswith("==") or "==" in out["text"]  # no_stop_trim keeps it
    if kind == "sglang-tests":
        meta = out["meta_info"]
        assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 5
        assert all(len(x) == 5 and isinstance(x[0][2], str) for x in meta["output_top_logprobs"])
        assert all([e[1] for e in x] == [4, 5] for x in meta["output_token_ids_logprobs"])
        assert meta["input_token_ids_logprobs"][0] is None


def test_areal_stop_strings_cut_text_and_report_the_match(url):
    body = CLIENT_CALLS["areal"]
    out = _post(url, {**body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 60,
                                                   "stop_token_ids": [], "ignore_eos": True,
                                                   "stop": list("0123456789")}}).json()
    fin = out["meta_info"]["finish_reason"]
    assert fin["type"] == "stop" and isinstance(fin["matched"], str)
    assert fin["matched"] not in out["text"]  # SGLang trims the stop string from the text, not the ids


def test_sglang_stream_is_server_sent_events(url):
    body = {**CLIENT_CALLS["sglang-tests"], "stream": True, "sampling_params": {"temperature": 0,
                                                                                 "max_new_tokens": 8}}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120, trust_env=False) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    full = _post(url, {k: v for k, v in body.items() if k != "stream"}).json()
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["output_top_logprobs"] == full["meta_info"]["output_top_logprobs"]


def test_refusals_are_sglang_style_400s(url):
    r = httpx.post(f"{url}/generate", trust_env=False, json={"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 5}},
                      timeout=60)
    assert r.status_code == 400 and "frequency_penalty" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", trust_env=False, json={"input_ids": PROMPT, "return_logprob": True,
                                                "logprob_start_len": 99}, timeout=60)
    assert r.status_code == 400 and "logprob_start_len" in r.json()["error"]["message"]


def test_context_length_is_checked_as_sglang_does(tmp_path):
    """SGLang 0.5.9 TokenizerManager._validate_one_request (no --allow-auto-truncate): a prompt as long as
    the context, or prompt + max_new_tokens reaching it, is a 400 with SGLang's message; one token less
    is served; max_new_tokens null takes the room left."""
    from fastapi.testclient import TestClient

    from moerl.rollout.server import ReferenceEngine, create_app
    from moerl.rollout.testing import make_tiny_moe_checkpoint

    make_tiny_moe_checkpoint(str(tmp_path), seed=0)
    engine = ReferenceEngine(str(tmp_path))
    try:
        c = TestClient(create_app(engine))
        ctx = engine.max_positions
        prompt = [4] * (ctx - 10)
        r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 10}})
        assert r.status_code == 400 and "exceeds the model's maximum context length of" in r.text, r.text
        r = c.post("/generate", json={"input_ids": [4] * ctx, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and "is longer than the model's context length" in r.text, r.text
        r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 9, "ignore_eos": True,
                                                                               "temperature": 0}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 9, r.text
        r = c.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": None,
                                                                               "ignore_eos": True, "temperature": 0}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 9, r.text
    finally:
        engine.close()
