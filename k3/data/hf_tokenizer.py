"""Tokenizers of HF-format checkpoint directories, behind the project's small tokenizer interface:
encode(text) -> list[int], decode(ids) -> str, vocab_size, bos_token_id, eos_token_id, save(dir),
and apply_chat_template(messages) when the directory carries a chat template.

Two storage forms are read:
- `tokenizer.json` (the `tokenizers` library), special tokens named in tokenizer_config.json;
- `tiktoken.model` as Kimi ships it: one "base64(token bytes) rank" line per BPE token, plus
  tokenizer_config.json whose `added_tokens_decoder` names the special tokens. Kimi reserves 256 special
  ids right after the BPE ranks; unnamed ones are `<|reserved_token_{id}|>`. The Encoding is built
  directly from the rank file with Kimi's pre-tokenizer regex; nothing is downloaded.
The chat template comes from tokenizer_config.json (`chat_template`), chat_template.jinja or chat_template.json.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from k3.atomic import atomic_write_bytes

KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256
# The pre-tokenizer split of Kimi's tiktoken tokenizer (tokenization_kimi.py's pat_str, as published).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja",
                   "chat_template.json", "special_tokens_map.json")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json names a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from error


def read_chat_template(directory: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if (directory / "chat_template.json").is_file():
        return read_json(directory / "chat_template.json").get("chat_template")
    return None


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file: one `base64(token) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'base64-token rank', got {line[:80]!r}")
        try:
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, base64.binascii.Error) as error:
            raise ValueError(f"{path}:{number}: bad token or rank ({error})") from error
    return ranks


class HFTokenizer:
    """One tokenizer, whichever of the two backends stores it."""

    def __init__(self, backend: Any, kind: str, config: dict, chat_template: str | None,
                 special_tokens: dict[str, int], vocab_size: int, ranks: dict[bytes, int] | None = None) -> None:
        self.backend, self.kind = backend, kind
        self.config = dict(config)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self._vocab_size = vocab_size
        self._ranks = ranks
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))

    # --- the project's interface -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    def encode(self, text: str) -> list[int]:
        """Text -> ids. Special tokens written in the text (e.g. by a chat template) become their ids;
        no BOS/EOS is added."""
        if self.kind == "tiktoken":
            return self.backend.encode(text, allowed_special="all")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "tiktoken":
            return self.backend.decode(ids)
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if token in self.special_tokens:
            return self.special_tokens[token]
        if self.kind == "tiktoken":
            return self._ranks.get(token.encode("utf-8"))
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **extra: Any) -> str | list[int]:
        """Render a conversation ([{"role": ..., "content": ...}, ...]) with the directory's chat template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (none in tokenizer_config.json, chat_template.jinja "
                             "or chat_template.json); pass plain text instead")
        text = _render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        return self.encode(text) if tokenize else text

    def save(self, directory: str | os.PathLike) -> None:
        """Write the tokenizer files back in the form they were read in."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = dict(self.config)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        if self.kind == "tiktoken":
            lines = [f"{base64.b64encode(token).decode('ascii')} {rank}"
                     for token, rank in sorted(self._ranks.items(), key=lambda item: item[1])]
            atomic_write_bytes(directory / "tiktoken.model", ("\n".join(lines) + "\n").encode("utf-8"))
            config["added_tokens_decoder"] = {
                str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                         "single_word": False}
                for t, i in sorted(self.special_tokens.items(), key=lambda item: item[1])}
        else:
            atomic_write_bytes(directory / "tokenizer.json", self.backend.to_str().encode("utf-8"))
        atomic_write_bytes(directory / "tokenizer_config.json",
                           json.dumps(config, indent=2, ensure_ascii=False).encode("utf-8"))

    def __len__(self) -> int:
        return self.vocab_size


def _render(template: str, **context: Any) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    # Chat templates are written for these settings (the ones transformers renders them with).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(**context)
    except jinja2.TemplateError as error:
        raise ValueError(f"chat template failed to render: {error}") from error


def _tiktoken_tokenizer(directory: Path, config: dict, chat_template: str | None) -> HFTokenizer:
    import tiktoken

    ranks = read_tiktoken_ranks(directory / "tiktoken.model")
    num_base = len(ranks)
    named = {int(i): _token_text(entry) for i, entry in (config.get("added_tokens_decoder") or {}).items()}
    special: dict[str, int] = {}
    top = max([num_base + KIMI_NUM_RESERVED_SPECIAL_TOKENS - 1, *named]) if named else \
        num_base + KIMI_NUM_RESERVED_SPECIAL_TOKENS - 1
    for token_id in range(num_base, top + 1):
        special[named.get(token_id) or f"<|reserved_token_{token_id}|>"] = token_id
    clash = sorted(i for i in named if i < num_base)
    if clash:
        raise ValueError(f"{directory / 'tokenizer_config.json'}: added_tokens_decoder ids {clash[:5]} overlap the "
                         f"{num_base} BPE ranks of tiktoken.model; special ids must follow the ranks")
    encoding = tiktoken.Encoding(name=directory.name or "kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                 special_tokens=special)
    return HFTokenizer(encoding, "tiktoken", config, chat_template, special, top + 1, ranks)


def load_hf_tokenizer(path: str | os.PathLike, required: bool = True) -> HFTokenizer | None:
    """The tokenizer of an HF-format directory. With required=False a directory without tokenizer files
    gives None instead of an error."""
    directory = Path(path)
    config_file = directory / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    chat_template = read_chat_template(directory, config)
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as error:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{directory / 'tokenizer.json'} could not be read by the tokenizers library: "
                             f"{error}") from error
        special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        return HFTokenizer(backend, "tokenizers", config, chat_template, special,
                           backend.get_vocab_size(with_added_tokens=True))
    if (directory / "tiktoken.model").is_file():
        return _tiktoken_tokenizer(directory, config, chat_template)
    if required:
        raise FileNotFoundError(f"{directory} has no tokenizer.json and no tiktoken.model; put the tokenizer files "
                                f"next to config.json")
    return None
