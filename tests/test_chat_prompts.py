"""Chat prompts (string and message-list prompts, data.system_prompt), tokenizer precedence and
tokenizer fingerprints, for moerl's byte-level tokenizer and a ChatML (Qwen-style) tokenizer built
offline here.

References are independent of moerl's code path: hand-written template text, UTF-8 bytes (moerl's ids
are byte values), ids assembled from the special-token ids and the tokenizer's plain encoding of the
text between them, and transformers' own ``apply_chat_template(tokenize=True)``.
"""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from moerl.data.fingerprint import tokenizer_fingerprint
from moerl.data.tokenizer import (
    build_tokenizer,
    byte_to_unicode,
    encode_prompt,
    encode_sft_example,
    load_tokenizer,
    PromptEncoder,
    render_prompt,
    tokenizer_from_config,
)

# Qwen's ChatML layout, written from its description: every turn "<|im_start|>{role}\n{content}<|im_end|>\n",
# the generation prompt "<|im_start|>assistant\n".
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A few merges so that ids are not one per byte (the test would not notice a split at a wrong place otherwise).
CHATML_MERGES = (("t", "h"), ("th", "e"), ("Ġ", "the"), ("u", "s"), ("us", "e"), ("use", "r"), ("1", "2"), ("a", "s"))


def build_chatml_test_tokenizer(out_dir, extra_special=(), merges=CHATML_MERGES, unmerged=()):
    """A byte-level BPE tokenizer with <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos) and the ChatML
    template, saved with save_pretrained and loaded back with AutoTokenizer (offline). ``unmerged``:
    extra vocab entries no merge produces."""
    vocab = {ch: i for i, ch in enumerate(sorted(byte_to_unicode().values()))}
    for token in [a + b for a, b in merges] + list(unmerged):
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special])
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    ).save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)


@pytest.fixture(scope="module")
def moerl_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moerl_tok")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def moerl_tok(moerl_dir):
    return load_tokenizer(moerl_dir)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chatml_tok")
    build_chatml_test_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def chatml(chatml_dir):
    return load_tokenizer(chatml_dir)


def _template_ids(tok, messages):
    """transformers' own tokenization of the chat (v5 returns a BatchEncoding, v4 a list)."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


MULTI_TURN = [
    {"role": "user", "content": "12+30="},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "the user asks: 7+5="},
]


# ----------------------------------------------------------------------------- moerl's byte-level tokenizer
def test_moerl_string_prompt(moerl_tok):
    assert render_prompt(moerl_tok, "1+2=") == "<|user|>1+2=<|assistant|>"
    ids = encode_prompt(moerl_tok, "1+2=")
    assert ids == [258, *b"1+2=", 259]
    assert ids == _template_ids(moerl_tok, [{"role": "user", "content": "1+2="}])


def test_moerl_message_prompts(moerl_tok):
    text = render_prompt(moerl_tok, MULTI_TURN)
    assert text == "<|user|>12+30=<|assistant|>42<|endoftext|><|user|>the user asks: 7+5=<|assistant|>"
    ids = encode_prompt(moerl_tok, MULTI_TURN)
    assert ids == [258, *b"12+30=", 259, *b"42", 257, 258, *b"the user asks: 7+5=", 259]
    assert ids == _template_ids(moerl_tok, MULTI_TURN)
    # A one-message list is the same prompt as the bare string.
    assert encode_prompt(moerl_tok, [{"role": "user", "content": "1+2="}]) == encode_prompt(moerl_tok, "1+2=")


def test_moerl_tokenizer_refuses_the_system_role(moerl_tok):
    with pytest.raises(ValueError, match=r"data.system_prompt is set, but moerl's byte-level tokenizer has no system role"):
        render_prompt(moerl_tok, "1+2=", system_prompt="Answer with digits only.")
    with pytest.raises(ValueError, match=r"the prompt \(data.prompt_key\) has a system message.*no system role"):
        encode_prompt(moerl_tok, [{"role": "system", "content": "x"}, {"role": "user", "content": "1+2="}])
    with pytest.raises(ValueError, match="data.tokenizer_path"):
        encode_sft_example(moerl_tok, "1+2=", "3", system_prompt="x")


# ----------------------------------------------------------------------------- ChatML tokenizer
def _chatml_ids(tok, turns, generation_prompt=True):
    """Ids assembled by hand: special-token ids around the plain encoding of the text between them."""
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    nl = tok.encode("\n", add_special_tokens=False)
    ids = []
    for role, content in turns:
        ids += [start, *tok.encode(f"{role}\n{content}", add_special_tokens=False), end, *nl]
    if generation_prompt:
        ids += [start, *tok.encode("assistant\n", add_special_tokens=False)]
    return ids


def test_chatml_tokenizer_is_what_the_tests_assume(chatml, chatml_dir):
    assert chatml.eos_token == "<|im_end|>" and chatml.pad_token == "<|endoftext|>"
    assert chatml.convert_ids_to_tokens(chatml.encode("the user 12", add_special_tokens=False)) == ["the", "Ġ", "user", "Ġ", "12"]
    assert tokenizer_fingerprint(chatml) == tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(chatml_dir)))


@pytest.mark.parametrize(
    "prompt,system_prompt,text",
    [
        ("12+30=", None, "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n"),
        (
            "12+30=",
            "Answer with the number only.",
            "<|im_start|>system\nAnswer with the number only.<|im_end|>\n"
            "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            MULTI_TURN,
            None,
            "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n"
            "<|im_start|>user\nthe user asks: 7+5=<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            MULTI_TURN,
            "Be brief.",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n"
            "42<|im_end|>\n<|im_start|>user\nthe user asks: 7+5=<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the 12"}],
            None,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nthe 12<|im_end|>\n<|im_start|>assistant\n",
        ),
    ],
)
def test_chatml_prompts_render_and_encode_like_the_template(chatml, prompt, system_prompt, text):
    assert render_prompt(chatml, prompt, system_prompt) == text
    ids = encode_prompt(chatml, prompt, system_prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    assert ids == _template_ids(chatml, messages)
    assert ids == _chatml_ids(chatml, [(m["role"], m["content"]) for m in messages])
    assert chatml.decode(ids) == text


def test_caller_messages_are_not_modified(chatml):
    prompt = [dict(m) for m in MULTI_TURN]
    encode_prompt(chatml, prompt, system_prompt="Be brief.")
    assert prompt == MULTI_TURN


def test_system_prompt_and_a_system_message_are_refused(chatml):
    prompt = [{"role": "system", "content": "mine"}, {"role": "user", "content": "1+2="}]
    with pytest.raises(ValueError, match=r"already has a system message \(message 1\) and data.system_prompt"):
        render_prompt(chatml, prompt, system_prompt="Be brief.")
    with pytest.raises(ValueError, match=r"data.system_prompt must be a non-empty string or null"):
        render_prompt(chatml, "1+2=", system_prompt="")


@pytest.mark.parametrize(
    "prompt,pattern",
    [
        ([], "non-empty list of chat messages"),
        ("", "non-empty string"),
        ([{"role": "tool", "content": "x"}], r"message 1 has role 'tool'"),
        ([{"role": "user", "content": "a"}, {"role": "assistant"}], r"message 2 \(assistant\) needs a string 'content'"),
        (["hello"], "message 1 must be an object"),
        (7, "non-empty string or a non-empty list"),
    ],
)
def test_bad_prompts(chatml, prompt, pattern):
    with pytest.raises(ValueError, match=pattern):
        encode_prompt(chatml, prompt)


def test_sft_example_with_messages_and_system_prompt(chatml, moerl_tok):
    ids, mask = encode_sft_example(chatml, MULTI_TURN, "12", system_prompt="Be brief.")
    prompt_ids = _chatml_ids(chatml, [("system", "Be brief."), *[(m["role"], m["content"]) for m in MULTI_TURN]])
    response = [*chatml.encode("12", add_special_tokens=False), chatml.convert_tokens_to_ids("<|im_end|>")]
    assert len(response) == 2  # "12" is one merged token, then eos
    assert ids == prompt_ids + response and mask == [0] * len(prompt_ids) + [1, 1]
    ids, mask = encode_sft_example(moerl_tok, [{"role": "user", "content": "1+2="}], "3")
    assert ids == [258, 49, 43, 50, 61, 259, 51, 257] and mask == [0] * 6 + [1, 1]


@pytest.mark.parametrize("system_prompt", [None, "Be brief."])
def test_prompt_encoder_memoizes_and_equals_the_uncached_functions(chatml, system_prompt):
    """PromptEncoder (the run's memoized encoding): the same ids as encode_prompt / encode_sft_example for
    text and chat-message prompts; a text prompt or response is tokenized once; callers get their own lists."""
    calls = []
    real = chatml.encode
    enc = PromptEncoder(chatml, system_prompt)
    chatml.encode = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    try:
        for _ in range(3):
            for prompt in ("What is 2+2?", MULTI_TURN):
                assert enc(prompt) == encode_prompt(chatml, prompt, system_prompt)
                assert enc.sft_example(prompt, "12") == encode_sft_example(chatml, prompt, "12", system_prompt)
        text_encodes = [c for c in calls if "2+2" in c]
        # 3 rounds x 2 uncached calls (encode_prompt, encode_sft_example) + 1 for the encoder's own cache
        assert len(text_encodes) == 3 * 2 + 1
        assert calls.count("12") == 3 * 2 + 1  # encode_sft_example's, for both prompts, + the encoder's one
        ids = enc("What is 2+2?")
        ids.append(-1)
        assert enc("What is 2+2?") == encode_prompt(chatml, "What is 2+2?", system_prompt)
        # a full cache keeps what it has and encodes the rest each time (no eviction), with the same ids
        room = 4 * len(encode_prompt(chatml, "first prompt", system_prompt)) + len("first prompt") \
            + PromptEncoder.ENTRY_OVERHEAD_BYTES  # exactly the first prompt's entry
        small = PromptEncoder(chatml, system_prompt, max_bytes=room)
        calls.clear()
        for _ in range(2):
            for prompt in ("first prompt", "What is 2+2?"):
                assert small(prompt) == encode_prompt(chatml, prompt, system_prompt)
        assert small.cached_bytes == small.max_bytes
        assert len([c for c in calls if "first prompt" in c]) == 2 + 1  # cached: the uncached calls + one
        assert len([c for c in calls if "2+2" in c]) == 2 + 2  # over the budget: encoded every time
    finally:
        chatml.encode = real


# ----------------------------------------------------------------------------- tokenizer_from_config
def test_tokenizer_from_config_precedence(tmp_path, chatml_dir, moerl_dir):
    ckpt = tmp_path / "hf_ckpt"  # an init_from checkpoint carrying a tokenizer
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    for f in chatml_dir.iterdir():
        shutil.copy(f, ckpt / f.name)
    bare = tmp_path / "bare_ckpt"  # an init_from checkpoint without one
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    im_end = "<|im_end|>"

    # 1. data.tokenizer_path beats init_from's tokenizer.
    tok = tokenizer_from_config(str(moerl_dir), tmp_path / "run1", init_from=str(ckpt))
    assert tok.eos_token == "<|endoftext|>" and not (tmp_path / "run1" / "tokenizer").exists()
    # 2. init_from's tokenizer beats moerl's.
    tok = tokenizer_from_config(None, tmp_path / "run2", init_from=str(ckpt))
    assert tok.eos_token == im_end and not (tmp_path / "run2" / "tokenizer").exists()
    # 3. moerl's tokenizer, built into the run dir, when neither is there.
    for init in (None, str(bare)):
        run = tmp_path / f"run3_{init is None}"
        tok = tokenizer_from_config(None, run, init_from=init)
        assert len(tok) == 260 and tok.eos_token_id == 257
        assert sorted(p.name for p in (run / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_tokenizer_from_config_errors_name_the_key(tmp_path, chatml_dir):
    with pytest.raises(ValueError, match=r"tokenizer directory not found: .*nope \(data.tokenizer_path\)"):
        tokenizer_from_config(str(tmp_path / "nope"), tmp_path / "run")
    with pytest.raises(ValueError, match=r"model.init_from directory not found: .*gone"):
        tokenizer_from_config(None, tmp_path / "run", init_from=str(tmp_path / "gone"))
    ckpt = tmp_path / "ckpt"
    shutil.copytree(chatml_dir, ckpt)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"\(model.init_from.*\) has no chat_template"):
        tokenizer_from_config(None, tmp_path / "run", init_from=str(ckpt))


# ----------------------------------------------------------------------------- tokenizer fingerprints
def test_tokenizer_fingerprint(tmp_path, chatml, chatml_dir, moerl_tok, moerl_dir):
    fp = tokenizer_fingerprint
    assert len(fp(chatml)) == 64
    # the same tokenizer saved again / rebuilt / reloaded: equal
    assert fp(moerl_tok) == fp(build_tokenizer(tmp_path / "again")) == fp(AutoTokenizer.from_pretrained(str(moerl_dir)))
    chatml.save_pretrained(tmp_path / "resaved")
    assert fp(AutoTokenizer.from_pretrained(str(tmp_path / "resaved"))) == fp(chatml)
    assert fp(build_chatml_test_tokenizer(tmp_path / "chatml2")) == fp(chatml)
    # one extra added token: differs
    extra = build_chatml_test_tokenizer(tmp_path / "extra", extra_special=("<|tool|>",))
    assert fp(extra) != fp(chatml)
    plain_extra = AutoTokenizer.from_pretrained(str(moerl_dir))
    plain_extra.add_tokens(["<x>"])
    assert fp(plain_extra) != fp(moerl_tok)
    # the same vocab (token -> id), one merge fewer: encodes differently, so differs
    fewer = build_chatml_test_tokenizer(tmp_path / "fewer", merges=CHATML_MERGES[:-1], unmerged=("as",))
    assert fewer.get_vocab() == chatml.get_vocab() and fewer.encode("as") != chatml.encode("as")
    assert fp(fewer) != fp(chatml)
    # only the chat template differs
    other = AutoTokenizer.from_pretrained(str(chatml_dir))
    other.chat_template = CHATML_TEMPLATE.replace("\n", " ")
    assert other.chat_template != chatml.chat_template
    assert fp(other) != fp(chatml)
    # only the eos token differs
    other = AutoTokenizer.from_pretrained(str(chatml_dir))
    other.eos_token = "<|endoftext|>"
    assert fp(other) != fp(chatml)
    assert fp(moerl_tok) != fp(chatml)
