from pathlib import Path

import pytest

from k3.train.trainer import TrainConfig


def write_corpus(directory: Path) -> Path:
    """A small, fixed corpus: a few stdlib-like text documents, so tests do not depend on the machine."""
    directory.mkdir()
    for i in range(12):
        body = "\n".join(f"def function_{i}_{j}(value):\n    return value * {j} + {i}  # number {j}"
                         for j in range(40))
        (directory / f"doc{i:02d}.txt").write_text(body)
    return directory


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


def _small_config(out: Path, corpus: Path, **changes) -> TrainConfig:
    values = dict(preset="debug", out=str(out), max_steps=6, seq_len=32, batch_size=2, lr=3e-3, warmup_steps=2,
                  eval_every=3, eval_batches=1, save_every=2, data=[str(corpus)], val_fraction=0.2,
                  model_overrides={"vocab_size": 320}, recall_fraction=0.25, recall_pairs=4)
    values.update(changes)
    return TrainConfig.flat(**values)


@pytest.fixture
def small_config():
    """A function (out, corpus, **changes) -> TrainConfig for a seconds-long debug-preset run."""
    return _small_config
