"""Jinja chat templates rendered in a sandbox, with bounds: a template is data from a checkpoint, so it may
neither reach Python objects (jinja2's immutable sandbox) nor render without end (output is cut off at
MAX_RENDER_CHARS and the render fails, loops over `range` are capped by the sandbox)."""

from __future__ import annotations

import json
from typing import Any

MAX_RENDER_CHARS = 4_000_000  # about 1M tokens of text: a prompt longer than any context k3 serves


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                      separators=tuple(separators) if separators is not None else None)


_compiled: dict[str, Any] = {}


def _compile(template: str):
    compiled = _compiled.get(template)
    if compiled is None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The settings Hugging Face chat templates are written for (transformers renders them so).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"], undefined=jinja2.Undefined)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        try:
            compiled = env.from_string(template)
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template does not parse: {error}") from error
        if len(_compiled) > 32:
            _compiled.clear()
        _compiled[template] = compiled
    return compiled


def render_template(template: str, max_chars: int = MAX_RENDER_CHARS, **context: Any) -> str:
    """The template's text for `context` (messages, tools, add_generation_prompt, bos_token, ...).
    Raises ValueError when the template fails or writes more than max_chars characters."""
    import jinja2

    pieces, total = [], 0
    try:
        for piece in _compile(template).generate(**context):
            total += len(piece)
            if total > max_chars:
                raise ValueError(f"the chat template wrote more than {max_chars} characters; a template must "
                                 f"not loop without end")
            pieces.append(piece)
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template failed to render: {error}") from error
    return "".join(pieces)
