"""Conversation -> prompt text, for `k3 serve` (/v1/chat/completions) and `k3 chat`.

The template comes from the tokenizer when it carries one (an HF-format directory's tokenizer_config.json
`chat_template`, chat_template.jinja or chat_template.json, read by k3.checkpoint.hf_tokenizer), else from
those files in the tokenizer directory given, else the built-in default below.

The default, for models trained on plain text (every `k3 train` run), writes one line per message:

    System: You are terse.
    User: hello
    Assistant: hi
    User: and now?
    Assistant:

(roles: system and developer -> "System", user -> "User", assistant -> "Assistant", tool -> "Tool"; the
generation prompt is a last "Assistant:" line). A reply ends at the first newline: in this format a new line
begins the next speaker's turn, so the default template brings the stop string "\\n" with it, which is also
what `k3 chat` has always done. Templates read from a tokenizer end replies at its EOS token instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
DEFAULT_STOP = ["\n"]


def render_default(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    lines = []
    for message in messages:
        role = message.get("role")
        if role not in ROLE_NAMES:
            raise ValueError(f"unknown chat role {role!r}; use one of {sorted(ROLE_NAMES)}")
        lines.append(f"{ROLE_NAMES[role]}: {message.get('content') or ''}")
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


@dataclass
class ChatTemplate:
    """template: Jinja text in Hugging Face's chat-template dialect, or None for the default above.
    source says where it came from (shown by GET /v1/models and in errors); stop are stop strings replies
    need in this format."""

    template: str | None = None
    source: str = "default"
    bos_token: str = ""
    eos_token: str = ""
    stop: list[str] = field(default_factory=lambda: list(DEFAULT_STOP))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """messages: [{"role": ..., "content": text}, ...] -> the prompt text."""
        if not messages:
            raise ValueError("a conversation needs at least one message")
        if self.template is None:
            return render_default(messages, add_generation_prompt)
        # The one Jinja renderer of the project (sandboxed, transformers' settings), kept with the tokenizers.
        from k3.checkpoint.hf_tokenizer import _render

        return _render(self.template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token)

    def encode(self, messages: list[dict[str, Any]], tokenizer, add_generation_prompt: bool = True) -> list[int]:
        return tokenizer.encode(self.render(messages, add_generation_prompt))


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value or ""


def load_chat_template(tokenizer, directory: str | os.PathLike | None = None) -> ChatTemplate:
    """The tokenizer's own template, else one in `directory` (a tokenizer or HF model directory), else the
    default."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return ChatTemplate(template, source="tokenizer", bos_token=getattr(tokenizer, "bos_token", None) or "",
                            eos_token=getattr(tokenizer, "eos_token", None) or "", stop=[])
    if directory is not None and Path(directory).is_dir():
        from k3.checkpoint.hf_tokenizer import _read_chat_template, _read_json

        directory = Path(directory)
        config_file = directory / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        template = _read_chat_template(directory, config)
        if template:
            return ChatTemplate(template, source=str(directory), bos_token=_token_text(config.get("bos_token")),
                                eos_token=_token_text(config.get("eos_token")), stop=[])
    return ChatTemplate()
