"""Packing documents into fixed-length rows, and rows into packed batches with cu_seqlens.

Storage: a split is one flat int32 token stream, each document followed by EOS. Row i is the window
stream[i*T : i*T + T + 1] (inputs are its first T tokens, labels the last T), so rows tile the stream.

A batch of B rows becomes ONE packed sequence ids [1, B*T] with cu_seqlens [N+1] marking every row start and
every document start (the token after an EOS). The model keeps KDA state, short convs and MLA attention
inside each segment, so nothing leaks across rows or documents. The label of an EOS input (the first token of
the next document) is -100: it cannot be predicted from inside the document.

Order: rows are visited in a permutation drawn from (seed, epoch); the data position is just the number of rows
consumed, so resuming needs only that number. Optionally a fraction of rows is replaced by synthetic recall
sequences, drawn from an RNG seeded by (seed, batch index): also reproducible from the position alone. A recall
row may hold several short sequences (recall_length) and weigh its answers more than a text token in the loss
(recall_weight): a row is then (ids, labels, weights) and the packed batch carries the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from k3.data.synthetic import RecallTask


# On CUDA, packed RL and SFT batches are padded up to a multiple of this many tokens (a filler document). Every
# new packed length otherwise meets fla kernels compiled and autotuned per length bucket: on one H200, 20 SFT
# steps of `small` took 213 s, nearly all of it compiling, and an RL step's backward had not finished at 400 s.
PACK_MULTIPLE_CUDA = 2048


def filler_length(total: int, multiple: int | None, device: torch.device | None = None) -> int:
    """Tokens of filler that bring a packed length of ``total`` up to a multiple of ``multiple`` (0: no padding;
    None: PACK_MULTIPLE_CUDA on a CUDA ``device``, else no padding). The filler is one more document in
    cu_seqlens, so attention, KDA state and short convs never cross into it, and its labels are ignored."""
    if multiple is None:
        multiple = PACK_MULTIPLE_CUDA if device is not None and device.type == "cuda" else 0
    if multiple <= 0:
        return 0
    return -total % multiple


def tokenize_documents(texts: list[str], tokenizer, eos_token_id: int, show_progress: bool = True) -> np.ndarray:
    """The flat token stream [sum(len_i + 1)] int32: each document's ids then EOS."""
    pieces: list[np.ndarray] = []
    eos = np.array([eos_token_id], dtype=np.int32)
    batch = 256
    encode_batch = getattr(tokenizer, "encode_batch", None)
    for start in tqdm(range(0, len(texts), batch), desc="tokenizing", unit="batch", disable=not show_progress,
                      leave=False):
        chunk = texts[start:start + batch]
        ids = encode_batch(chunk) if encode_batch else [tokenizer.encode(t) for t in chunk]
        for doc in ids:
            pieces.append(np.asarray(doc, dtype=np.int32))
            pieces.append(eos)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def save_stream(path: Path, stream: np.ndarray) -> None:
    from k3.atomic import atomic_write_bytes

    atomic_write_bytes(path, stream.astype(np.int32).tobytes())


def load_stream(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.int32)


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, B*T] int64
    labels: torch.Tensor  # [1, B*T] int64, -100 where not scored
    cu_seqlens: torch.Tensor  # [N+1] int64
    weights: torch.Tensor | None = None  # [1, B*T] float32 loss weight per scored token; None: all 1
    # Image-text rows (k3.vision.image_batches): the images of the media tokens, in reading order; None: text only.
    # uint8 patches travel to the device and are normalised there (k3.vision.processing.normalise)
    image_patches: torch.Tensor | None = None  # [N, 3, p, p] uint8
    grid_thw: torch.Tensor | None = None  # [num_images, 3]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def scored_weight(self) -> float:
        """Sum of the loss weights of the scored tokens (their count when unweighted)."""
        scored = self.labels != -100
        if self.weights is None:
            return float(scored.sum())
        return float(self.weights[scored].sum())


def pack_rows(rows: list[tuple[np.ndarray, ...]], eos_token_id: int | None) -> PackedBatch:
    """rows: (ids [T], labels [T]) or (ids, labels, weights [T]) -> one packed batch. Segments start at every
    row start and after every EOS input token. Weights (1 for rows without them) are kept only when some row
    has them."""
    ids = np.concatenate([r[0] for r in rows]).astype(np.int64)
    labels = np.concatenate([r[1] for r in rows]).astype(np.int64)
    weights = None
    if any(len(r) > 2 for r in rows):
        weights = torch.from_numpy(np.concatenate([r[2] if len(r) > 2 else np.ones(len(r[0]))
                                                   for r in rows]).astype(np.float32))[None]
    starts = {0}
    offset = 0
    for row in rows:
        row_ids = row[0]
        starts.add(offset)
        if eos_token_id is not None:
            starts.update((offset + np.flatnonzero(row_ids[:-1] == eos_token_id) + 1).tolist())
        offset += len(row_ids)
    cu = sorted(starts) + [offset]
    return PackedBatch(torch.from_numpy(ids)[None], torch.from_numpy(labels)[None], torch.tensor(cu), weights)


def text_row(stream: np.ndarray, index: int, length: int, eos_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    window = stream[index * length: index * length + length + 1].astype(np.int64)
    ids, labels = window[:-1].copy(), window[1:].copy()
    labels[ids == eos_token_id] = -100
    return ids, labels


class BatchStream:
    """Deterministic batches of packed rows from a token stream, resumable from `state_dict()`."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, eos_token_id: int, seed: int = 0,
                 shuffle: bool = True, recall: RecallTask | None = None, recall_fraction: float = 0.0,
                 recall_length: int = 0, recall_weight: float = 1.0) -> None:
        self.num_rows = (len(stream) - 1) // seq_len
        if self.num_rows < 1:
            raise ValueError(f"the token stream has {len(stream)} tokens, fewer than one row of seq_len={seq_len} "
                             f"+ 1; use more data or a shorter --seq-len")
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.eos_token_id, self.seed, self.shuffle = eos_token_id, seed, shuffle
        self.recall, self.recall_fraction = recall, recall_fraction
        self.recall_length, self.recall_weight = recall_length, recall_weight
        self.rows_consumed = 0
        self.batches_made = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _row_index(self, position: int) -> int:
        epoch, within = divmod(position, self.num_rows)
        if not self.shuffle:
            return within
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._perm_epoch = epoch
        return int(self._perm[within])

    def next_batch(self) -> PackedBatch:
        return pack_rows(self.next_rows(), self.eos_token_id)

    def next_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The next batch's rows (ids [T], labels [T]) unpacked: a data-parallel rank packs only its share."""
        rng = np.random.default_rng([self.seed, 1_000_003, self.batches_made])
        rows = []
        for _ in range(self.batch_size):
            if self.recall is not None and rng.random() < self.recall_fraction:
                rows.append(self._recall_row(rng))
            else:
                rows.append(text_row(self.stream, self._row_index(self.rows_consumed), self.seq_len,
                                     self.eos_token_id))
                self.rows_consumed += 1
        self.batches_made += 1
        return rows

    def _recall_row(self, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        if self.recall_length and self.recall_length < self.seq_len:
            ids, labels = self.recall.packed_row(self.seq_len, self.recall_length, self.eos_token_id, rng)
        else:
            ids, labels = self.recall.sample(self.seq_len, rng)
        if self.recall_weight == 1.0:
            return ids, labels
        return ids, labels, np.where(labels != -100, self.recall_weight, 1.0).astype(np.float32)

    @property
    def epoch(self) -> float:
        return self.rows_consumed / self.num_rows

    def state_dict(self) -> dict[str, int]:
        return {"rows_consumed": self.rows_consumed, "batches_made": self.batches_made}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.rows_consumed = int(state["rows_consumed"])
        self.batches_made = int(state["batches_made"])
