"""Chat-message prompts: validation and the system-prompt rule (kept free of heavy imports).

A prompt is either a non-empty string (one user turn) or a non-empty list of messages
``{"role": "system" | "user" | "assistant", "content": str}`` (the OpenAI / Hugging Face chat format
that ``apply_chat_template`` takes).
"""

from __future__ import annotations

from typing import Any, Optional

CHAT_ROLES = ("system", "user", "assistant")


def check_messages(messages: Any, where: str = "prompt") -> None:
    """Check a chat prompt: a non-empty list of ``{"role": one of CHAT_ROLES, "content": str}`` dicts
    (other keys are allowed and reach the chat template as they are).

    Raises:
        ValueError: the first offence, e.g. ``"<where>: message 2 has role 'tool'; expected one of ..."``.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty string or a non-empty list of chat messages, got {messages!r}")
    for i, m in enumerate(messages, start=1):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: message {i} must be an object with 'role' and 'content', got {m!r}")
        if m.get("role") not in CHAT_ROLES:
            raise ValueError(f"{where}: message {i} has role {m.get('role')!r}; expected one of {', '.join(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} ({m['role']}) needs a string 'content', got {m.get('content')!r}")


def to_messages(prompt: Any, system_prompt: Optional[str] = None) -> list[dict[str, Any]]:
    """The message list a prompt stands for, with ``system_prompt`` (``data.system_prompt``) prepended.

    A string prompt becomes ``[{"role": "user", "content": prompt}]``; a message list is checked with
    :func:`check_messages` and copied (each message a new dict; the caller's list is not changed).
    ``system_prompt`` None adds nothing; otherwise ``{"role": "system", "content": system_prompt}`` goes
    first, and a prompt that already holds a system message is refused rather than given two.

    Raises:
        ValueError: an empty or non-string, non-list prompt, an invalid message, an empty or non-string
            ``system_prompt``, or ``system_prompt`` set for a prompt with its own system message (names
            data.system_prompt and data.prompt_key).
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of chat messages, got ''")
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    else:
        check_messages(prompt)
        messages = [dict(m) for m in prompt]
    if system_prompt is None:
        return messages
    if not isinstance(system_prompt, str) or not system_prompt:
        raise ValueError(f"data.system_prompt must be a non-empty string or null, got {system_prompt!r}")
    own = [i for i, m in enumerate(messages, start=1) if m["role"] == "system"]
    if own:
        raise ValueError(
            f"the prompt already has a system message (message {own[0]}) and data.system_prompt would add a "
            "second; unset data.system_prompt or drop the system messages from the data (data.prompt_key)"
        )
    return [{"role": "system", "content": system_prompt}, *messages]
