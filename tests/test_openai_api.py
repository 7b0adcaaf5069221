"""OpenAI-compatible /v1/completions and /v1/chat/completions of the reference server (in-process)
against a transformers reference: greedy text equals HF ``generate``'s, the chat template is the
tokenizer's, usage counts tokens, bad fields answer 400 naming the field (SGLang's ErrorResponse)."""

from __future__ import annotations

import json

import os

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from fastapi.testclient import TestClient  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from moerl.rollout.server import ReferenceEngine, create_app  # noqa: E402
from moerl.rollout.testing import make_tiny_moe_checkpoint  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}={% endfor %}"
            "{% if add_generation_prompt %}a{% endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("oai"))
    make_tiny_moe_checkpoint(path, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    engine = ReferenceEngine(path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield TestClient(create_app(engine)), AutoTokenizer.from_pretrained(path), ref, path
    engine.close()


def _hf_greedy_text(ref, tok, ids: list[int], max_new: int) -> tuple[str, int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, eos_token_id=1,
                           pad_token_id=0)[0, len(ids):].tolist()
    return tok.decode(out, skip_special_tokens=True), len(out)


@pytest.mark.parametrize("prompt", ["1+2=", "abc-7*"])
def test_completions_greedy_text_equals_hf_generate(served, prompt):
    client, tok, ref, path = served
    r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode(prompt)
    text, n_out = _hf_greedy_text(ref, tok, ids, 12)
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert body["choices"][0]["text"] == text and body["choices"][0]["index"] == 0
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out,
                             "prompt_tokens_details": None, "reasoning_tokens": 0}
    assert body["metadata"] == {"weight_version": "default"}


def test_completions_token_prompts_n_and_logprobs(served):
    client, tok, ref, _ = served
    r = client.post("/v1/completions", json={"prompt": [[4, 5, 6], [7, 8]], "max_tokens": 4, "temperature": 0,
                                             "n": 2, "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 4 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 16  # each prompt once
    c0, c1, c2 = body["choices"][:3]  # prompt-major (SGLang's order): choices 0 and 1 answer prompt 0
    assert c0["text"] == c1["text"] == tok.decode(tok.convert_tokens_to_ids(c0["logprobs"]["tokens"]))
    assert c2["text"] != c0["text"] or c2["logprobs"]["token_logprobs"] != c0["logprobs"]["token_logprobs"]
    lp = c0["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    ids = tok.convert_tokens_to_ids(lp["tokens"])
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([[4, 5, 6] + ids])).logits[0, 2:-1]
    want = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(lp["token_logprobs"]), want, atol=1e-4)


def test_chat_applies_the_chat_template(served):
    client, tok, ref, _ = served
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "1+"},
                                                                              {"type": "text", "text": "2"}]}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 10,
                                                  "temperature": 0.0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.apply_chat_template([messages[0], {"role": "user", "content": "1+2"}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == tok.encode("sx=u1+2=a")  # the template really ran
    text, n_out = _hf_greedy_text(ref, tok, ids, 10)
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == text
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == n_out
    assert body["choices"][0]["logprobs"] is None


def test_chat_logprobs_and_seeded_sampling_is_reproducible(served):
    client, _, _, _ = served
    req = {"messages": [{"role": "user", "content": "12"}], "max_tokens": 6, "temperature": 0.9, "seed": 5,
           "logprobs": True}
    a, b = (client.post("/v1/chat/completions", json=req).json() for _ in range(2))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    content = a["choices"][0]["logprobs"]["content"]
    assert len(content) == a["usage"]["completion_tokens"]
    assert all(set(c) == {"token", "bytes", "logprob", "top_logprobs"} and c["logprob"] <= 0 for c in content)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": 3}, "prompt"),
    ("/v1/completions", {"prompt": "1", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "1", "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "1", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "1", "stop": 7}, "stop"),
    ("/v1/completions", {"prompt": "1", "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_requests_answer_400_naming_the_field(served, path, body, param):
    client = served[0]
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400 and err["param"] == param
    assert param in err["message"] or param == "messages"


def test_chat_without_a_template_is_refused(tmp_path):
    make_tiny_moe_checkpoint(str(tmp_path), seed=0)
    engine = ReferenceEngine(str(tmp_path))
    try:
        r = TestClient(create_app(engine)).post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                                          "content": "1"}]})
        assert r.status_code == 400 and "chat template" in r.json()["message"]
    finally:
        engine.close()


def test_review_fixes_match_sglang(served, tmp_path):
    """From an outside review against SGLang 0.5.9: batched n > 1 is prompt-major (TokenizerManager.
    _handle_batch_request), a sampling_seed outside int64 is a 400 for that request only, completions
    refuse max_tokens <= 0 (CompletionRequest.validate_max_tokens_positive), /start_profile with an
    output_dir that cannot be created is a 400, /model_info has model_type and architectures, an abort
    finish_reason carries status_code and err_type (FINISH_ABORT.to_json), and chat takes unset sampling
    fields from generation_config.json (ModelConfig.get_default_sampling_params)."""
    client, tok, _, path = served
    # prompt-major: 2 prompts x n=2, greedy -> [p0, p0, p1, p1]
    r = client.post("/generate", json={"input_ids": [[4, 5, 6], [7, 8]], "rid": "pm",
                                       "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2}})
    outs = r.json()
    alone = [client.post("/generate", json={"input_ids": p, "sampling_params": {"max_new_tokens": 3,
                                                                                 "temperature": 0}}).json()
             for p in ([4, 5, 6], [7, 8])]
    assert [o["output_ids"] for o in outs] == [alone[0]["output_ids"]] * 2 + [alone[1]["output_ids"]] * 2
    assert len({o["meta_info"]["id"] for o in outs}) == 4
    # a seed beyond int64
    r = client.post("/generate", json={"input_ids": [4, 5], "sampling_params": {"sampling_seed": 2**70}})
    assert r.status_code == 400 and "sampling_seed" in r.text
    # completions: max_tokens must be positive
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["param"] == "max_tokens" and "positive" in r.json()["message"]
    # profiler output_dir that cannot be created
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = client.post("/start_profile", json={"output_dir": str(blocker / "sub")})
    assert r.status_code == 400 and "output_dir" in r.text
    info = client.get("/model_info").json()
    assert info["model_type"] == "qwen3_moe" and info["architectures"] == ["Qwen3MoeForCausalLM"]
    assert info["has_image_understanding"] is False and info["has_audio_understanding"] is False
    # an abort finish_reason has SGLang's four keys
    from moerl.rollout.engine import abort_reason

    assert abort_reason("Aborted") == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    # chat: unset sampling fields come from generation_config.json, set ones win
    from moerl.rollout.openai_api import chat_to_generate, model_sampling_defaults

    cfg_dir = tmp_path / "gen"
    cfg_dir.mkdir()
    (cfg_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                "do_sample": True}))
    defaults = model_sampling_defaults(str(cfg_dir))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    msgs = [{"role": "user", "content": "abc"}]
    sp = chat_to_generate({"messages": msgs, "top_p": 0.5}, tok_with_template(tok), defaults)["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (0.6, 0.5, 20)
    sp = chat_to_generate({"messages": msgs}, tok_with_template(tok), {})["sampling_params"]
    assert sp["temperature"] == 1.0 and sp.get("top_p", 1.0) == 1.0
    assert model_sampling_defaults(str(tmp_path)) == {}


def tok_with_template(tok):
    tok.chat_template = TEMPLATE
    return tok
