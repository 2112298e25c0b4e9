from pathlib import Path

import pytest

from k3.data.tokenizer import train_bpe
from k3.eval.tasks import DEFAULT_FILLER_TEXT


@pytest.fixture(scope="session")
def tokenizer():
    """A small byte-level BPE (vocab 320) trained on fixed text: merges cross word and digit boundaries, as a
    real tokenizer's do."""
    text = [DEFAULT_FILLER_TEXT * 20, "The special magic number for amber-basil is 1234567. VAR ABCDE = 12345. "
            "What are the 3 most common words in the list above? " * 20,
            "def function(value):\n    return value * 2 + 1  # number\n" * 30]
    return train_bpe(text, 320, show_progress=False)


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """A few stdlib-like text documents."""
    directory = tmp_path / "corpus"
    directory.mkdir()
    for i in range(12):
        body = "\n".join(f"def function_{i}_{j}(value):\n    return value * {j} + {i}  # number {j}"
                         for j in range(40))
        (directory / f"doc{i:02d}.txt").write_text(body)
    return directory
