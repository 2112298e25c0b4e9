"""Recall rows mixed into text batches: several short recall sequences per row (each answerable from its own
segment only) and a loss weight on their answers."""

import numpy as np
import torch

from k3.config import ModelConfig
from k3.data.packing import BatchStream, pack_rows, text_row
from k3.data.synthetic import RecallTask
from k3.model import K3ForCausalLM
from k3.train.trainer import weighted_loss

EOS = 0


def _segments(ids: np.ndarray, labels: np.ndarray):
    ends = np.flatnonzero(ids == EOS)
    start = 0
    for end in ends:
        yield ids[start:end], labels[start:end]
        start = end + 1
    assert start == len(ids)  # the row ends with an EOS


def test_packed_recall_row_answers_come_from_their_own_segment():
    task = RecallTask(vocab_size=512, num_pairs=4, num_queries=10)
    ids, labels = task.packed_row(200, 48, EOS, np.random.default_rng(5))
    assert len(ids) == len(labels) == 200
    segments = list(_segments(ids, labels))
    assert [len(s[0]) for s in segments] == [48, 48, 48, 48 + 200 - 4 * 49]  # the last takes what is left
    for seg_ids, seg_labels in segments:
        pairs = dict(zip(seg_ids[0:8:2].tolist(), seg_ids[1:8:2].tolist()))
        scored = np.flatnonzero(seg_labels != -100)
        assert len(scored) == 10
        for position in scored:  # the answer is the value paired with the query key earlier in this segment
            assert pairs[int(seg_ids[position])] == seg_labels[position] == seg_ids[position + 1]
    assert (labels[ids == EOS] == -100).all()
    # The packer starts a segment after every EOS, so the model sees each sequence alone.
    batch = pack_rows([(ids, labels)], EOS)
    assert batch.cu_seqlens.tolist() == [0, 49, 98, 147, 200]


def test_recall_rows_carry_their_weight_and_text_rows_weigh_one():
    stream = (np.arange(1, 3000, dtype=np.int32) % 200) + 1
    task = RecallTask(vocab_size=512, num_pairs=4, num_queries=8)
    batches = BatchStream(stream, 128, 4, EOS, seed=1, recall=task, recall_fraction=0.5, recall_length=40,
                          recall_weight=3.0)
    batch = next(b for b in (batches.next_batch() for _ in range(10)) if b.weights is not None)
    scored = batch.labels[0] != -100
    is_recall = batch.weights[0] != 1.0
    assert (batch.weights[0][is_recall] == 3.0).all() and is_recall.any()
    assert (~scored[is_recall]).sum() == 0  # only answers are weighted
    assert batch.scored_weight() == float(scored.sum() + 2 * is_recall.sum())
    plain = BatchStream(stream, 128, 4, EOS, seed=1, recall=task, recall_fraction=0.5, recall_length=40)
    assert all(plain.next_batch().weights is None for _ in range(10))


def test_weighted_loss_is_a_weighted_mean_of_token_losses():
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    stream = np.random.default_rng(0).integers(1, 256, 200).astype(np.int32)
    batch = pack_rows([text_row(stream, i, 30, EOS) for i in range(2)], EOS)
    with torch.no_grad():
        logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens).logits
        plain = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels).loss
        ones = weighted_loss(logits, batch.labels, torch.ones_like(batch.labels, dtype=torch.float32))
        torch.testing.assert_close(ones, plain)
        weights = torch.ones(1, 60)
        weights[0, :30] = 3.0
        token = torch.nn.functional.cross_entropy(logits[0], batch.labels[0], reduction="none")
        expected = (3 * token[:30].sum() + token[30:].sum()) / 120
        torch.testing.assert_close(weighted_loss(logits, batch.labels, weights), expected)
