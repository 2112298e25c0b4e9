"""load_tokenizer_for_inference reads the tokenizer and no weights: a run or a Hugging Face-format directory whose
weights are damaged or gone still gives its tokenizer (a server tokenizes while its engine loads elsewhere)."""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

from k3.checkpoint.inference import load_for_inference, load_tokenizer_for_inference
from k3.checkpoint.native import directory_files, save_checkpoint
from k3.config import ModelConfig
from k3.data.tokenizer import train_bpe
from k3.model import K3ForCausalLM

TEXT = "def add(a, b):\n    return a + b\n" * 8
PROBE = "def add(x, y): return x + y"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tokenizer = train_bpe([TEXT], vocab_size=300, show_progress=False)
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(directory)
    return tokenizer, directory


def _run_with_tokenizer_inside(directory: Path, tokenizer_dir: Path, vocab_size: int) -> Path:
    """A run directory whose only tokenizer is the copy inside checkpoint.pt (no tokenizer/ beside it)."""
    config = ModelConfig.from_preset("debug", vocab_size=vocab_size)
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    directory.mkdir(parents=True)
    save_checkpoint(directory / "checkpoint.pt", {"config": config.to_dict(), "model": model.state_dict(),
                                                  "step": 0, "tokenizer": directory_files(tokenizer_dir)})
    return directory


def _overwrite_tensor_bytes(checkpoint: Path) -> int:
    """Fill every tensor record of a torch checkpoint with 0xff bytes (NaN in any float dtype) in place; the
    pickled entries (config, tokenizer) stay intact. Returns the bytes overwritten."""
    with zipfile.ZipFile(checkpoint) as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename and info.file_size]
    written = 0
    with open(checkpoint, "r+b") as handle:
        for info in records:
            handle.seek(info.header_offset + 26)
            name_length, extra_length = (int.from_bytes(handle.read(2), "little") for _ in range(2))
            handle.seek(info.header_offset + 30 + name_length + extra_length)
            handle.write(b"\xff" * info.file_size)
            written += info.file_size
    return written


def test_a_run_whose_checkpoint_weights_are_damaged_still_gives_the_tokenizer_inside_it(tmp_path, tokenizer):
    expected, tokenizer_dir = tokenizer
    run = _run_with_tokenizer_inside(tmp_path / "run", tokenizer_dir, expected.vocab_size)
    assert _overwrite_tensor_bytes(run / "checkpoint.pt") > 100_000
    with pytest.raises(ValueError, match="NaN or infinite"):  # the weights really are damaged
        load_for_inference(str(run), None, "cpu")
    loaded = load_tokenizer_for_inference(str(run), None)
    assert loaded.encode(PROBE) == expected.encode(PROBE)
    assert loaded.vocab_size == expected.vocab_size


def test_the_checkpoint_file_itself_is_read_the_same_way(tmp_path, tokenizer):
    expected, tokenizer_dir = tokenizer
    run = _run_with_tokenizer_inside(tmp_path / "run", tokenizer_dir, expected.vocab_size)
    _overwrite_tensor_bytes(run / "checkpoint.pt")
    assert load_tokenizer_for_inference(str(run / "checkpoint.pt"), None).encode(PROBE) == expected.encode(PROBE)


def test_no_model_is_built_for_the_tokenizer(tmp_path, tokenizer, monkeypatch):
    expected, tokenizer_dir = tokenizer
    run = _run_with_tokenizer_inside(tmp_path / "run", tokenizer_dir, expected.vocab_size)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built to get the tokenizer")

    monkeypatch.setattr(K3ForCausalLM, "__init__", refuse)
    assert load_tokenizer_for_inference(str(run), None).encode(PROBE) == expected.encode(PROBE)


def test_a_run_without_its_weights_file_gives_the_tokenizer_beside_it(tmp_path, tokenizer):
    expected, _ = tokenizer
    run = tmp_path / "run"
    expected.save(run / "tokenizer")
    assert not (run / "checkpoint.pt").exists()
    assert load_tokenizer_for_inference(str(run), None).encode(PROBE) == expected.encode(PROBE)


def test_a_hugging_face_directory_with_damaged_weights_gives_its_tokenizer(tmp_path, tokenizer):
    expected, tokenizer_dir = tokenizer
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    for name, data in directory_files(tokenizer_dir).items():
        (model_dir / name).write_bytes(data)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"\xff" * 4096)  # not a safetensors file
    assert load_tokenizer_for_inference(None, str(model_dir)).encode(PROBE) == expected.encode(PROBE)


def test_a_run_with_no_tokenizer_anywhere_says_so(tmp_path):
    config = ModelConfig.from_preset("debug", vocab_size=300)
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(run / "checkpoint.pt", {"config": config.to_dict(), "model": {}, "step": 0})
    with pytest.raises(RuntimeError, match="no tokenizer"):
        load_tokenizer_for_inference(str(run), None)


@pytest.mark.parametrize("name", ["../escaped.json", "sub/tokenizer.json", "/tmp/k3-escaped-abs.json", ".."])
def test_a_tokenizer_entry_named_as_a_path_is_refused_and_nothing_lands_outside(tmp_path, tokenizer, name):
    """A stranger's checkpoint names its tokenizer files: a path in that name must not write where it points."""
    _, tokenizer_dir = tokenizer
    run = _run_with_tokenizer_inside(tmp_path / "run", tokenizer_dir, vocab_size=300)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["tokenizer"] = {**state["tokenizer"], name: b"{}"}
    save_checkpoint(run / "checkpoint.pt", state)
    before = set(tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="not a plain file name"):
        load_tokenizer_for_inference(str(run), None)
    assert set(tmp_path.rglob("*")) == before
    assert not Path("/tmp/k3-escaped-abs.json").exists()


def test_the_tokenizer_unpacked_from_a_checkpoint_leaves_no_directory_behind(tmp_path, tokenizer, monkeypatch):
    expected, tokenizer_dir = tokenizer
    run = _run_with_tokenizer_inside(tmp_path / "run", tokenizer_dir, expected.vocab_size)
    temp_root = tmp_path / "temp-root"
    temp_root.mkdir()
    (temp_root / "someone-elses").mkdir()  # not ours: must survive
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
    assert load_tokenizer_for_inference(str(run), None).encode(PROBE) == expected.encode(PROBE)
    assert sorted(p.name for p in temp_root.iterdir()) == ["someone-elses"]


def test_the_full_load_leaves_no_tokenizer_directory_behind(tmp_path, tokenizer, monkeypatch):
    expected, tokenizer_dir = tokenizer
    run = _run_with_tokenizer_inside(tmp_path / "run", tokenizer_dir, expected.vocab_size)
    temp_root = tmp_path / "temp-root"
    temp_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
    _, loaded = load_for_inference(str(run), None, "cpu")
    assert loaded.encode(PROBE) == expected.encode(PROBE)
    assert list(temp_root.iterdir()) == []
