"""`k3 train --out` never deletes what it did not write: a directory of other files is refused before anything
in it is touched; an earlier attempt of k3 train in it is cleared and started over."""

from k3.cli import main


def _args(out, corpus_dir):
    return ["train", "--preset", "debug", "--out", str(out), "--data", str(corpus_dir), "--max-steps", "1",
            "--seq-len", "32", "--batch-size", "1", "--eval-batches", "1", "--val-fraction", "0.2"]


def test_a_directory_of_other_files_is_refused_and_kept(tmp_path, corpus_dir, capsys):
    out = tmp_path / "project"
    (out / "data").mkdir(parents=True)
    (out / "data" / "mine.csv").write_text("1,2,3")
    assert main(_args(out, corpus_dir)) == 1
    assert "did not write" in capsys.readouterr().err
    assert (out / "data" / "mine.csv").read_text() == "1,2,3"
    assert sorted(p.name for p in out.iterdir()) == ["data"]


def test_a_file_as_out_is_refused(tmp_path, corpus_dir, capsys):
    (tmp_path / "f").write_text("x")
    assert main(_args(tmp_path / "f", corpus_dir)) == 1
    assert "is a file" in capsys.readouterr().err


def test_an_interrupted_attempt_is_started_over(tmp_path, corpus_dir, monkeypatch):
    out = tmp_path / "run"
    from k3.train import trainer

    # The first attempt stops before its first checkpoint (after preparing its data and tokenizer).
    monkeypatch.setattr(trainer.Trainer, "train", lambda self, **kw: (_ for _ in ()).throw(ValueError("stopped")))
    assert main(_args(out, corpus_dir)) == 1
    assert (out / "tokenizer").is_dir() and not (out / "checkpoint.pt").exists()
    monkeypatch.undo()
    assert main(_args(out, corpus_dir)) == 0
    assert (out / "checkpoint.pt").is_file()
