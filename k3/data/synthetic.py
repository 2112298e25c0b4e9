"""Multi-query associative recall (MQAR): a retrieval task that needs attention over the whole context.

One sequence:  k1 v1 k2 v2 ... kP vP | filler ... | q1 a1 q2 a2 ... qQ aQ
Keys are distinct; each query q_i is one of the keys and its answer a_i is that key's value. Only the answer
positions are scored (labels elsewhere are -100): the model must predict a_i when it reads q_i. With a long
filler between the pairs and the queries, the decaying KDA state cannot hold the pairs; the global MLA layers
can look back at them. Keys, values and filler come from disjoint id ranges of the vocabulary.

Evaluating with a longer filler than in training measures retrieval beyond the trained length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RecallTask:
    vocab_size: int
    num_pairs: int = 8
    num_queries: int = 8
    num_keys: int = 32
    num_values: int = 32

    def __post_init__(self) -> None:
        if self.num_pairs > self.num_keys:
            raise ValueError(f"num_pairs={self.num_pairs} needs at least as many distinct keys, got "
                             f"num_keys={self.num_keys}")
        if self.num_keys + self.num_values + 64 > self.vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} is too small for {self.num_keys} keys, "
                             f"{self.num_values} values and a filler range")

    # Id ranges at the top of the vocabulary: BPE merges learned last are rare, so the ids are mostly unused.
    @property
    def key_start(self) -> int:
        return self.vocab_size - self.num_keys - self.num_values

    @property
    def value_start(self) -> int:
        return self.vocab_size - self.num_values

    @property
    def core_length(self) -> int:
        return 2 * self.num_pairs + 2 * self.num_queries

    def sample(self, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One sequence of exactly `length` tokens: (ids [length], labels [length]) int64; labels are -100
        except at query positions, where they hold the answer (the next token)."""
        gap = length - self.core_length
        if gap < 0:
            raise ValueError(f"a recall sequence needs at least {self.core_length} tokens, got length={length}")
        keys = rng.choice(self.num_keys, self.num_pairs, replace=False) + self.key_start
        values = rng.integers(0, self.num_values, self.num_pairs) + self.value_start
        pairs = np.stack([keys, values], axis=1).reshape(-1)
        # Filler from the lower part of the vocabulary (ordinary text tokens), away from keys and values.
        filler = rng.integers(1, self.key_start, gap)
        asked = rng.choice(self.num_pairs, self.num_queries, replace=self.num_queries > self.num_pairs)
        queries = np.stack([keys[asked], values[asked]], axis=1).reshape(-1)
        ids = np.concatenate([pairs, filler, queries]).astype(np.int64)
        labels = np.full(length, -100, dtype=np.int64)
        query_positions = length - 2 * self.num_queries + 2 * np.arange(self.num_queries)
        labels[query_positions] = ids[query_positions + 1]
        return ids, labels

    def packed_row(self, seq_len: int, example_len: int, eos_token_id: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One training row of exactly `seq_len` tokens holding several independent sequences of `example_len`
        tokens, each followed by EOS (the packer starts a new segment after every EOS, so no sequence sees
        another's pairs); the last sequence takes the tokens left over. (ids [seq_len], labels [seq_len]) int64.
        Short sequences give many answers per row: the signal a mixed text + recall batch needs to learn recall
        in a few hundred steps; evaluating at longer lengths then measures retrieval beyond the trained one."""
        count = seq_len // (example_len + 1)
        if count < 1:
            raise ValueError(f"a row of {seq_len} tokens cannot hold a recall sequence of {example_len} tokens "
                             f"and its EOS; use a shorter recall length")
        lengths = [example_len] * count
        lengths[-1] += seq_len - count * (example_len + 1)
        ids, labels = [], []
        for length in lengths:
            one_ids, one_labels = self.sample(length, rng)
            ids += [one_ids, np.array([eos_token_id], dtype=np.int64)]
            labels += [one_labels, np.array([-100], dtype=np.int64)]
        return np.concatenate(ids), np.concatenate(labels)


@torch.no_grad()
def recall_accuracy(model, task: RecallTask, length: int, num_sequences: int, seed: int = 0,
                    batch_size: int = 8) -> float:
    """Fraction of answers predicted exactly (argmax) over `num_sequences` fresh sequences of `length` tokens.
    Chance is 1 / task.num_values."""
    rng = np.random.default_rng(seed)
    correct = total = 0
    was_training = model.training
    model.eval()
    try:
        for start in range(0, num_sequences, batch_size):
            rows = [task.sample(length, rng) for _ in range(min(batch_size, num_sequences - start))]
            ids = torch.from_numpy(np.stack([r[0] for r in rows]))
            labels = torch.from_numpy(np.stack([r[1] for r in rows]))
            logits = model(ids).logits
            scored = labels != -100
            correct += int((logits.argmax(-1)[scored] == labels[scored]).sum())
            total += int(scored.sum())
    finally:
        model.train(was_training)
    return correct / max(total, 1)
