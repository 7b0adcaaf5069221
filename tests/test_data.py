"""Tokenizer, arithmetic task generator, jsonl dataset loading and the prompt sampler (moerl/data)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from moerl.data.dataset import DatasetError, PromptSampler, load_prompt_dataset
from moerl.data.tasks import generate_arithmetic, prepare_task_data
from moerl.data.tokenizer import (
    build_tokenizer,
    decode_response,
    encode_prompt,
    encode_sft_example,
    load_tokenizer,
    render_prompt,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


# ----------------------------------------------------------------------------- tokenizer
def test_tokenizer_vocab_and_special_tokens(tok, tok_dir):
    assert len(tok) == 260
    assert sorted(os.listdir(tok_dir)) == ["tokenizer.json", "tokenizer_config.json"]
    ids = tok.convert_tokens_to_ids(["<|pad|>", "<|endoftext|>", "<|user|>", "<|assistant|>"])
    assert ids == [256, 257, 258, 259]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 257
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == 256
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg and cfg["eos_token"] == "<|endoftext|>"


@pytest.mark.parametrize("text", ["123+456=", "0", " 7 ", "héllo wörld", "日本語\n\t", "\x00\x7f~!", ""])
def test_token_ids_are_utf8_bytes_and_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # independent reference: one token per byte, id == byte
    assert tok.decode(ids) == text


def test_every_byte_is_a_token(tok):
    # Ids 0..255 are exactly the symbols of the tokenizers library's ByteLevel alphabet.
    from tokenizers import pre_tokenizers

    assert set(tok.convert_ids_to_tokens(list(range(256)))) == set(pre_tokenizers.ByteLevel.alphabet())
    # Text covering every 1- and 2-byte UTF-8 character plus 3- and 4-byte ones encodes to its bytes.
    text = "".join(chr(c) for c in range(0x800)) + "".join(chr(c) for c in range(0x800, 0x10000, 0x3F1) if not 0xD800 <= c < 0xE000)
    text += "\U0001F600\U0010FFFD"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_digits_are_single_tokens(tok):
    for d in "0123456789":
        assert tok.encode(d, add_special_tokens=False) == [ord(d)]


def test_encode_prompt_short_and_stable(tok, tmp_path):
    ids = encode_prompt(tok, "123+456=")
    assert ids == [258, 49, 50, 51, 43, 52, 53, 54, 61, 259]  # <|user|> '1' '2' '3' '+' '4' '5' '6' '=' <|assistant|>
    assert render_prompt(tok, "123+456=") == "<|user|>123+456=<|assistant|>"
    again = build_tokenizer(tmp_path / "other")  # a fresh build gives the same ids
    assert encode_prompt(again, "123+456=") == ids


def test_chat_template_via_apply_chat_template(tok):
    msgs = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "<|user|>1+2=<|assistant|>3<|endoftext|>"
    with pytest.raises(Exception, match="unsupported chat role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)


def test_encode_sft_example_and_decode_response(tok):
    ids, mask = encode_sft_example(tok, "1+2=", "3")
    assert ids == [258, 49, 43, 50, 61, 259, 51, 257]
    assert mask == [0, 0, 0, 0, 0, 0, 1, 1]
    assert decode_response(tok, [51, 55, 257, 256, 256]) == "37"


def test_rebuild_is_byte_identical_and_leaves_files_untouched(tok_dir, tmp_path):
    d = tmp_path / "t"
    build_tokenizer(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (d / name).read_bytes() == (tok_dir / name).read_bytes()
        os.utime(d / name, (1_000_000, 1_000_000))
    build_tokenizer(d)
    assert all(os.stat(d / n).st_mtime == 1_000_000 for n in ("tokenizer.json", "tokenizer_config.json"))
    assert not [n for n in os.listdir(d) if n.startswith(".")]  # no temp dir left behind


def test_load_tokenizer_errors(tok_dir, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer directory not found: .*missing \(data.tokenizer_path\)"):
        load_tokenizer(tmp_path / "missing")
    d = tmp_path / "no_template"
    shutil.copytree(tok_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has no chat_template"):
        load_tokenizer(d)


# ----------------------------------------------------------------------------- arithmetic task
def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_generate_arithmetic_rows(tmp_path):
    train, evl = generate_arithmetic(tmp_path, num_train=500, num_eval=50, digits=3, seed=1)
    tr, ev = _read(train), _read(evl)
    assert len(tr) == 500 and len(ev) == 50
    for row in tr + ev:
        assert set(row) == {"prompt", "label"}
        m = re.fullmatch(r"(\d{3})\+(\d{3})=", row["prompt"])
        assert m, row
        assert row["label"] == str(int(m.group(1)) + int(m.group(2)))
    train_prompts, eval_prompts = [r["prompt"] for r in tr], [r["prompt"] for r in ev]
    assert len(set(train_prompts)) == 500 and len(set(eval_prompts)) == 50
    assert not set(train_prompts) & set(eval_prompts)
    # zero padding really happens somewhere in 550 draws from 0..999
    assert any(p.startswith("0") or "+0" in p for p in train_prompts)


def test_generate_arithmetic_deterministic_and_seeded(tmp_path):
    a = generate_arithmetic(tmp_path / "a", 200, 20, 3, seed=5)
    b = generate_arithmetic(tmp_path / "b", 200, 20, 3, seed=5)
    c = generate_arithmetic(tmp_path / "c", 200, 20, 3, seed=6)
    assert Path(a[0]).read_bytes() == Path(b[0]).read_bytes()
    assert Path(a[1]).read_bytes() == Path(b[1]).read_bytes()
    assert Path(a[0]).read_bytes() != Path(c[0]).read_bytes()
    d = generate_arithmetic(tmp_path / "d", 400, 20, 3, seed=5)  # eval does not depend on num_train
    assert Path(d[1]).read_bytes() == Path(a[1]).read_bytes()


def test_generate_arithmetic_skips_identical_rewrite(tmp_path):
    train, evl = generate_arithmetic(tmp_path, 100, 10, 2, seed=3)
    for p in (train, evl):
        os.utime(p, (1_000_000, 1_000_000))
    generate_arithmetic(tmp_path, 100, 10, 2, seed=3)
    assert os.stat(train).st_mtime == 1_000_000 and os.stat(evl).st_mtime == 1_000_000
    generate_arithmetic(tmp_path, 100, 10, 2, seed=4)  # different content -> rewritten
    assert os.stat(train).st_mtime != 1_000_000


def test_generate_arithmetic_full_space_and_errors(tmp_path):
    train, evl = generate_arithmetic(tmp_path, 90, 10, 1, seed=0)
    prompts = {r["prompt"] for r in _read(train) + _read(evl)}
    assert prompts == {f"{a}+{b}=" for a in range(10) for b in range(10)}  # all 100 1-digit problems
    with pytest.raises(ValueError, match="exceeds the 100 distinct"):
        generate_arithmetic(tmp_path, 91, 10, 1, seed=0)
    with pytest.raises(ValueError, match="num_eval"):
        generate_arithmetic(tmp_path, 10, 0, 1, seed=0)


def test_prepare_task_data(tmp_path):
    tr, ev = prepare_task_data("arithmetic", tmp_path / "gen", 1, num_train=10, num_eval=5, digits=2)
    assert len(_read(tr)) == 10 and len(_read(ev)) == 5
    assert prepare_task_data("jsonl", tmp_path, 1, train_path=tr, eval_path=ev) == (tr, ev)
    with pytest.raises(ValueError, match="data.eval_path file not found"):
        prepare_task_data("jsonl", tmp_path, 1, train_path=tr, eval_path=str(tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match="unknown data.task"):
        prepare_task_data("chess", tmp_path, 1)


# ----------------------------------------------------------------------------- jsonl loading
def _jsonl(tmp_path, lines, name="x.jsonl"):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


def test_load_prompt_dataset(tmp_path):
    p = _jsonl(tmp_path, ['{"prompt": "1+2=", "label": "3", "id": 1}', "", '{"prompt": "4+5=", "label": "9", "id": 2}'])
    ds = load_prompt_dataset(p, cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 2 and ds[0] == {"prompt": "1+2=", "label": "3", "id": 1} and ds[1]["label"] == "9"


def test_load_prompt_dataset_custom_keys_and_int_labels(tmp_path):
    p = _jsonl(tmp_path, ['{"question": "2*3=", "answer": 6}', '{"question": "9-1=", "answer": 8}'])
    ds = load_prompt_dataset(p, prompt_key="question", label_key="answer", cache_dir=str(tmp_path / "c"))
    assert [r["answer"] for r in ds] == ["6", "8"]
    with pytest.raises(DatasetError, match=r"row 1 of x.jsonl has no field 'prompt' \(data.prompt_key\)"):
        load_prompt_dataset(p, cache_dir=str(tmp_path / "c"))


def test_generated_files_load(tmp_path):
    train, _ = generate_arithmetic(tmp_path, 30, 5, 3, seed=2)
    ds = load_prompt_dataset(train, cache_dir=str(tmp_path / "c"))
    assert [dict(r) for r in ds] == _read(train)


@pytest.mark.parametrize(
    "lines,pattern",
    [
        (['{"prompt": "a", "label": "1"}', '{"prompt": "b"}'], r"row 2 of x.jsonl has no field 'label' \(data.label_key\)"),
        (['{"prompt": "a", "label": "1"}'] * 16 + ['{"label": "1"}'], r"row 17 of x.jsonl has no field 'prompt' \(data.prompt_key\)"),
        (['{"prompt": "a", "label": "1"}', "", '{"prompt": "a", "label": }'], r"row 3 of .*x.jsonl is not valid JSON"),
        (['["a", "1"]'], r"row 1 of .*x.jsonl is a JSON list, not an object"),
        (['{"prompt": "", "label": "1"}'], r"row 1 of x.jsonl: field 'prompt' \(data.prompt_key\) must be a non-empty string"),
        (['{"prompt": 5, "label": "1"}'], r"field 'prompt'"),
        (['{"prompt": "a", "label": 1.5}'], r"row 1 of x.jsonl: field 'label' \(data.label_key\) must be a string or an integer"),
        (['{"prompt": "a", "label": null}'], r"field 'label'"),
        (['{"prompt": "a", "label": 1}', '{"prompt": "b", "label": "2"}'], r"row 2 of x.jsonl: field 'label' is str but row 1 holds int"),
        ([], r"holds no rows"),
        (["", "  "], r"holds no rows"),
    ],
)
def test_load_prompt_dataset_errors(tmp_path, lines, pattern):
    p = _jsonl(tmp_path, lines)
    with pytest.raises(DatasetError, match=pattern):
        load_prompt_dataset(p, cache_dir=str(tmp_path / "cache"))


def test_missing_file_names_path_and_recipe_key(tmp_path):
    with pytest.raises(DatasetError, match=r"prompt file not found: .*nope.jsonl \(data.eval_path\)"):
        load_prompt_dataset(tmp_path / "nope.jsonl", recipe_key="data.eval_path")
    with pytest.raises(DatasetError, match=r"data.train_path / data.eval_path"):
        load_prompt_dataset(tmp_path / "nope.jsonl")
    assert issubclass(DatasetError, ValueError)


# ----------------------------------------------------------------------------- sampler
ROWS = [{"prompt": f"p{i}", "label": str(i)} for i in range(10)]


def test_sampler_epochs_are_permutations():
    s = PromptSampler(ROWS, batch_size=4, seed=0)
    drawn = [s.next_indices() for _ in range(5)]  # 20 rows = exactly 2 epochs
    flat = [i for b in drawn for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled per epoch (fixed seeds: deterministic)
    assert drawn[2][:2] == flat[8:10] and drawn[2][2:] == flat[10:12]  # batch 3 spans the epoch boundary
    assert s.state_dict() == {"epoch": 2, "position": 0, "seed": 0, "num_rows": 10}


def test_sampler_deterministic_and_seeded():
    a = PromptSampler(ROWS, 3, seed=7)
    b = PromptSampler(ROWS, 3, seed=7)
    c = PromptSampler(ROWS, 3, seed=8)
    seq_a = [a.next_indices() for _ in range(7)]
    assert seq_a == [b.next_indices() for _ in range(7)]
    assert seq_a != [c.next_indices() for _ in range(7)]
    batch = next(iter(PromptSampler(ROWS, 3, seed=7)))
    assert batch == [ROWS[i] for i in seq_a[0]]


def test_sampler_resume_matches_uninterrupted_run():
    ref = PromptSampler(ROWS, 4, seed=3)
    expected = [ref.next_indices() for _ in range(9)]
    first = PromptSampler(ROWS, 4, seed=3)
    got = [first.next_indices() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(ROWS, 4, seed=3)
    resumed.load_state_dict(state)
    got += [resumed.next_indices() for _ in range(5)]
    assert got == expected


def test_sampler_batch_larger_than_dataset():
    s = PromptSampler(ROWS[:3], batch_size=7, seed=1)
    b = s.next_indices()
    assert len(b) == 7 and Counter(b[:3]) == Counter(range(3)) and Counter(b[3:6]) == Counter(range(3))
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 1


def test_sampler_errors():
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(ROWS, 0, 0)
    with pytest.raises(ValueError, match="non-empty"):
        PromptSampler([], 1, 0)
    s = PromptSampler(ROWS, 2, seed=0)
    with pytest.raises(ValueError, match="same seed and data"):
        s.load_state_dict({"epoch": 0, "position": 0, "seed": 1, "num_rows": 10})
    with pytest.raises(ValueError, match="same seed and data"):
        s.load_state_dict({"epoch": 0, "position": 0, "seed": 0, "num_rows": 11})
    with pytest.raises(ValueError, match="outside"):
        s.load_state_dict({"epoch": 0, "position": 10, "seed": 0, "num_rows": 10})
    with pytest.raises(ValueError, match="lacks"):
        s.load_state_dict({"epoch": 0})
