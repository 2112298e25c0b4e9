"""The runner's decode inputs, built through one flat numpy-filled buffer, against the plain nested-list
construction they replaced: same values, shapes and dtypes, for every kind of row a decode batch holds."""

import pytest
import torch

from k3.config import ModelConfig
from k3.infer.cache_pool import SCRATCH
from k3.infer.engine import Engine
from k3.infer.runner import ModelRunner
from k3.infer.sampling import SamplingParams
from k3.infer.scheduler import DECODE, Sequence, pages_for
from k3.model import K3ForCausalLM

PAGE = 16


def reference_inputs(seqs, rows, table_pages, page_size):
    """The straightforward construction: nested Python lists through torch.tensor."""
    pad = rows - len(seqs)
    ids = [[s.tokens[s.num_cached]] for s in seqs] + [[0]] * pad
    slots = [s.slot for s in seqs] + [SCRATCH] * pad
    positions = [s.num_cached for s in seqs] + [0] * pad
    table = []
    for s in seqs:
        used = s.pages[: pages_for(s.num_cached + 1, page_size)]
        table.append(used + [SCRATCH] * (table_pages - len(used)))
    table += [[SCRATCH] * table_pages] * pad
    return torch.tensor(ids), torch.tensor(slots), torch.tensor(positions), torch.tensor(table)


class _Pool:
    page_size = PAGE


def bare_runner():
    """_decode_inputs reads only the pool's page size."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.pool = _Pool()
    return runner


def decoding(slot, num_cached, pages, token=None):
    """A sequence about to decode the token at position num_cached."""
    tokens = list(range(1000, 1000 + num_cached)) + [token if token is not None else 7 + slot]
    seq = Sequence(f"r{slot}", 0, SamplingParams(), tokens, prompt_len=1, num_cached=num_cached, slot=slot,
                   pages=list(pages))
    seq.status = DECODE
    return seq


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cpu" and g.dtype == w.dtype == torch.int64
        assert g.shape == w.shape and g.is_contiguous()
        assert torch.equal(g, w)


def mixed_rows():
    return [
        decoding(3, 0, [11]),  # the first decode of a one-token prompt
        decoding(5, 15, [21, 22]),  # last slot of page 0; page 1 allocated but not yet read
        decoding(6, 16, [31, 32]),  # first slot of page 1: the table grows by one page here
        decoding(9, 47, [41, 42, 43]),  # ends exactly on a page boundary (48 tokens, 3 pages)
        decoding(2, 100, [51 + i for i in range(7)] + [99, 98]),  # more pages reserved than used
        decoding(1, 5, [61], token=0),
    ]


@pytest.mark.parametrize("rows", [6, 8, 16])
@pytest.mark.parametrize("table_pages", [7, 8, 32])
def test_decode_inputs_equal_the_nested_list_construction(rows, table_pages):
    seqs = mixed_rows()
    got = bare_runner()._decode_inputs(seqs, rows, table_pages)
    assert_same(got, reference_inputs(seqs, rows, table_pages, PAGE))


def test_padding_only_and_single_row_batches():
    runner = bare_runner()
    one = [decoding(4, 31, [1, 2])]
    assert_same(runner._decode_inputs(one, 1, 2), reference_inputs(one, 1, 2, PAGE))
    assert_same(runner._decode_inputs(one, 4, 9), reference_inputs(one, 4, 9, PAGE))
    assert_same(runner._decode_inputs([], 2, 3), reference_inputs([], 2, 3, PAGE))


def test_each_call_returns_fresh_tensors():
    """A caller may hold a batch's inputs while the next batch is built: the buffers must not be shared."""
    runner = bare_runner()
    seqs = mixed_rows()
    first = runner._decode_inputs(seqs, 8, 8)
    kept = [t.clone() for t in first]
    for s in seqs:
        s.num_cached += 1
        s.tokens.append(3)
    runner._decode_inputs(seqs, 8, 8)
    assert_same(first, kept)


def test_a_running_engines_decode_inputs_equal_the_reference():
    """Rows as the scheduler leaves them (prompt lengths around page boundaries, forks sharing pages), at the
    eager path's power-of-two width and at the graph path's full width."""
    torch.manual_seed(0)
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    engine = Engine(model, None, max_context=256, max_batch=8, page_size=PAGE, prefill_chunk=32)
    generator = torch.Generator().manual_seed(3)
    for length in (1, 15, 16, 17, 47, 90):
        prompt = torch.randint(1, model.config.vocab_size, (length,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=20, temperature=0))
    engine.add_request([5] * 31, SamplingParams(max_new_tokens=20, temperature=1.0, seed=1, n=2))
    runner = engine.runner
    real_decode = runner.decode
    checked = []

    def checking_decode(seqs):
        longest = max(pages_for(s.num_cached + 1, PAGE) for s in seqs)
        for rows, width in ((len(seqs), 1 << (longest - 1).bit_length()), (8, runner.max_pages_per_seq)):
            assert_same(runner._decode_inputs(seqs, rows, width), reference_inputs(seqs, rows, width, PAGE))
        checked.append(len(seqs))
        return real_decode(seqs)

    runner.decode = checking_decode
    while engine.has_unfinished():
        engine.step()
    assert len(checked) >= 19 and max(checked) == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_pinned_inputs_equal_the_reference():
    seqs = mixed_rows()
    got = bare_runner()._decode_inputs(seqs, 8, 32, pin=True)
    assert all(t.is_pinned() for t in got)
    assert_same(got, reference_inputs(seqs, 8, 32, PAGE))
