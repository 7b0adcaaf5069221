"""OpenAI-compatible /v1/completions and /v1/chat/completions of the CPU reference server.

Requests and answers follow SGLang 0.5.9's openai_api protocol module
(sglang/srt/entrypoints/openai/protocol.py: CompletionRequest / CompletionResponse,
ChatCompletionRequest / ChatCompletionResponse, UsageInfo, ErrorResponse) with OpenAI's field names;
each request becomes one engine /generate body (moerl.rollout.engine), so sampling, stop handling
and weight versions are the native API's.

Mapping (OpenAI field -> /generate): prompt (str | [str] | [int] | [[int]]) -> text / input_ids;
chat ``messages`` -> the tokenizer's chat template (``apply_chat_template(messages,
add_generation_prompt=not continue_final_message, tools=tools, **chat_template_kwargs)``) ->
input_ids; max_tokens (completions, default 16) / max_completion_tokens or max_tokens (chat, default:
the engine's) -> max_new_tokens; temperature (default 1.0), top_p, top_k, min_p, seed ->
sampling_seed, stop, stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, n,
frequency_penalty / presence_penalty / repetition_penalty (sent only when not the default) ->
sampling_params; logprobs -> return_logprob (+ top_logprobs_num for completions' logprobs=k > 0 and
chat's top_logprobs); rid -> rid.

Answers: ``{"id", "object": "text_completion" | "chat.completion", "created", "model", "choices":
[{"index", "text" | "message": {"role": "assistant", "content", "reasoning_content": null,
"tool_calls": null}, "logprobs", "finish_reason", "matched_stop"}], "usage": {"prompt_tokens",
"completion_tokens", "total_tokens", "prompt_tokens_details": null, "reasoning_tokens": 0},
"metadata": {"weight_version"}}``; finish_reason is the native finish_reason type ("stop", "length",
"abort") and matched_stop its ``matched``; usage counts each prompt once and every choice's tokens
(SGLang UsageProcessor: every n-th answer). Choices come in the engine's (SGLang's TokenizerManager)
order, prompt-major: choice i answers prompt i // n.

Refused with HTTP 400 and SGLang's ErrorResponse ``{"object": "error", "message", "type":
"BadRequestError", "param": <field>, "code": 400}``: stream=true, echo=true, suffix, best_of other
than n, logit_bias, response_format / regex / ebnf / json_schema (no constrained decoding here),
tool_choice "required" or a named function, non-text message parts, a tokenizer without a chat
template, and any field of the wrong type.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, Optional

from fastapi import Request  # module level: endpoint annotations resolve from globals

__all__ = ["OpenAIRequestError", "chat_to_generate", "completion_to_generate", "install_openai_routes"]


class OpenAIRequestError(ValueError):
    """A request the endpoint refuses; ``param`` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def _error_body(msg: str, param: Optional[str], code: int = 400) -> dict:
    return {"object": "error", "message": msg, "type": "BadRequestError" if code == 400 else "InternalServerError",
            "param": param, "code": code}


def _check_type(body: dict, key: str, types, what: str) -> None:
    v = body.get(key)
    if v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in _as_tuple(types))):
        raise OpenAIRequestError(f"{key} must be {what}, got {v!r}", key)


def _as_tuple(t) -> tuple:
    return t if isinstance(t, tuple) else (t,)


_UNSUPPORTED = {"logit_bias": "logit_bias is not supported by the reference server",
                "response_format": "response_format (constrained decoding) is not supported by the reference server",
                "regex": "regex (constrained decoding) is not supported by the reference server",
                "ebnf": "ebnf (constrained decoding) is not supported by the reference server",
                "json_schema": "json_schema (constrained decoding) is not supported by the reference server",
                "suffix": "suffix is not supported by the reference server",
                "lora_path": "LoRA adapters are not supported by the reference server",
                "custom_logit_processor": "custom_logit_processor is not supported by the reference server"}


def _sampling(body: dict, max_new: Optional[int]) -> dict:
    """Common OpenAI sampling fields -> SGLang sampling_params (validated; errors name the field)."""
    for key, msg in _UNSUPPORTED.items():
        if body.get(key) is not None:
            raise OpenAIRequestError(msg, key)
    if body.get("stream"):
        raise OpenAIRequestError("stream=true is not supported by the reference server's OpenAI endpoints "
                                 "(use the native /generate with stream, or stream=false)", "stream")
    num = (int, float)
    for key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        _check_type(body, key, num, "a number")
    for key in ("top_k", "seed", "n", "min_tokens"):
        _check_type(body, key, int, "an integer")
    for key in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
        _check_type(body, key, bool, "a boolean")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise OpenAIRequestError(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise OpenAIRequestError(f"stop_token_ids must be a list of integers, got {ids!r}", "stop_token_ids")
    n = body.get("n", 1)
    if n is not None and n < 1:
        raise OpenAIRequestError(f"n must be >= 1, got {n}", "n")
    sp: dict[str, Any] = {"temperature": 1.0 if body.get("temperature") is None else body["temperature"]}
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    for src, dst in (("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"), ("seed", "sampling_seed"),
                     ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
                     ("skip_special_tokens", "skip_special_tokens"), ("no_stop_trim", "no_stop_trim")):
        if body.get(src) is not None:
            sp[dst] = body[src]
    if stop:
        sp["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if n and n != 1:
        sp["n"] = n
    for key, default in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                         ("min_tokens", 0)):
        if body.get(key) is not None and body[key] != default:
            sp[key] = body[key]
    return sp


def _common(body: dict, gen: dict) -> dict:
    if body.get("rid") is not None:
        if not isinstance(body["rid"], str):
            raise OpenAIRequestError("rid must be a string", "rid")
        gen["rid"] = body["rid"]
    if body.get("return_routed_experts"):
        gen["return_routed_experts"] = True
    return gen


def completion_to_generate(body: Any) -> dict:
    """Map a CompletionRequest body (dict) to a /generate body.

    Raises:
        OpenAIRequestError: a missing / mistyped / unsupported field (``param`` names it).
    """
    if not isinstance(body, dict):
        raise OpenAIRequestError("the body must be a JSON object (CompletionRequest)")
    if body.get("echo"):
        raise OpenAIRequestError("echo=true is not supported by the reference server", "echo")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise OpenAIRequestError("best_of other than n is not supported by the reference server", "best_of")
    _check_type(body, "max_tokens", int, "an integer")
    _check_type(body, "logprobs", int, "an integer")
    max_tokens = 16 if body.get("max_tokens") is None else body["max_tokens"]
    if max_tokens < 1:  # SGLang CompletionRequest.validate_max_tokens_positive
        raise OpenAIRequestError(f"max_tokens must be positive, got {max_tokens}", "max_tokens")
    prompt = body.get("prompt")
    gen: dict[str, Any] = {}
    is_ints = lambda x: isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)  # noqa: E731
    if isinstance(prompt, str):
        gen["text"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        gen["text"] = prompt if len(prompt) > 1 else prompt[0]
    elif is_ints(prompt) and prompt:
        gen["input_ids"] = prompt
    elif isinstance(prompt, list) and prompt and all(is_ints(p) and p for p in prompt):
        gen["input_ids"] = prompt if len(prompt) > 1 else prompt[0]
    else:
        raise OpenAIRequestError("prompt must be a non-empty string, list of strings, list of token ids or "
                                 "list of token-id lists", "prompt")
    gen["sampling_params"] = _sampling(body, max_tokens)
    lp = body.get("logprobs")
    if lp is not None:
        if lp < 0:
            raise OpenAIRequestError(f"logprobs must be >= 0, got {lp}", "logprobs")
        gen["return_logprob"] = True
        gen["return_text_in_logprobs"] = True
        if lp > 0:
            gen["top_logprobs_num"] = lp
    return _common(body, gen)


def _message_text(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise OpenAIRequestError(f"messages[{i}] must be an object with a role", "messages")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIRequestError(f"messages[{i}].content[{j}]: only text parts are supported by the "
                                         f"reference server", "messages")
            parts.append(part["text"])
        m = {**m, "content": "".join(parts)}
    elif content is not None and not isinstance(content, str):
        raise OpenAIRequestError(f"messages[{i}].content must be a string, a list of text parts or null", "messages")
    return m


#: sampling fields a chat request takes from the model's generation_config.json when it leaves them unset
#: (SGLang ModelConfig.get_default_sampling_params with --sampling-defaults model, its default), and the
#: OpenAI defaults otherwise (ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS).
CHAT_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def model_sampling_defaults(model_path: str) -> dict:
    """The non-null ``temperature, top_p, top_k, min_p, repetition_penalty`` of ``model_path``'s
    generation_config.json ({} when there is none), as SGLang's get_default_sampling_params reads them."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    return {k: cfg[k] for k in CHAT_SAMPLING_DEFAULTS if cfg.get(k) is not None}


def chat_to_generate(body: Any, tokenizer, model_defaults: Optional[dict] = None) -> dict:
    """Map a ChatCompletionRequest body (dict) to a /generate body, applying the chat template.

    Raises:
        OpenAIRequestError: as :func:`completion_to_generate`; also a tokenizer without a chat
            template (param "messages").
    """
    if not isinstance(body, dict):
        raise OpenAIRequestError("the body must be a JSON object (ChatCompletionRequest)")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise OpenAIRequestError("messages must be a non-empty list", "messages")
    msgs = [_message_text(m, i) for i, m in enumerate(msgs)]
    tc = body.get("tool_choice")
    if tc not in (None, "auto", "none"):
        raise OpenAIRequestError("tool_choice 'required' or a named function is not supported by the reference "
                                 "server", "tool_choice")
    for key in ("max_tokens", "max_completion_tokens", "top_logprobs"):
        _check_type(body, key, int, "an integer")
    _check_type(body, "logprobs", bool, "a boolean")
    _check_type(body, "continue_final_message", bool, "a boolean")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise OpenAIRequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if getattr(tokenizer, "chat_template", None) is None:
        raise OpenAIRequestError("the served tokenizer has no chat template; use /v1/completions", "messages")
    cont = bool(body.get("continue_final_message"))
    try:
        ids = tokenizer.apply_chat_template(msgs, tools=body.get("tools"), add_generation_prompt=not cont,
                                            continue_final_message=cont, tokenize=True, **kwargs)
    except Exception as e:  # template errors (a role the template refuses, ...)
        raise OpenAIRequestError(f"the chat template failed on these messages: {e}", "messages") from e
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    ids = [int(i) for i in ids]
    max_new = body.get("max_completion_tokens")
    if max_new is None:
        max_new = body.get("max_tokens")
    if max_new is not None and max_new < 0:
        raise OpenAIRequestError(f"max_completion_tokens must be >= 0, got {max_new}", "max_completion_tokens")
    # user value > the model's generation_config > OpenAI's default (SGLang ChatCompletionRequest.to_sampling_params)
    unset = {k: v for k, v in {**CHAT_SAMPLING_DEFAULTS, **(model_defaults or {})}.items() if body.get(k) is None}
    gen: dict[str, Any] = {"input_ids": ids, "sampling_params": _sampling({**body, **unset}, max_new)}
    if body.get("logprobs"):
        gen["return_logprob"] = True
        gen["return_text_in_logprobs"] = True
        if body.get("top_logprobs"):
            gen["top_logprobs_num"] = body["top_logprobs"]
    elif body.get("top_logprobs"):
        raise OpenAIRequestError("top_logprobs needs logprobs=true", "top_logprobs")
    return _common(body, gen)


def _usage(outs: list[dict], n: int) -> dict:
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::max(1, n)])  # prompt-major: one per prompt
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None, "reasoning_tokens": 0}


def _finish(o: dict) -> tuple[Optional[str], Any]:
    fr = o["meta_info"].get("finish_reason")
    return (fr["type"] if fr else None), (fr.get("matched") if fr else None)


def _top(entry) -> dict:
    return {} if not entry else {str(t[2]): float(t[0]) for t in entry}


def _completion_logprobs(o: dict) -> dict:
    toks = o["meta_info"].get("output_token_logprobs") or []
    tops = o["meta_info"].get("output_top_logprobs")
    offsets, at = [], 0
    for e in toks:
        offsets.append(at)
        at += len(e[2] or "")
    return {"text_offset": offsets, "token_logprobs": [float(e[0]) for e in toks],
            "tokens": [e[2] for e in toks],
            "top_logprobs": [_top(t) for t in tops] if tops is not None else []}


def _chat_logprobs(o: dict) -> dict:
    toks = o["meta_info"].get("output_token_logprobs") or []
    tops = o["meta_info"].get("output_top_logprobs") or [None] * len(toks)
    content = []
    for e, top in zip(toks, tops):
        tok = e[2] or ""
        content.append({"token": tok, "bytes": list(tok.encode("utf-8")), "logprob": float(e[0]),
                        "top_logprobs": [{"token": t[2] or "", "bytes": list((t[2] or "").encode("utf-8")),
                                          "logprob": float(t[0])} for t in (top or [])]})
    return {"content": content}


def install_openai_routes(app, engine) -> None:
    """Add POST /v1/completions and /v1/chat/completions (module docstring) to a FastAPI ``app``
    serving ``engine`` (a moerl.rollout.engine.ReferenceEngine: submit / response / tokenizer /
    model_path)."""
    from fastapi.responses import JSONResponse

    defaults = model_sampling_defaults(engine.model_path)  # read once at start-up, as SGLang does

    async def run(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError:
            body = None
        try:
            gen = (chat_to_generate(body, engine.tokenizer, defaults) if chat else completion_to_generate(body))
            req = engine.submit(gen)
        except OpenAIRequestError as e:
            return JSONResponse(_error_body(str(e), e.param), status_code=400)
        except ValueError as e:  # the engine refused a field (its message names it)
            return JSONResponse(_error_body(str(e), None), status_code=400)
        except RuntimeError as e:
            return JSONResponse(_error_body(str(e), None, 503), status_code=503)
        try:
            await asyncio.wrap_future(req.future)
        except RuntimeError as e:
            return JSONResponse(_error_body(str(e), None, 500), status_code=500)
        outs = engine.response(req)
        outs = outs if isinstance(outs, list) else [outs]
        n = int(gen["sampling_params"].get("n", 1))
        choices = []
        for i, o in enumerate(outs):
            reason, matched = _finish(o)
            choice: dict[str, Any] = {"index": i}
            if chat:
                choice["message"] = {"role": "assistant", "content": o["text"], "reasoning_content": None,
                                     "tool_calls": None}
                choice["logprobs"] = _chat_logprobs(o) if gen.get("return_logprob") else None
            else:
                choice["text"] = o["text"]
                choice["logprobs"] = _completion_logprobs(o) if gen.get("return_logprob") else None
            choice["finish_reason"] = reason
            choice["matched_stop"] = matched
            choices.append(choice)
        model = body.get("model") if isinstance(body.get("model"), str) else engine.model_path
        return JSONResponse({"id": outs[0]["meta_info"]["id"], "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": model, "choices": choices,
                             "usage": _usage(outs, n),
                             "metadata": {"weight_version": outs[0]["meta_info"].get("weight_version")}})

    @app.post("/v1/completions")
    async def openai_v1_completions(request: Request):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def openai_v1_chat_completions(request: Request):
        return await run(request, chat=True)
