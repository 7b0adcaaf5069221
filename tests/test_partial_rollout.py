"""Partial rollout on the real reference server: a response interrupted after 5 tokens (SGLang
/pause_generation, mode abort) while the trainer pushes new weights, then resumed for its 3 remaining
tokens, comes out as 8 tokens whose behaviour log-probs equal a teacher-forced transformers forward of
the weights of each token's own version (model A for tokens 1-5, model B for 6-8), whose versions are
[v0] * 5 + [v1] * 3, and whose loss mask follows train.partial_rollout_mask_old. The same with
rollout.pause_mode in_place: the response is not cut but suspended after 5 tokens and continued on model B
with model A's KV cache (reference: transformers' KV-cache loop, A for the prompt and tokens 1-4, B from
the forward that feeds token 5 on), the server reporting each token's version.

Independent reference: transformers' own models loaded from the two checkpoints.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from transformers import AutoModelForCausalLM  # noqa: E402

from moerl.data.dataset import PromptSampler  # noqa: E402
from moerl.rollout.client import RolloutClient  # noqa: E402
from moerl.rollout.inprocess import serve_in_thread  # noqa: E402
from moerl.rollout.manager import RolloutManager  # noqa: E402
from moerl.rollout.server import ReferenceEngine  # noqa: E402

TEMPERATURE = 0.8
PROMPT = [5, 9, 14, 3, 7]



class _Servers:
    """The cluster side the manager calls around a weight update: SGLang's endpoints over HTTP."""

    def __init__(self, url: str):
        self.url = url
        self.calls: list[str] = []

    def pause_generation(self, mode: str = "abort"):
        self.calls.append(f"pause:{mode}")
        httpx.post(self.url + "/pause_generation", json={"mode": mode}, timeout=60).raise_for_status()
        return [self.url]

    def continue_generation(self):
        self.calls.append("continue")
        httpx.post(self.url + "/continue_generation", json={}, timeout=60).raise_for_status()
        return [self.url]


def _teacher_forced(path: str, tokens: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + tokens])).logits[0].float()
    logits = logits[len(PROMPT) - 1: len(PROMPT) - 1 + len(tokens)]
    return torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _kv_switch(path_a: str, path_b: str, tokens: list[int], k: int) -> torch.Tensor:
    """log_softmax(logits / T)[token] of each token when A's KV cache covers the prompt and tokens 0..k-2
    and B computes every forward from the one that feeds token k-1 on (an in_place pause after k tokens)."""
    a, b = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (path_a, path_b))
    out = []
    with torch.no_grad():
        r = a(input_ids=torch.tensor([PROMPT]), use_cache=True)
        for t, tok in enumerate(tokens):
            if t > 0:
                r = (a if t < k else b)(input_ids=torch.tensor([[tokens[t - 1]]]), past_key_values=r.past_key_values,
                                        use_cache=True)
            out.append(torch.log_softmax(r.logits[0, -1].float() / TEMPERATURE, -1)[tok])
    return torch.stack(out)


@pytest.mark.parametrize("mask_old", [False, True])
@pytest.mark.parametrize("pause_mode", ["abort", "in_place"])
def test_response_cut_after_5_tokens_resumes_for_3_with_per_version_log_probs(ckpts, mask_old, pause_mode):
    model_a, model_b = ckpts
    engine = ReferenceEngine(model_a)
    engine.eos_ids = ()  # no early stop: the response runs to its 8-token budget
    engine.weight_version = "0"
    cfg = SimpleNamespace(
        seed=11, train=SimpleNamespace(mode="async", max_staleness=1, staleness_policy="wait",
                                       partial_rollout_mask_old=mask_old),
        rollout=SimpleNamespace(n_samples_per_prompt=1, rollout_batch_size=1, dynamic_sampling=False,
                                max_oversample_factor=1.0, max_new_tokens=8, temperature=TEMPERATURE, top_p=1.0,
                                top_k=-1, placement="disaggregated", pause_mode=pause_mode),
        data=SimpleNamespace(prompt_key="prompt", label_key="label"))
    try:
        with serve_in_thread(engine) as url:
            servers = _Servers(url)
            engine.pause_after_steps(5, pause_mode)  # the in-flight update lands after exactly 5 decode steps

            def push() -> int:  # the trainer's new weights, published as version 1
                ok, msg = engine.update_weights_from_disk(model_b, weight_version="1")
                assert ok, msg
                return 1

            manager = RolloutManager(client=RolloutClient(url, timeout_s=60, max_retries=0), cluster=servers,
                                     sampler=PromptSampler([{"prompt": "p", "label": "0"}], 1, 0),
                                     encode=lambda text: list(PROMPT), decode=str, reward_fn=lambda t, l: 1.0,
                                     cfg=cfg, eos_id=0, num_steps=1, version=0, log=print)
            with manager:
                t0 = time.monotonic()
                while not engine.paused:  # the engine pauses itself after 5 decode steps
                    assert time.monotonic() - t0 < 60, "the generation was never cut"
                    time.sleep(0.01)
                manager.update_weights(push, 0)  # pause (abort / in_place), push v1, continue
                batch = manager.get_batch(1)
    finally:
        engine.close()
    # async: the producer's requests went through its HTTP worker process (rollout.client_process null),
    # closed with the producer
    assert manager._worker is not None and manager._worker.starts == 1 and manager._worker.proc is None
    (s,) = batch.samples
    assert len(s.response_ids) == 8 and s.status == "truncated"
    assert s.token_versions == [0] * 5 + [1] * 3
    assert servers.calls == [f"pause:{pause_mode}", "continue"]
    # cut and resumed (a resubmission queued during the pause may be cut once more, with no tokens) / suspended
    assert s.metadata["segments"] >= 2 if pause_mode == "abort" else s.metadata["segments"] == 1
    lp = torch.tensor(s.rollout_log_probs)
    want_a = _teacher_forced(model_a, s.response_ids)[:5]
    if pause_mode == "abort":  # resumed from its prefix: B recomputes the whole prefix
        want_b = _teacher_forced(model_b, s.response_ids)[5:]
    else:  # continued in place: B on top of A's KV cache
        want_b = _kv_switch(model_a, model_b, s.response_ids, 5)[5:]
        assert (want_b - _teacher_forced(model_b, s.response_ids)[5:]).abs().max() > 1e-4  # the cache matters
    torch.testing.assert_close(lp[:5], want_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[5:], want_b, atol=1e-5, rtol=0)
    # and not the other model's: the versions really differ per token
    assert (lp[5:] - _teacher_forced(model_a, s.response_ids)[5:]).abs().max() > 1e-3
    assert s.loss_mask == ([0] * 5 + [1] * 3 if mask_old else [1] * 8)
    assert batch.trainer_version == 1 and batch.metrics["staleness/max"] == (0.0 if mask_old else 1.0)

