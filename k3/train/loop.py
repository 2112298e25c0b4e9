"""The training-loop skeleton of every k3 trainer (k3 train, sft, rl, distill).

The trainer supplies what differs (LoopHooks: its optimizer step, how a step's values become metrics records,
its evaluation, its checkpoint, its plot); the loop owns when each happens and what every run shares:

    step 0          a new run evaluates once before training and writes {"step": 0, **evaluation}
    every step      the trainer's step; the progress bar
    log points      the pending steps' records are read together (every log_every steps, the session's first
                    step, before an evaluation or a save, and where the loop stops): one host sync per window
    eval points     every eval_every steps and at the last: the evaluation joins the step's record, and (after a
                    save) the plot is redrawn, at most once a minute, so a long run's curves can be read as it runs
    save points     every save_every steps and at the last: the trainer's atomic checkpoint
    stop            at max_steps; at stop_at (as an interrupted run would: no extra save); past the time budget
                    (evaluate, write that row, save, then report the steps run)
    end             the plot (unless the last evaluation's is current)

A resumed run is the same loop started at the checkpoint's step: the trainer restores its state (model, optimizer,
data position, RNG) from the run directory (k3.train.run_dir) before `run`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tqdm import tqdm

from k3.train.metrics import MetricsLog

STOPS = ("max_steps", "stop_at", "time_budget")
PLOT_EVERY_S = 60.0  # the least time between two redraws of the plot at evaluations


@dataclass(frozen=True)
class Cadence:
    """When the loop evaluates, saves and reads metrics: every N steps, and always at the last step."""
    max_steps: int
    save_every: int
    eval_every: int | None = None  # None: the trainer has no periodic evaluation
    log_every: int = 1  # steps whose metrics are read together

    def __post_init__(self) -> None:
        for name in ("max_steps", "save_every", "eval_every", "log_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")

    def evaluates(self, step: int) -> bool:
        return self.eval_every is not None and (step % self.eval_every == 0 or step == self.max_steps)

    def saves(self, step: int) -> bool:
        return step % self.save_every == 0 or step == self.max_steps

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps


@dataclass
class LoopHooks:
    """What a trainer supplies to the loop; the loop decides when each is called."""
    step: Callable[[], Any]  # one optimizer step (advancing `position`); returns its pending values
    position: Callable[[], int]  # optimizer steps done so far
    save: Callable[[], None]  # the atomic checkpoint (collective under torchrun: every rank calls it)
    # (pending values of the steps since the last read, the window's seconds) -> their metrics records;
    # None: every step returns its record.
    read: Callable[[list[Any], float], list[dict[str, Any]]] | None = None
    evaluate: Callable[[], dict[str, Any]] | None = None  # values that join the step's record
    plot: Callable[[], None] | None = None
    progress: Callable[[dict[str, Any]], dict[str, str]] | None = None  # the bar's postfix from a record
    describe_first_eval: Callable[[dict[str, Any]], list[str]] = field(default=lambda values: [])  # its log lines


@dataclass
class LoopResult:
    start_step: int
    steps: int  # steps done when the loop stopped (counted from the run's start)
    stopped: str  # one of STOPS
    seconds: float = 0.0  # the session's training time (not the step-0 evaluation, nor a budget stop's save)
    first_eval: dict[str, Any] | None = None  # the step-0 evaluation (a new run)
    last_eval: dict[str, Any] | None = None  # the session's last evaluation


class TrainingLoop:
    """Build with the trainer's cadence and hooks, then `run()`."""

    def __init__(self, cadence: Cadence, hooks: LoopHooks, *, metrics: MetricsLog | None, desc: str,
                 show_progress: bool = True, log: Callable[[str], None] = print,
                 time_budget_s: float | None = None, first_step_note: str | None = None) -> None:
        """metrics: where records go (None: this rank writes none); desc: the progress bar's label;
        first_step_note: shown on the bar while the session's first step runs (a GPU's kernel compiles)."""
        if time_budget_s is not None and time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be a positive number of seconds, got {time_budget_s}")
        self.cadence, self.hooks, self.metrics = cadence, hooks, metrics
        self.desc, self.show_progress, self.log = desc, show_progress, log
        self.time_budget_s, self.first_step_note = time_budget_s, first_step_note
        self._plot_current = False  # the plot shows every record written
        self._plotted_at = -math.inf  # when an evaluation last redrew it (the loop's clock)

    def _write(self, record: dict[str, Any]) -> None:
        self._plot_current = False
        if self.metrics is not None:
            self.metrics.write(record)

    def _read(self, pending: list[Any], seconds: float) -> list[dict[str, Any]]:
        return self.hooks.read(pending, seconds) if self.hooks.read is not None else list(pending)

    def run(self, stop_at: int | None = None) -> LoopResult:
        """Train to the cadence's max_steps, or stop after step `stop_at` (as an interrupted run would: no save
        of its own), or once the time budget is spent. Returns how far it got and why it stopped."""
        hooks, cadence = self.hooks, self.cadence
        result = LoopResult(start_step=hooks.position(), steps=hooks.position(), stopped="max_steps")
        if result.start_step == 0 and hooks.evaluate is not None:
            result.first_eval = hooks.evaluate()
            self._write({"step": 0, **result.first_eval})
            for line in hooks.describe_first_eval(result.first_eval):
                self.log(f"step 0: {line}")
        started = time.perf_counter()

        def over_budget() -> bool:
            return self.time_budget_s is not None and time.perf_counter() - started > self.time_budget_s

        bar = tqdm(total=cadence.max_steps, initial=result.start_step, desc=self.desc, unit="step",
                   disable=not self.show_progress, dynamic_ncols=True)
        pending: list[Any] = []
        read_any = False  # the session's first step is read on its own: its time is the compiles'
        window_started = time.perf_counter()
        try:
            while hooks.position() < cadence.max_steps:
                if stop_at is not None and hooks.position() >= stop_at:
                    result.stopped = "stop_at"
                    break
                if over_budget():
                    result.stopped = "time_budget"
                    break
                if not read_any and self.first_step_note:
                    bar.set_postfix_str(self.first_step_note)
                    bar.refresh()
                pending.append(hooks.step())
                step = hooks.position()
                bar.update(1)
                evaluates, saves = cadence.evaluates(step), cadence.saves(step)
                # A save reads first: a step that must stop the run (a non-finite loss) stops it before the save.
                if not (cadence.logs(step) or not read_any or evaluates or saves
                        or (stop_at is not None and step >= stop_at) or over_budget()):
                    continue
                records = self._read(pending, time.perf_counter() - window_started)
                pending, read_any = [], True
                if evaluates and hooks.evaluate is not None:
                    result.last_eval = hooks.evaluate()
                    records[-1].update(result.last_eval)
                for record in records:
                    self._write(record)
                if hooks.progress is not None:
                    bar.set_postfix(**hooks.progress(records[-1]))
                if saves:
                    hooks.save()
                # A long run's curves, readable while it runs; at most once a PLOT_EVERY_S (a redraw costs
                # about a second of host time, which a GPU step at a 50-step eval cadence would feel).
                if (evaluates and hooks.plot is not None
                        and time.perf_counter() - self._plotted_at >= PLOT_EVERY_S):
                    hooks.plot()
                    self._plot_current, self._plotted_at = True, time.perf_counter()
                window_started = time.perf_counter()
            if pending:  # stopped between reads
                for record in self._read(pending, time.perf_counter() - window_started):
                    self._write(record)
        finally:
            bar.close()
        result.seconds = time.perf_counter() - started
        result.steps = hooks.position()
        if result.stopped == "time_budget":
            if hooks.evaluate is not None:
                result.last_eval = hooks.evaluate()
                self._write({"step": result.steps, **result.last_eval})
            hooks.save()
            self.log(f"time budget of {self.time_budget_s:g} s spent: stopped after step {result.steps} "
                     f"({result.steps - result.start_step} steps this session), "
                     f"{'evaluated and ' if hooks.evaluate is not None else ''}saved")
        if hooks.plot is not None and not self._plot_current:
            hooks.plot()
        return result
