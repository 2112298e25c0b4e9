"""Loss by position: does the loss keep falling as the model sees more context?

Windows of `length` tokens are cut from held-out documents (documents at least that long when the split has
enough of them, else windows that run across document boundaries, which the rows say), scored by the
engine's packed prefill (`Engine.score`: log p(x_t | x_<t) for every t >= 1), and the per-token losses are
averaged in position buckets [1, 2), [2, 4), [4, 8), ... up to the length (powers of two: each bucket holds
as many tokens as all before it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from k3.infer.engine import Engine
from k3.infer.memory_budget import release_cached_memory


@dataclass
class PositionBucket:
    length: int
    start: int  # first position (0-based index of the predicted token) in the bucket
    end: int  # one past the last
    loss: float  # mean negative log-likelihood, nats per token
    n_tokens: int
    windows: int
    source: str  # "documents" (each window inside one document) or "stream" (windows cross documents)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else float("inf")

    def row(self) -> dict:
        return {"length": self.length, "position_start": self.start, "position_end": self.end, "loss": self.loss,
                "perplexity": self.perplexity, "n_tokens": self.n_tokens, "windows": self.windows,
                "source": self.source}


def position_buckets(length: int) -> list[tuple[int, int]]:
    """[1, 2), [2, 4), ..., the last one ending at `length` (position 0 has no prediction)."""
    buckets, start = [], 1
    while start < length:
        end = min(length, start * 2)
        buckets.append((start, end))
        start = end
    return buckets


def split_documents(stream: np.ndarray, eos_token_id: int | None) -> list[np.ndarray]:
    """The documents of a flat token stream (EOS after each), without their EOS."""
    stream = np.asarray(stream)
    if eos_token_id is None:
        return [stream]
    ends = np.flatnonzero(stream == eos_token_id)
    docs, start = [], 0
    for end in ends:
        if end > start:
            docs.append(stream[start:end])
        start = end + 1
    if start < len(stream):
        docs.append(stream[start:])
    return docs


def held_out_windows(stream: np.ndarray, eos_token_id: int | None, length: int, count: int,
                     seed: int = 0) -> tuple[list[list[int]], str]:
    """`count` windows of `length` tokens: from documents at least that long if there are `count` of them
    (one window per document, at a random offset), else from the stream as a whole. Returns (windows, source)."""
    rng = np.random.default_rng([seed, length])
    long_docs = [d for d in split_documents(stream, eos_token_id) if len(d) >= length]
    if len(long_docs) >= count:
        chosen = rng.choice(len(long_docs), count, replace=False)
        windows = []
        for i in chosen:
            doc = long_docs[int(i)]
            offset = int(rng.integers(0, len(doc) - length + 1))
            windows.append(doc[offset:offset + length].tolist())
        return windows, "documents"
    if len(stream) < length:
        raise ValueError(f"the held-out stream has {len(stream)} tokens, fewer than one window of {length}; give "
                         f"more held-out text or a shorter length")
    offsets = rng.integers(0, len(stream) - length + 1, count)
    return [np.asarray(stream[o:o + length]).tolist() for o in offsets], "stream"


def bucketed_loss(engine: Engine, windows: list[list[int]], length: int, source: str) -> list[PositionBucket]:
    """Mean loss per position bucket over `windows` (each `length` tokens), scored by the engine."""
    outputs = engine.score(windows, [1] * len(windows))
    # logprobs[j] is log p(window[j + 1] | window[:j + 1]): position j + 1.
    nll = -np.asarray([out.logprobs for out in outputs], dtype=np.float64)  # [W, length - 1]
    rows = []
    for start, end in position_buckets(length):
        part = nll[:, start - 1:end - 1]
        rows.append(PositionBucket(length, start, end, float(part.mean()), int(part.size), len(windows), source))
    return rows


def perplexity_by_position(model, tokenizer, stream: np.ndarray, lengths: list[int], windows: int = 8,
                           seed: int = 0) -> list[PositionBucket]:
    """Position-bucketed loss at every length, on windows of the held-out `stream`."""
    rows = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for length in lengths:
        chosen, source = held_out_windows(stream, eos, length, windows, seed)
        # The engine's prefill chunk grows with max_context (long_prefill_chunk) and sets Engine.score's
        # per-forward budget (4 chunks; fewer tokens where the device's free memory says so, see
        # k3.infer.memory_budget): a 1M window is scored in four cached forwards of 256K tokens on a large GPU.
        engine = Engine(model, tokenizer, max_context=length, max_batch=1, prefix_cache=False)
        rows.extend(bucketed_loss(engine, chosen, length, source))
        del engine
        release_cached_memory()
    return rows
