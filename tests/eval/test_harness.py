"""The harness scores through the engine: generation and teacher-forced scoring agree; loss by position equals
a plain fp32 forward; the reports hold the rows."""

import json

import numpy as np
import pytest
import torch

from k3.config import ModelConfig
from k3.eval.harness import evaluate_examples, engine_for, generated_correct, scored_correct
from k3.eval.perplexity import bucketed_loss, held_out_windows, position_buckets
from k3.eval.report import accuracy_table, parse_lengths, plot_accuracy, write_json
from k3.eval.tasks import Example, Filler, TaskContext, make_examples
from k3.infer.engine import Engine
from k3.infer.sampling import SamplingParams
from k3.model import K3ForCausalLM


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=320)).eval()


def test_own_greedy_continuation_is_correct_in_both_modes_and_a_changed_one_is_not(model, tokenizer):
    ctx = TaskContext(tokenizer, 320, Filler(tokenizer))
    engine = engine_for(model, tokenizer, 200)
    prompts = [ex.ids[:ex.answer_spans[0][0]] for ex in make_examples("needle_single", ctx, 150, 4, seed=0)]
    continuations = engine.generate_ids(prompts, SamplingParams(max_new_tokens=3, temperature=0.0))
    right = [Example(p + c, [(len(p), len(p) + 3)]) for p, c in zip(prompts, continuations)]
    wrong = [Example(p + c[:2] + [(c[2] + 1) % 320], [(len(p), len(p) + 3)]) for p, c in zip(prompts, continuations)]
    assert generated_correct(engine, right) == [True] * 4
    assert [f[0] for f in scored_correct(engine, right)] == [True] * 4
    assert generated_correct(engine, wrong) == [False] * 4
    assert [f[0] for f in scored_correct(engine, wrong)] == [False] * 4
    assert evaluate_examples(engine, "own", 150, right + wrong, "generate").row() == \
        {"task": "own", "length": 150, "accuracy": 0.5, "n": 8}
    assert evaluate_examples(engine, "own", 150, right + wrong, "score").accuracy == 0.5


def test_mqar_counts_every_query_and_refuses_generation(model, tokenizer):
    ctx = TaskContext(tokenizer, 320, Filler(tokenizer))
    examples = make_examples("mqar", ctx, 128, 3)
    engine = engine_for(model, tokenizer, 128)
    result = evaluate_examples(engine, "mqar", 128, examples)
    assert result.n == 3 * 8
    flags = scored_correct(engine, examples)
    # The flags are the plain forward's argmax at the query positions.
    logits = model(torch.tensor([ex.ids for ex in examples])).logits
    for ex, row, got in zip(examples, logits, flags):
        assert got == [int(row[s - 1].argmax()) == ex.ids[s] for s, _ in ex.answer_spans]
    with pytest.raises(ValueError, match="scored in place"):
        evaluate_examples(engine, "mqar", 128, examples, "generate")


def test_loss_by_position_equals_a_plain_forward(model):
    generator = np.random.default_rng(0)
    windows = [generator.integers(1, 320, 64).tolist() for _ in range(3)]
    engine = Engine(model, None, max_context=64, max_batch=1, prefix_cache=False)
    rows = bucketed_loss(engine, windows, 64, "stream")
    assert [(r.start, r.end) for r in rows] == position_buckets(64) == [(1, 2), (2, 4), (4, 8), (8, 16), (16, 32),
                                                                         (32, 64)]
    with torch.no_grad():
        ids = torch.tensor(windows)
        nll = torch.nn.functional.cross_entropy(model(ids).logits[:, :-1].transpose(1, 2).double(), ids[:, 1:],
                                                reduction="none")  # [W, 63], position j+1
    for r in rows:
        expected = float(nll[:, r.start - 1:r.end - 1].mean())
        assert r.loss == pytest.approx(expected, rel=1e-5)
        assert r.n_tokens == 3 * (r.end - r.start)


def test_held_out_windows_prefer_whole_documents():
    eos = 0
    docs = [np.arange(1, 101), np.arange(1, 31), np.arange(1, 81)]
    stream = np.concatenate([np.append(d, eos) for d in docs])
    windows, source = held_out_windows(stream, eos, 64, 2)
    assert source == "documents" and all(len(w) == 64 and eos not in w for w in windows)
    windows, source = held_out_windows(stream, eos, 64, 3)  # only two documents are long enough
    assert source == "stream" and all(len(w) == 64 for w in windows)
    with pytest.raises(ValueError, match="fewer than one window"):
        held_out_windows(stream, eos, 10_000, 1)


def test_reports(tmp_path):
    assert parse_lengths("256, 1K,4k,1M") == [256, 1024, 4096, 1 << 20]
    with pytest.raises(ValueError, match="cannot read length"):
        parse_lengths("4Q")
    rows = [{"task": "mqar", "length": 256, "accuracy": 0.5, "n": 64},
            {"task": "mqar", "length": 1024, "accuracy": 0.25, "n": 64},
            {"task": "needle_single", "length": 1024, "accuracy": 1.0, "n": 8}]
    table = accuracy_table(rows)
    assert "1K" in table and "0.250 ( 64)" in table and "-" in table.splitlines()[-1]
    write_json(tmp_path / "rows.json", rows)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    plot_accuracy(rows, tmp_path / "acc.png")
    assert (tmp_path / "acc.png").read_bytes()[:4] == b"\x89PNG"


def test_long_prompts_prefill_in_chunks_of_a_sixteenth():
    from k3.infer.engine import long_prefill_chunk

    assert long_prefill_chunk(8192) is None and long_prefill_chunk(32768) is None  # the engine's default
    assert long_prefill_chunk(65536) == 4096
    assert long_prefill_chunk(1 << 20) == 65536
    assert long_prefill_chunk(1 << 22) == 65536  # capped
    assert all(long_prefill_chunk(n) % 2048 == 0 for n in (100000, 300000, 700000))
