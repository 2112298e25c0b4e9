"""What /v1/chat/completions makes of a request before the engine sees it: messages (with tool calls, tool
results and reasoning) in the model's chat format, the tools it declares, the stops its turns end at, the
grammar that constrains the reply (response_format, tool_choice "required" or a named function), and how the
reply is read back (k3.chat.reply)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3.chat import ChatFormat
from k3.chat.reply import ReplyParser
from k3.infer.protocol import APIError, ChatCompletionRequest


@dataclass
class ChatPlan:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    stops: list[str]
    stop_token_ids: list[int]
    grammar: object | None  # k3.infer.structured.Grammar
    tool_syntax: str | None  # how replies are read for calls (None: never)
    tool_names: set[str] | None
    thinking: bool

    def parser(self) -> ReplyParser:
        # A grammar makes forced calls valid, so their arguments can stream as they come.
        return ReplyParser(self.tool_syntax, self.thinking, self.tool_names, stream_arguments=self.grammar is not None)


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template reads them (text content, tool calls as dicts)."""
    out = []
    for m in body.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def plan_chat(body: ChatCompletionRequest, fmt: ChatFormat, tokenizer, grammar_tokenizer) -> ChatPlan:
    """grammar_tokenizer(): the served model's k3.infer.structured.GrammarTokenizer (built on first use)."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    names = {t["function"]["name"] for t in tools or []}
    if tools and len(names) != len(tools):
        raise APIError("two tools have the same name; give every function its own name", param="tools")
    if tools and fmt.tool_syntax is None:
        raise APIError(f"this model's chat format ({fmt.source}) has no tool-call syntax, so it cannot be given "
                       f"tools; serve a model whose chat template declares tools (the kimi_k2 or k3 format)",
                       param="tools")
    if not isinstance(choice, str):
        if not tools or choice.function.name not in names:
            raise APIError(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                           f"request's tools ({sorted(names) or 'none given'})", param="tool_choice")
    elif choice == "required" and not tools:
        raise APIError("tool_choice \"required\" needs tools", param="tool_choice")

    stop_token_ids, stop_strings = fmt.stops(tokenizer)
    grammar = None
    response_format = body.response_format
    forced = [t for t in tools or [] if not isinstance(choice, str) and t["function"]["name"] == choice.function.name]
    if choice == "required":
        forced = tools or []
    try:
        if forced:
            from k3.infer.structured import tool_call_grammar

            grammar = tool_call_grammar(grammar_tokenizer(), fmt.tool_syntax, forced, body.parallel_tool_calls,
                                        end=_end_of_turn(fmt, tokenizer, stop_token_ids, stop_strings),
                                        separators=fmt.argument_separators)
        elif response_format is not None and response_format.type != "text":
            from k3.infer.structured import json_grammar

            schema = None
            if response_format.type == "json_schema":
                if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                    raise APIError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                   "{...}}}", param="response_format")
                schema = response_format.json_schema.schema_
            grammar = json_grammar(grammar_tokenizer(), schema)
    except (ValueError, RuntimeError) as error:
        raise APIError(f"invalid {'tool_choice' if forced else 'response_format'}: {error}",
                       param="tool_choice" if forced else "response_format") from error
    parse = fmt.tool_syntax if tools and choice != "none" else None
    return ChatPlan(chat_messages(body), tools, stop_strings, stop_token_ids, grammar, parse,
                    names if parse else None, fmt.thinking and grammar is None)


def _end_of_turn(fmt: ChatFormat, tokenizer, stop_token_ids: list[int], stop_strings: list[str]) -> int | str | None:
    """What ends an assistant turn in this format, as a forced reply must end it to be written as an unforced
    one is: the end marker's token, else its text, else EOS (formats whose turns end with EOS)."""
    if stop_token_ids:
        return stop_token_ids[0]
    if stop_strings:
        return stop_strings[0]
    return getattr(tokenizer, "eos_token_id", None) if fmt.end_of_turn is None else None
