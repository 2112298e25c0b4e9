"""Chat formats: one per model, stored with its tokenizer, read by every part of k3 that turns a conversation
into tokens or a model's reply back into text, tool calls and reasoning."""

from k3.chat.format import (BUILTIN, ChatFormat, Segment, attach_chat_format, builtin_template, encode_text,
                            load_chat_format, normalize_messages)

__all__ = ["BUILTIN", "ChatFormat", "Segment", "attach_chat_format", "builtin_template", "encode_text",
           "load_chat_format", "normalize_messages"]
