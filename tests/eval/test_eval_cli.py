"""`k3 eval` end to end on a seconds-long debug run."""

import json

from k3.cli import main
from k3.train.trainer import TrainConfig, Trainer


def test_eval_run_writes_rows_plot_and_loss_by_position(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    config = TrainConfig.flat(preset="debug", out=str(run), max_steps=2, seq_len=32, batch_size=2, warmup_steps=1,
                              eval_every=2, eval_batches=1, save_every=2, data=[str(corpus_dir)], val_fraction=0.2,
                              model_overrides={"vocab_size": 320}, recall_fraction=0.5, recall_pairs=4,
                              recall_queries=6)
    Trainer(config, show_progress=False, log=lambda *_: None).train()
    out = tmp_path / "eval"
    assert main(["eval", "--run", str(run), "--task", "mqar", "needle_single", "common_words", "--lengths", "400,800",
                 "--n", "2", "--perplexity", "--ppl-windows", "2", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((out / "eval.json").read_text())
    assert {(r["task"], r["length"]) for r in rows} == {(t, n) for t in ("mqar", "needle_single", "common_words")
                                                        for n in (400, 800)}
    assert all(set(r) == {"task", "length", "accuracy", "n", "seconds", "peak_gib"} and 0 <= r["accuracy"] <= 1
               for r in rows)
    assert all(r["seconds"] > 0 and r["peak_gib"] is None for r in rows)  # peak memory is CUDA's only
    assert {r["n"] for r in rows if r["task"] == "mqar"} == {12}  # 2 sequences x the run's 6 recall queries
    assert {r["n"] for r in rows if r["task"] != "mqar"} == {2}
    ppl = json.loads((out / "perplexity.json").read_text())
    assert {r["length"] for r in ppl} == {400, 800} and all(r["loss"] > 0 for r in ppl)
    for name in ("eval.png", "perplexity.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "needle_single" in printed and "positions" in printed
    cost = printed[printed.index("peak GiB"):].splitlines()[1:7]  # one line per task and length, CPU: no peak
    assert len(cost) == 6 and all(float(line.split()[2]) >= 0 and line.split()[3] == "-" for line in cost)
    assert "loss by position:" in printed


def test_eval_without_held_out_text_says_what_is_missing(tmp_path, capsys):
    assert main(["eval", "--run", str(tmp_path / "nothing"), "--perplexity-only"]) == 1
    assert "error" in capsys.readouterr().err
