"""The chat format of k3's RL and SFT: how a conversation with tool calls becomes token ids, and how an
assistant turn's tool calls are read back. Rendering and parsing share the markers defined here.

A conversation is a list of messages {"role": "system" | "user" | "assistant" | "tool", "content": str}.
Rendered, each message is its role marker, its content and an end:

    <|system|>You solve tasks with tools ...\n
    <|user|>Compute 37*41+5.\n
    <|assistant|><tool_call>{"name": "python", "arguments": {"code": "print(37*41+5)"}}</tool_call><EOS>
    <|tool|>1522\n
    <|assistant|><tool_call>{"name": "submit", "arguments": {"answer": "1522"}}</tool_call><EOS>

An assistant turn ends with the tokenizer's EOS token (the id itself, appended, never text): the engine
stops a turn there. Everything else ends with a newline. Markers are plain text: a byte-level BPE
needs no special tokens for them, and a tokenizer that has them as special tokens encodes them as such.

A tool call is ``<tool_call>`` + one JSON object {"name": str, "arguments": {...}} + ``</tool_call>``;
an assistant turn may hold several, run in order. ``arguments`` may also be a JSON string holding the
object (some models write it so). What a turn holds besides its calls is free text.

Rendering goes through the model's chat format (k3.chat): the tokenizer's own chat template when it carries
one (a run saves it as tokenizer/chat_template.jinja), else the built-in "k3" format, which writes exactly the
text above.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from k3.chat import ChatFormat, Segment, load_chat_format

ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>"}
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
GENERATION_PROMPT = ROLE_MARKERS["assistant"]


@dataclass
class ToolCall:
    """One parsed call. ``error`` is set (and name/arguments may be empty) when the call could not be read."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of one tool call, as the model should write it."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CALL_CLOSE}"


def _check_message(index: int, message: Any) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise ValueError(f"message {index} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role not in ROLE_MARKERS:
        raise ValueError(f"message {index} has role {role!r}; roles are {sorted(ROLE_MARKERS)}")
    if not isinstance(content, str):
        raise ValueError(f"message {index} ({role}) needs a string 'content', got {type(content).__name__}")
    return role, content


def render_message_text(role: str, content: str) -> str:
    """The text of a message in the built-in k3 format, except the EOS that closes an assistant turn."""
    return ROLE_MARKERS[role] + content + ("" if role == "assistant" else "\n")


def chat_format_of(tokenizer) -> ChatFormat:
    """The tokenizer's chat format, or the built-in k3 one (the format this module's parser reads)."""
    return load_chat_format(tokenizer, default="k3")


def render_segments(messages: list[dict[str, Any]], tokenizer, add_generation_prompt: bool = False,
                    train_on: str = "assistant") -> list[Segment]:
    """Messages -> token segments. Assistant content and its closing EOS are trainable (when
    ``train_on == "assistant"``); markers, system, user and tool text are not.

    Each message is encoded on its own, so the ids of a conversation are the concatenation of its messages'
    ids: a later turn never changes how an earlier one was tokenized (an RL context stays exactly the tokens
    the policy saw and produced)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the chat format ends assistant turns with EOS, but this tokenizer has no eos_token")
    for index, message in enumerate(messages):
        _check_message(index, message)
    return chat_format_of(tokenizer).segments(messages, tokenizer, add_generation_prompt=add_generation_prompt,
                                              train_on=train_on)


def render_ids(messages: list[dict[str, Any]], tokenizer, add_generation_prompt: bool = False
               ) -> tuple[list[int], list[bool]]:
    """(ids, trainable mask) of a whole conversation; see render_segments."""
    ids: list[int] = []
    mask: list[bool] = []
    for segment in render_segments(messages, tokenizer, add_generation_prompt):
        ids.extend(segment.ids)
        mask.extend([segment.trainable] * len(segment.ids))
    return ids, mask


def tool_message_ids(content: str, tokenizer) -> list[int]:
    """Ids of a tool observation followed by the next assistant prompt (what is fed after a tool turn)."""
    return chat_format_of(tokenizer).continuation_ids([{"role": "tool", "content": content}], tokenizer)


_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def parse_tool_calls(text: str, max_calls: int = 8) -> list[ToolCall]:
    """Every tool call in an assistant turn's text, in order. Never raises: a call that cannot be read comes
    back with ``error`` saying why (bad JSON, no name, arguments not an object, an unclosed tag)."""
    calls: list[ToolCall] = []
    end = 0
    for match in _CALL.finditer(text):
        end = match.end()
        calls.append(_parse_one(match.group(1)))
    rest = text[end:]
    if CALL_OPEN in rest:
        raw = rest[rest.index(CALL_OPEN):]
        calls.append(ToolCall(error=f"a {CALL_OPEN} was opened but never closed with {CALL_CLOSE}", raw=raw))
    elif not calls and CALL_CLOSE in text:
        calls.append(ToolCall(error=f"found {CALL_CLOSE} without a {CALL_OPEN} before it", raw=text))
    if len(calls) > max_calls:
        calls = calls[:max_calls] + [ToolCall(error=f"at most {max_calls} tool calls per turn; the rest were "
                                                    f"not run", raw="")]
    return calls


def _parse_one(body: str) -> ToolCall:
    raw = body
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError as error:
        return ToolCall(error=f"the tool call is not valid JSON ({error.msg} at character {error.pos}); write "
                              f'{CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}', raw=raw)
    if not isinstance(value, dict):
        return ToolCall(error=f"the tool call must be a JSON object with 'name' and 'arguments', got "
                              f"{type(value).__name__}", raw=raw)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(error="the tool call has no 'name' (a string naming the tool)", raw=raw)
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return ToolCall(name=name, error=f"'arguments' is a string that is not JSON ({error.msg})", raw=raw)
    if not isinstance(arguments, dict):
        return ToolCall(name=name, error=f"'arguments' must be a JSON object, got {type(arguments).__name__}",
                        raw=raw)
    return ToolCall(name=name, arguments=arguments, raw=raw)
