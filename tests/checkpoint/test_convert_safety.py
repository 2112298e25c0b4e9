"""`k3 convert` never deletes what it did not write: a non-empty --to is refused (unless --force), a target that
holds the source or lies inside it is refused even with --force, and a failed conversion leaves the target as
it was."""

from __future__ import annotations

import pytest
import torch

from k3.checkpoint import native
from k3.cli import main
from k3.config import ModelConfig
from k3.model import K3ForCausalLM


@pytest.fixture
def run(tmp_path):
    model = K3ForCausalLM(ModelConfig.from_preset("debug")).eval()
    run = tmp_path / "run"
    native.save_checkpoint(run / "checkpoint.pt", {"model": model.state_dict(), "config": model.config.to_dict(),
                                                   "step": 3})
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    return run


def _snapshot(directory):
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_non_empty_target_is_refused_and_kept(run, tmp_path, capsys):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("not a checkpoint")
    assert main(["convert", "--from", str(run), "--to", str(target)]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert (target / "notes.txt").read_text() == "not a checkpoint"


def test_the_sources_own_directory_is_refused(run, capsys):
    before = _snapshot(run)
    assert main(["convert", "--from", str(run / "checkpoint.pt"), "--to", str(run), "--force"]) == 1
    assert "overlap" in capsys.readouterr().err
    assert _snapshot(run) == before


def test_native_into_a_run_directory_is_refused(run, tmp_path, capsys):
    other = tmp_path / "other"
    assert main(["convert", "--from", str(run), "--to", str(other), "--format", "native"]) == 0
    before = _snapshot(run)
    assert main(["convert", "--from", str(other), "--to", str(run), "--format", "native"]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert _snapshot(run) == before


def test_a_target_inside_the_source_is_refused(run, capsys):
    assert main(["convert", "--from", str(run), "--to", str(run / "hf"), "--force"]) == 1
    assert "overlap" in capsys.readouterr().err
    assert not (run / "hf").exists()


def test_force_replaces_a_non_empty_target(run, tmp_path):
    target = tmp_path / "old"
    target.mkdir()
    (target / "stale.txt").write_text("x")
    assert main(["convert", "--from", str(run), "--to", str(target), "--format", "native", "--force"]) == 0
    assert sorted(p.name for p in target.iterdir()) == ["checkpoint.pt"]
    assert native.load_checkpoint(target)["config"] == native.load_checkpoint(run)["config"]


def test_a_failed_conversion_leaves_the_target_and_no_scraps(run, tmp_path, monkeypatch):
    target = tmp_path / "empty"
    target.mkdir()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    assert main(["convert", "--from", str(run), "--to", str(target), "--format", "native"]) == 1
    assert target.is_dir() and not any(target.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "run"]
