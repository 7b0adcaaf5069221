"""Partial rollout on the real reference server: a response interrupted after 5 tokens (SGLang
/pause_generation, mode abort) while the trainer pushes new weights, then resumed for its 3 remaining
tokens, comes out as 8 tokens whose behaviour log-probs equal a teacher-forced transformers forward of
the weights of each token's own version (model A for tokens 1-5, model B for 6-8), whose versions are
[v0] * 5 + [v1] * 3, and whose loss mask follows train.partial_rollout_mask_old.

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


@pytest.mark.parametrize("mask_old", [False, True])
def test_response_cut_after_5_tokens_resumes_for_3_with_per_version_log_probs(ckpts, mask_old):
    model_a, model_b = ckpts
    engine = ReferenceEngine(model_a)
    engine.eos_ids = ()  # no early stop: the response runs to its 8-token budget
    engine.weight_version = "0"
    cfg = SimpleNamespace(
        seed=11, train=SimpleNamespace(mode="async", max_staleness=1, staleness_policy="wait",
                                       partial_rollout_mask_old=mask_old),
        rollout=SimpleNamespace(n_samples_per_prompt=1, rollout_batch_size=1, dynamic_sampling=False,
                                max_oversample_factor=1.0, max_new_tokens=8, temperature=TEMPERATURE, top_p=1.0,
                                top_k=-1, placement="disaggregated"),
        data=SimpleNamespace(prompt_key="prompt", label_key="label"))
    try:
        with serve_in_thread(engine) as url:
            servers = _Servers(url)
            engine.pause_after_steps(5)  # the in-flight update lands after exactly 5 decode steps

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
                manager.update_weights(push, 0)  # pause (abort), push v1, continue
                batch = manager.get_batch(1)
    finally:
        engine.close()
    (s,) = batch.samples
    assert len(s.response_ids) == 8 and s.status == "truncated"
    assert s.token_versions == [0] * 5 + [1] * 3
    assert servers.calls == ["pause:abort", "continue"]
    lp = torch.tensor(s.rollout_log_probs)
    want_a = _teacher_forced(model_a, s.response_ids)[:5]
    want_b = _teacher_forced(model_b, s.response_ids)[5:]
    torch.testing.assert_close(lp[:5], want_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(lp[5:], want_b, atol=1e-5, rtol=0)
    # and not the other model's: the versions really differ per token
    assert (lp[5:] - _teacher_forced(model_a, s.response_ids)[5:]).abs().max() > 1e-3
    assert s.loss_mask == ([0] * 5 + [1] * 3 if mask_old else [1] * 8)
    assert batch.trainer_version == 1 and batch.metrics["staleness/max"] == (0.0 if mask_old else 1.0)

