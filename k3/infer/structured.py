"""Grammar-constrained decoding (structured output) with llguidance: response_format json_object /
json_schema, and forced tool calls (tool_choice "required" or a named function) in the chat format's syntax.

A `Grammar` (a Lark grammar for llguidance) travels in SamplingParams.grammar; each sequence that samples under
it gets its own matcher (`Grammar.matcher()`, a copy of a matcher at the grammar's start), which the engine asks for the
allowed tokens before every sample and tells the sampled token after. The engine unpacks the matchers'
bitmasks on the device and masks those rows only, so constrained and free requests share a batch. A matcher
that has reached the grammar's end stops its sequence (finish_reason "stop").

Compiling a grammar against the vocabulary is the costly part, and agents send the same tools and schemas
request after request, so each GrammarTokenizer keeps the compiled start matchers of recent grammars in a small
LRU (`CompiledGrammars`) keyed by the exact Lark text, bounded in entries and characters so that requests with
ever new schemas cannot grow it without limit.

JSON is generated without free whitespace (llguidance's whitespace_flexible off), so a model cannot spend its
tokens on blanks, and an object schema that lists properties without saying otherwise takes no others
(additionalProperties false, as vLLM's strict default).

A forced tool call is written with the token ids the model writes such a call with unforced: a marker that the
tokenizer keeps as one token of its own (a special or added token, as Kimi's <|tool_call_begin|>) is that
token (`<[id]>`; a quoted literal would forbid it and make the model spell the marker out byte by byte), the
arguments' JSON has the separators the chat format renders calls with (", " and ": " for json.dumps-style
templates), and the reply ends with the format's end of turn (its end marker, or EOS).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from k3.chat.reply import (K3_CALL_CLOSE, K3_CALL_OPEN, KIMI_CALL_ARGS, KIMI_CALL_CLOSE, KIMI_CALL_OPEN,
                           KIMI_SECTION_CLOSE, KIMI_SECTION_OPEN)

MAX_SCHEMA_CHARS = 100_000
MAX_FORCED_CALLS = 8  # calls in one forced reply: a model cannot loop on calls until max_tokens
CACHED_GRAMMARS = 64  # compiled grammars kept per served tokenizer
CACHED_GRAMMAR_CHARS = 2_000_000  # their Lark text in all; a larger grammar is compiled for its request alone
log = logging.getLogger("k3.structured")


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def import_ahead() -> None:
    """Import torch.compile's modules, and the grammar library whose torch helpers load them, on the calling
    thread: AsyncEngine calls it before its loop's thread starts. The engine's first forward loads
    the same modules (torch.nn.attention.bias imports torch._dynamo), and two threads importing that cycle at
    once can each be handed the other's half-initialised module: an ImportError that stopped the engine loop."""
    import torch._dynamo  # noqa: F401

    if available():
        _llguidance()


def build_ahead(grammar_tokenizer: Callable[[], object]) -> None:
    """Call `grammar_tokenizer` (a served model's lazy GrammarTokenizer getter) now, as the first constrained
    request would, where the library is installed: its import and the vocabulary scan take seconds, which stalled
    every stream when a request paid for them. A tokenizer the library cannot read is logged, and the requests that
    need it fail later with the reason."""
    if not available():
        return
    try:
        grammar_tokenizer()
    except Exception as error:  # noqa: BLE001 - a tokenizer it cannot read fails the grammar requests later
        log.warning("the grammar library could not read the tokenizer (%s); constrained requests will fail", error)


def _llguidance():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401
    except ImportError as error:
        raise RuntimeError("structured output and forced tool calls need llguidance: pip install 'k3[serve]' "
                           "(or pip install llguidance)") from error
    return llguidance


class GrammarTokenizer:
    """The tokenizer as llguidance sees it (built once per served model: a vocabulary scan)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        llg = _llguidance()
        self.vocab_size = vocab_size
        eos = getattr(tokenizer, "eos_token_id", None)
        backend = getattr(tokenizer, "backend", None)
        if hasattr(backend, "to_str"):  # the `tokenizers` library (k3's BPE, HF tokenizer.json)
            self.ll = llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos if eos is not None else 0)
        elif hasattr(tokenizer, "encoding") or getattr(tokenizer, "kind", None) == "tiktoken":
            from llguidance.tiktoken import lltokenizer_from_encoding

            encoding = tokenizer.encoding if hasattr(tokenizer, "encoding") else tokenizer.backend
            self.ll = lltokenizer_from_encoding(encoding, n_vocab=vocab_size, eos_token=eos)
        else:
            raise ValueError(f"structured output does not know how to read a {type(tokenizer).__name__}'s "
                             f"vocabulary (it reads `tokenizers` and tiktoken tokenizers)")
        self.atomic = atomic_tokens(tokenizer)
        self.compiled = CompiledGrammars()

    def literal(self, text: str | int) -> str:
        """A Lark item for a marker: a token id, or text that is the token itself where the tokenizer keeps it as
        one token of its own, else the text (any tokenization of it)."""
        if isinstance(text, int):
            return f"<[{text}]>"
        return f"<[{self.atomic[text]}]>" if text in self.atomic else json.dumps(text)


def atomic_tokens(tokenizer) -> dict[str, int]:
    """Text -> id of every token the tokenizer encodes as itself wherever it stands (special and added tokens:
    they are matched before the text is split, so the model only ever sees them as that one id)."""
    out: dict[str, int] = {}
    backend = getattr(tokenizer, "backend", None)
    if hasattr(backend, "get_added_tokens_decoder"):  # the `tokenizers` library
        out.update({token.content: int(i) for i, token in backend.get_added_tokens_decoder().items()})
    encoding = getattr(tokenizer, "encoding", None)
    if hasattr(encoding, "special_tokens_set"):  # tiktoken
        out.update({text: encoding.encode_single_token(text) for text in encoding.special_tokens_set})
    out.update({text: int(i) for text, i in (getattr(tokenizer, "special_tokens", None) or {}).items()})
    return out


class CompiledGrammars:
    """A bounded LRU of compiled grammars for one tokenizer: Lark text -> a matcher at the grammar's start, never
    advanced itself (sequences get deep copies). Thread-safe: requests are planned on worker threads."""

    def __init__(self, max_entries: int = CACHED_GRAMMARS, max_chars: int = CACHED_GRAMMAR_CHARS) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.builds = 0  # grammars compiled so far (misses), for tests and logs

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        return self._chars

    def start(self, tokenizer: "GrammarTokenizer", lark: str, description: str):
        """The start matcher of `lark`, compiled now or taken from the cache."""
        with self._lock:
            if lark in self._entries:
                self._entries.move_to_end(lark)
                return self._entries[lark]
        start = _compile(tokenizer, lark, description)  # outside the lock: a large grammar takes a while
        with self._lock:
            self.builds += 1
            if len(lark) <= self.max_chars and lark not in self._entries:
                self._entries[lark] = start
                self._chars += len(lark)
                while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                    old, _ = self._entries.popitem(last=False)
                    self._chars -= len(old)
        return start


def _compile(tokenizer: "GrammarTokenizer", lark: str, description: str):
    llg = _llguidance()
    start = llg.LLMatcher(tokenizer.ll, llg.grammar_from("lark", lark), log_level=0)
    if start.is_error():
        raise ValueError(f"the {description} cannot be used: {start.get_error()}")
    return start


@dataclass
class Grammar:
    """A compiled grammar for one request (shared through the tokenizer's cache); matcher() gives each sequence
    its own state."""

    tokenizer: GrammarTokenizer
    lark: str
    description: str

    def __post_init__(self) -> None:
        self._start = self.tokenizer.compiled.start(self.tokenizer, self.lark, self.description)

    def matcher(self) -> "Matcher":
        return Matcher(self)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.state = grammar._start.deep_copy()  # the start matcher is shared, so each sequence copies it

    @property
    def stopped(self) -> bool:
        return self.state.is_stopped() or self.state.is_error()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch as llt

        llt.fill_next_token_bitmask(self.state, bitmask, row)

    def advance(self, token: int) -> None:
        if not self.state.is_stopped():
            self.state.consume_token(token)


# From this many constrained rows a step, llguidance's thread pool fills the masks (it pays from about 16 rows:
# with a 24K vocabulary on 2 cores 64 rows took 0.10 ms against 0.43 one by one, 8 rows 0.08 against 0.05).
PARALLEL_MASK_ROWS = 16
_executor = None


def _mask_executor():
    global _executor
    if _executor is None:
        _executor = _llguidance().LLExecutor()
    return _executor


def allowed_rows(matchers: list[Matcher], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(matchers), vocab] bool on the device: the tokens each matcher allows next. The bitmasks are filled
    on the host (llguidance; in its thread pool from PARALLEL_MASK_ROWS rows), then unpacked on the device."""
    import llguidance.torch as llt

    bitmask = llt.allocate_token_bitmask(len(matchers), vocab)
    if len(matchers) >= PARALLEL_MASK_ROWS:
        llt.fill_next_token_bitmask_par(_mask_executor(), [(m.state, row) for row, m in enumerate(matchers)],
                                        bitmask)
    else:
        for row, matcher in enumerate(matchers):
            matcher.fill(bitmask, row)
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(len(matchers), -1)[:, :vocab].bool()


# --- grammars of requests -------------------------------------------------------------------------------
def _closed(schema: Any) -> Any:
    """The schema with additionalProperties false wherever an object lists its properties and says nothing
    (as vLLM's default strict mode does): otherwise a model may add keys without end."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _closed(value) if key not in ("enum", "const", "default", "examples") else value
           for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema_text(schema: dict[str, Any], separators: tuple[str, str] | None = None) -> str:
    """separators: (between items, between a key and its value) as a chat format writes them; None: compact."""
    guidance: dict[str, Any] = {"whitespace_flexible": False}
    if separators is not None:
        guidance.update(item_separator=separators[0], key_separator=separators[1])
    schema = {**_closed(schema), "x-guidance": guidance}
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"the JSON schema has {len(text)} characters; at most {MAX_SCHEMA_CHARS} are accepted")
    return text


def json_grammar(tokenizer: GrammarTokenizer, schema: dict[str, Any] | None) -> Grammar:
    """Any JSON object (schema None), or JSON valid under `schema`."""
    schema = schema if schema is not None else {"type": "object"}
    return Grammar(tokenizer, f"start: %json {_schema_text(schema)}\n",
                   "JSON schema" if schema != {"type": "object"} else "JSON object grammar")


def tool_call_grammar(tokenizer: GrammarTokenizer, syntax: str, tools: list[dict[str, Any]],
                      parallel: bool = True, end: str | int | None = None, max_calls: int = MAX_FORCED_CALLS,
                      separators: tuple[str, str] = (", ", ": ")) -> Grammar:
    """One to max_calls calls (one if not parallel) to the given tools, in the chat format's syntax, each with
    arguments valid under the tool's parameters schema and written with the format's JSON `separators`; then
    `end`, the turn's end (marker text, or a token id such as EOS) if given."""
    lit = tokenizer.literal
    item, key = separators
    rules, names = [], []
    for index, tool in enumerate(tools):
        function = tool["function"]
        schema = function.get("parameters") or {"type": "object"}
        name = function["name"]
        arguments = f"%json {_schema_text(schema, separators)}"
        if syntax == "kimi_k2":
            rules.append(f'call{index}: {lit(KIMI_CALL_OPEN)} {json.dumps("functions." + name + ":")} /[0-9]{{1,2}}/ '
                         f'{lit(KIMI_CALL_ARGS)} {arguments} {lit(KIMI_CALL_CLOSE)}')
        elif syntax == "k3":
            head = '{"name"' + key + json.dumps(name) + item + '"arguments"' + key
            rules.append(f'call{index}: {lit(K3_CALL_OPEN)} {json.dumps(head)} {arguments} "}}" '
                         f'{lit(K3_CALL_CLOSE)}')
        else:
            raise ValueError("this chat format has no tool-call syntax, so calls cannot be forced")
        names.append(f"call{index}")
    repeat = f"{{1,{max_calls}}}" if parallel else ""
    calls = f"({' | '.join(names)}){repeat}"
    if syntax == "kimi_k2":
        body = f"{lit(KIMI_SECTION_OPEN)} {calls} {lit(KIMI_SECTION_CLOSE)}"
    else:
        body = calls
    if end is not None:
        body += f" {lit(end)}"
    return Grammar(tokenizer, f"start: {body}\n" + "\n".join(rules) + "\n", "tool-call grammar")
