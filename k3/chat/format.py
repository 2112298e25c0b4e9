"""A model's chat format: how a conversation (with tools, tool calls, tool results and reasoning) becomes
token ids, the same way for `k3 sft`, `k3 rl`, `k3 distill`, `k3 chat`, `k3 generate --chat` and `k3 serve`.

A format is a Jinja chat template in Hugging Face's dialect (the `chat_template.jinja` transformers and vLLM
read), kept in the tokenizer's directory, so it travels with every checkpoint. Built in (k3/chat/templates/):

    kimi_k2  the Kimi-K2 format (K3 checkpoints, and any tokenizer with Kimi's <|im_middle|> token)
    k3       the format of k3's SFT and RL runs (<|user|> ... markers, EOS ends an assistant turn)
    plain    "User: ..." / "Assistant: ..." lines, for models trained on plain text

Ids are built message by message: a conversation's ids are the concatenation of its messages' ids (a later
turn never changes how an earlier one was tokenized), with the assistant's own tokens marked trainable.
That needs a template whose text for a conversation starts with its text for every earlier prefix, which
`segments` checks.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from k3.chat.render import render_template

BUILTIN = ("kimi_k2", "k3", "plain")
KIMI_END = "<|im_end|>"


@functools.lru_cache(maxsize=None)
def builtin_template(name: str) -> str:
    if name not in BUILTIN:
        raise ValueError(f"unknown chat format {name!r}; built in: {', '.join(BUILTIN)}")
    return resources.files("k3.chat").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


@dataclass
class Segment:
    """Token ids of one piece of a conversation; ``trainable`` marks ids the model produced."""

    ids: list[int]
    trainable: bool


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked copies of OpenAI-style messages: tool-call arguments as objects (a JSON string is parsed), every
    call with an id (functions.NAME:INDEX when none was given)."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {index} must be a dict with 'role' and 'content', got "
                             f"{type(message).__name__}")
        message = dict(message)
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"message {index} ({message.get('role')}) needs a string 'content', got "
                             f"{type(content).__name__}")
        calls = []
        for number, call in enumerate(message.get("tool_calls") or []):
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as error:
                    raise ValueError(f"message {index}: tool call {number} has arguments that are not JSON "
                                     f"({error.msg})") from error
            function["arguments"] = arguments if arguments is not None else {}
            name = function.get("name") or ""
            calls.append({"id": call.get("id") or f"functions.{name}:{number}", "type": "function",
                          "function": function})
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def encode_text(tokenizer, text: str) -> list[int]:
    """tokenizer.encode, except that the EOS token's text always becomes the EOS id (tokenizers that read
    special tokens in text do so anyway; the others would spell it out)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    eos_text = _eos_text(tokenizer)
    if eos is None or not eos_text or eos_text not in text:
        return tokenizer.encode(text) if text else []
    ids: list[int] = []
    pieces = text.split(eos_text)
    for i, piece in enumerate(pieces):
        if piece:
            ids += tokenizer.encode(piece)
        if i < len(pieces) - 1:
            ids.append(eos)
    return ids


def _eos_text(tokenizer) -> str:
    text = getattr(tokenizer, "eos_token", None)
    if isinstance(text, str) and text:
        return text
    eos = getattr(tokenizer, "eos_token_id", None)
    return tokenizer.decode([eos]) if eos is not None else ""


class ChatFormat:
    """template: Jinja text; source: where it came from (shown by `k3 serve` and in errors)."""

    def __init__(self, template: str, source: str = "", bos_token: str = "", eos_token: str = "") -> None:
        self.template, self.source = template, source or "given"
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self.name = next((n for n in BUILTIN if builtin_template(n) == template), "custom")
        # What the format's text says about itself (a template written for another model is read the same way).
        if "<|tool_calls_section_begin|>" in template:
            self.tool_syntax: str | None = "kimi_k2"
        elif "<tool_call>" in template:
            self.tool_syntax = "k3"
        else:
            self.tool_syntax = None
        self.thinking = "<think>" in template
        if KIMI_END in template:
            self.end_of_turn: str | None = KIMI_END
        elif self.name == "plain":
            self.end_of_turn = "\n"
        else:
            self.end_of_turn = None  # the tokenizer's EOS ends a turn

    def __repr__(self) -> str:
        return f"ChatFormat(name={self.name!r}, source={self.source!r})"

    @functools.cached_property
    def argument_separators(self) -> tuple[str, str]:
        """(between items, between a key and its value) in the JSON this format writes a call's arguments with,
        read from a rendered call (json.dumps' ", " and ": " where it shows none): forced calls use the same."""
        if self.tool_syntax is None:
            return ", ", ": "
        call = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": 2}}}
        try:
            text = self.render([{"role": "user", "content": "."},
                                {"role": "assistant", "content": "", "tool_calls": [call]}],
                               add_generation_prompt=False)
        except ValueError:
            return ", ", ": "
        match = re.search(r'"a"(\s*:\s*)1(\s*,\s*)"b"', text)
        return (match.group(2), match.group(1)) if match else (", ", ": ")

    # --- text -----------------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """Messages (OpenAI-style dicts) -> the prompt text."""
        return render_template(self.template, messages=normalize_messages(messages), tools=tools or None,
                               add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                               eos_token=self.eos_token, **extra)

    # --- ids ------------------------------------------------------------------------------------------
    def segments(self, messages: list[dict[str, Any]], tokenizer, tools: list[dict] | None = None,
                 add_generation_prompt: bool = False, train_on: str = "assistant") -> list[Segment]:
        """Messages -> token segments, one or two per message: a non-assistant message's text, or an assistant
        message's prompt (not trainable) and its own text up to and including its end (trainable when
        train_on == "assistant"), then the generation prompt if asked."""
        if not messages:
            raise ValueError("a conversation needs at least one message")
        messages = normalize_messages(messages)
        eos_text = self.eos_token if self.eos_token else _eos_text(tokenizer)
        fmt = self if eos_text == self.eos_token else ChatFormat(self.template, self.source, self.bos_token,
                                                                 eos_text)
        done = ""
        out: list[Segment] = []

        def extend(text: str, what: str) -> str:
            if not text.startswith(done):
                raise ValueError(f"chat format {self.source}: the text of the conversation up to {what} does not "
                                 f"start with the text before it, so its ids cannot be built message by "
                                 f"message; use a template whose rendering of a conversation extends that of "
                                 f"each of its prefixes")
            return text[len(done):]

        for index, message in enumerate(messages):
            full = fmt.render(messages[:index + 1], tools, add_generation_prompt=False)
            if message.get("role") == "assistant":
                prompt = fmt.render(messages[:index], tools, add_generation_prompt=True)
                out.append(Segment(encode_text(tokenizer, extend(prompt, f"message {index}'s prompt")), False))
                done = prompt
                out.append(Segment(encode_text(tokenizer, extend(full, f"message {index}")),
                                   train_on == "assistant"))
            else:
                out.append(Segment(encode_text(tokenizer, extend(full, f"message {index}")), False))
            done = full
        if add_generation_prompt:
            prompt = fmt.render(messages, tools, add_generation_prompt=True)
            out.append(Segment(encode_text(tokenizer, extend(prompt, "the generation prompt")), False))
        return [s for s in out if s.ids]

    def render_ids(self, messages: list[dict[str, Any]], tokenizer, tools: list[dict] | None = None,
                   add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
        """(ids, trainable mask) of a whole conversation."""
        ids: list[int] = []
        mask: list[bool] = []
        for segment in self.segments(messages, tokenizer, tools, add_generation_prompt):
            ids += segment.ids
            mask += [segment.trainable] * len(segment.ids)
        return ids, mask

    def encode(self, messages: list[dict[str, Any]], tokenizer, tools: list[dict] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a conversation (what `k3 serve` and `k3 chat` feed the engine)."""
        return self.render_ids(messages, tokenizer, tools, add_generation_prompt)[0]

    def continuation_ids(self, messages: list[dict[str, Any]], tokenizer, add_generation_prompt: bool = True
                         ) -> list[int]:
        """Ids of `messages` (tool results, say) appended after an assistant turn, then the generation prompt:
        what an agent loop feeds after a turn without re-rendering the conversation."""
        stub = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        before = len(self.segments(stub, tokenizer))
        segments = self.segments(stub + list(messages), tokenizer, add_generation_prompt=add_generation_prompt)
        return [t for s in segments[before:] for t in s.ids]

    # --- stopping -------------------------------------------------------------------------------------
    def stops(self, tokenizer) -> tuple[list[int], list[str]]:
        """(stop token ids, stop strings) that end an assistant turn in this format, besides the tokenizer's
        EOS: the end marker's id where the tokenizer has it as one token, else its text."""
        if self.end_of_turn is None:
            return [], []
        ids = tokenizer.encode(self.end_of_turn)
        if len(ids) == 1 and len(self.end_of_turn) > 1:
            return ids, []
        return [], [self.end_of_turn]


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _has_kimi_tokens(tokenizer) -> bool:
    special = getattr(tokenizer, "special_tokens", None) or {}
    return "<|im_middle|>" in special and "<|im_end|>" in special


def read_template_files(directory: str | Path) -> tuple[str | None, dict]:
    """(template, tokenizer_config) of a tokenizer or model directory: tokenizer_config.json's
    `chat_template`, else chat_template.jinja, else chat_template.json."""
    from k3.data.hf_tokenizer import read_chat_template, read_json

    directory = Path(directory)
    config_file = directory / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    return read_chat_template(directory, config), config


def load_chat_format(tokenizer, directory: str | Path | None = None, default: str = "plain") -> ChatFormat:
    """The format of a model: the tokenizer's own template (read from its directory when it was loaded),
    else a template file in `directory`, else Kimi-K2's for a tokenizer with Kimi's special tokens, else the
    built-in `default` ("plain" for serving a model trained on text, "k3" for SFT / RL / distillation)."""
    bos = _token_text(getattr(tokenizer, "bos_token", None))
    eos = _token_text(getattr(tokenizer, "eos_token", None))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        return ChatFormat(template, "tokenizer", bos, eos)
    if directory is not None and Path(directory).is_dir():
        template, config = read_template_files(directory)
        if template:
            return ChatFormat(template, str(directory), _token_text(config.get("bos_token")) or bos,
                              _token_text(config.get("eos_token")) or eos)
    name = "kimi_k2" if _has_kimi_tokens(tokenizer) else default
    return ChatFormat(builtin_template(name), f"built-in {name}", bos, eos)


def attach_chat_format(tokenizer, fmt: ChatFormat) -> None:
    """Keep `fmt` with the tokenizer, so that tokenizer.save(directory) writes it (chat_template.jinja) and the
    run's later users (rl after sft, serve after rl) read the same format."""
    tokenizer.chat_template = fmt.template
