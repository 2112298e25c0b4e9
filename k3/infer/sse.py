"""Server-sent events as OpenAI streams them: one `data: <json>` event per chunk, then `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

SSE_DONE = "data: [DONE]\n\n"
# One encoder for every event (json.dumps with these options builds a new one per call).
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse_event(payload: dict[str, Any]) -> str:
    """One event. JSON never holds a raw newline, so one `data:` line is enough."""
    return f"data: {_encode(payload)}\n\n"


def sse_chunks(head: dict[str, Any]):
    """A function choice -> the event of a chunk `{**head, "choices": [choice]}`, with the head serialised once
    per stream instead of once per token (the same bytes as sse_event)."""
    prefix = "data: " + _encode(head)[:-1] + ',"choices":['

    def event(choice: dict[str, Any]) -> str:
        return f"{prefix}{_encode(choice)}]}}\n\n"
    return event


def parse_sse(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an event stream given line by line, up to `[DONE]` (for clients and tests)."""
    data: list[str] = []
    for line in lines:
        line = line.rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif not line and data:
            text, data = "\n".join(data), []
            if text == "[DONE]":
                return
            yield json.loads(text)
        # other fields (event:, id:, retry:) and comments (": ...") carry nothing OpenAI uses
    if data and "\n".join(data) != "[DONE]":
        yield json.loads("\n".join(data))
