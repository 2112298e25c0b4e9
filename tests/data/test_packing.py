import numpy as np
import torch

from k3.config import ModelConfig
from k3.data.packing import BatchStream, pack_rows, text_row
from k3.data.synthetic import RecallTask
from k3.model import K3ForCausalLM

EOS = 0


def test_rows_split_at_eos_and_mask_cross_document_labels():
    stream = np.array([5, 6, 7, EOS, 8, 9, EOS, 10, 11, 12, 13], dtype=np.int32)
    ids, labels = text_row(stream, 0, 5, EOS)
    assert ids.tolist() == [5, 6, 7, EOS, 8]
    assert labels.tolist() == [6, 7, EOS, -100, 9]  # EOS is predicted; what follows an EOS is not
    batch = pack_rows([text_row(stream, 0, 5, EOS), text_row(stream, 1, 5, EOS)], EOS)
    assert batch.input_ids.tolist() == [[5, 6, 7, EOS, 8, 9, EOS, 10, 11, 12]]
    # rows start at 0 and 5; documents start after each EOS (positions 4 and 7)
    assert batch.cu_seqlens.tolist() == [0, 4, 5, 7, 10]


def test_packed_batch_equals_separate_segments():
    """Nothing leaks across rows or documents: the packed loss equals the loss of each segment run alone."""
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    rng = np.random.default_rng(0)
    stream = rng.integers(1, 256, 200).astype(np.int32)
    stream[[13, 50, 51, 90]] = EOS
    batch = pack_rows([text_row(stream, i, 40, EOS) for i in range(3)], EOS)
    with torch.no_grad():
        packed = model(batch.input_ids, cu_seqlens=batch.cu_seqlens).logits[0]
        cu = batch.cu_seqlens.tolist()
        separate = torch.cat([model(batch.input_ids[:, a:b]).logits[0] for a, b in zip(cu[:-1], cu[1:])])
    torch.testing.assert_close(packed, separate, atol=2e-5, rtol=1e-4)


def test_batch_stream_is_resumable_from_its_position():
    stream = np.arange(1, 1000, dtype=np.int32) % 97 + 1
    task = RecallTask(vocab_size=256, num_pairs=4, num_queries=4)
    make = lambda: BatchStream(stream, 32, 3, EOS, seed=7, recall=task, recall_fraction=0.3)  # noqa: E731
    first = make()
    batches = [first.next_batch() for _ in range(12)]
    second = make()
    for _ in range(5):
        second.next_batch()
    resumed = make()
    resumed.load_state_dict(second.state_dict())
    for expected in batches[5:]:
        got = resumed.next_batch()
        assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.labels, expected.labels)
    assert any((b.labels != -100).sum() < b.labels.numel() - 10 for b in batches)  # recall rows were mixed in


def test_recall_sequences_ask_about_their_own_pairs():
    task = RecallTask(vocab_size=512, num_pairs=6, num_queries=5)
    ids, labels = task.sample(100, np.random.default_rng(3))
    assert len(ids) == len(labels) == 100
    pairs = dict(zip(ids[0:12:2].tolist(), ids[1:12:2].tolist()))
    scored = np.flatnonzero(labels != -100)
    assert len(scored) == 5
    for position in scored:
        assert pairs[int(ids[position])] == labels[position] == ids[position + 1]
    assert all(task.key_start <= k < task.value_start for k in pairs)
    assert (ids[12:90] < task.key_start).all()  # filler never looks like a key or value
