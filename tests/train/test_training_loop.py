"""The training-loop skeleton (k3.train.loop) with the run directory (k3.train.run_dir), on a trainer of a few
lines: cadence, windowed metric reads, the time budget, exact resume, and a save that dies half-way."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from k3.checkpoint import native
from k3.checkpoint.native import load_checkpoint
from k3.runtime import set_rng_state
from k3.train import loop as loop_module
from k3.train.loop import Cadence, LoopHooks, TrainingLoop
from k3.train.metrics import read_metrics
from k3.train.run_dir import RunDirectory, RunKind

KIND = RunKind(key="tiny", settings_file="tiny_config.json", command="tiny train", what="a tiny run")


class TinyTrainer:
    """A linear regression trained by AdamW on batches drawn from the global torch RNG, so that an exact resume
    needs the model, the optimizer and the RNG states back from the checkpoint."""

    def __init__(self, out: Path, resume: bool = False, max_steps: int = 6, save_every: int = 2,
                 eval_every: int | None = 3, log_every: int = 1, time_budget_s: float | None = None) -> None:
        self.run_dir = RunDirectory(out, KIND)
        state = self.run_dir.open(resume)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.step = 0
        if state is None:
            self.run_dir.check_new()
            self.run_dir.create()
            self.run_dir.write_settings({"max_steps": max_steps}, {})
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            set_rng_state(state["rng"])
            self.step = int(state["step"])
        self.metrics = self.run_dir.metrics(self.step, resumed=state is not None)
        self.calls: list[tuple[str, int]] = []
        self.loop = TrainingLoop(Cadence(max_steps, save_every, eval_every, log_every),
                                 LoopHooks(step=self.train_step, position=lambda: self.step, save=self.save,
                                           read=self.read, evaluate=self.evaluate, plot=self.plot),
                                 metrics=self.metrics, desc="tiny", show_progress=False, log=lambda *_: None,
                                 time_budget_s=time_budget_s)

    def train_step(self) -> tuple[int, torch.Tensor]:
        x = torch.randn(8, 4)
        loss = torch.nn.functional.mse_loss(self.model(x), x.sum(-1, keepdim=True))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1
        self.calls.append(("step", self.step))
        return self.step, loss.detach()  # read later, a window at a time

    def read(self, pending: list[tuple[int, torch.Tensor]], seconds: float) -> list[dict]:
        self.calls.append(("read", [step for step, _ in pending]))
        return [{"step": step, "loss": float(loss)} for step, loss in pending]

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.calls.append(("evaluate", self.step))
        x = torch.linspace(-1, 1, 16).reshape(4, 4)
        return {"val_loss": float(torch.nn.functional.mse_loss(self.model(x), x.sum(-1, keepdim=True)))}

    def save(self) -> None:
        self.calls.append(("save", self.step))
        self.run_dir.save(self.model.state_dict(), self.optimizer.state_dict(), {}, {"kind": "tiny"}, self.step)

    def plot(self) -> None:
        self.calls.append(("plot", self.step))


def calls(trainer: TinyTrainer, kind: str) -> list:
    return [value for name, value in trainer.calls if name == kind]


def test_cadence_every_n_steps_and_always_at_the_last():
    cadence = Cadence(max_steps=7, save_every=3, eval_every=2, log_every=4)
    assert [s for s in range(1, 8) if cadence.saves(s)] == [3, 6, 7]
    assert [s for s in range(1, 8) if cadence.evaluates(s)] == [2, 4, 6, 7]
    assert [s for s in range(1, 8) if cadence.logs(s)] == [4, 7]
    assert not any(Cadence(max_steps=7, save_every=3).evaluates(s) for s in range(1, 8))
    with pytest.raises(ValueError, match="save_every must be at least 1, got 0"):
        Cadence(max_steps=7, save_every=0)


def test_the_loop_evaluates_saves_reads_and_writes_on_its_cadence(tmp_path):
    trainer = TinyTrainer(tmp_path / "run", max_steps=7, save_every=3, eval_every=5, log_every=4)
    result = trainer.loop.run()
    assert (result.start_step, result.steps, result.stopped) == (0, 7, "max_steps")
    assert calls(trainer, "evaluate") == [0, 5, 7] and calls(trainer, "save") == [3, 6, 7]
    # Windows end at the session's first step, at log points (4) and before every evaluation or save.
    assert calls(trainer, "read") == [[1], [2, 3], [4], [5], [6], [7]]
    # The plot is redrawn at every evaluation (after its save), and not again at the end when that one is current.
    assert calls(trainer, "plot") == [5, 7]
    assert trainer.calls[-3:] == [("evaluate", 7), ("save", 7), ("plot", 7)]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(8))
    assert records[0] == {"step": 0, **result.first_eval}
    assert [r["step"] for r in records if "val_loss" in r] == [0, 5, 7]
    assert records[-1]["val_loss"] == result.last_eval["val_loss"]
    assert load_checkpoint(tmp_path / "run")["step"] == 7


def test_stop_at_stops_like_an_interrupted_run_without_a_save_of_its_own(tmp_path):
    trainer = TinyTrainer(tmp_path / "run", max_steps=6, save_every=2, log_every=3)
    result = trainer.loop.run(stop_at=3)
    assert (result.steps, result.stopped) == (3, "stop_at")
    assert calls(trainer, "save") == [2] and calls(trainer, "read")[-1] == [3]  # step 3 is read, not saved
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_spent_time_budget_stops_evaluates_saves_and_reports_the_steps(tmp_path, monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(loop_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    trainer = TinyTrainer(tmp_path / "run", max_steps=100, save_every=50, eval_every=50, log_every=10,
                          time_budget_s=25.0)
    step = trainer.train_step

    def ten_seconds_a_step():
        clock.now += 10.0
        return step()

    trainer.loop.hooks.step = ten_seconds_a_step
    result = trainer.loop.run()
    # Steps end at 10, 20 and 30 s: step 3 is past the budget, read at once; the loop stops before step 4.
    assert (result.steps, result.stopped, result.seconds) == (3, "time_budget", 30.0)
    assert calls(trainer, "read") == [[1], [2, 3]]
    assert calls(trainer, "evaluate") == [0, 3] and calls(trainer, "save") == [3]
    assert calls(trainer, "plot") == [3]  # at the end, showing the budget stop's evaluation
    assert load_checkpoint(tmp_path / "run")["step"] == 3
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 3] and records[-1] == {"step": 3, **result.last_eval}


def test_a_run_resumed_from_its_checkpoint_equals_the_unbroken_run(tmp_path):
    unbroken = TinyTrainer(tmp_path / "unbroken", log_every=4)
    unbroken.loop.run()
    broken = TinyTrainer(tmp_path / "broken", log_every=4)
    broken.loop.run(stop_at=5)  # the last checkpoint is step 4: step 5 is done again after the resume
    assert load_checkpoint(tmp_path / "broken")["step"] == 4
    with pytest.raises(ValueError, match="already holds a tiny run .*pass --resume"):
        TinyTrainer(tmp_path / "broken")
    resumed = TinyTrainer(tmp_path / "broken", resume=True, log_every=4)
    result = resumed.loop.run()
    assert (result.start_step, result.steps, result.first_eval) == (4, 6, None)
    assert read_metrics(tmp_path / "broken" / "metrics.jsonl") == read_metrics(tmp_path / "unbroken" / "metrics.jsonl")
    for name, value in unbroken.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def test_a_save_that_dies_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = TinyTrainer(tmp_path / "run", max_steps=4, save_every=2)
    trainer.loop.run(stop_at=3)
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()

    def dies_half_way(obj, handle, *args, **kwargs):
        handle.write(b"PK\x03\x04 half a zip file")
        raise OSError("disk full")

    monkeypatch.setattr(native.torch, "save", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        trainer.loop.run()  # step 4's save dies
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before
    assert not [p for p in os.listdir(tmp_path / "run") if p.endswith(".tmp")]
    monkeypatch.undo()
    resumed = TinyTrainer(tmp_path / "run", resume=True, max_steps=4, save_every=2)
    assert resumed.step == 2 and resumed.loop.run().steps == 4


def test_a_rank_without_metrics_writes_no_rows(tmp_path):
    trainer = TinyTrainer(tmp_path / "run", max_steps=2)
    trainer.loop.metrics = None
    assert trainer.loop.run().steps == 2
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_resume_refuses_a_directory_without_a_checkpoint_or_with_another_commands(tmp_path):
    with pytest.raises(FileNotFoundError, match="--resume given but .* holds no finished checkpoint"):
        RunDirectory(tmp_path / "none", KIND).open(resume=True)
    TinyTrainer(tmp_path / "run", max_steps=2).loop.run()
    other = RunKind(key="rl", settings_file="rl_config.json", command="k3 rl", what="an RL run")
    with pytest.raises(ValueError, match="was not written by `k3 rl` \\(no rl settings in it\\)"):
        RunDirectory(tmp_path / "run", other).open(resume=True)


def test_a_new_run_refuses_a_directory_of_other_files_and_clears_its_own_leftovers(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already holds files that tiny train did not write"):
        RunDirectory(foreign, KIND).check_new(leftovers=("data",))
    assert (foreign / "notes.txt").read_text() == "mine"
    attempt = RunDirectory(tmp_path / "attempt", KIND)
    attempt.create()
    (attempt.out / "data").mkdir()
    (attempt.out / "data" / "train.bin").write_bytes(b"old")
    attempt.check_new(leftovers=("data",))
    assert not (attempt.out / "data").exists()
