"""Image-text training data: the JSONL format `k3 train --data` and `k3 sft --data` read (docs/vision.md).

One JSON object per line, of one of two kinds:

    {"text": "Two shapes: <image> and <image>.", "images": ["a.png", "data:image/png;base64,..."]}
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What colour is it?"},
                                               {"type": "image_url", "image_url": {"url": "cat.png"}}]},
                  {"role": "assistant", "content": "Red."}]}

A document's `<image>` tags take its `images` in order (as many tags as images); a chat's image parts are
OpenAI's `image_url` parts. An image is a path or a base64 `data:` URL. Relative paths resolve against the JSONL
file's folder; absolute paths and paths that lead out of that folder (`..`, a symbolic link) are refused unless
`allow_outside`. Files over `max_image_bytes` and images over the processor's `max_input_pixels` (the
decompression-bomb guard, checked before decoding) are refused.

Every image goes through the K2.5/K3 ImageProcessor once at reading (so a bad one fails here, before training),
and its one placeholder becomes tokens_per_image copies of the media token. Loss: a document's every text token
(and its closing EOS), a chat's assistant tokens; a placeholder is never a target.

A bad record raises ImageDataError naming the file, the line and the field; with `skip_bad` it is left out and
listed in ImageTextData.skipped instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

IMAGE_TAG = "<image>"
MEDIA_TOKEN = "<|media_pad|>"  # Kimi tokenizers' media placeholder token
DEFAULT_MAX_IMAGE_BYTES = 32 << 20
# Image parts become this marker in the rendered chat text, and the marker one media token in the ids.
_CHAT_MARKER = "\x00k3-image\x00"


class ImageDataError(ValueError):
    """A record of an image-text file that cannot be trained on; the message names file, line and field."""


@dataclass
class ImageDataOptions:
    max_tokens: int | None = None  # an example longer than this is bad (images are never cut); None: no limit
    skip_bad: bool = False  # leave bad records out (listed in ImageTextData.skipped) instead of raising
    allow_outside: bool = False  # follow absolute paths and paths outside the JSONL's folder
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # an image file (or data: URL payload) larger is bad


@dataclass
class ImageTextExample:
    ids: list[int]  # media placeholders expanded: tokens_per_image[i] media tokens for image i
    labels: list[int]  # labels[t] = ids[t + 1] where that is a trained text token, else -100
    images: list[str]  # resolved absolute paths or data: URLs, in placeholder order
    tokens_per_image: list[int]
    source: str  # "file:line"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "ImageTextExample":
        return cls(**value)


@dataclass
class ImageTextData:
    examples: list[ImageTextExample] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why each left-out record was bad (skip_bad)


def media_token_id_for(tokenizer) -> int:
    """`<|media_pad|>`'s id when the tokenizer has it as one token (Kimi tokenizers), else the first id past the
    tokenizer's own (a model trained with it needs vocab_size > that id)."""
    ids = tokenizer.encode(MEDIA_TOKEN)
    return int(ids[0]) if len(ids) == 1 else int(tokenizer.vocab_size)


def is_image_text_file(path: str | os.PathLike) -> bool:
    """A .jsonl file with a record that has "images" or "messages" (an image-text file, not a text corpus: read
    as one, its <image> tags would be trained as text)."""
    path = Path(path)
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if '"images"' not in line and '"messages"' not in line:  # most text lines are never parsed
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and ("images" in record or "messages" in record):
                return True
    return False


def has_images(path: str | os.PathLike) -> bool:
    """Whether a JSONL file has a record with a non-empty "images" list or an image_url part."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if "image" not in line:  # cheap pre-check; records are parsed only when they may hold images
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            if record.get("images"):
                return True
            for message in record.get("messages") or []:
                content = message.get("content") if isinstance(message, dict) else None
                if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url"
                                                     for p in content):
                    return True
    return False


class _MediaTokens:
    """The tokenizer, except that the chat marker encodes as one media token (chat templates render text)."""

    def __init__(self, tokenizer, media_token_id: int) -> None:
        self._tokenizer, self._media = tokenizer, media_token_id

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pieces = text.split(_CHAT_MARKER)
        for i, piece in enumerate(pieces):
            if piece:
                ids += self._tokenizer.encode(piece)
            if i < len(pieces) - 1:
                ids.append(self._media)
        return ids


class ImageTextReader:
    """Reads image-text JSONL files into examples; see the module docstring."""

    def __init__(self, tokenizer, processor, media_token_id: int, options: ImageDataOptions | None = None) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("image-text documents end with EOS, but this tokenizer has no eos_token")
        self.tokenizer, self.processor, self.media = tokenizer, processor, media_token_id
        self.options = options or ImageDataOptions()

    def read(self, paths: list[str | os.PathLike]) -> ImageTextData:
        data = ImageTextData()
        for path in paths:
            self._read_file(Path(path), data)
        return data

    def _read_file(self, path: Path, data: ImageTextData) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"image-text file {path} does not exist")
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    data.examples.append(self.example(line, path, number))
                except ImageDataError as error:
                    if not self.options.skip_bad:
                        raise
                    data.skipped.append(str(error))

    def example(self, line: str, path: Path, number: int) -> ImageTextExample:
        """One JSONL line -> its example; ImageDataError("path:number: field F: why") when it is bad."""
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ImageDataError(f"{where}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ImageDataError(f"{where}: a record must be a JSON object with \"text\" + \"images\" or "
                                 f"\"messages\", got {type(record).__name__}")
        if "messages" in record:
            ids, trainable, refs = self._chat(record["messages"], where)
        elif isinstance(record.get("text"), str):
            ids, trainable, refs = self._document(record, where)
        else:
            raise ImageDataError(f"{where}: field \"text\": needs a string (with {IMAGE_TAG} tags and an "
                                 f"\"images\" list) or a \"messages\" list")
        images, tokens = [], []
        for field_name, ref in refs:
            source = self._resolve(ref, path.parent, f"{where}: field {field_name}")
            tokens.append(self._tokens_of(source, f"{where}: field {field_name}"))
            images.append(source)
        ids, trainable = self._expand(ids, trainable, tokens)
        limit = self.options.max_tokens
        if limit is not None and len(ids) > limit:
            name = "\"messages\"" if "messages" in record else "\"images\""
            raise ImageDataError(f"{where}: field {name}: the "
                                 f"example is {len(ids)} tokens with its {len(images)} image(s) of {tokens} tokens, "
                                 f"over the limit of {limit} (a row: --seq-len); images are never cut: lower "
                                 f"--max-image-patches or raise --seq-len")
        labels = [ids[t + 1] if trainable[t + 1] and ids[t + 1] != self.media else -100
                  for t in range(len(ids) - 1)] + [-100]
        return ImageTextExample(ids, labels, images, tokens, where)

    # --- the two kinds of record ---------------------------------------------------------------------------
    def _document(self, record: dict, where: str) -> tuple[list[int], list[bool], list[tuple[str, Any]]]:
        images = record.get("images", [])
        if not isinstance(images, list):
            raise ImageDataError(f"{where}: field \"images\": needs a list of paths or data: URLs, got "
                                 f"{type(images).__name__}")
        pieces = record["text"].split(IMAGE_TAG)
        if len(pieces) - 1 != len(images):
            raise ImageDataError(f"{where}: field \"images\": {len(images)} image(s) but the text has "
                                 f"{len(pieces) - 1} {IMAGE_TAG} tag(s); put one tag where each image goes")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                ids += self._encode_text(piece, where, "text")
            if i < len(images):
                ids.append(self.media)
        ids.append(self.tokenizer.eos_token_id)
        return ids, [True] * len(ids), [(f"\"images\"[{i}]", ref) for i, ref in enumerate(images)]

    def _chat(self, messages: Any, where: str) -> tuple[list[int], list[bool], list[tuple[str, Any]]]:
        from k3.chat.format import load_chat_format

        if not isinstance(messages, list) or not messages:
            raise ImageDataError(f"{where}: field \"messages\": needs a non-empty list of {{role, content}} "
                                 f"messages")
        flat, refs = [], []
        for m, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ImageDataError(f"{where}: field \"messages\"[{m}]: needs an object, got "
                                     f"{type(message).__name__}")
            content = message.get("content")
            if isinstance(content, list):
                texts = []
                for p, part in enumerate(content):
                    name = f"\"messages\"[{m}].content[{p}]"
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text" and isinstance(part.get("text"), str):
                        texts.append(part["text"])
                    elif kind == "image_url":
                        url = part.get("image_url")
                        if not isinstance(url, dict) or not isinstance(url.get("url"), str):
                            raise ImageDataError(f"{where}: field {name}.image_url: needs {{\"url\": \"path or "
                                                 f"data: URL\"}}, got {url!r:.60}")
                        texts.append(_CHAT_MARKER)
                        refs.append((f"{name}.image_url.url", url["url"]))
                    else:
                        raise ImageDataError(f"{where}: field {name}: a part is {{\"type\": \"text\", \"text\": "
                                             f"...}} or {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}"
                                             f", got {part!r:.80}")
                message = {**message, "content": "".join(texts)}
            elif content is not None and not isinstance(content, str):
                raise ImageDataError(f"{where}: field \"messages\"[{m}].content: needs a string or a list of "
                                     f"parts, got {type(content).__name__}")
            flat.append(message)
        if not any(m.get("role") == "assistant" for m in flat):
            raise ImageDataError(f"{where}: field \"messages\": no assistant message to learn from")
        try:
            fmt = load_chat_format(self.tokenizer, default="k3")
            segments = fmt.segments(flat, _MediaTokens(self.tokenizer, self.media), train_on="assistant")
        except (ValueError, TypeError) as error:
            raise ImageDataError(f"{where}: field \"messages\": {error}") from None
        ids = [t for s in segments for t in s.ids]
        trainable = [s.trainable for s in segments for _ in s.ids]
        found = sum(1 for t in ids if t == self.media)
        if found != len(refs):
            raise ImageDataError(f"{where}: field \"messages\": the chat format rendered {found} image "
                                 f"placeholder(s) for {len(refs)} image part(s); each image part needs exactly one "
                                 f"(a template that drops content, or text holding the media token?)")
        return ids, trainable, refs

    def _encode_text(self, text: str, where: str, name: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if self.media in ids:
            raise ImageDataError(f"{where}: field \"{name}\": the text itself holds the media token {MEDIA_TOKEN} "
                                 f"(id {self.media}); mark images with {IMAGE_TAG} instead")
        return ids

    def _expand(self, ids: list[int], trainable: list[bool], tokens: list[int]) -> tuple[list[int], list[bool]]:
        out_ids, out_trainable = [], []
        counts = iter(tokens)
        for token, train in zip(ids, trainable):
            repeat = next(counts) if token == self.media else 1
            out_ids += [token] * repeat
            out_trainable += [train] * repeat
        return out_ids, out_trainable

    # --- images ----------------------------------------------------------------------------------------------
    def _resolve(self, ref: Any, folder: Path, where: str) -> str:
        """A data: URL as it is, or the absolute path of an image file inside `folder` (see the module doc)."""
        limit = self.options.max_image_bytes
        if not isinstance(ref, str) or not ref:
            raise ImageDataError(f"{where}: needs an image path or a data: URL, got {ref!r:.60}")
        if ref.startswith("data:"):
            payload = ref.split(",", 1)[-1]
            if len(payload) * 3 // 4 > limit:
                raise ImageDataError(f"{where}: the data: URL holds about {len(payload) * 3 // 4:,} bytes, over "
                                     f"the limit of {limit:,} (--max-image-bytes)")
            return ref
        if "://" in ref:
            raise ImageDataError(f"{where}: {ref[:60]!r} is a URL; k3 reads local image files and data: URLs "
                                 f"only (nothing is fetched from the network)")
        given = Path(ref)
        if given.is_absolute() and not self.options.allow_outside:
            raise ImageDataError(f"{where}: absolute path {ref!r} refused; give paths relative to the JSONL's "
                                 f"folder {folder}, or pass --allow-image-paths-outside")
        full = (folder / given).resolve()
        if not self.options.allow_outside and not full.is_relative_to(folder.resolve()):
            raise ImageDataError(f"{where}: {ref!r} leads outside the JSONL's folder {folder} (.. or a symbolic "
                                 f"link); keep images under it, or pass --allow-image-paths-outside")
        if not full.is_file():
            raise ImageDataError(f"{where}: image file {folder / given} does not exist")
        size = full.stat().st_size
        if size > limit:
            raise ImageDataError(f"{where}: image file {folder / given} is {size:,} bytes, over the limit of "
                                 f"{limit:,} (--max-image-bytes)")
        return str(full)

    def _tokens_of(self, source: str, where: str) -> int:
        """The image's merged-token count, from processing it whole (a corrupt or oversized image fails here)."""
        try:
            processed = self.processor([source])
        except (ValueError, OSError) as error:
            raise ImageDataError(f"{where}: {error}") from None
        return int(processed.tokens_per_image[0])


def read_image_text(paths: list[str | os.PathLike], tokenizer, processor, media_token_id: int,
                    options: ImageDataOptions | None = None) -> ImageTextData:
    """The examples of image-text JSONL files; see ImageTextReader."""
    return ImageTextReader(tokenizer, processor, media_token_id, options).read(paths)
