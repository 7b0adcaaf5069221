"""SGLang's /pause_generation and /continue_generation on the CPU reference server (tiny model, in-process).

SGLang facts these tests pin (sglang 0.5.9: io_struct.PauseGenerationReqInput, http_server.py,
TokenizerManager / Scheduler .pause_generation): body {"mode": "abort" | "retract" | "in_place"},
default "abort"; answer {"message": "Generation paused successfully.", "status": "ok"}; "abort" answers
running requests with the tokens so far (finish_reason type "abort") and queued ones with none;
new /generate requests wait while paused; weight updates run while paused; "in_place" suspends the
running batch at its next step with its KV cache and continues it on the new weights. The reference server
differs for "retract": it finishes the running batch instead of retracting it; and it reports a version
per token (meta_info output_token_weight_versions) for a response that spanned an update.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from fastapi.testclient import TestClient  # noqa: E402

from moerl.rollout.client import PAUSE_MODES, RolloutClient  # noqa: E402
from moerl.rollout.inprocess import serve_in_thread  # noqa: E402
from moerl.rollout.server import ReferenceEngine, create_app  # noqa: E402

PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}




@pytest.fixture
def served(ckpts):
    """A fresh engine on model A and a TestClient of its app; the engine is closed afterwards."""
    engine = ReferenceEngine(ckpts[0])
    yield engine, TestClient(create_app(engine))
    engine.continue_generation()
    engine.close()


def _logprobs_at(model, prompt, response, temperature):
    """Teacher-forced log_softmax(logits / T)[y_t] of each response token: [len(response)]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logits = logits[len(prompt) - 1: len(prompt) - 1 + len(response)]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def _lps(out):
    return torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])


def _in_thread(fn):
    """Run fn() in a thread; returns (thread, result dict filled with "r" or "e")."""
    box: dict = {}

    def run():
        try:
            box["r"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            box["e"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def _started_hook(at_step: int, delay_s: float = 0.002):
    """A step hook that sets an Event once a batch reached ``at_step`` and slows every step down a
    little, so that a pause sent after the event lands while the batch still runs."""
    event = threading.Event()

    def hook(step, rids):
        if step >= at_step:
            event.set()
        time.sleep(delay_s)

    return hook, event


# ----------------------------------------------------------------------------- (a) abort while running


def test_abort_pause_answers_running_rows_with_tokens_so_far_and_queued_ones_with_none(served, ref_models):
    engine, client = served
    hook, started = _started_hook(3)
    engine.step_hook = hook
    T = 0.8
    running = engine.submit({"input_ids": [[4, 5, 13], [6, 7, 8]], "return_logprob": True, "rid": "long",
                             "sampling_params": {"temperature": T, "max_new_tokens": 200, "ignore_eos": True,
                                                 "sampling_seed": 5}})
    assert started.wait(30)
    queued = engine.submit({"input_ids": [9, 10], "return_logprob": True,  # another length: its own batch
                            "sampling_params": {"max_new_tokens": 4}})
    r = client.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200 and r.json() == PAUSED
    # pause returned after the aborted items were answered: a weight update now cannot race them
    assert running.future.done() and queued.future.done() and engine.paused
    outs = engine.response(running)
    for prompt, out in zip([[4, 5, 13], [6, 7, 8]], outs):
        meta, toks = out["meta_info"], out["output_ids"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert 3 <= len(toks) < 200 and meta["completion_tokens"] == len(toks)
        assert [e[1] for e in meta["output_token_logprobs"]] == toks
        ref = _logprobs_at(ref_models[0], prompt, toks, T)
        assert torch.allclose(_lps(out), ref, atol=1e-5, rtol=0), (_lps(out) - ref).abs().max()
    assert len(outs[0]["output_ids"]) == len(outs[1]["output_ids"])  # one batch, stopped at one step
    q = engine.response(queued)
    assert q["output_ids"] == [] and q["meta_info"]["output_token_logprobs"] == []
    assert q["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue", "status_code": None,
                                                 "err_type": None}


# ----------------------------------------------------------------------------- (b) exactly k steps, then resume


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_interrupt_after_exactly_k_steps_then_resubmit_the_partial(served, ref_models, temperature):
    """pause_after_steps(k) stops every row after exactly k tokens; prompt + partial with the remaining
    budget continues: greedy reproduces the uninterrupted response, and the partial of a seeded
    sample is the uninterrupted sample's prefix; every log-prob is the teacher-forced one."""
    engine, client = served
    prompts, k, budget = [[4, 5, 13], [6, 7, 8]], 5, 12
    sp = {"temperature": temperature, "max_new_tokens": budget, "ignore_eos": True, "sampling_seed": 3}
    whole = engine.generate({"input_ids": prompts, "return_logprob": True, "sampling_params": sp})

    engine.pause_after_steps(k)
    part = engine.generate({"input_ids": prompts, "return_logprob": True, "sampling_params": sp})
    assert engine.paused and engine.step_hook is None  # one-shot: the previous (no) hook is back
    assert client.post("/continue_generation").json() == CONTINUED and not engine.paused
    T = temperature if temperature > 0 else 1.0
    for prompt, w, p in zip(prompts, whole, part):
        assert p["meta_info"]["finish_reason"]["type"] == "abort" and len(p["output_ids"]) == k
        assert p["output_ids"] == w["output_ids"][:k]
        assert torch.allclose(_lps(p), _lps(w)[:k], atol=1e-5, rtol=0)
        rest = engine.generate({"input_ids": prompt + p["output_ids"], "return_logprob": True,
                                "sampling_params": {**sp, "max_new_tokens": budget - k}})
        assert rest["meta_info"]["finish_reason"] == {"type": "length", "length": budget - k}
        resp = p["output_ids"] + rest["output_ids"]
        lps = torch.cat([_lps(p), _lps(rest)])
        assert torch.allclose(lps, _logprobs_at(ref_models[0], prompt, resp, T), atol=1e-5, rtol=0)
        if temperature == 0.0:
            assert resp == w["output_ids"]


# ----------------------------------------------------------------------------- (c) requests wait while paused


@pytest.mark.parametrize("mode", ["retract"])
def test_running_batch_finishes_and_new_requests_wait_until_continue(served, mode):
    engine, client = served
    hook, started = _started_hook(2)
    engine.step_hook = hook
    running = engine.submit({"input_ids": [4, 5, 13], "sampling_params": {"temperature": 0.0,
                                                                           "max_new_tokens": 40, "ignore_eos": True}})
    assert started.wait(30)
    assert client.post("/pause_generation", json={"mode": mode}).json() == PAUSED
    # the reference engine cannot suspend a running generate call: it ran to its end before pause returned
    assert running.future.done()
    assert engine.response(running)["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    engine.step_hook = None
    th, box = _in_thread(lambda: client.post("/generate", json={"input_ids": [6, 7], "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}}))
    time.sleep(0.3)
    assert th.is_alive() and len(engine._pending) == 1  # accepted and queued, not run
    assert client.post("/pause_generation", json={"mode": mode}).json() == PAUSED  # idempotent
    assert client.get("/health_generate").status_code == 200  # healthy, though it generates nothing now
    assert client.post("/continue_generation").json() == CONTINUED
    th.join(30)
    assert box["r"].status_code == 200
    assert box["r"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert client.post("/continue_generation").json() == CONTINUED  # continuing twice is harmless


# ----------------------------------------------------------------------------- (d) weight update while paused


def test_weight_update_between_pause_and_continue_serves_the_new_version(served, ckpts, ref_models):
    engine, client = served
    assert client.post("/pause_generation", json={}).json() == PAUSED  # {} = the default mode, abort
    body = {"input_ids": [4, 5, 13, 6], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}}
    th, box = _in_thread(lambda: client.post("/generate", json=body))
    r = client.post("/update_weights_from_disk", json={"model_path": ckpts[1], "weight_version": "v1"})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert client.get("/get_weight_version").json() == {"weight_version": "v1"}
    time.sleep(0.1)
    assert th.is_alive()
    assert client.post("/continue_generation").json() == CONTINUED
    th.join(30)
    out = box["r"].json()
    assert out["meta_info"]["weight_version"] == "v1" and len(out["output_ids"]) == 6
    with torch.no_grad():  # greedy under model B
        expect = []
        for _ in range(6):
            logits = ref_models[1](input_ids=torch.tensor([body["input_ids"] + expect])).logits
            expect.append(int(logits[0, -1].argmax()))
    assert out["output_ids"] == expect
    assert torch.allclose(_lps(out), _logprobs_at(ref_models[1], body["input_ids"], expect, 1.0), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- (e) validation, client helpers


@pytest.mark.parametrize("body", [{"mode": "pause"}, {"mode": None}, {"mode": 1}, ["abort"]])
def test_bad_mode_is_refused_with_400_naming_the_field(served, body):
    engine, client = served
    r = client.post("/pause_generation", json=body)
    assert r.status_code == 400 and not engine.paused
    msg = r.json()["error"]["message"]
    assert ("mode must be one of ['abort', 'retract', 'in_place']" in msg) or "JSON object" in msg
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.pause_generation("pause")


def test_rollout_client_pauses_and_continues_one_server(served):
    engine, _ = served
    assert PAUSE_MODES == ("abort", "retract", "in_place")
    with serve_in_thread(engine) as url:
        client = RolloutClient(url, timeout_s=30, max_retries=0)
        with pytest.raises(ValueError, match="mode must be one of"):
            client.pause_generation("stop")  # refused before anything is sent
        assert not engine.paused
        assert client.pause_generation() == PAUSED and engine.paused
        assert client.continue_generation() == CONTINUED and not engine.paused

        async def both():
            try:
                assert await client.apause_generation("in_place") == PAUSED and engine.paused
                with pytest.raises(RuntimeError, match="await RolloutClient.apause_generation"):
                    client.pause_generation()  # the sync helper refuses to run inside an event loop
                assert await client.acontinue_generation() == CONTINUED and not engine.paused
            finally:
                await client.aclose()

        asyncio.run(both())


# ----------------------------------------------------------------------------- (f) in_place: suspend, update, go on


def _greedy_with_switch(model_a, model_b, prompt, k, total):
    """Independent reference of an in_place pause after k tokens with an update A -> B: greedy tokens 0..k-1
    under A (KV cache of prompt + tokens 0..k-2 from A), then token k-1 is fed to B with A's cache and
    tokens k..total-1 are greedy under B. Returns (tokens, log_softmax log-probs of each token)."""
    with torch.no_grad():
        out = model_a(input_ids=torch.tensor([prompt]), use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
        toks, lps = [], []
        for t in range(total):
            if t > 0:
                model = model_a if t < k else model_b  # token t-1 is fed by the forward that yields token t
                out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            toks.append(int(lp.argmax()))
            lps.append(float(lp[toks[-1]]))
    return toks, torch.tensor(lps)


def test_in_place_pause_suspends_the_running_batch_and_continues_it_on_the_new_weights(served, ckpts, ref_models):
    """pause_generation("in_place") at decode step 5 returns with the batch suspended (not answered);
    a weight update to model B runs meanwhile; after continue the batch goes on under B with A's KV cache:
    8 tokens whose values and log-probs equal a hand-built KV-cache loop (A for tokens 0-4, B from the
    forward that feeds token 4 on), versions reported per token."""
    engine, client = served
    prompt, k, total = [4, 5, 13, 6], 5, 8
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": total, "ignore_eos": True}}
    engine.pause_after_steps(k, "in_place")
    th, box = _in_thread(lambda: client.post("/generate", json=body))
    deadline = time.monotonic() + 30
    while not engine._parked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._parked and engine.paused and th.is_alive()  # suspended, not answered
    assert client.post("/pause_generation", json={"mode": "in_place"}).json() == PAUSED  # returns while suspended
    r = client.post("/update_weights_from_disk", json={"model_path": ckpts[1], "weight_version": "v1"})
    assert r.status_code == 200 and r.json()["success"], r.text  # the suspended batch holds no lock
    time.sleep(0.1)
    assert th.is_alive()
    assert client.post("/continue_generation").json() == CONTINUED
    th.join(30)
    out = box["r"].json()
    meta = out["meta_info"]
    expect, expect_lps = _greedy_with_switch(ref_models[0], ref_models[1], prompt, k, total)
    assert out["output_ids"] == expect and meta["finish_reason"] == {"type": "length", "length": total}
    assert torch.allclose(_lps(out), expect_lps, atol=1e-5, rtol=0), (_lps(out) - expect_lps).abs().max()
    assert meta["output_token_weight_versions"] == ["default"] * k + ["v1"] * (total - k)
    assert meta["weight_version"] == "v1"
    # a control: without the update the same pause changes nothing (one version, A's greedy tokens)
    engine.pause_after_steps(k, "in_place")
    th, box = _in_thread(lambda: client.post("/generate", json=body))
    while not engine._parked and th.is_alive():
        time.sleep(0.01)
    assert client.post("/continue_generation").json() == CONTINUED
    th.join(30)
    again = box["r"].json()
    ref_b, _ = _greedy_with_switch(ref_models[1], ref_models[1], prompt, k, total)
    assert again["output_ids"] == ref_b and "output_token_weight_versions" not in again["meta_info"]


def test_abort_pause_ends_a_suspended_batch_and_parse_reads_token_versions(served, ckpts):
    """An "abort" pause after an "in_place" one ends the suspended batch's rows at the step they were
    suspended at, with finish_reason abort and their tokens so far (nothing left hanging); the client
    parses per-token versions."""
    from moerl.rollout.client import RolloutRequestError, parse_generate_item

    engine, client = served
    body = {"input_ids": [4, 5, 13], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 50, "ignore_eos": True}}
    engine.pause_after_steps(3, "in_place")
    th, box = _in_thread(lambda: client.post("/generate", json=body))
    while not engine._parked and th.is_alive():
        time.sleep(0.01)
    assert client.post("/pause_generation", json={"mode": "abort"}).json() == PAUSED
    th.join(30)
    out = box["r"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) == 3
    assert "output_token_weight_versions" not in out["meta_info"]  # no update happened: one version
    item = parse_generate_item({**out, "meta_info": {**out["meta_info"],
                                                     "output_token_weight_versions": ["1", "1", "2"]}})
    assert item.token_versions == ["1", "1", "2"] and item.status == "aborted"
    with pytest.raises(RolloutRequestError, match="output_token_weight_versions"):
        parse_generate_item({**out, "meta_info": {**out["meta_info"], "output_token_weight_versions": ["1"]}})
