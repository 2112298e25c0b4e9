import json
import math
import os
from pathlib import Path

import pytest
import torch

from k3.checkpoint import native
from k3.checkpoint.native import load_checkpoint, load_model_state, model_from_checkpoint
from k3.cli import main
from k3.config import ModelConfig
from k3.model import K3ForCausalLM
from k3.train.metrics import read_metrics
from k3.train.optim import lr_at
from k3.train.trainer import NonFiniteLossError, Trainer


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def test_run_writes_metrics_plot_checkpoint_and_learns(tmp_path, corpus_dir, small_config):
    run = tmp_path / "run"
    config = small_config(run, corpus_dir, max_steps=12, eval_every=12)
    summary = Trainer(config, show_progress=False).train()
    records = read_metrics(run / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    for key in ("loss", "lr", "tokens_per_s", "step_seconds", "maxvio", "maxvio_per_layer"):
        assert key in steps[0]
    assert all(r["step_seconds"] > 0 for r in steps) and summary["first_step_s"] == steps[0]["step_seconds"]
    assert set(steps[0]["maxvio_per_layer"]) == {"1", "2", "3"}  # debug: layers 1..3 are MoE
    # Published QB (debug routes with quantile balancing): one update per MoE layer and step; a packed batch holds
    # at least one document per row.
    assert config.optim.qb_iters == 0 and all(r["qb_updates_mean"] == r["qb_updates_max"] == 1 for r in steps)
    assert all(r["documents"] >= config.data.batch_size for r in steps)
    assert records[0] == {"step": 0, "val_loss": summary["first_val_loss"]}
    assert summary["last_val_loss"] < summary["first_val_loss"] - 0.5
    assert (run / "metrics.png").stat().st_size > 1000
    state = load_checkpoint(run)
    assert state["step"] == 12 and state["data"]["batches_made"] == 12
    assert any(k.endswith("e_score_correction_bias") for k in state["model"])
    assert any(float(v.abs().sum()) > 0 for k, v in state["model"].items() if k.endswith("e_score_correction_bias"))
    assert "tokenizer.json" in state["tokenizer"]


def test_resume_reaches_the_same_losses_as_an_unbroken_run(tmp_path, corpus_dir, small_config):
    unbroken = tmp_path / "unbroken"
    Trainer(small_config(unbroken, corpus_dir), show_progress=False).train()
    broken = tmp_path / "broken"
    # Stop after step 5: the last checkpoint is from step 4, so step 5 is redone after the resume.
    Trainer(small_config(broken, corpus_dir), show_progress=False).train(stop_at=5)
    assert load_checkpoint(broken)["step"] == 4
    Trainer(small_config(broken, corpus_dir), resume=True, show_progress=False).train()
    assert losses(broken) == losses(unbroken)
    assert len(losses(broken)) == 6
    a, b = load_checkpoint(unbroken)["model"], load_checkpoint(broken)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path, corpus_dir, small_config, monkeypatch):
    run = tmp_path / "run"
    trainer = Trainer(small_config(run, corpus_dir, max_steps=4, save_every=2), show_progress=False)
    trainer.train(stop_at=2)
    before = (run / "checkpoint.pt").read_bytes()

    def dies_half_way(obj, handle, *args, **kwargs):
        handle.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(native.torch, "save", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert (run / "checkpoint.pt").read_bytes() == before
    assert load_checkpoint(run)["step"] == 2
    assert not [p for p in os.listdir(run) if p.endswith(".tmp")]


def poison_before_step(trainer: Trainer, monkeypatch, step: int) -> None:
    """Step `step`'s forward reads a NaN weight, as a diverging run's would: the eager and the graphed (CUDA) step
    alike, where a patched _forward reaches only the eager one."""
    next_batch = trainer._next_batch

    def poisoned():
        if trainer.step == step - 1:
            with torch.no_grad():
                trainer.model.model.norm.weight.fill_(float("nan"))
        return next_batch()

    monkeypatch.setattr(trainer, "_next_batch", poisoned)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus_dir, small_config, monkeypatch):
    run = tmp_path / "run"
    trainer = Trainer(small_config(run, corpus_dir, max_steps=6, save_every=2), show_progress=False)
    poison_before_step(trainer, monkeypatch, 4)
    with pytest.raises(NonFiniteLossError, match="loss became nan at step 4.*last good checkpoint.*step 2"):
        trainer.train()
    state = load_checkpoint(run)
    assert state["step"] == 2
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    last = read_metrics(run / "metrics.jsonl")[-1]
    assert last["step"] == 4 and last["loss"] is None and last["non_finite"] == ["loss"]


def test_nan_loss_in_the_last_partial_metrics_window_stops_before_the_final_save(tmp_path, corpus_dir, small_config,
                                                                                 monkeypatch):
    """Metrics read every 10 steps (the CUDA default) in a 7-step run: steps 5-7 are read only at the end, and a
    NaN loss at step 6 still stops the run before the final save, the step-4 checkpoint kept."""
    run = tmp_path / "run"
    trainer = Trainer(small_config(run, corpus_dir, max_steps=7, save_every=4, eval_every=100, log_every=10),
                      show_progress=False)
    poison_before_step(trainer, monkeypatch, 6)
    with pytest.raises(NonFiniteLossError, match="loss became nan at step 6.*last good checkpoint.*step 4"):
        trainer.train()
    assert load_checkpoint(run)["step"] == 4
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] is None and all(math.isfinite(r["loss"]) for r in records[:-1])
    assert [r.get("window_steps", 1) for r in records[:-1]] == [1, 3, 3, 3, 3]  # read at 1, at the save, at the end


def test_corrupt_and_mismatched_checkpoints(tmp_path, corpus_dir, small_config):
    (tmp_path / "checkpoint.pt").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(RuntimeError, match="corrupt or truncated"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "elsewhere")
    run = tmp_path / "run"
    Trainer(small_config(run, corpus_dir, max_steps=2), show_progress=False).train()
    state = load_checkpoint(run)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes((run / "checkpoint.pt").read_bytes()[:5000])
    with pytest.raises(RuntimeError, match="corrupt or truncated"):
        load_checkpoint(truncated)
    other = K3ForCausalLM(ModelConfig.from_preset("debug", vocab_size=320, hidden_size=32))
    with pytest.raises(ValueError, match="does not match the model config.*shape mismatches"):
        load_model_state(other, state["model"], "run")
    assert model_from_checkpoint(state).config.vocab_size == 320
    with pytest.raises(ValueError, match="already holds a run.*--resume"):
        Trainer(small_config(run, corpus_dir), show_progress=False)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, 100, 1.0, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


def test_cli_bad_input_messages(tmp_path, corpus_dir, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), "--data", str(tmp_path / "missing")]) == 1
    assert "data path" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    assert main(["train", "--out", str(tmp_path / "r2"), "--data", str(empty)]) == 1
    assert "corpus is empty" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path / "r3"), "--resume"]) == 1
    assert "holds no finished checkpoint" in capsys.readouterr().err


def test_cli_train_then_resume(tmp_path, corpus_dir, capsys):
    run = tmp_path / "run"
    args = ["train", "--preset", "debug", "--out", str(run), "--data", str(corpus_dir), "--max-steps", "2",
            "--seq-len", "32", "--batch-size", "1", "--eval-batches", "1", "--val-fraction", "0.2"]
    assert main(args) == 0
    assert main(["train", "--out", str(run), "--resume", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-2])["steps"] == 3
    assert sorted(losses(run)) == [1, 2, 3]
    assert math.isfinite(losses(run)[3])


# The profile tests' model: parsing the profiler's events (one per op, ~2x as many at the preset's 4 layers) is
# most of such a test's time, and the report is the same at any depth.
PROFILED_MODEL = {"vocab_size": 320, "num_layers": 2, "full_attn_layers": [2]}


def test_profile_reports_a_window_of_steps_after_the_first_ones(tmp_path, corpus_dir, small_config):
    """`--profile DIR`: steps 4-6 under torch.profiler (the first three compile kernels on a GPU), one report
    with the per-step times, the host syncs and the op table; the run itself is unchanged."""
    from k3.train.profile import PROFILE_AFTER, PROFILE_STEPS

    run = tmp_path / "run"
    trainer = Trainer(small_config(run, corpus_dir, max_steps=7, eval_every=7, model_overrides=PROFILED_MODEL),
                      show_progress=False, profile=tmp_path / "prof")
    summary = trainer.train()
    first, last = PROFILE_AFTER + 1, PROFILE_AFTER + PROFILE_STEPS
    report = tmp_path / "prof" / f"profile_steps_{first}-{last}.txt"
    assert summary["profile"] == str(report) and summary["steps"] == 7
    text = report.read_text()
    assert text.startswith(f"k3 train profile: steps {first}-{last} ({PROFILE_STEPS} steps)")
    seconds = [r["step_seconds"] for r in read_metrics(run / "metrics.jsonl") if first <= r.get("step", 0) <= last
               and "loss" in r]
    wall = float(text.splitlines()[1].split()[3])
    assert wall == pytest.approx(1e3 * sum(seconds) / len(seconds), abs=0.15)
    assert "host synchronisations per step:" in text and "Optimizer.step#" in text  # the op table of the steps
    if not trainer.graph_step:  # a CUDA graph replays the model's matmuls inside one launch, not as aten ops
        assert "aten::mm" in text
    assert sorted(tmp_path.glob("prof/*")) == [report.with_suffix(".json"), report]
    assert json.loads(report.with_suffix(".json").read_text())["wall_ms"] == pytest.approx(wall, abs=0.15)


def test_profile_of_a_run_that_stops_inside_the_window_is_still_written(tmp_path, corpus_dir, small_config):
    run = tmp_path / "run"
    summary = Trainer(small_config(run, corpus_dir, max_steps=5, eval_every=5, model_overrides=PROFILED_MODEL),
                      show_progress=False, profile=tmp_path / "prof").train()
    assert summary["profile"].endswith("profile_steps_4-5.txt")
    assert "steps 4-5 (2 steps)" in Path(summary["profile"]).read_text()


def test_profile_at_moves_the_window_to_a_later_step(tmp_path, corpus_dir, small_config):
    run = tmp_path / "run"
    summary = Trainer(small_config(run, corpus_dir, max_steps=8, eval_every=8, model_overrides=PROFILED_MODEL),
                      show_progress=False, profile=tmp_path / "prof", profile_at=6).train()
    assert summary["profile"].endswith("profile_steps_6-8.txt")
    assert "steps 6-8 (3 steps)" in Path(summary["profile"]).read_text()
    with pytest.raises(ValueError, match="needs a profile directory"):
        Trainer(small_config(tmp_path / "other", corpus_dir), show_progress=False, profile_at=6)


def test_profile_at_needs_profile_on_the_command_line(tmp_path, corpus_dir):
    with pytest.raises(SystemExit, match="add --profile DIR"):
        main(["train", "--preset", "debug", "--data", str(corpus_dir), "--out", str(tmp_path / "run"),
              "--max-steps", "1", "--profile-at", "3"])


def test_optimizer_is_fused_only_for_plain_cuda_parameters():
    from k3.train.optim import build_optimizer, fused_pays

    model = K3ForCausalLM(ModelConfig.from_preset("debug"))
    optimizer = build_optimizer(model, 1e-3, 0.1)
    assert not optimizer.defaults["fused"] and not fused_pays(list(model.parameters()))
    assert not fused_pays([])
    if torch.cuda.is_available():
        cuda_model = K3ForCausalLM(ModelConfig.from_preset("debug")).cuda()
        assert build_optimizer(cuda_model, 1e-3, 0.1).defaults["fused"]


def test_profile_counts_each_kernel_once():
    """A host op's self device time repeats its kernels'; only device events (not user annotations) count."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from k3.train.profile import _kernel_time_us

    events = [SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=100.0, is_user_annotation=False),
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=100.0, is_user_annotation=False),
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=40.0, is_user_annotation=True)]
    assert sum(_kernel_time_us(e) for e in events) == 100.0


STEP_VALUES = ("loss", "lr", "grad_norm", "tokens", "maxvio", "maxvio_per_layer", "qb_updates_max", "qb_updates_mean",
               "documents", "graphed", "epoch", "seq_len", "val_loss")


def step_values(run: Path) -> list[dict]:
    """Every metrics record without its timings (which differ from run to run)."""
    return [{k: r[k] for k in ("step", *STEP_VALUES) if k in r} for r in read_metrics(run / "metrics.jsonl")]


def test_metrics_read_every_n_steps_equal_those_read_every_step(tmp_path, corpus_dir, small_config):
    every = tmp_path / "every"
    Trainer(small_config(every, corpus_dir, max_steps=7, log_every=1, device="cpu"), show_progress=False).train()
    windowed = tmp_path / "windowed"
    Trainer(small_config(windowed, corpus_dir, max_steps=7, log_every=4, device="cpu"), show_progress=False).train()
    assert step_values(windowed) == step_values(every)
    steps = [r for r in read_metrics(windowed / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 8))
    # Read at the first step, then at the saves (every 2 steps, eval_every 3) and window ends: a window's steps
    # share its mean step time.
    assert "window_steps" not in steps[0] and steps[4]["window_steps"] == 2  # steps 5-6: the save at 6
    assert steps[4]["step_seconds"] == steps[5]["step_seconds"] > 0


def test_resume_is_exact_with_metrics_read_every_n_steps(tmp_path, corpus_dir, small_config):
    unbroken = tmp_path / "unbroken"
    Trainer(small_config(unbroken, corpus_dir, log_every=5, save_every=3, device="cpu"), show_progress=False).train()
    broken = tmp_path / "broken"
    Trainer(small_config(broken, corpus_dir, log_every=5, save_every=3, device="cpu"), show_progress=False).train(stop_at=5)
    assert load_checkpoint(broken)["step"] == 3
    Trainer(small_config(broken, corpus_dir), resume=True, show_progress=False).train()
    assert step_values(broken) == step_values(unbroken)
    a, b = load_checkpoint(unbroken)["model"], load_checkpoint(broken)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_log_every_must_not_be_negative(tmp_path, corpus_dir, small_config):
    with pytest.raises(ValueError, match="log_every must be 0"):
        small_config(tmp_path / "run", corpus_dir, log_every=-1)


def test_a_window_reads_steps_whose_device_values_differ_in_length(tmp_path, corpus_dir, small_config):
    """A graphed step of the iterated QB counts its updates on the device, an eager step of the same run (a batch
    with more documents than the graph holds) on the host: one window holds both."""
    trainer = Trainer(small_config(tmp_path / "run", corpus_dir, device="cpu"), show_progress=False)
    host = {"step": 1, "lr": 0.1, "tokens": 64, "host_seconds": 0.0, "layers": [1, 2], "documents": 3,
            "graphed": True, "epoch": 0.0, "seq_len": 32}
    device_counted = ({**host, "qb_updates": [None, None]}, torch.tensor([2.5, 1.0, 0.25, 0.5, 4.0, 3.0],
                                                                         dtype=torch.float64))
    host_counted = ({**host, "step": 2, "graphed": False, "qb_updates": [7, 9]},
                    torch.tensor([2.0, 0.5, 0.125, 0.75], dtype=torch.float64))
    first, second = trainer._read_window([device_counted, host_counted], seconds=1.0)
    assert (first["loss"], first["grad_norm"], first["maxvio"], first["qb_updates_max"]) == (2.5, 1.0, 0.5, 4)
    assert first["maxvio_per_layer"] == {"1": 0.25, "2": 0.5} and first["qb_updates_mean"] == 3.5
    assert (second["loss"], second["maxvio"], second["qb_updates_max"], second["qb_updates_mean"]) == (2.0, 0.75, 9, 8)
    assert first["step_seconds"] == second["step_seconds"] == 0.5 and first["tokens_per_s"] == 128
