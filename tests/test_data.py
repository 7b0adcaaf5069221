"""Tokenizer, task generators (arithmetic, reasoning-gym), prompt files (jsonl, parquet, chat messages),
the prompt sampler and data fingerprints (moerl/data)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from moerl.data.dataset import DatasetError, PromptSampler, load_prompt_dataset
from moerl.data.fingerprint import describe_change, file_fingerprint, rows_fingerprint
from moerl.data.tasks import generate_arithmetic, generate_reasoning_gym, metadata_json, prepare_task_data, row_metadata
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


def test_data_seed_fixes_the_split_while_seed_varies(tmp_path):
    """data.seed: the main job's generated train/eval files are generate_arithmetic's for data.seed whatever
    the recipe seed (so RL can be repeated with other seeds on a warm start's split); unset, the recipe seed."""
    from types import SimpleNamespace

    from moerl.config import load_config
    from moerl.rollout.common import free_port_block
    from moerl.train.setup import prepare_run

    ref_tr, ref_ev = generate_arithmetic(tmp_path / "ref", 16, 10, 1, 7)
    dist = SimpleNamespace(world_size=1, is_main=True, rank=0)

    def files(name, *overrides):
        base = free_port_block(3)
        cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "tiny_arith.yaml"),
                          [f"output_dir={tmp_path / name}", f"rollout.base_port={base}", f"rollout.router_port={base + 2}",
                           "data.digits=1", "data.num_train=16", "data.num_eval=10", "eval.num_prompts=4",
                           "sft.eval_prompts=4", "rollout.num_servers=1", *overrides])
        ctx = prepare_run(cfg, dist)
        return [(ctx.run_dir / "data" / f).read_bytes() for f in ("train.jsonl", "eval.jsonl")]

    ref = [Path(ref_tr).read_bytes(), Path(ref_ev).read_bytes()]
    assert files("a", "seed=1", "data.seed=7") == ref
    assert files("b", "seed=2", "data.seed=7") == ref
    assert files("c", "seed=7") == ref
    assert files("d", "seed=2")[1] != ref[1]


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


# ----------------------------------------------------------------------------- chat-message prompts and parquet
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]


def test_message_prompts_load_as_lists_of_dicts(tmp_path):
    rows = [
        {"prompt": MSGS, "label": "3", "metadata": '{"k": [1, 2]}'},
        {"prompt": [{"role": "user", "content": "9-1="}, {"role": "assistant", "content": "8"}, {"role": "user", "content": "and 9-2="}], "label": "7", "metadata": "{}"},
    ]
    p = _jsonl(tmp_path, [json.dumps(r) for r in rows])
    ds = load_prompt_dataset(p, cache_dir=str(tmp_path / "c"))
    assert [dict(r) for r in ds] == rows  # messages stay lists of dicts, metadata stays text


@pytest.mark.parametrize(
    "prompt,pattern",
    [
        ([], r"row 2 of x.jsonl: field 'prompt' \(data.prompt_key\) must be a non-empty string or a non-empty list"),
        ([{"role": "tool", "content": "x"}], r"row 2 of x.jsonl: field 'prompt' \(data.prompt_key\): message 1 has role 'tool'"),
        ([{"role": "user", "content": 5}], r"row 2 of x.jsonl: .*message 1 \(user\) needs a string 'content'.*file .*x.jsonl"),
        (["1+2="], r"row 2 of .*message 1 must be an object"),
        ("1+2=", r"row 2 of x.jsonl: field 'prompt' \(data.prompt_key\) is a string but row 1 holds a list of chat messages"),
    ],
)
def test_bad_message_prompts(tmp_path, prompt, pattern):
    p = _jsonl(tmp_path, [json.dumps({"prompt": MSGS, "label": "3"}), json.dumps({"prompt": prompt, "label": "3"})])
    with pytest.raises(DatasetError, match=pattern):
        load_prompt_dataset(p, cache_dir=str(tmp_path / "c"))


def _parquet(tmp_path, rows, name="x.parquet"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), p)
    return p


def test_load_parquet(tmp_path):
    rows = [{"question": MSGS, "answer": 3, "metadata": '{"a": 1}'}, {"question": [MSGS[1]], "answer": 4, "metadata": "{}"}]
    ds = load_prompt_dataset(_parquet(tmp_path, rows), "question", "answer", cache_dir=str(tmp_path / "c"))
    assert [dict(r) for r in ds] == [{**r, "answer": str(r["answer"])} for r in rows]
    plain = [{"prompt": "1+2=", "label": "3"}, {"prompt": "4+5=", "label": "9"}]
    ds = load_prompt_dataset(_parquet(tmp_path, plain, "plain.parquet"), cache_dir=str(tmp_path / "c"))
    assert [dict(r) for r in ds] == plain


@pytest.mark.parametrize(
    "rows,pattern",
    [
        ([{"prompt": "a", "label": "1"}, {"prompt": "", "label": "2"}], r"row 2 of x.parquet: field 'prompt' \(data.prompt_key\) must be a non-empty"),
        ([{"prompt": "a", "label": "1"}, {"prompt": None, "label": "2"}], r"row 2 of x.parquet: field 'prompt'"),
        ([{"prompt": "a", "label": 1}] * 3 + [{"prompt": "b", "label": None}], r"row 4 of x.parquet: field 'label' \(data.label_key\) must be a string or an integer"),
        ([{"prompt": "a", "label": 1.5}], r"row 1 of x.parquet: field 'label'"),
        ([{"text": "a", "label": "1"}], r"row 1 of x.parquet has no field 'prompt' \(data.prompt_key\); the file's columns are \['text', 'label'\]"),
        ([{"prompt": [{"role": "user", "content": "a"}], "label": "1"}, {"prompt": [{"role": "robot", "content": "b"}], "label": "1"}], r"row 2 of x.parquet: .*message 1 has role 'robot'"),
    ],
)
def test_parquet_errors(tmp_path, rows, pattern):
    with pytest.raises(DatasetError, match=pattern):
        load_prompt_dataset(_parquet(tmp_path, rows), cache_dir=str(tmp_path / "c"))


def test_empty_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "e.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "label": pa.array([], pa.string())}), p)
    with pytest.raises(DatasetError, match=r"holds no rows"):
        load_prompt_dataset(p, recipe_key="data.train_path", cache_dir=str(tmp_path / "c"))
    bad = tmp_path / "bad.parquet"
    bad.write_text('{"prompt": "a", "label": "1"}\n')
    with pytest.raises(DatasetError, match=r"bad.parquet \(data.eval_path\) is not a readable parquet file"):
        load_prompt_dataset(bad, recipe_key="data.eval_path", cache_dir=str(tmp_path / "c"))


# ----------------------------------------------------------------------------- reasoning-gym task
RG_CONFIG = {"min_terms": 2, "max_terms": 3, "max_digits": 2}


def test_reasoning_gym_rows_match_the_library(tmp_path):
    import reasoning_gym

    train, evl = generate_reasoning_gym(tmp_path, "basic_arithmetic", RG_CONFIG, size=40, num_eval=10, seed=7)
    tr, ev = _read(train), _read(evl)
    ref = reasoning_gym.create_dataset("basic_arithmetic", size=40, seed=7, **RG_CONFIG)
    assert len(tr) == 40 and len(ev) == 10
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    for row, entry in zip(tr, ref):
        assert set(row) == {"prompt", "label", "metadata"} and isinstance(row["metadata"], str)
        assert row["prompt"] == entry["question"] and row["label"] == str(entry["answer"])
        meta = row_metadata(row)
        assert meta["expression"] == entry["metadata"]["expression"]
        assert meta["difficulty"]["num_terms"] == [2, 3]  # a tuple in reasoning-gym, a list after JSON
        # the row holds all reasoning-gym's scorer needs
        assert score(row["label"], {"question": row["prompt"], "answer": row["label"], "metadata": meta}) == 1.0
    eval_q = [r["prompt"] for r in ev]
    assert len(set(eval_q)) == 10 and not set(eval_q) & {r["prompt"] for r in tr}
    for row in ev:  # eval answers are right too: evaluate the expression (only + - * / on ints)
        expr = row_metadata(row)["expression"]
        assert float(row["label"]) == pytest.approx(eval(expr))  # noqa: S307 - generated arithmetic


def test_reasoning_gym_deterministic_and_seeded(tmp_path):
    a = generate_reasoning_gym(tmp_path / "a", "basic_arithmetic", RG_CONFIG, 30, 5, 1)
    for p in a:
        os.utime(p, (1_000_000, 1_000_000))
    b = generate_reasoning_gym(tmp_path / "a", "basic_arithmetic", dict(RG_CONFIG), 30, 5, 1)
    assert a == b and all(os.stat(p).st_mtime == 1_000_000 for p in a)  # identical: not rewritten
    c = generate_reasoning_gym(tmp_path / "c", "basic_arithmetic", RG_CONFIG, 30, 5, 1)
    assert [Path(p).read_bytes() for p in a] == [Path(p).read_bytes() for p in c]
    d = generate_reasoning_gym(tmp_path / "d", "basic_arithmetic", RG_CONFIG, 30, 5, 2)
    assert Path(d[0]).read_bytes() != Path(a[0]).read_bytes()
    assert not [n for n in os.listdir(tmp_path / "a") if n.startswith(".")]


def test_reasoning_gym_errors(tmp_path):
    with pytest.raises(ValueError, match=r"'basic_arithmetc' \(data.reasoning_gym.name\); did you mean basic_arithmetic.*reasoning_gym.factory.DATASETS"):
        generate_reasoning_gym(tmp_path, "basic_arithmetc", {}, 10, 2, 0)
    with pytest.raises(ValueError, match=r"rejects data.reasoning_gym.config \{'max_term': 3\}.*unexpected keyword.*'max_terms'"):
        generate_reasoning_gym(tmp_path, "basic_arithmetic", {"max_term": 3}, 10, 2, 0)
    with pytest.raises(ValueError, match=r"rejects data.reasoning_gym.config.*AssertionError"):
        generate_reasoning_gym(tmp_path, "basic_arithmetic", {"min_terms": 4, "max_terms": 2}, 10, 2, 0)
    with pytest.raises(ValueError, match=r"data.reasoning_gym.config must not set 'seed'; use data.reasoning_gym.seed"):
        generate_reasoning_gym(tmp_path, "basic_arithmetic", {"seed": 3}, 10, 2, 0)
    with pytest.raises(ValueError, match=r"data.num_eval must be a positive int"):
        generate_reasoning_gym(tmp_path, "basic_arithmetic", {}, 10, 0, 0)
    # one-digit sums: about a hundred distinct questions, mostly drawn by the 300 train entries
    tiny = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_negation": False, "allow_parentheses": False}
    with pytest.raises(ValueError, match=r"fewer than data.num_eval=100; lower data.num_eval or data.reasoning_gym.size"):
        generate_reasoning_gym(tmp_path, "basic_arithmetic", tiny, 300, 100, 0)
    assert not os.path.exists(tmp_path / "train.jsonl")  # nothing written before the checks pass


def test_prepare_task_data_reasoning_gym(tmp_path):
    rg = {"name": "basic_arithmetic", "config": RG_CONFIG, "size": 20}
    got = prepare_task_data("reasoning_gym", tmp_path / "run", 5, num_eval=4, reasoning_gym=rg)
    ref = generate_reasoning_gym(tmp_path / "ref", "basic_arithmetic", RG_CONFIG, 20, 4, 5)  # seed = run seed
    assert [Path(p).read_bytes() for p in got] == [Path(p).read_bytes() for p in ref]
    got = prepare_task_data("reasoning_gym", tmp_path / "run2", 5, num_eval=4, reasoning_gym={**rg, "seed": 9})
    ref = generate_reasoning_gym(tmp_path / "ref2", "basic_arithmetic", RG_CONFIG, 20, 4, 9)
    assert [Path(p).read_bytes() for p in got] == [Path(p).read_bytes() for p in ref]
    ds = load_prompt_dataset(got[0], cache_dir=str(tmp_path / "c"))
    assert ds.column_names == ["prompt", "label", "metadata"] and isinstance(ds[0]["metadata"], str)
    assert row_metadata(ds[0])["source_dataset"] == "basic_arithmetic"
    with pytest.raises(ValueError, match=r"data.reasoning_gym must be set"):
        prepare_task_data("reasoning_gym", tmp_path, 5)
    with pytest.raises(ValueError, match=r"data.reasoning_gym.size must be set"):
        prepare_task_data("reasoning_gym", tmp_path, 5, reasoning_gym={"name": "basic_arithmetic"})
    with pytest.raises(ValueError, match=r"data.reasoning_gym has unknown keys \['num_eval'\]"):
        prepare_task_data("reasoning_gym", tmp_path, 5, reasoning_gym={**rg, "num_eval": 3})


def test_row_metadata_and_metadata_json():
    assert row_metadata({"prompt": "p"}) == {} and row_metadata({"metadata": None}) == {}
    assert row_metadata({"metadata": '{"a": [1, 2]}'}) == {"a": [1, 2]}
    assert row_metadata({"metadata": {"a": 1}}) == {"a": 1}
    with pytest.raises(ValueError, match="not valid JSON"):
        row_metadata({"metadata": "{oops"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        row_metadata({"metadata": "[1]"})

    class Thing:
        def __str__(self):
            return "thing"

    text = metadata_json({"t": (1, (2, 3)), "s": {"b", "a"}, "o": Thing(), "u": "é"})
    assert text == '{"t": [1, [2, 3]], "s": ["a", "b"], "o": "thing", "u": "é"}'


# ----------------------------------------------------------------------------- fingerprints
def test_file_and_rows_fingerprints(tmp_path):
    import hashlib

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"prompt": "1+2=", "label": "3"}\n')
    b.write_text('{"prompt": "1+2=", "label": "4"}\n')  # same size, one byte differs
    assert a.stat().st_size == b.stat().st_size
    assert file_fingerprint(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert file_fingerprint(a) != file_fingerprint(b)
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * 9000)  # > 2 chunks
    assert file_fingerprint(big) == hashlib.sha256(big.read_bytes()).hexdigest()
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "é", "label": "4"}]
    ref = hashlib.sha256('[{"label":"3","prompt":"1+2="},{"label":"4","prompt":"é"}]'.encode()).hexdigest()
    assert rows_fingerprint(rows) == ref
    assert rows_fingerprint([{"label": "3", "prompt": "1+2="}, rows[1]]) == ref  # key order does not matter
    assert rows_fingerprint(rows[::-1]) != ref  # row order does


def test_describe_change():
    saved = {"train_data": "aa", "eval_data": "bb", "tokenizer": "cc", "train_rows": 2000, "eval_rows": 100, "seed": 1}
    assert describe_change(saved, dict(saved)) is None
    assert describe_change(saved, {**saved, "train_data": "xx"}) == "training data changed (data.train_path: content differs, 2000 rows both)"
    assert (
        describe_change(saved, {**saved, "eval_data": "xx", "eval_rows": 120, "tokenizer": "yy"})
        == "eval data changed (data.eval_path: content differs, 100 rows then, 120 now); "
        "tokenizer changed (data.tokenizer_path: vocab, special tokens, encoding or chat template differ)"
    )
    assert describe_change(saved, {**saved, "train_data": "xx"}, sources={"train_data": "data.reasoning_gym"}) == (
        "training data changed (data.reasoning_gym: content differs, 2000 rows both)"
    )
    assert describe_change(saved, {**saved, "seed": 2}) == "seed changed (1 -> 2)"
    now = {k: v for k, v in saved.items() if k != "tokenizer"}
    assert describe_change(saved, now) == "tokenizer no longer recorded (data.tokenizer_path)"
    assert describe_change(now, saved) == "tokenizer not recorded then (data.tokenizer_path)"


def test_setup_checks_every_row_before_any_work(tmp_path):
    """moerl.train.setup.check_rows: a row with unparsable metadata, a prompt too long for
    the context far past the first rows, and countdown rows without metadata['numbers'] are refused,
    naming the row, the file and the recipe key."""
    from moerl.data.dataset import DatasetError, load_prompt_dataset
    from moerl.train.setup import check_rows

    def check(ds, path, reward="arithmetic", max_positions=64):  # one token per byte
        check_rows(ds, path, "data.train_path", prompt_key="prompt", label_key="label", encode=str.encode,
                   reward_spec=reward, max_positions=max_positions, max_new_tokens=8)

    def ds_of(rows, name):
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_prompt_dataset(str(path), "prompt", "label", recipe_key="data.train_path",
                                   cache_dir=str(tmp_path / "cache")), path

    ds, path = ds_of([{"prompt": "1+2=", "label": "3", "metadata": "{}"}] * 3
                     + [{"prompt": "1+2=", "label": "3", "metadata": "not json"}], "meta.jsonl")
    with pytest.raises(DatasetError, match=r"row 4 of .*meta.jsonl \(data.train_path\): field 'metadata'"):
        check(ds, path)
    ds, path = ds_of([{"prompt": "1+2=", "label": "3"}] * 1500 + [{"prompt": "x" * 57, "label": "3"}], "long.jsonl")
    with pytest.raises(DatasetError, match=r"row 1501 of .*the prompt has 57 tokens; with rollout.max_new_tokens \(8\)"):
        check(ds, path)
    with pytest.raises(DatasetError, match="row 1501 .* reaches"):
        check(ds, path, max_positions=65)  # 57 + 8 = 65 reaches the context: SGLang refuses it
    check(ds, path, max_positions=66)
    ds, path = ds_of([{"prompt": "p", "label": "24", "metadata": {"numbers": [6, 4]}},
                      {"prompt": "p", "label": "24"}], "countdown.jsonl")
    with pytest.raises(DatasetError, match=r"row 2 of .*reward.function=countdown: .*metadata\['numbers'\]"):
        check(ds, path, "countdown")
    check(ds, path, "exact_match")  # no hook: nothing to check
