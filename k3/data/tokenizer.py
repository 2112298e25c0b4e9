"""Tokenizers behind one small interface, which every tokenizer in the project follows:

    encode(text: str) -> list[int]      no BOS/EOS added
    decode(ids: list[int]) -> str
    vocab_size: int                     ids are in [0, vocab_size)
    eos_token_id: int | None            ends a document (the packer appends it) and stops generation
    bos_token_id: int | None
    save(directory) -> None             writes files that load_tokenizer(directory) reads back
    chat_template: str | None           the model's chat format (k3.chat), saved as chat_template.jinja

`load_tokenizer(path)` accepts a directory (tokenizer.json or tiktoken.model, as written by `save` or by a
Hugging Face model), a tokenizer.json file, or a tiktoken rank file (*.tiktoken / tiktoken.model).

The default tokenizer is a byte-level BPE trained with the `tokenizers` library on the training corpus
(`train_bpe`); its one special token `<|endoftext|>` is id 0 and serves as EOS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Protocol

EOS_TOKEN = "<|endoftext|>"


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: str | os.PathLike) -> None: ...


class BPETokenizer:
    """A `tokenizers.Tokenizer` (byte-level BPE) with an EOS token."""

    def __init__(self, backend, eos_token: str | None = EOS_TOKEN, bos_token: str | None = None) -> None:
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token, self.bos_token = eos_token, bos_token
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (the library parallelises this)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike) -> None:
        from k3.atomic import atomic_write_bytes

        directory = Path(directory)
        atomic_write_bytes(directory / "tokenizer.json", self.backend.to_str().encode("utf-8"))
        config = {"eos_token": self.eos_token, "bos_token": self.bos_token}
        atomic_write_bytes(directory / "tokenizer_config.json", json.dumps(config, indent=2).encode("utf-8"))
        _save_chat_template(self, directory)


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = True,
              split_digits: bool = False) -> BPETokenizer:
    """Train a byte-level BPE with `vocab_size` ids in total (256 byte symbols, EOS, and merges). split_digits:
    every digit is a token of its own (as in Llama's and DeepSeek's tokenizers), so a small model copies and
    computes with numbers digit by digit instead of learning a token per number."""
    from tokenizers import Tokenizer as HFTokenizerBackend, decoders, models, pre_tokenizers, trainers

    minimum = 256 + 1
    if vocab_size < minimum:
        raise ValueError(f"a byte-level BPE needs vocab_size >= {minimum} (256 bytes + EOS), got {vocab_size}")
    backend = HFTokenizerBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         backend.pre_tokenizer])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(backend)


def _tokenizer_json(path: Path) -> BPETokenizer:
    from tokenizers import Tokenizer as HFTokenizerBackend

    try:
        backend = HFTokenizerBackend.from_file(str(path))
    except Exception as error:  # the library raises a bare Exception on malformed files
        raise ValueError(f"{path} is not a tokenizer.json the tokenizers library can read: {error}") from error
    config_file = path.parent / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    eos = config.get("eos_token", EOS_TOKEN if backend.token_to_id(EOS_TOKEN) is not None else None)
    if isinstance(eos, dict):
        eos = eos.get("content")
    bos = config.get("bos_token")
    if isinstance(bos, dict):
        bos = bos.get("content")
    tokenizer = BPETokenizer(backend, eos, bos)
    tokenizer.chat_template = read_chat_template(path.parent, config)
    return tokenizer


def read_chat_template(directory: Path, config: dict) -> str | None:
    from k3.data.hf_tokenizer import read_chat_template as read

    return read(directory, config)


def _save_chat_template(tokenizer, directory: Path) -> None:
    """The chat format travels with the tokenizer files (k3.chat), as transformers stores it."""
    from k3.atomic import atomic_write_bytes

    if getattr(tokenizer, "chat_template", None):
        atomic_write_bytes(Path(directory) / "chat_template.jinja", tokenizer.chat_template.encode("utf-8"))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a directory, a tokenizer.json file or a tiktoken rank file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist; give a tokenizer.json, a tiktoken model "
                                f"file, or a directory holding one")
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _tokenizer_json(path / "tokenizer.json")
        if (path / "tiktoken.model").is_file():
            if not (path / "tokenizer_config.json").is_file():
                return _tiktoken_file(path / "tiktoken.model")
            # A model directory (Kimi's layout): its config names the special tokens.
            from k3.data.hf_tokenizer import load_hf_tokenizer

            return load_hf_tokenizer(path)
        raise FileNotFoundError(f"{path} holds neither tokenizer.json nor tiktoken.model")
    if path.suffix == ".json":
        return _tokenizer_json(path)
    if path.suffix in (".tiktoken", ".model"):
        return _tiktoken_file(path)
    raise ValueError(f"cannot tell the tokenizer format of {path}; use a tokenizer.json, a *.tiktoken / "
                     f"tiktoken.model rank file, or a directory")


class TiktokenTokenizer:
    """A tiktoken rank file (one `base64(token) rank` per line), split with Kimi's pre-tokenizer pattern;
    EOS is one extra special id after the ranks."""

    def __init__(self, ranks: dict[bytes, int], source: Path) -> None:
        import tiktoken

        from k3.data.hf_tokenizer import KIMI_PATTERN

        self.ranks = ranks
        self.eos_token_id = max(ranks.values()) + 1
        self.bos_token_id = None
        self.vocab_size = self.eos_token_id + 1
        self.chat_template: str | None = None
        self.encoding = tiktoken.Encoding(name=source.stem, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                          special_tokens={EOS_TOKEN: self.eos_token_id})

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def save(self, directory: str | os.PathLike) -> None:
        import base64

        from k3.atomic import atomic_write_bytes

        lines = [f"{base64.b64encode(t).decode('ascii')} {r}" for t, r in sorted(self.ranks.items(),
                                                                                  key=lambda item: item[1])]
        atomic_write_bytes(Path(directory) / "tiktoken.model", ("\n".join(lines) + "\n").encode("utf-8"))
        _save_chat_template(self, Path(directory))


def _tiktoken_file(path: Path) -> TiktokenTokenizer:
    from k3.data.hf_tokenizer import read_tiktoken_ranks

    tokenizer = TiktokenTokenizer(read_tiktoken_ranks(path), path)
    template = path.parent / "chat_template.jinja"
    tokenizer.chat_template = template.read_text(encoding="utf-8") if template.is_file() else None
    return tokenizer
