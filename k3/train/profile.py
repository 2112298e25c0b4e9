"""`k3 train --profile DIR`: where a training step's time goes, from torch.profiler over a few steps.

The first steps of a run compile kernels (Triton, fla, Inductor) and are not representative, so the window starts
PROFILE_AFTER steps into the run and lasts PROFILE_STEPS steps. At its end DIR/profile_steps_A-B.txt gets:
- the steps' wall seconds against the device's kernel time and the host's op time per step, which tells a
  GPU-bound step (kernel time near the wall time) from a host-bound one;
- the host synchronisations per step (reads of a device value on the host, stream and device syncs): each one
  drains the GPU's queue, so the host cannot launch ahead of it;
- the kernel table by self device time and the op table by self host time (torch.profiler's own tables).
"""

from __future__ import annotations

from pathlib import Path

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


class StepProfiler:
    """Call `before(step)` before and `after(step, seconds)` after each training step (`step` counts from 1);
    it profiles steps first..first + steps - 1 and writes the report when the last of them ends."""

    def __init__(self, out_dir: str | Path, first_step: int, device: torch.device,
                 steps: int = PROFILE_STEPS) -> None:
        if steps < 1:
            raise ValueError(f"the profile needs at least one step, got {steps}")
        self.dir = Path(out_dir)
        self.first, self.last = first_step, first_step + steps - 1
        self.cuda = device.type == "cuda"
        self.seconds: list[float] = []
        self._profile = None
        self.written: Path | None = None

    def before(self, step: int) -> None:
        if step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            if self.cuda:
                torch.cuda.synchronize()  # the window holds only the profiled steps' kernels
            self._profile = profile(activities=activities)
            self._profile.__enter__()

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
        path = self.dir / f"profile_steps_{self.first}-{last}.txt"
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, ("\n".join(lines) + "\n").encode("utf-8"))
        return path
