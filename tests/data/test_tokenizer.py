import base64
from pathlib import Path

import pytest

from k3.data.corpus import load_corpus
from k3.data.tokenizer import EOS_TOKEN, load_tokenizer, train_bpe


@pytest.fixture(scope="module")
def bpe():
    texts = [d.text for d in load_corpus(max_bytes=200_000)]
    return train_bpe(texts, 600, show_progress=False)


def test_trained_bpe_round_trips_and_has_eos(bpe, tmp_path: Path):
    assert bpe.vocab_size == 600
    assert bpe.eos_token_id == 0 and bpe.bos_token_id is None
    text = "def f(x):\n    return x  # ünïcode ✓\n"
    ids = bpe.encode(text)
    assert len(ids) < len(text.encode())  # merges were learned
    assert bpe.decode(ids) == text
    assert max(ids) < bpe.vocab_size
    bpe.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(text) == ids and again.eos_token_id == 0 and again.vocab_size == 600
    assert load_tokenizer(tmp_path / "tokenizer.json").encode(text) == ids


def test_tiktoken_rank_file(tmp_path: Path):
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"ab"] = 256
    path = tmp_path / "x.tiktoken"
    path.write_text("\n".join(f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()) + "\n")
    tok = load_tokenizer(path)
    assert tok.encode("ab") == [256]
    assert tok.eos_token_id == 257 and tok.vocab_size == 258
    assert tok.decode(tok.encode("abc xyz")) == "abc xyz"
    assert tok.encode(EOS_TOKEN) != [257]  # text never turns into the special id
    tok.save(tmp_path / "saved")
    assert load_tokenizer(tmp_path / "saved").encode("ab") == [256]


def test_bad_tokenizer_paths(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="vocab_size >= 257"):
        train_bpe(["abc"], 100)


def test_split_digits_gives_every_digit_its_own_token_and_survives_save_and_load(tmp_path: Path):
    texts = ["Compute 35+38+32. x = 35+38+32 -> 105"] * 50
    merged, split = train_bpe(texts, 300, show_progress=False), train_bpe(texts, 300, show_progress=False,
                                                                            split_digits=True)
    assert any(len(merged.decode([i]).strip()) > 1 and merged.decode([i]).strip().isdigit()
               for i in merged.encode("35+38 105"))
    pieces = [split.decode([i]) for i in split.encode("x 35+38 105")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("3538105")
    split.save(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.encode("x 35+38 105") == split.encode("x 35+38 105")
    assert loaded.decode(loaded.encode("Compute 35+38+32.")) == "Compute 35+38+32."
