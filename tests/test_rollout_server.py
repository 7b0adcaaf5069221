"""Reference rollout server (in-process, FastAPI TestClient) against independent transformers forwards."""

from __future__ import annotations

import os
import threading

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from fastapi.testclient import TestClient  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from moerl.rollout.server import ReferenceEngine, create_app, load_safetensors_dir  # noqa: E402
from moerl.rollout.weight_sync import (  # noqa: E402
    serialize_bucket, sync_weights_from_disk, sync_weights_from_tensor)

EOS = 1




@pytest.fixture(scope="module")
def shared(ckpts):
    """One server on model A that no test mutates."""
    engine = ReferenceEngine(ckpts[0])
    return engine, TestClient(create_app(engine))


def _fresh(path):
    engine = ReferenceEngine(path)
    return engine, TestClient(create_app(engine))


def _gen(client, body, status=200):
    r = client.post("/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


def _forward_logits(model, prompt, response):
    """Raw logits predicting each response token: [len(response), V] (one full forward, no cache)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(response)]


def _greedy_reference(model, prompt, max_new, stop=(EOS,)):
    """Greedy decoding by repeated full forwards (no KV cache), stopping after a stop token."""
    out = []
    for _ in range(max_new):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1]
        tok = int(torch.argmax(logits))
        out.append(tok)
        if tok in stop:
            break
    return out


PROMPTS = [[4, 5, 13, 6, 15], [7, 8, 15], [9, 10, 11, 12, 13, 14, 15]]  # different lengths: left padding


# ----------------------------------------------------------------------------- log-probs and sampling


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.3, -1, 0.6), (1.0, -1, 1.0)])
def test_logprobs_match_forward_at_temperature(shared, ref_models, temperature, top_k, top_p):
    _, client = shared
    model = ref_models[0]
    sp = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "max_new_tokens": 12,
          "sampling_seed": 11, "ignore_eos": True}
    outs = _gen(client, {"input_ids": PROMPTS, "sampling_params": sp, "return_logprob": True})
    assert isinstance(outs, list) and len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        resp = out["output_ids"]
        meta = out["meta_info"]
        assert len(resp) == 12 and meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12
        assert meta["weight_version"] == "default"
        lps = meta["output_token_logprobs"]
        assert [e[1] for e in lps] == resp and all(e[2] is None for e in lps)
        logits = _forward_logits(model, prompt, resp)
        ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(resp)[:, None]).squeeze(1)
        got = torch.tensor([e[0] for e in lps])
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (got - ref).abs().max()
        # the sampled token respects the filter applied after the log-probs were taken
        probs = torch.softmax(logits / temperature, -1)
        for t, tok in enumerate(resp):
            order = torch.argsort(probs[t], descending=True)
            rank = int((order == tok).nonzero())
            if top_k > 0:
                assert rank < top_k
            mass_before = float(probs[t][order[:rank]].sum())
            assert mass_before <= top_p + 1e-6


def test_greedy_matches_reference_decoding_and_plain_logprobs(shared, ref_models):
    _, client = shared
    model = ref_models[0]
    outs = _gen(client, {"input_ids": PROMPTS, "return_logprob": True,
                         "sampling_params": {"temperature": 0.0, "max_new_tokens": 10}})
    for prompt, out in zip(PROMPTS, outs):
        expect = _greedy_reference(model, prompt, 10)
        assert out["output_ids"] == expect
        logits = _forward_logits(model, prompt, expect)
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(expect)[:, None]).squeeze(1)
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_sampling_distribution_matches_softmax(shared, ref_models):
    """First tokens of 20000 differently seeded items follow softmax(logits/T) (and the top-k renorm)."""
    _, client = shared
    prompt, T, n = [7, 8, 15], 0.6, 20000
    logits = _forward_logits(ref_models[0], prompt, [0])[0]

    def target(temp, top_k):
        p = torch.softmax(logits / temp, -1)
        if top_k > 0:
            keep = torch.topk(p, top_k).indices
            q = torch.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return p

    for top_k in (-1, 3):
        sps = [{"temperature": T, "top_k": top_k, "max_new_tokens": 1, "sampling_seed": 1000 + i}
               for i in range(n)]
        outs = _gen(client, {"input_ids": [prompt] * n, "sampling_params": sps})
        freq = torch.bincount(torch.tensor([o["output_ids"][0] for o in outs]), minlength=logits.numel()) / n
        p = target(T, top_k)
        # expected total variation from sampling noise alone: 0.5 * sum sqrt(2 p (1-p) / (pi n))
        noise = 0.5 * float(torch.sqrt(2 * p * (1 - p) / (torch.pi * n)).sum())
        tv = 0.5 * float((freq - p).abs().sum())
        assert tv < 2 * noise, (tv, noise)
        assert freq[p == 0].sum() == 0
        # the check has power: a 20% temperature error would be caught
        assert 0.5 * float((freq - target(T * 1.2, top_k)).abs().sum()) > 2 * noise


def test_sampling_seed_determinism(shared, ckpts):
    engine, client = shared
    body = {"input_ids": [PROMPTS[0]] * 4, "return_logprob": True,
            "sampling_params": [{"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 100 + k}
                                for k in range(4)]}
    first = _gen(client, body)
    _gen(client, {"input_ids": PROMPTS, "sampling_params": {"temperature": 1.0, "max_new_tokens": 7}})
    again = _gen(client, body)
    _, other = _fresh(ckpts[0])  # a second server instance
    elsewhere = _gen(other, body)
    ids = [o["output_ids"] for o in first]
    assert ids == [o["output_ids"] for o in again] == [o["output_ids"] for o in elsewhere]
    assert [o["meta_info"]["output_token_logprobs"] for o in first] == \
        [o["meta_info"]["output_token_logprobs"] for o in elsewhere]
    assert len({tuple(x) for x in ids}) > 1, "different seeds must give different samples"
    # an item's output does not depend on the rest of its batch (same-length prompts: no padding)
    alone = _gen(client, {"input_ids": PROMPTS[0], "sampling_params":
                          {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 102}})
    assert alone["output_ids"] == ids[2]
    # the same seed twice in one batch gives the same response (SGLang semantics)
    twins = _gen(client, {"input_ids": [PROMPTS[0]] * 2, "sampling_params":
                          {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 102}})
    assert twins[0]["output_ids"] == twins[1]["output_ids"] == ids[2]


def test_stop_token_included_and_generation_stops(shared, ref_models):
    _, client = shared
    prompt = PROMPTS[2]
    free = _gen(client, {"input_ids": prompt, "sampling_params":
                         {"temperature": 0.0, "max_new_tokens": 15, "ignore_eos": True}})["output_ids"]
    stop_tok = free[4]
    cut = next(j for j, t in enumerate(free) if t in (stop_tok, EOS)) + 1
    out = _gen(client, {"input_ids": prompt, "return_logprob": True, "sampling_params":
                        {"temperature": 0.0, "max_new_tokens": 15, "stop_token_ids": [stop_tok]}})
    assert out["output_ids"] == free[:cut]
    assert out["output_ids"][-1] in (stop_tok, EOS)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": free[cut - 1]}
    assert len(out["meta_info"]["output_token_logprobs"]) == cut
    # the tokenizer's eos stops sampling too, and nothing follows it
    outs = _gen(client, {"input_ids": [prompt] * 64, "sampling_params": [
        {"temperature": 1.5, "max_new_tokens": 20, "sampling_seed": s} for s in range(64)]})
    stopped = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped, "expected some samples to end on eos"
    for o in outs:
        ids = o["output_ids"]
        assert EOS not in ids[:-1]
        # SGLang checks max_new_tokens before the stop tokens: eos as the 20th token is "length"
        ends_on_eos = bool(ids) and ids[-1] == EOS
        assert (o["meta_info"]["finish_reason"]["type"] == "stop") == (ends_on_eos and len(ids) < 20)


def test_parallel_sampling_n_and_text_input(shared):
    engine, client = shared
    outs = _gen(client, {"text": "12+3=", "rid": "g7", "sampling_params":
                         {"n": 3, "max_new_tokens": 4, "temperature": 1.0}})
    assert [o["meta_info"]["id"] for o in outs] == ["g7_0", "g7_1", "g7_2"]
    assert all(o["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("12+3=")) for o in outs)


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": [4, 5], "sampling_params": {"temprature": 1.0}}, "temprature"),
    ({"input_ids": [4, 5], "sampling_params": {"stop": 5}}, "sampling_params.stop"),
    ({"input_ids": [4, 5], "sampling_params": {"stop": ["x", 1]}}, "sampling_params.stop"),
    ({"input_ids": [4, 5], "sampling_params": {"frequency_penalty": 2.5}}, "sampling_params.frequency_penalty"),
    ({"input_ids": [4, 5], "sampling_params": {"presence_penalty": -3}}, "sampling_params.presence_penalty"),
    ({"input_ids": [4, 5], "sampling_params": {"repetition_penalty": 2.1}}, "sampling_params.repetition_penalty"),
    ({"input_ids": [4, 5], "sampling_params": {"stream_interval": 0}}, "sampling_params.stream_interval"),
    ({"input_ids": [4, 5], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    ({"input_ids": [4, 5], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"input_ids": [4, 5], "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": [4, 5], "return_logprob": True, "token_ids_logprob": [4, 999]}, "token_ids_logprob"),
    ({"input_ids": [[4, 5], [6]], "return_logprob": True, "top_logprobs_num": [1]}, "top_logprobs_num"),
    ({"input_ids": [4, 5], "return_logprob": True, "token_ids_logprob": [[4]], "sampling_params": {"n": 2}},
     "token_ids_logprob"),
    ({"input_ids": [4, 5], "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"input_ids": [4, 5], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [4, 5], "text": "1"}, "exactly one"),
    ({"input_ids": [4, 999]}, "vocabulary"),
    ({"input_ids": [[4, 5], [6]], "sampling_params": [{}]}, "one per prompt"),
    ({"input_ids": [4, 5], "sampling_params": {"stop_regex": "x+"}}, "stop_regex"),
])
def test_bad_requests_name_the_field(shared, body, needle):
    _, client = shared
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert needle in r.json()["error"]["message"]


def test_info_endpoints(shared, ckpts):
    _, client = shared
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["model_path"] == ckpts[0] and info["is_generation"] is True
    assert info["weight_version"] == "default"
    assert client.get("/get_server_info").json()["weight_version"] == "default"
    assert client.post("/flush_cache").status_code == 200


# ----------------------------------------------------------------------------- SGLang fields: stop strings,
# penalties, log-prob options, streaming (each was refused with HTTP 400 before; semantics of sglang 0.5.9)


def _reference_decode(model, tok, prompt, max_new, *, T=0.0, seed=None, freq=0.0, pres=0.0,
                      stop_ids=(EOS,), stop_strs=()):
    """Independent reference from the HF model's logits: one full forward per step (no KV cache),
    SGLang's penalties on the raw logits (count * frequency_penalty + presence_penalty over the tokens
    generated so far), greedy argmax or the server's documented sampling (inverse CDF in vocabulary
    order at uniforms torch.rand(max_new, Generator(seed), float64)), and SGLang's finish order
    (length, stop token, stop string in the decoded tail of stop_str_max_len + 2 tokens).
    Returns (tokens, logprobs, per-step log-prob vectors [V], finish_reason)."""
    u = torch.rand(max_new, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) if T > 0 else None
    max_len = max((len(tok.encode(x, add_special_tokens=False)) for x in stop_strs), default=0)
    out, lps, dists, counts = [], [], [], None
    for t in range(max_new):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
        counts = torch.zeros_like(logits) if counts is None else counts
        logits = logits - freq * counts - pres * (counts > 0).float()
        if T == 0:
            logp = torch.log_softmax(logits, -1)
            nxt = int(torch.argmax(logits))
        else:
            logp = torch.log_softmax(logits / T, -1)
            cdf = torch.softmax(logits / T, -1).double().cumsum(0)
            nxt = min(int(torch.searchsorted(cdf, (u[t] * cdf[-1]).reshape(1), right=True)), len(cdf) - 1)
        out.append(nxt)
        lps.append(float(logp[nxt]))
        dists.append(logp)
        counts[nxt] += 1
        n = len(out)
        if n >= max_new:
            return out, lps, dists, {"type": "length", "length": max_new}
        if nxt in stop_ids:
            return out, lps, dists, {"type": "stop", "matched": nxt}
        tail = tok.decode(out[-min(max_len + 2, n):]) if stop_strs else ""
        hit = [x for x in stop_strs if x in tail]
        if hit:
            return out, lps, dists, {"type": "stop", "matched": hit[0]}
    raise AssertionError("unreachable")


def _stop_string_from(tok, free, start=2, fresh=False):
    """A 2-character stop string taken from a free-running response (plain characters only; with
    ``fresh`` its first character does not occur earlier, so no earlier chunk is held back)."""
    j = next(j for j in range(start, len(free) - 1) if free[j] > 2 and free[j + 1] > 2
             and not (fresh and free[j] in free[:j]))
    return tok.decode(free[j: j + 2])


@pytest.mark.parametrize("T,seed,freq,pres", [(0.0, None, 0.0, 0.0), (0.0, None, 0.8, 0.5),
                                               (1.0, 5, 0.6, 0.0), (0.8, 9, -0.5, 1.0)])
def test_stop_strings_and_penalties_match_reference(shared, ref_models, T, seed, freq, pres):
    engine, client = shared
    model, tok, prompt = ref_models[0], engine.tokenizer, PROMPTS[0]
    free, *_ = _reference_decode(model, tok, prompt, 24, T=T, seed=seed, freq=freq, pres=pres, stop_ids=())
    stop = _stop_string_from(tok, free)
    stops = ["never-there", stop]
    ref, ref_lps, _, finish = _reference_decode(model, tok, prompt, 24, T=T, seed=seed, freq=freq, pres=pres,
                                                stop_strs=tuple(stops))
    sp = {"temperature": T, "max_new_tokens": 24, "stop": stops, "frequency_penalty": freq,
          "presence_penalty": pres}
    if seed is not None:
        sp["sampling_seed"] = seed
    out = _gen(client, {"input_ids": prompt, "sampling_params": sp, "return_logprob": True})
    assert out["output_ids"] == ref, (out["output_ids"], ref)
    assert out["meta_info"]["finish_reason"] == finish
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, torch.tensor(ref_lps), atol=1e-5, rtol=0)
    text = tok.decode(ref, skip_special_tokens=True)
    if finish.get("matched") == stop:  # SGLang cuts the text (not the ids) at the stop string
        assert stop in text and out["text"] == text[: text.find(stop)]
    # no_stop_trim keeps it
    kept = _gen(client, {"input_ids": prompt, "sampling_params": {**sp, "no_stop_trim": True}})
    assert kept["output_ids"] == ref and kept["text"] == text


def test_penalties_change_the_output_and_repetition_penalty_is_accepted_as_in_sglang(shared):
    _, client = shared
    base = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    plain = _gen(client, {"input_ids": PROMPTS[1], "sampling_params": base})["output_ids"]
    pen = _gen(client, {"input_ids": PROMPTS[1], "sampling_params": {**base, "frequency_penalty": 2.0}})["output_ids"]
    assert pen != plain and max(pen.count(t) for t in set(pen)) <= max(plain.count(t) for t in set(plain))
    # sglang 0.5.9 validates repetition_penalty ([0, 2]) but has no penalizer for it: same output
    rep = _gen(client, {"input_ids": PROMPTS[1], "sampling_params": {**base, "repetition_penalty": 1.7}})
    assert rep["output_ids"] == plain


def test_ignore_eos_disables_stop_token_ids_as_in_sglang(shared):
    _, client = shared
    base = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    free = _gen(client, {"input_ids": PROMPTS[2], "sampling_params": base})["output_ids"]
    out = _gen(client, {"input_ids": PROMPTS[2], "sampling_params": {**base, "stop_token_ids": [free[3]]}})
    assert out["output_ids"] == free and out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    cut = _gen(client, {"input_ids": PROMPTS[2], "sampling_params": {**base, "ignore_eos": False,
                                                                     "stop_token_ids": [free[3]]}})
    k = cut["meta_info"]["completion_tokens"]
    assert cut["output_ids"] == free[:k] and cut["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("start", [0, 2, -1])
def test_input_and_top_logprobs_match_reference(shared, ref_models, start):
    """logprob_start_len, top_logprobs_num and token_ids_logprob (SGLang's own tests send
    logprob_start_len 0): prompt log-probs of the raw logits, output ones of the tempered penalized
    distribution, in SGLang's [logprob, id, text] entries with None at the first prompt position."""
    engine, client = shared
    model, tok, prompt = ref_models[0], engine.tokenizer, PROMPTS[2]
    T, seed, freq, k, want = 0.7, 21, 0.3, 4, [3, 7]
    ref, ref_lps, dists, _ = _reference_decode(model, tok, prompt, 10, T=T, seed=seed, freq=freq)
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": k, "token_ids_logprob": want,
            "return_text_in_logprobs": True,
            "sampling_params": {"temperature": T, "sampling_seed": seed, "max_new_tokens": 10,
                                "frequency_penalty": freq}}
    if start != -1:
        body["logprob_start_len"] = start
    meta = _gen(client, body)["meta_info"]
    s = len(prompt) - 1 if start == -1 else start
    with torch.no_grad():
        plp = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt[s:] and [e[2] for e in inp] == [tok.decode([t]) for t in prompt[s:]]
    assert inp[0][0] is None and meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    for j in range(1, len(prompt) - s):
        pos = s + j - 1  # the position that predicts prompt[s + j]
        assert abs(inp[j][0] - float(plp[pos, prompt[s + j]])) < 1e-5
        top = meta["input_top_logprobs"][j]
        v, ix = plp[pos].topk(k)
        assert [e[1] for e in top] == ix.tolist() and torch.allclose(torch.tensor([e[0] for e in top]), v, atol=1e-5)
        assert [e[1] for e in meta["input_token_ids_logprobs"][j]] == want
        assert torch.allclose(torch.tensor([e[0] for e in meta["input_token_ids_logprobs"][j]]), plp[pos, want], atol=1e-5)
    out = meta["output_token_logprobs"]
    assert [e[1] for e in out] == ref
    assert torch.allclose(torch.tensor([e[0] for e in out]), torch.tensor(ref_lps), atol=1e-5)
    assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == len(ref)
    for t, d in enumerate(dists):
        v, ix = d.topk(k)
        top = meta["output_top_logprobs"][t]
        assert [e[1] for e in top] == ix.tolist() and [e[2] for e in top] == [tok.decode([i]) for i in ix.tolist()]
        assert torch.allclose(torch.tensor([e[0] for e in top]), v, atol=1e-5)
        ids = meta["output_token_ids_logprobs"][t]
        assert [e[1] for e in ids] == want and torch.allclose(torch.tensor([e[0] for e in ids]), d[want], atol=1e-5)


def test_prompt_scoring_with_zero_new_tokens(shared, ref_models):
    """max_new_tokens 0 + logprob_start_len 0: the prompt's log-probs only (prompt scoring)."""
    _, client = shared
    prompt = PROMPTS[0]
    out = _gen(client, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                        "sampling_params": {"max_new_tokens": 0}})
    with torch.no_grad():
        plp = torch.log_softmax(ref_models[0](input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    ref = [None] + [float(plp[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    got = out["meta_info"]["input_token_logprobs"]
    assert got[0] == [None, prompt[0], None]
    assert all(abs(g[0] - r) < 1e-5 for g, r in zip(got[1:], ref[1:]))
    assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []


def _sse_events(resp) -> list:
    """Parse SGLang's server-sent events: 'data: {json}' blocks separated by blank lines, ending 'data: [DONE]'."""
    import json

    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    blocks = resp.text.split("\n\n")
    assert blocks[-1] == "" and blocks[-2] == "data: [DONE]", resp.text[-200:]
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [json.loads(b[len("data: "):]) for b in blocks[:-2]]


def _without_latency(item: dict) -> dict:
    meta = {k: v for k, v in item["meta_info"].items() if k != "e2e_latency"}
    return {**item, "meta_info": meta}


@pytest.mark.parametrize("sp_extra", [{"temperature": 1.0, "sampling_seed": 4},
                                      {"temperature": 0.0, "stream_interval": 3}])
def test_stream_concatenation_equals_non_streamed(shared, sp_extra):
    engine, client = shared
    free = _gen(client, {"input_ids": PROMPTS[0], "sampling_params": {**sp_extra, "max_new_tokens": 20,
                                                                     "ignore_eos": True}})["output_ids"]
    stop = _stop_string_from(engine.tokenizer, free, start=5, fresh=True)
    body = {"input_ids": PROMPTS[0], "rid": "s1", "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {**sp_extra, "max_new_tokens": 20, "stop": stop}}
    full = _gen(client, body)
    events = _sse_events(client.post("/generate", json={**body, "stream": True}))
    assert len(events) >= 2 and all("index" not in e for e in events)
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert _without_latency(events[-1]) == _without_latency(full)
    # each chunk is the whole result so far (SGLang without --stream-output): the deltas concatenate
    text, ids = "", []
    for e in events:
        assert e["text"].startswith(text) and e["output_ids"][: len(ids)] == ids
        assert stop not in e["text"]  # a chunk never shows the stop string (SGLang holds it back)
        text, ids = e["text"], e["output_ids"]
        assert len(e["meta_info"]["output_token_logprobs"]) == len(ids) == e["meta_info"]["completion_tokens"]
    assert (text, ids) == (full["text"], full["output_ids"])
    interval = sp_extra.get("stream_interval")
    if interval:  # SGLang: a chunk after tokens 1, 1 + interval, ... (plus the final one)
        assert all(len(e["output_ids"]) % interval == 1 for e in events[:-1])


def test_batched_stream_carries_index(shared):
    _, client = shared
    body = {"input_ids": PROMPTS[:2], "rid": "b", "sampling_params": {"temperature": 1.0, "sampling_seed": 8,
                                                          "max_new_tokens": 6, "n": 2}}
    full = _gen(client, body)
    events = _sse_events(client.post("/generate", json={**body, "stream": True}))
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    for i, item in enumerate(full):
        f = {k: v for k, v in finals[i].items() if k != "index"}
        assert _without_latency(f) == _without_latency(item)


def test_stream_bad_input_is_an_error_event(shared):
    """SGLang answers 200 and sends {"error": {"message"}} as an event before [DONE]."""
    _, client = shared
    events = _sse_events(client.post("/generate", json={"input_ids": [4, 5], "stream": True,
                                                       "sampling_params": {"top_p": 0.0}}))
    assert len(events) == 1 and "top_p" in events[0]["error"]["message"]


# ----------------------------------------------------------------------------- abort


def test_abort_queued_request(ckpts):
    engine, _ = _fresh(ckpts[0])
    result = {}
    with engine._model_lock:  # the model is busy: the request waits in the queue
        th = threading.Thread(target=lambda: result.setdefault("r", engine.generate(
            {"input_ids": [[4, 5], [6, 7]], "rid": "q", "sampling_params": {"max_new_tokens": 8}})))
        th.start()
        while not (engine._pending or engine._running):
            pass
        engine.abort(rid="q")
    th.join()
    assert [o["meta_info"]["finish_reason"]["type"] for o in result["r"]] == ["abort", "abort"]
    assert all(o["output_ids"] == [] for o in result["r"])


def test_abort_running_item_keeps_tokens_so_far(ckpts):
    engine, client = _fresh(ckpts[0])
    forward = engine.model.forward
    calls = {"n": 0}

    def counting_forward(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:  # during step 4: abort item 1 of the request
            engine.abort(rid="run_1")
        return forward(*a, **kw)

    engine.model.forward = counting_forward
    outs = engine.generate({"input_ids": [[4, 5], [6, 7]], "rid": "run", "sampling_params":
                            {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}})
    engine.model.forward = forward
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "length" and len(outs[0]["output_ids"]) == 10
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "abort" and len(outs[1]["output_ids"]) == 4
    full = _gen(client, {"input_ids": [6, 7], "sampling_params":
                         {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}})
    assert outs[1]["output_ids"] == full["output_ids"][:4]


# ----------------------------------------------------------------------------- weight updates


def _greedy_outputs(client, max_new=10):
    outs = _gen(client, {"input_ids": PROMPTS, "return_logprob": True,
                         "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new}})
    return [o["output_ids"] for o in outs], outs


def test_update_from_disk_switches_to_second_model(ckpts, ref_models):
    engine, client = _fresh(ckpts[0])
    before, _ = _greedy_outputs(client)
    r = client.post("/update_weights_from_disk", json={"model_path": ckpts[1], "weight_version": "v1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    after, outs = _greedy_outputs(client)
    expect = [_greedy_reference(ref_models[1], p, 10) for p in PROMPTS]
    assert after == expect and after != before
    for p, o in zip(PROMPTS, outs):
        assert o["meta_info"]["weight_version"] == "v1"
        lp = torch.tensor([e[0] for e in o["meta_info"]["output_token_logprobs"]])
        logits = _forward_logits(ref_models[1], p, o["output_ids"])
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(o["output_ids"])[:, None]).squeeze(1)
        assert torch.allclose(lp, ref, atol=1e-5, rtol=0)
    assert client.get("/get_model_info").json()["weight_version"] == "v1"
    # and every parameter really equals model B's (the fused expert layout included)
    for (n, p), (n2, p2) in zip(engine.model.named_parameters(), ref_models[1].named_parameters()):
        assert n == n2 and torch.equal(p, p2), n


def test_update_from_disk_missing_parameter_is_refused(ckpts, tmp_path):
    from safetensors.torch import save_file

    engine, client = _fresh(ckpts[0])
    before, _ = _greedy_outputs(client)
    sd = dict(load_safetensors_dir(ckpts[1]))
    dropped = "model.layers.1.mlp.experts.2.up_proj.weight"
    del sd[dropped]
    save_file(sd, str(tmp_path / "model.safetensors"))
    r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "weight_version": "bad"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert dropped in r.json()["message"]
    assert _greedy_outputs(client)[0] == before  # nothing was changed
    assert client.get("/get_model_info").json()["weight_version"] == "default"
    # unknown name and wrong shape are refused too
    sd = dict(load_safetensors_dir(ckpts[1]))
    sd["model.layers.0.mlp.experts.9.up_proj.weight"] = torch.zeros(32, 64)
    save_file(sd, str(tmp_path / "model.safetensors"))
    r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert r.status_code == 400 and "expert 9" in r.json()["message"]
    r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert r.status_code == 400 and "not a directory" in r.json()["message"]


def test_update_from_tensor_buckets(ckpts, ref_models):
    engine, client = _fresh(ckpts[0])
    sd = dict(load_safetensors_dir(ckpts[1]))
    names = list(sd)
    thirds = [names[0::3], names[1::3], names[2::3]]
    # all buckets but the last: applied, version unchanged
    for k, part in enumerate(thirds[:2]):
        r = client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_bucket({n: sd[n] for n in part})],
            "load_format": None, "flush_cache": False, "weight_version": None})
        assert r.status_code == 200 and r.json()["success"], r.text
    assert client.get("/get_model_info").json()["weight_version"] == "default"
    r = client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_bucket({n: sd[n] for n in thirds[2]})],
        "flush_cache": True, "weight_version": "t1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    after, outs = _greedy_outputs(client)
    assert after == [_greedy_reference(ref_models[1], p, 10) for p in PROMPTS]
    assert {o["meta_info"]["weight_version"] for o in outs} == {"t1"}

    # SGLang 0.5.9: a call that carries weight_version sets it, whatever the bucket covers (the answer
    # says which weights it left unchanged)
    r = client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_bucket({n: sd[n] for n in names[1:]})],
        "weight_version": "t2"})
    assert r.status_code == 200 and r.json()["success"] and names[0] in r.json()["message"], r.text
    assert client.get("/get_model_info").json()["weight_version"] == "t2"
    # unknown names are refused before anything is written
    r = client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [serialize_bucket({"model.layers.0.mlp.nope.weight": torch.zeros(2)})]})
    assert r.status_code == 400 and "nope" in r.json()["message"]


def test_weight_sync_helpers(ckpts, ref_models, tmp_path):
    engine, client = _fresh(ckpts[0])
    url = str(client.base_url)
    sd_b = dict(load_safetensors_dir(ckpts[1]))
    sd_a = dict(load_safetensors_dir(ckpts[0]))
    cfg = AutoConfig.from_pretrained(ckpts[1])
    expect_b = [_greedy_reference(ref_models[1], p, 10) for p in PROMPTS]
    expect_a = [_greedy_reference(ref_models[0], p, 10) for p in PROMPTS]

    paths = []
    for v, sd in (("1", sd_b), ("2", sd_a), ("3", sd_b)):
        paths.append(sync_weights_from_disk([url], sd, cfg, tmp_path, v, http_client=client))
        assert _greedy_outputs(client)[0] == (expect_b if sd is sd_b else expect_a)
        assert client.get("/get_model_info").json()["weight_version"] == v
    assert not os.path.exists(paths[0]) and os.path.isdir(paths[1]) and os.path.isdir(paths[2])
    assert os.path.exists(os.path.join(paths[2], "config.json"))

    n_buckets = sync_weights_from_tensor([url], sd_a, "4", bucket_bytes=20_000, http_client=client)
    assert n_buckets > 3
    assert _greedy_outputs(client)[0] == expect_a
    # a partial state dict is applied and its version published, as SGLang does (the caller owns coverage)
    sync_weights_from_tensor([url], {k: v for k, v in sd_b.items() if "q_norm" not in k}, "5",
                             bucket_bytes=20_000, http_client=client)
    assert client.get("/get_model_info").json()["weight_version"] == "5"
    q_norm = [k for k in sd_a if "q_norm" in k]
    assert q_norm and all(torch.equal(engine.model.state_dict()[k], sd_a[k]) for k in q_norm)  # left as they were
