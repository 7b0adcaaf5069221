"""Reward-model scoring (moerl/rewards/model.py) in-process and through RewardPool's model worker,
against a direct transformers forward of each text alone (unpadded)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moerl.data.tokenizer import build_tokenizer  # noqa: E402
from moerl.rewards import RewardModel, RewardPool  # noqa: E402

PROMPTS = ["What is 2+3?", [{"role": "user", "content": "Name a colour."}], "Say hi"]
RESPONSES = ["5", "It is 5, clearly.", "blue", "hi there, this response is longer than the others by far", "", "x"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny random Qwen3ForSequenceClassification (num_labels=1) with moerl's byte-level tokenizer."""
    d = tmp_path_factory.mktemp("tiny_rm")
    tok = build_tokenizer(d)
    cfg = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=512, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(cfg).eval()
    with torch.no_grad():  # a unit-scale head: scores clearly apart (init std is 0.02)
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(d)
    return str(d)


def _reference(rm_dir, prompts, responses):
    """Each text alone through the model, no padding: the pooled logit is the last token's."""
    tok = transformers.AutoTokenizer.from_pretrained(rm_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    out = []
    for p, r in zip(prompts, responses):
        msgs = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        text = tok.apply_chat_template(msgs + [{"role": "assistant", "content": r}], tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def _pairs():
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(RESPONSES))]
    return prompts, RESPONSES


def test_reward_model_in_process_matches_direct_forward(rm_dir):
    prompts, responses = _pairs()
    ref = _reference(rm_dir, prompts, responses)
    assert len(set(round(x, 6) for x in ref)) == len(ref)  # the texts really score differently
    for batch_size in (1, 4, 16):  # padded batches give each text's own score
        got = RewardModel(rm_dir, batch_size=batch_size).score(prompts, responses)
        assert got == pytest.approx(ref, abs=1e-5)
    rm = RewardModel(rm_dir)
    assert rm.text("hi", "yo") == "<|user|>hi<|assistant|>yo<|endoftext|>"
    with pytest.raises(ValueError, match="2 prompts for 1 responses"):
        rm.score(["a", "b"], ["c"])


def test_pool_combines_rule_and_model(rm_dir):
    prompt = "What is 2+3?"
    responses = ["5", "It is 5, clearly.", "6", "5"]
    ref = _reference(rm_dir, [prompt] * len(responses), responses)
    rule = [1.0, 0.0, 0.0, 1.0]  # exact_match against "5"
    with RewardPool("exact_match", num_workers=1, model_path=rm_dir, model_weight=0.5, rule_weight=2.0,
                    model_batch_size=3, timeout_s=30) as p:
        p.wait_ready(timeout=120)
        out = p.score_group("g-rm", prompt, responses, "5", {})
    for r, rl, m in zip(out, rule, ref):
        assert r.error is None
        assert r.metrics["rule"] == rl
        assert r.metrics["model"] == pytest.approx(m, abs=1e-5)
        assert r.score == pytest.approx(2.0 * rl + 0.5 * m, abs=1e-5)
    # inline mode loads the model in-process and gives the same numbers
    with RewardPool("exact_match", num_workers=0, model_path=rm_dir, model_weight=0.5, rule_weight=2.0) as p:
        inline = p.score_group("g-rm", prompt, responses, "5", {})
    assert [r.score for r in inline] == pytest.approx([r.score for r in out], abs=1e-5)


def test_bad_model_dir_is_reported(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with RewardPool("exact_match", num_workers=1, model_path=str(tmp_path)) as p:
        with pytest.raises(Exception, match="reward.model_path"):
            p.wait_ready(timeout=120)
