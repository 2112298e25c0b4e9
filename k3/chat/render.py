"""Jinja chat templates rendered in a sandbox, with bounds: a template is data from a checkpoint, so it may
neither reach Python objects (jinja2's immutable sandbox) nor render without end: output is cut off at
MAX_RENDER_CHARS, loops over `range` are capped by the sandbox, and a render still running after
RENDER_DEADLINE_S (nested loops that write nothing: three of the sandbox's ranges are 1e15 iterations) is stopped
by an exception a watchdog thread raises inside it.

Why a watchdog and not a tracer: sys.settrace on the template's lines made rendering 2.7x slower (k3's format,
100 messages: 0.69 -> 1.86 ms), and a chat request renders a conversation once per message. The watchdog costs a
render two lock round trips; CPython delivers its exception at the render thread's next bytecode
(PyThreadState_SetAsyncExc), and a render that ends first withdraws it under the same lock."""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from typing import Any

MAX_RENDER_CHARS = 4_000_000  # about 1M tokens of text: a prompt longer than any context k3 serves
# k3's templates render a long agent conversation in milliseconds; seconds mean a template that loops.
RENDER_DEADLINE_S = 2.0


class _RenderTimeout(Exception):
    """Raised inside a render by the watchdog (instantiated there without arguments)."""


def _raise_in(thread_id: int, exception: type[BaseException] | None) -> None:
    """Make `exception` pending in the thread (None withdraws a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exception) if exception else None)


class _Watchdog:
    """One daemon thread for every render of the process: a render registers its deadline and thread; past the
    deadline the watchdog makes _RenderTimeout pending in that thread. Both sides hold one lock, so a render that
    finishes first unregisters (and withdraws what may have just been made pending) before returning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._renders: dict[int, list] = {}  # key -> [deadline, thread id, fired]
        self._next = 0
        self._thread: threading.Thread | None = None

    def start(self, seconds: float) -> int:
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._renders[key] = [time.monotonic() + seconds, threading.get_ident(), False]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="k3-template-watchdog", daemon=True)
                self._thread.start()
            self._changed.notify()
        return key

    def finish(self, key: int) -> None:
        """Unregister (again: a no-op). Under the lock, so after it no exception of this render is pending."""
        with self._lock:
            render = self._renders.pop(key, None)
            if render is not None and render[2]:
                _raise_in(render[1], None)  # withdrawn if not yet delivered (delivered: raised inside the render)

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                waiting = []
                for render in self._renders.values():
                    if not render[2] and render[0] <= now:
                        render[2] = True
                        _raise_in(render[1], _RenderTimeout)
                    elif not render[2]:
                        waiting.append(render[0])
                self._changed.wait(min(waiting) - now if waiting else None)

    def forget_threads(self) -> None:
        """In a forked child: the parent's watchdog thread is not there (the next render starts one)."""
        self.__init__()


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.forget_threads)


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

    compiled = _compile(template)
    pieces, total, timed_out = [], 0, False
    watch = _WATCHDOG.start(RENDER_DEADLINE_S)
    try:
        for piece in compiled.generate(**context):
            total += len(piece)
            if total > max_chars:
                raise ValueError(f"the chat template wrote more than {max_chars} characters; a template must "
                                 f"not loop without end")
            pieces.append(piece)
    except jinja2.TemplateError as error:
        raise ValueError(f"the chat template failed to render: {error}") from error
    except _RenderTimeout:
        timed_out = True
    finally:
        while True:  # the watchdog's exception may land on the way into finish(): then finish again
            try:
                _WATCHDOG.finish(watch)
                break
            except _RenderTimeout:
                timed_out = True
    if timed_out:
        raise ValueError(f"the chat template took more than {RENDER_DEADLINE_S:g} s to render; a template must not "
                         f"loop without end")
    return "".join(pieces)
