"""moerl's offline byte-level tokenizer and the prompt/response encoding helpers.

The tokenizer is built with the Hugging Face ``tokenizers`` library (no download): a BPE model whose
vocabulary is exactly the 256 byte symbols of the GPT-2 byte-to-unicode map and no merges, so token
id == byte value (``"0"`` -> 48, ``"+"`` -> 43) and every digit is its own token. Four special tokens
follow at ids 256..259: ``<|pad|>``, ``<|endoftext|>`` (eos), ``<|user|>``, ``<|assistant|>``. It is
saved as ``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template inside), so
``transformers.AutoTokenizer``, SGLang and moerl's reference server all load it from the directory.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import tempfile
from array import array
from typing import Any, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from moerl.data.messages import to_messages

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)

# One user turn -> "<|user|>{content}"; an assistant turn -> "<|assistant|>{content}<|endoftext|>";
# add_generation_prompt appends "<|assistant|>". Other roles are rejected.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER_TOKEN + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT_TOKEN + "{{ message['content'] }}" + EOS_TOKEN +
    "{% else %}{{ raise_exception('unsupported chat role: ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT_TOKEN + "{% endif %}"
)

_SAVED_FILES = ("tokenizer.json", "tokenizer_config.json")
_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": EOS_TOKEN,
    "pad_token": PAD_TOKEN,
    "additional_special_tokens": [USER_TOKEN, ASSISTANT_TOKEN],
    "chat_template": CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
}


def byte_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable-unicode map of GPT-2's byte-level BPE (used by
    ``tokenizers.pre_tokenizers.ByteLevel``): printable Latin-1 bytes map to themselves, the other 68
    bytes to code points 256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _make_fast_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(out_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Build moerl's byte-level tokenizer, save it to ``out_dir`` and return it loaded from there.

    Vocabulary: 256 byte tokens (id == byte value) + ``<|pad|>`` 256, ``<|endoftext|>`` 257 (eos),
    ``<|user|>`` 258, ``<|assistant|>`` 259; ``len(tokenizer) == 260``. Deterministic: building
    twice gives identical files, and files already identical on disk are left untouched (files are
    written to a temp dir and moved in with ``os.replace``, so concurrent builders do not corrupt them).
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tok = _make_fast_tokenizer()
    tmp = tempfile.mkdtemp(prefix=".tok-", dir=out_dir)
    try:
        tok.save_pretrained(tmp, save_jinja_files=False)
        # Portable tokenizer_config.json: the class and key names transformers 4.x and 5.x (and SGLang)
        # both read; save_pretrained of transformers 5 writes v5-only names ("TokenizersBackend").
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(_TOKENIZER_CONFIG, f, indent=2, ensure_ascii=False)
            f.write("\n")
        for name in _SAVED_FILES:
            src, dst = os.path.join(tmp, name), os.path.join(out_dir, name)
            if not (os.path.isfile(dst) and filecmp.cmp(src, dst, shallow=False)):
                os.replace(src, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(out_dir)


# files that make a directory a tokenizer directory for transformers' AutoTokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str | os.PathLike, recipe_key: str = "data.tokenizer_path") -> PreTrainedTokenizerBase:
    """Load a tokenizer directory (moerl's or any HF tokenizer with a chat template and an eos token).

    Raises:
        ValueError: ``path`` is not a directory holding a tokenizer, or the tokenizer lacks an eos
            token or a chat template (the message names ``recipe_key``).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"tokenizer directory not found: {path} ({recipe_key}); set it to a HF tokenizer dir or null")
    if not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {path} ({recipe_key}); "
                         "give a directory written by a tokenizer's save_pretrained")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the recipe key, on one line
        why = " ".join(str(e).split())
        raise ValueError(f"cannot load a tokenizer from {path} ({recipe_key}): {type(e).__name__}: "
                         f"{why[:300]}{' ...' if len(why) > 300 else ''}") from e
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer at {path} ({recipe_key}) has no eos token; responses could never stop")
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer at {path} ({recipe_key}) has no chat_template; add one to tokenizer_config.json")
    return tok


def _has_tokenizer_files(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, n)) for n in _SAVED_FILES)


def tokenizer_from_config(
    tokenizer_path: Optional[str], run_dir: str | os.PathLike, init_from: Optional[str] = None
) -> PreTrainedTokenizerBase:
    """The run's tokenizer, first match wins:

    1. ``data.tokenizer_path`` (``tokenizer_path``) when set: loaded with :func:`load_tokenizer`;
    2. the tokenizer saved beside the weights of ``model.init_from`` (``init_from``), when that directory
       holds a ``tokenizer.json`` or ``tokenizer_config.json`` (as a Hugging Face checkpoint does);
    3. moerl's byte-level tokenizer, built into ``<run_dir>/tokenizer`` (:func:`build_tokenizer`).

    Raises:
        ValueError: the chosen directory cannot be loaded, has no eos token or no chat template (names
            data.tokenizer_path or model.init_from), or ``init_from`` is set but is not a directory
            (names model.init_from).
    """
    if tokenizer_path is not None:
        return load_tokenizer(tokenizer_path, recipe_key="data.tokenizer_path")
    if init_from is not None:
        init_from = os.fspath(init_from)
        if not os.path.isdir(init_from):
            raise ValueError(f"model.init_from directory not found: {init_from}")
        if _has_tokenizer_files(init_from):
            return load_tokenizer(init_from, recipe_key="model.init_from (its tokenizer; override with data.tokenizer_path)")
    return build_tokenizer(os.path.join(os.fspath(run_dir), "tokenizer"))


def is_moerl_tokenizer(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` carries moerl's byte-level chat template (user/assistant turns only)."""
    return getattr(tokenizer, "chat_template", None) == CHAT_TEMPLATE


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, Any]], system_prompt: Optional[str] = None
) -> str:
    """The chat-templated prompt text, ending with the generation prompt (what the policy continues).

    ``messages = moerl.data.messages.to_messages(prompt, system_prompt)`` (a string is one user turn; a
    message list is used as given; ``system_prompt`` = ``data.system_prompt`` is prepended as a system
    message and refused when the prompt already has one), then
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` (the Hugging
    Face ``PreTrainedTokenizerBase.apply_chat_template`` API). With moerl's tokenizer ``"1+2="`` ->
    ``"<|user|>1+2=<|assistant|>"``; with a ChatML (Qwen) template
    ``"<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"``.

    Raises:
        ValueError: see ``to_messages``; a system message for moerl's byte-level tokenizer, whose
            template has no system role (names data.system_prompt / data.prompt_key and
            data.tokenizer_path); any other refusal of the chat template (its message included).
    """
    messages = to_messages(prompt, system_prompt)
    if is_moerl_tokenizer(tokenizer) and any(m["role"] == "system" for m in messages):
        source = "data.system_prompt is set" if system_prompt is not None else "the prompt (data.prompt_key) has a system message"
        raise ValueError(
            f"{source}, but moerl's byte-level tokenizer has no system role (its chat template knows only user "
            "and assistant turns); unset data.system_prompt / drop system messages, or use a tokenizer whose "
            "chat template has one (data.tokenizer_path, or the tokenizer of model.init_from)"
        )
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError or the template's raise_exception
        raise ValueError(f"the tokenizer's chat template rejected the prompt {messages!r}: {type(e).__name__}: {e}") from e


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, Any]], system_prompt: Optional[str] = None
) -> list[int]:
    """Token ids of :func:`render_prompt`'s text, ``tokenizer.encode(text, add_special_tokens=False)``:
    equal, token for token, to ``apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)`` (no bos/eos is added beyond what the template writes).

    With moerl's tokenizer ``"123+456="`` -> ``[258, 49, 50, 51, 43, 52, 53, 54, 61, 259]``.

    Raises:
        ValueError: as :func:`render_prompt`.
    """
    return tokenizer.encode(render_prompt(tokenizer, prompt, system_prompt), add_special_tokens=False)


def encode_sft_example(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict[str, Any]],
    response_text: str,
    system_prompt: Optional[str] = None,
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of prompt + gold response + eos for supervised warm start.

    ids = encode_prompt(prompt, system_prompt) + ids(response) + [eos]; the mask is 0 on prompt tokens
    and 1 on the response and eos tokens (both lists have the same length).

    Raises:
        ValueError: as :func:`render_prompt`.
    """
    return _sft_pair(encode_prompt(tokenizer, prompt, system_prompt), _sft_response_ids(tokenizer, response_text))


def _sft_response_ids(tokenizer: PreTrainedTokenizerBase, response_text: str) -> list[int]:
    """The gold response's ids + eos (the supervised target of :func:`encode_sft_example`)."""
    return tokenizer.encode(response_text, add_special_tokens=False) + [tokenizer.eos_token_id]


def _sft_pair(prompt_ids: list[int], response_ids: list[int]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a supervised example: 0 on the prompt, 1 on the response and eos."""
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


class PromptEncoder:
    """:func:`encode_prompt` and :func:`encode_sft_example` of one tokenizer and ``data.system_prompt``,
    memoized for text prompts. The prompt sampler visits every row once per epoch, so the cache pays from a
    run's second epoch on: the demo's SFT warm start (~3 epochs of its 20,000 prompts) re-rendered the chat
    template and re-tokenized 128 examples every step, ~9% of its trainer time (py-spy). Chat-message prompts
    (lists) are encoded each time. The cache holds at most ``max_bytes`` (ids as int32 arrays, keys and a
    per-entry overhead, estimated); once full, new prompts are encoded but not kept (no eviction: with the
    sampler's cyclic order an evicting cache would hit nothing). Results are new lists, equal to the uncached
    functions'. Thread-safe under the GIL (two threads may encode the same prompt once each).

    Args:
        tokenizer: the run's tokenizer.
        system_prompt: ``data.system_prompt``.
        max_bytes: cache budget (default 256 MiB).

    Raises:
        ValueError: as :func:`render_prompt` (not cached).
    """

    ENTRY_OVERHEAD_BYTES = 200  # dict slot, array and str headers (CPython, estimated)

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: Optional[str] = None,
                 max_bytes: int = 256 << 20):
        self.tokenizer, self.system_prompt, self.max_bytes = tokenizer, system_prompt, max_bytes
        self.cached_bytes = 0
        self._prompts: dict[str, array] = {}
        self._responses: dict[str, array] = {}

    def _keep(self, cache: dict, key: str, ids: list[int]) -> None:
        size = 4 * len(ids) + len(key) + self.ENTRY_OVERHEAD_BYTES
        if self.cached_bytes + size <= self.max_bytes:
            cache[key] = array("i", ids)
            self.cached_bytes += size

    def __call__(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """``encode_prompt(tokenizer, prompt, system_prompt)``."""
        if not isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt, self.system_prompt)
        ids = self._prompts.get(prompt)
        if ids is not None:
            return ids.tolist()
        out = encode_prompt(self.tokenizer, prompt, self.system_prompt)
        self._keep(self._prompts, prompt, out)
        return list(out)

    def sft_example(self, prompt: str | list[dict[str, Any]], response_text: str) -> tuple[list[int], list[int]]:
        """``encode_sft_example(tokenizer, prompt, response_text, system_prompt)``."""
        cached = self._responses.get(response_text)
        if cached is not None:
            response = cached.tolist()
        else:
            response = _sft_response_ids(self.tokenizer, response_text)
            self._keep(self._responses, response_text, response)
        return _sft_pair(self(prompt), response)


def decode_response(tokenizer: PreTrainedTokenizerBase, response_ids: list[int]) -> str:
    """Response text with special tokens (eos, pad, role markers) removed, as the verifiers expect."""
    return tokenizer.decode(list(response_ids), skip_special_tokens=True)
