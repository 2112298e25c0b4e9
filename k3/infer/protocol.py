"""The OpenAI-compatible request and response shapes of `k3 serve`, and the checks that turn bad input into
HTTP 400 bodies saying what was wrong and what is allowed.

Requests are validated in two passes. `parse_request` checks the JSON body alone (types, ranges, required
fields) with pydantic in strict mode, so `"max_tokens": "10"` or `"n": true` are refused rather than coerced.
The server then checks what needs the tokenizer and the engine's limits (`check_prompt`, `resolve_max_tokens`).
Every refusal is an `APIError`, whose `body()` is OpenAI's error shape:
    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}
Fields OpenAI defines but k3 does not implement (UNSUPPORTED_FIELDS where a request kind lacks them, suffix,
best_of > n, logit_bias, streamed echo) are refused by name instead of silently ignored; fields nobody defines are
ignored, as OpenAI's own server does. Text must be valid Unicode: a lone UTF-16 surrogate ("\\ud800" in the JSON)
is refused.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from k3.infer.tool_protocol import MAX_TOOLS, TOOLS_ALLOWED, ResponseFormat, Tool, ToolCallInMessage, ToolChoice

# What each field accepts, in words; appended to every error about that field.
ALLOWED = {
    "model": "the name listed by GET /v1/models",
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "messages": "a non-empty list of {\"role\": \"system\"|\"user\"|\"assistant\"|\"developer\"|\"tool\", "
                "\"content\": string or list of {\"type\": \"text\", \"text\": string} and {\"type\": "
                "\"image_url\", \"image_url\": {\"url\": \"data:image/...;base64,...\"}}}",
    "max_tokens": "an integer >= 1, at most the context length minus the prompt's tokens",
    "max_completion_tokens": "an integer >= 1, at most the context length minus the prompt's tokens",
    "temperature": "a number >= 0 (0 = greedy; below 1e-5 also greedy), not Infinity or NaN",
    "top_p": "a number in (0, 1] (1 = off)",
    "top_k": "an integer >= 0 (0 or -1 = off; values past the vocabulary size mean all of it)",
    "min_p": "a number in [0, 1] (0 = off)",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "repetition_penalty": "a number in [0.01, 100] (1 = off)",
    "n": "an integer in [1, 64]",
    "logprobs": "an integer in [0, 20] for /v1/completions; true or false for /v1/chat/completions",
    "top_logprobs": "an integer in [0, 20], with logprobs: true",
    "stop": "a string or a list of at most 16 non-empty strings",
    "stop_token_ids": "a list of token ids",
    "seed": "an integer in [-2**63, 2**64)",
    "stream": "true or false",
    "stream_options": "{\"include_usage\": true|false}",
    "return_token_ids": "true or false",
    "echo": "true or false (with max_tokens 0 and logprobs: the prompt's own logprobs)",
    **TOOLS_ALLOWED,
}
# OpenAI request fields refused by name (400) when present, not null, and not a field of the request kind (chat
# completions implement tools, tool_choice and response_format; the legacy functions API nowhere).
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call", "response_format")
MAX_N = 64
SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes (a 64-bit value, either sign)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# A request body's arrays and objects nest at most this deep (the body itself is level 1); a JSON schema of 29
# nested objects fits, and everything downstream that recurses stays far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# What a response says for a token the sampler had ruled out (a grammar's mask: log probability -inf), as vLLM's
# OpenAI server does: JSON has no -inf, and a client reading floats gets one.
LOGPROB_FLOOR = -9999.0


class APIError(Exception):
    """A refusal with its HTTP status and OpenAI-style error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: str | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


# Where an image part sat in a message's text; replaced by the image's media tokens after templating.
IMAGE_MARKER = "\x00k3-image\x00"


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[Union[TextPart, ImagePart]], None] = None
    name: str | None = None
    tool_calls: list[ToolCallInMessage] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning, for formats with a thinking region

    def text(self) -> str:
        """The message's text, with IMAGE_MARKER where each image part was."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else IMAGE_MARKER for part in self.content)

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class _SamplingRequest(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # A k3 extension (vLLM spells it the same way): the prompt's and each choice's token ids in the response.
    return_token_ids: bool = False
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise APIError(f"invalid 'stop': got {len(stops)} strings{' (one is empty)' if '' in stops else ''}; "
                           f"allowed: {ALLOWED['stop']}", param="stop")
        return stops

    def _check_common(self) -> None:
        for stop in self.stop_strings():
            check_text(stop, "stop")
        if self.logit_bias:
            raise APIError("'logit_bias' is not supported by this server; leave it out", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("'stream_options' is only allowed with \"stream\": true", param="stream_options")

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (score the prompt, generate nothing)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self._check_common()
        if self.max_tokens == 0 and not self.echo:
            raise APIError("invalid 'max_tokens': 0 is allowed only with \"echo\": true (the prompt scored, "
                           f"nothing generated); allowed: {ALLOWED['max_tokens']}", param="max_tokens")
        if self.echo and self.stream:
            raise APIError("'echo' is supported without streaming only; set \"stream\": false", param="echo")
        if self.suffix:
            raise APIError("'suffix' (insertion) is not supported by this server; leave it out", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"'best_of' other than n is not supported (got best_of={self.best_of}, n={self.n}); "
                           f"leave it out", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(f"invalid 'prompt': the list is empty; allowed: {ALLOWED['prompt']}", param="prompt")
        for prompt in self.prompts():
            if isinstance(prompt, str):
                check_text(prompt, "prompt")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a token id list."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    def check(self) -> None:
        self._check_common()
        if not self.messages:
            raise APIError(f"invalid 'messages': the list is empty; allowed: {ALLOWED['messages']}",
                           param="messages")
        for i, message in enumerate(self.messages):
            check_text(message.text(), f"messages.{i}.content")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            raise APIError(f"'max_tokens' ({self.max_tokens}) and 'max_completion_tokens' "
                           f"({self.max_completion_tokens}) disagree; give one of them", param="max_tokens")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def check_text(text: str, param: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate cannot be encoded, so no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise APIError(f"invalid '{param}': it holds a lone UTF-16 surrogate ({text[error.start]!r} at character "
                       f"{error.start}), which is not a Unicode character; send valid UTF-8 text", param=param,
                       code="invalid_value") from None


def _describe(error: dict[str, Any]) -> tuple[str, str]:
    """One pydantic error -> (param path, message)."""
    loc = [str(part) for part in error["loc"]]
    # Errors inside a Union carry the tried member's type in the path ("prompt", "list[int]", 1): drop those.
    path = [p for p in loc if not (("[" in p and "]" in p) or p in ("str", "int", "float", "bool", "TextPart"))]
    param = ".".join(path) if path else (loc[0] if loc else "body")
    top = path[0] if path else param
    if error["type"] == "missing":
        message = f"'{param}' is required"
    elif error["type"] == "literal_error" and param.endswith("role"):
        message = f"invalid '{param}': got {error.get('input')!r}"
    else:
        got = json.dumps(error.get("input"), default=str)
        got = got if len(got) <= 80 else got[:77] + "..."
        message = f"invalid '{param}': {error['msg'][0].lower()}{error['msg'][1:]}, got {got}"
    if top in ALLOWED:
        message += f"; allowed: {ALLOWED[top]}"
    return param, message


def reported_logprob(logprob: float) -> float:
    """A log probability as a response carries it: -inf (and NaN) as LOGPROB_FLOOR."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _nesting_error() -> APIError:
    return APIError(f"the request body nests JSON arrays and objects more than {MAX_JSON_DEPTH} levels deep; at most "
                    f"{MAX_JSON_DEPTH} are accepted", code="invalid_json")


def json_depth(data: Any, limit: int) -> int:
    """How deep `data` (parsed JSON) nests its arrays and objects (a scalar 0, `{}` 1), counted without
    recursion and only until it passes `limit` (then limit + 1)."""
    deepest = 0
    stack = [(data, 1)] if isinstance(data, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            break
        children = node.values() if isinstance(node, dict) else node
        if {dict, list}.isdisjoint(map(type, children)):  # a flat array (a prompt's ids) checked at C speed
            continue
        stack.extend((child, depth + 1) for child in children if type(child) in (dict, list))
    return deepest


def parse_request(body: bytes, kind: type[_SamplingRequest]) -> _SamplingRequest:
    """Raw request body -> a checked request, or APIError(400) saying what is wrong."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(f"the request body is not valid JSON ({error}); send a JSON object with "
                       f"Content-Type: application/json", code="invalid_json") from error
    except RecursionError as error:  # past Python's recursion limit
        raise _nesting_error() from error
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    # Whatever reads the request later may recurse (validation, the chat template, a grammar compiler, the error's
    # own echo of the input): a bound here keeps every such step far from the recursion limit.
    if json_depth(data, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise _nesting_error()
    for name in UNSUPPORTED_FIELDS:
        if data.get(name) is not None and name not in kind.model_fields:
            raise APIError(f"'{name}' is not supported by this endpoint; leave it out", param=name,
                           code="unsupported_field")
    try:
        request = kind.model_validate(data)
    except ValidationError as error:
        errors = error.errors()
        param, message = _describe(errors[0])
        # A Union reports one error per member it tried; say the first, and how many fields are bad in all.
        fields = {_describe(e)[0] for e in errors}
        if len(fields) > 1:
            message += f" (and {len(fields) - 1} more invalid field{'s' if len(fields) > 2 else ''})"
        raise APIError(message, param=param, code="invalid_value") from error
    request.check()
    return request


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(f"unknown model {requested!r}; this server serves {served!r} (see GET /v1/models)",
                       param="model", code="model_not_found")


def check_prompt(ids: list[int], max_context: int, vocab_size: int, what: str = "prompt") -> None:
    """A tokenized prompt must be non-empty, leave room for one new token and hold only known ids."""
    if not ids:
        verb = "are" if what.endswith("s") else "is"  # "the messages are", "the prompt is"
        raise APIError(f"the {what} {verb} empty after tokenization; give at least one token", param=what)
    if len(ids) >= max_context:
        raise APIError(f"the {what} has {len(ids)} tokens but this server's context is {max_context} tokens "
                       f"(prompt plus at least one new token); shorten it or restart the server with a larger "
                       f"--max-context", param=what, code="context_length_exceeded")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"the {what} holds token ids outside [0, {vocab_size}): {bad[:5]}", param=what)


def resolve_max_tokens(requested: int | None, prompt_length: int, max_context: int, default: int | None) -> int:
    """The number of new tokens to allow: the request's, else `default` (None = all the room left), never past
    the context."""
    room = max_context - prompt_length
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(f"max_tokens={requested} is too large: the prompt has {prompt_length} tokens and the "
                       f"context is {max_context}, so at most {room} new tokens fit; allowed: "
                       f"{ALLOWED['max_tokens']}", param="max_tokens", code="context_length_exceeded")
    return requested


def sampling_params(request: _SamplingRequest, max_tokens: int, stops: list[str], logprobs: int | None,
                    vocab_size: int | None = None):
    """The engine's SamplingParams for a checked request (top_k clipped to vocab_size when given)."""
    from k3.infer.sampling import SamplingParams

    top_k = 0 if request.top_k == -1 else request.top_k
    if vocab_size is not None:
        top_k = min(top_k, vocab_size)
    try:
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=request.temperature, top_k=top_k, top_p=request.top_p, min_p=request.min_p,
            repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, stop_token_ids=list(request.stop_token_ids or []),
            stop=list(stops), seed=request.seed, logprobs=logprobs, n=request.n)
    except ValueError as error:  # the engine's own checks, should a rule above be looser than its
        raise APIError(str(error)) from error
