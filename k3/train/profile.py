"""`k3 train --profile DIR`: where a training step's time goes, from torch.profiler over a few steps.

The first steps of a run compile kernels (Triton, fla, Inductor) and are not representative, so the window starts
PROFILE_AFTER steps into the run and lasts PROFILE_STEPS steps. At its end DIR/profile_steps_A-B.txt gets:
- the steps' wall seconds against the device's kernel time and the host's op time per step, which tells a
  GPU-bound step (kernel time near the wall time) from a host-bound one;
- the host synchronisations per step (reads of a device value on the host, stream and device syncs): each one
  drains the GPU's queue, so the host cannot launch ahead of it;
- the kernel table by self device time and the op table by self host time (torch.profiler's own tables);
- in a run with image-text data, the step split into the vision tower (+ projector) forward and backward, the
  language model's forward and backward, and the rest (data, optimizer), timed by VisionSplit; also written as
  DIR/profile_steps_A-B.json for scripts.
"""

from __future__ import annotations

from pathlib import Path

import json
import time
from contextlib import contextmanager

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from k3.atomic import atomic_write_bytes

PROFILE_AFTER = 3  # steps before the window (the first compiles kernels; the next ones settle allocator and caches)
PROFILE_STEPS = 3
ROWS = 40
# The events that block the host until the device catches up.
SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def _kernel_time_us(event) -> float:
    """An event's device time when it is a kernel (or copy) on the device; 0 for host ops, whose self device
    time repeats their kernels' (as torch.profiler's own "Self CUDA time total" counts)."""
    if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
        return 0.0
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0) or 0.0


class VisionSplit:
    """Times the vision tower's share of each profiled step, on the device's clock (CUDA events; the host's clock
    on a CPU, where ops run as they are called):
        split.start()                      # the step's forward begins
        with split.vision_forward():       # the tower and projector
            embeds = vision(pixels, grid)
        split.watch(embeds)                # its backward starts when autograd reaches the projector's last op
        loss.backward(); split.backward_done()
    Autograd runs the ready node made last first, so the tower's nodes (the graph's oldest but the embedding
    table's) run after the language model's backward: the tower's backward is watch's mark to the end."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.active = False
        self.steps: list[dict[str, float]] = []  # ms per profiled step
        self._marks: dict[str, object] = {}

    def _mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks[name] = event
        else:
            self._marks[name] = time.perf_counter()

    def _ms(self, a: str, b: str) -> float:
        if a not in self._marks or b not in self._marks:
            return 0.0
        if self.cuda:
            self._marks[b].synchronize()
            return self._marks[a].elapsed_time(self._marks[b])
        return 1e3 * (self._marks[b] - self._marks[a])

    def start(self) -> None:
        if self.active:
            self._marks = {}
            self._mark("start")

    @contextmanager
    def vision_forward(self):
        if self.active:
            self._mark("vision_forward")
        yield
        if self.active:
            self._mark("vision_forward_end")

    def watch(self, image_embeds: torch.Tensor) -> None:
        if self.active and image_embeds.grad_fn is not None:  # no grad_fn: tower and projector frozen
            image_embeds.grad_fn.register_prehook(lambda grads: self._mark("vision_backward"))

    def backward_done(self) -> None:
        if not self.active or "start" not in self._marks:
            return
        self._mark("backward_end")
        forward_backward = self._ms("start", "backward_end")
        vision = self._ms("vision_forward", "vision_forward_end") + self._ms("vision_backward", "backward_end")
        self.steps.append({"forward_backward": forward_backward, "vision_forward":
                           self._ms("vision_forward", "vision_forward_end"),
                           "vision_backward": self._ms("vision_backward", "backward_end"),
                           "language_model": forward_backward - vision})


class StepProfiler:
    """Call `before(step)` before and `after(step, seconds)` after each training step (`step` counts from 1);
    it profiles steps first..first + steps - 1 and writes the report when the last of them ends."""

    def __init__(self, out_dir: str | Path, first_step: int, device: torch.device,
                 steps: int = PROFILE_STEPS, vision: bool = False) -> None:
        if steps < 1:
            raise ValueError(f"the profile needs at least one step, got {steps}")
        self.dir = Path(out_dir)
        self.first, self.last = first_step, first_step + steps - 1
        self.cuda = device.type == "cuda"
        self.seconds: list[float] = []
        self._profile = None
        self.written: Path | None = None
        self.vision_split = VisionSplit(device) if vision else None  # the trainer's image path reports to it

    def before(self, step: int) -> None:
        if step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            if self.cuda:
                torch.cuda.synchronize()  # the window holds only the profiled steps' kernels
            self._profile = profile(activities=activities)
            self._profile.__enter__()
            if self.vision_split is not None:
                self.vision_split.active = True

    def after(self, step: int, seconds: float) -> None:
        if self._profile is None:
            return
        self.seconds.append(seconds)
        if step == self.last:
            self.close()

    def close(self) -> None:
        """Ends the window and writes the report; a run that stops inside the window still writes what it
        profiled. Nothing to do outside the window."""
        if self._profile is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        if self.vision_split is not None:
            self.vision_split.active = False
        self.written = self._write(self._profile)
        self._profile = None

    def _write(self, prof) -> Path:
        events = prof.key_averages()
        steps = max(1, len(self.seconds))
        last = self.first + len(self.seconds) - 1
        wall_ms = 1e3 * sum(self.seconds) / steps
        device_ms = sum(_kernel_time_us(e) for e in events) / 1e3 / steps
        host_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
        syncs = {e.key: e.count / steps for e in events if e.key in SYNC_EVENTS}
        lines = [f"k3 train profile: steps {self.first}-{last} ({len(self.seconds)} steps)",
                 f"wall per step: {wall_ms:.1f} ms (the trainer's step_seconds)",
                 f"self host (CPU) op time per step: {host_ms:.1f} ms"]
        if self.cuda:
            lines.append(f"self device (kernel) time per step: {device_ms:.1f} ms "
                         f"({100 * device_ms / wall_ms if wall_ms else 0:.0f}% of the wall: "
                         f"{'GPU-bound' if device_ms > 0.8 * wall_ms else 'the GPU waits on the host'})")
        lines.append("host synchronisations per step: " + (", ".join(f"{k} {v:g}" for k, v in sorted(syncs.items()))
                                                           or "none"))
        if self.cuda:
            sort = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
            lines += ["", f"## kernels and ops by self device time (all {len(self.seconds)} steps)",
                      events.table(sort_by=sort, row_limit=ROWS)]
        lines += ["", f"## ops by self host time (all {len(self.seconds)} steps)",
                  events.table(sort_by="self_cpu_time_total", row_limit=ROWS)]
        split = self._split(wall_ms)
        if split:
            lines[3:3] = [f"vision tower + projector per step: forward {split['vision_forward_ms']:.1f} ms, backward "
                          f"{split['vision_backward_ms']:.1f} ms ({split['vision_share']:.0%} of the step); language "
                          f"model forward + backward {split['language_model_ms']:.1f} ms "
                          f"({split['language_model_share']:.0%}); the rest (data, optimizer) "
                          f"{split['other_ms']:.1f} ms"]
        path = self.dir / f"profile_steps_{self.first}-{last}.txt"
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
        summary = {"steps": [self.first, last], "wall_ms": wall_ms, "device_ms": device_ms if self.cuda else None,
                   "host_ms": host_ms, **split}
        atomic_write_bytes(path.with_suffix(".json"), (json.dumps(summary, indent=1) + "\n").encode("utf-8"))
        return path

    def _split(self, wall_ms: float) -> dict[str, float]:
        """Mean ms per step of the tower's forward and backward, the language model's and the rest; {} without
        images."""
        steps = self.vision_split.steps if self.vision_split is not None else []
        if not steps:
            return {}
        mean = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
        vision = mean["vision_forward"] + mean["vision_backward"]
        return {"vision_forward_ms": mean["vision_forward"], "vision_backward_ms": mean["vision_backward"],
                "language_model_ms": mean["language_model"], "other_ms": max(0.0, wall_ms - mean["forward_backward"]),
                "vision_share": vision / wall_ms if wall_ms else 0.0,
                "language_model_share": mean["language_model"] / wall_ms if wall_ms else 0.0}
