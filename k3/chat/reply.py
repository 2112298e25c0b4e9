"""A model's reply -> OpenAI's message parts: reasoning_content, content and tool_calls, read as the reply
streams in (one parser serves streamed deltas and whole responses, so the two always agree).

Markers come from the chat format (k3.chat.format):
- reasoning (formats with a thinking region): a reply that opens with <think> holds reasoning up to </think>;
- tool calls, Kimi-K2 syntax: <|tool_calls_section_begin|> then calls
  <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}<|tool_call_end|>, then
  <|tool_calls_section_end|>;
- tool calls, k3 syntax: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number.
Text that could still become a marker is held back until it cannot. A call is sent once it is complete and
its arguments are a JSON object; one that is not (bad JSON, no name, a tool the request did not offer, a
section never closed) comes back as content, with a logged warning: a malformed call never fails a request.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("k3.chat")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
KIMI_SECTION_OPEN, KIMI_SECTION_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_OPEN, KIMI_CALL_ARGS, KIMI_CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", \
    "<|tool_call_end|>"
K3_CALL_OPEN, K3_CALL_CLOSE = "<tool_call>", "</tool_call>"
_KIMI_ID = re.compile(r"^\s*(?:functions\.)?([^\s:<]+):(\d+)\s*$")


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # the JSON text of an object, as OpenAI sends it
    index: int = 0  # the call's place in the reply
    streamed: bool = False  # sent in pieces (Delta.call_parts) as it came

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """What one push added: text to each part, and calls completed by it."""

    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    # With stream_arguments: pieces of calls as they stream, (call index, id or None, name or None, arguments
    # text); the id and name come once, first, then the arguments in fragments.
    call_parts: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls or self.call_parts)


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of text could be the start of one of the markers."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


class ReplyParser:
    """push(text) -> Delta for each piece of a reply, finish() -> the last Delta. tool_syntax: "kimi_k2", "k3"
    or None (no calls read); thinking: the reply may open with a reasoning region; tool_names: the functions
    the request offered (a call to another is malformed), None = any."""

    def __init__(self, tool_syntax: str | None = None, thinking: bool = False,
                 tool_names: set[str] | None = None, stream_arguments: bool = False) -> None:
        self.syntax, self.tool_names = tool_syntax, tool_names
        # Kimi-K2 calls only, and only where a grammar makes the arguments valid: send them as they come.
        self.stream_arguments = stream_arguments and tool_syntax == "kimi_k2"
        self.current: ParsedCall | None = None
        self.state = "start" if thinking else "content"
        self.buffer = ""
        self.calls: list[ParsedCall] = []
        self.reasoning = self.content = ""
        self.parts_sent = 0
        if tool_syntax == "kimi_k2":
            self.open_marker = KIMI_SECTION_OPEN
        elif tool_syntax == "k3":
            self.open_marker = K3_CALL_OPEN
        elif tool_syntax is None:
            self.open_marker = None
        else:
            raise ValueError(f"unknown tool-call syntax {tool_syntax!r}; known: kimi_k2, k3")

    # --- streaming --------------------------------------------------------------------------------
    def push(self, text: str) -> Delta:
        self.buffer += text
        delta = Delta()
        while self._step(delta, final=False):
            pass
        return self._record(delta)

    def finish(self) -> Delta:
        delta = Delta()
        while self._step(delta, final=True):
            pass
        if self.state == "args":  # a streamed call cut short (max_tokens): it ends where the reply did
            self._argument_fragment(self.buffer, delta)
            delta.calls.append(self.current)
            self.buffer, self.current, self.state = "", None, "tools"
        if self.buffer:  # whatever is left is text: an unclosed tool section is malformed
            if self.state in ("tools", "call"):
                opened = "" if self.state == "tools" else \
                    (KIMI_CALL_OPEN if self.syntax == "kimi_k2" else K3_CALL_OPEN)
                self._malformed(opened + self.buffer, "the tool call was never closed", delta)
            elif self.state == "reasoning":
                delta.reasoning += self.buffer
            else:
                delta.content += self.buffer
            self.buffer = ""
        return self._record(delta)

    def _record(self, delta: Delta) -> Delta:
        self.reasoning += delta.reasoning
        self.content += delta.content
        self.calls += delta.calls
        return delta

    def _emit_until(self, markers: tuple[str, ...], delta: Delta, part: str, final: bool) -> str | None:
        """Send the buffer's text before the first marker to `part`; return the marker found (consumed), or
        None after sending all that cannot start a marker."""
        positions = [(self.buffer.find(m), m) for m in markers if m and m in self.buffer]
        if positions:
            at, marker = min(positions)
            setattr(delta, part, getattr(delta, part) + self.buffer[:at])
            self.buffer = self.buffer[at + len(marker):]
            return marker
        keep = 0 if final else _held_back(self.buffer, tuple(m for m in markers if m))
        setattr(delta, part, getattr(delta, part) + self.buffer[:len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return None

    def _step(self, delta: Delta, final: bool) -> bool:
        """Advance by one marker; False when the buffer cannot move on yet."""
        if self.state == "start":
            if self.buffer.startswith(THINK_OPEN):
                self.buffer = self.buffer[len(THINK_OPEN):]
                self.state = "reasoning"
                return True
            if THINK_OPEN.startswith(self.buffer) and not final:
                return False  # still could be the opening marker
            self.state = "content"
            return True
        if self.state == "reasoning":
            if self._emit_until((THINK_CLOSE,), delta, "reasoning", final) is None:
                return False
            self.state = "content"
            return True
        if self.state == "content":
            if self._emit_until((self.open_marker,), delta, "content", final) is None:
                return False
            self.state = "tools" if self.syntax == "kimi_k2" else "call"
            return True
        if self.syntax == "kimi_k2":
            return self._kimi_step(delta)
        return self._k3_step(delta)

    # --- the two syntaxes -------------------------------------------------------------------------
    def _argument_fragment(self, text: str, delta: Delta) -> None:
        if text:
            self.current.arguments += text
            delta.call_parts.append((self.parts_sent - 1, None, None, text))

    def _kimi_streamed_step(self, delta: Delta) -> bool | None:
        """A call's header, then its arguments as they arrive; None where the whole-call path must decide."""
        if self.state == "call":
            if KIMI_CALL_ARGS not in self.buffer:
                return False if KIMI_CALL_CLOSE not in self.buffer else None
            call_id, rest = self.buffer.split(KIMI_CALL_ARGS, 1)
            match = _KIMI_ID.match(call_id)
            if match is None or (self.tool_names is not None and match.group(1) not in self.tool_names):
                return None
            self.current = ParsedCall(call_id.strip(), match.group(1), "", self.parts_sent, streamed=True)
            delta.call_parts.append((self.parts_sent, self.current.id, self.current.name, ""))
            self.parts_sent += 1
            self.buffer, self.state = rest, "args"
            return True
        end = self.buffer.find(KIMI_CALL_CLOSE)
        if end < 0:
            keep = _held_back(self.buffer, (KIMI_CALL_CLOSE,))
            self._argument_fragment(self.buffer[:len(self.buffer) - keep], delta)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        self._argument_fragment(self.buffer[:end], delta)
        delta.calls.append(self.current)
        self.buffer, self.current, self.state = self.buffer[end + len(KIMI_CALL_CLOSE):], None, "tools"
        return True

    def _kimi_step(self, delta: Delta) -> bool:
        if self.stream_arguments and self.state in ("call", "args"):
            moved = self._kimi_streamed_step(delta)
            if moved is not None:
                return moved
        stripped = self.buffer.lstrip()
        if self.state == "tools":
            if stripped.startswith(KIMI_SECTION_CLOSE):
                self.buffer = stripped[len(KIMI_SECTION_CLOSE):]
                self.state = "content"
                return True
            if stripped.startswith(KIMI_CALL_OPEN):
                self.buffer = stripped[len(KIMI_CALL_OPEN):]
                self.state = "call"
                return True
            if stripped and not (KIMI_SECTION_CLOSE.startswith(stripped) or KIMI_CALL_OPEN.startswith(stripped)):
                # Neither a call nor the section's end: the rest of the reply is not a call.
                self._malformed(KIMI_SECTION_OPEN + self.buffer, "expected <|tool_call_begin|> or "
                                                               "<|tool_calls_section_end|>", delta)
                self.buffer = ""
                self.state = "content"
            return False
        end = self.buffer.find(KIMI_CALL_CLOSE)
        if end < 0:
            return False
        body, self.buffer = self.buffer[:end], self.buffer[end + len(KIMI_CALL_CLOSE):]
        self.state = "tools"
        raw = KIMI_CALL_OPEN + body + KIMI_CALL_CLOSE
        if KIMI_CALL_ARGS not in body:
            self._malformed(raw, "no <|tool_call_argument_begin|>", delta)
            return True
        call_id, arguments = body.split(KIMI_CALL_ARGS, 1)
        match = _KIMI_ID.match(call_id)
        if match is None:
            self._malformed(raw, f"the call id {call_id.strip()[:40]!r} is not functions.NAME:INDEX", delta)
            return True
        self._accept(call_id.strip(), match.group(1), arguments, raw, delta)
        return True

    def _k3_step(self, delta: Delta) -> bool:
        end = self.buffer.find(K3_CALL_CLOSE)
        if end < 0:
            return False
        body, self.buffer = self.buffer[:end], self.buffer[end + len(K3_CALL_CLOSE):]
        self.state = "content"
        raw = K3_CALL_OPEN + body + K3_CALL_CLOSE
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            self._malformed(raw, f"not JSON ({error.msg})", delta)
            return True
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            self._malformed(raw, "not an object with a 'name'", delta)
            return True
        arguments = value.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self._accept(f"functions.{value['name']}:{len(self.calls) + len(delta.calls)}", value["name"], text, raw,
                     delta)
        return True

    def _accept(self, call_id: str, name: str, arguments: str, raw: str, delta: Delta) -> None:
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            self._malformed(raw, f"arguments are not JSON ({error.msg})", delta)
            return
        if not isinstance(parsed, dict):
            self._malformed(raw, "arguments are not a JSON object", delta)
            return
        if self.tool_names is not None and name not in self.tool_names:
            self._malformed(raw, f"no tool named {name!r} was offered", delta)
            return
        delta.calls.append(ParsedCall(call_id, name, arguments.strip() or "{}", self.parts_sent))
        self.parts_sent += 1

    def _malformed(self, raw: str, why: str, delta: Delta) -> None:
        log.warning("a tool call in the reply could not be read (%s); it is returned as content: %.200r", why, raw)
        delta.content += raw


def parse_reply(text: str, tool_syntax: str | None = None, thinking: bool = False,
                tool_names: set[str] | None = None) -> ReplyParser:
    """A whole reply, parsed: the parser's .reasoning, .content and .calls."""
    parser = ReplyParser(tool_syntax, thinking, tool_names)
    parser.push(text)
    parser.finish()
    return parser
