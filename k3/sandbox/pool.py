"""``SandboxPool``: warm sandboxes, a concurrency limit, a snapshot store with GC, and metrics.

A rollout worker asks the pool for a sandbox, uses it, and gives it back:

    pool = SandboxPool(image, warm=4, max_concurrency=16)
    with pool.sandbox() as box:              # a warm one when available
        box.exec("pytest -q")
    with pool.sandbox(snapshot=snap) as box:  # starts from a snapshot (restore of a warm one)
        ...
    pool.close()

A returned sandbox is restored to a clean state (the pool's base snapshot) before it is reused, so
no rollout sees another's files or processes. ``store`` tracks which snapshots are pinned; ``gc``
removes every layer that no live sandbox and no pinned snapshot needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import threading
import time
from collections import defaultdict

from k3.sandbox import memory
from k3.sandbox.api import Sandbox
from k3.sandbox.cgroups import Limits
from k3.sandbox.image import Image, default_image
from k3.sandbox.layers import LayerStore
from k3.sandbox.paths import sandbox_home, scratch_dir


class SnapshotStore:
    """Pins snapshots and collects the layers nobody needs any more."""

    def __init__(self, store: LayerStore) -> None:
        self.layers = store
        self._pins: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def pin(self, snapshot: str) -> None:
        """Keep ``snapshot`` (and the layers below it) through ``gc`` until ``unpin``."""
        self.layers.info(snapshot)  # ValueError for an unknown id
        with self._lock:
            self._pins[snapshot] += 1

    def unpin(self, snapshot: str) -> None:
        with self._lock:
            if self._pins.get(snapshot, 0) <= 0:
                raise ValueError(f"snapshot {snapshot} is not pinned")
            self._pins[snapshot] -= 1
            if not self._pins[snapshot]:
                del self._pins[snapshot]

    def pinned(self) -> list[str]:
        with self._lock:
            return sorted(self._pins)

    def gc(self, in_use: list[list[str]] = (), min_age_s: float = 0.0) -> list[str]:
        """Remove layers not below a pinned snapshot, not in a chain of ``in_use`` and not in a
        chain of any sandbox running from this scratch directory; return the removed ids.

        ``min_age_s`` spares young layers (a snapshot just taken but not yet pinned elsewhere).
        """
        keep: set[str] = set()
        for snapshot in self.pinned():
            keep.update(self.layers.chain(snapshot))
        for chain in in_use:
            keep.update(chain)
        keep.update(_chains_of_running_sandboxes(self.layers.home))
        now = time.time()
        removed = []
        for info in self.layers.list():
            if info.id not in keep and now - info.created >= min_age_s:
                self.layers.remove(info.id)
                removed.append(info.id)
        memory.collect(self.layers.home, min_age_s)  # memory images no remaining layer names
        return removed


def _chains_of_running_sandboxes(scratch: str) -> set[str]:
    # Every sandbox writes the chain it runs on next to its upper (see Sandbox._start); a layer
    # in one of them may still be mounted, whichever process opened that sandbox.
    ids: set[str] = set()
    run = os.path.join(scratch, "run")
    for sandbox_id in os.listdir(run) if os.path.isdir(run) else ():
        for generation in os.listdir(os.path.join(run, sandbox_id)):
            try:
                with open(os.path.join(run, sandbox_id, generation, "chain")) as f:
                    ids.update(f.read().split())
            except (FileNotFoundError, NotADirectoryError):
                continue
    return ids


class SandboxPool:
    """Warm sandboxes on one image, at most ``max_concurrency`` handed out at once."""

    def __init__(
        self,
        image: Image | str | None = None,
        *,
        warm: int = 2,
        max_concurrency: int = 8,
        limits: Limits | None = None,
        home: str | None = None,
        backend: str = "local",
    ) -> None:
        if warm < 0 or max_concurrency < 1 or warm > max_concurrency:
            raise ValueError(f"need 0 <= warm <= max_concurrency and max_concurrency >= 1; got warm={warm}, "
                             f"max_concurrency={max_concurrency}")
        self.home = home or sandbox_home()
        self.image = default_image(self.home) if image is None else image if isinstance(image, Image) else Image.from_dir(image)
        self.limits = limits or Limits()
        self.backend = backend  # "local" or "vm" (see Sandbox); VM snapshots are not pinned in the layer store
        self.warm_target = warm
        self.max_concurrency = max_concurrency
        self.store = SnapshotStore(LayerStore(scratch_dir(self.home)))
        self._vm_pins: set[str] = set()  # VM snapshots live in their own store (k3.sandbox.vm.snapshots)
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._warm: list[Sandbox] = []
        self._in_use: set[Sandbox] = set()
        self._closed = False
        self._timings: dict[str, list[float]] = defaultdict(list)
        self._counts: dict[str, int] = defaultdict(int)
        self.base_snapshot: str | None = None
        for _ in range(warm):
            self._warm.append(self._new())
        if self._warm:
            self.base_snapshot = self._warm[0].snapshot()  # the clean state returned sandboxes go back to
            if backend == "local":
                self.store.pin(self.base_snapshot)

    def _new(self) -> Sandbox:
        with self._timer("create"):
            return Sandbox(self.image, self.limits, home=self.home, backend=self.backend)

    @contextlib.contextmanager
    def _timer(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._timings[name].append(time.perf_counter() - start)
                self._timings[name] = self._timings[name][-1000:]
                self._counts[name] += 1

    def acquire(self, snapshot: str | None = None, timeout: float | None = None) -> Sandbox:
        """A sandbox for the caller alone, started from ``snapshot`` or clean; waits while
        ``max_concurrency`` are out (TimeoutError after ``timeout`` seconds)."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        start = time.perf_counter()
        if not self._slots.acquire(timeout=timeout if timeout is not None else -1):
            raise TimeoutError(f"no sandbox free within {timeout} s ({self.max_concurrency} in use)")
        with self._lock:
            self._timings["wait"].append(time.perf_counter() - start)
            sandbox = self._warm.pop() if self._warm else None
        try:
            if sandbox is None:
                sandbox = self._new()
            if snapshot is not None:
                with self._timer("restore"):
                    sandbox.restore(snapshot)
        except BaseException:
            self._slots.release()
            if sandbox is not None:
                sandbox.close()
            raise
        with self._lock:
            self._in_use.add(sandbox)
            self._counts["acquired"] += 1
        return sandbox

    def release(self, sandbox: Sandbox) -> None:
        """Give a sandbox back: it is wiped (restored to the clean base) and kept warm, or closed."""
        with self._lock:
            if sandbox not in self._in_use:
                raise ValueError(f"{sandbox!r} was not acquired from this pool")
            self._in_use.discard(sandbox)
            keep = not self._closed and len(self._warm) < self.warm_target and self.base_snapshot is not None
        try:
            if keep and not sandbox.closed:
                with self._timer("reset"):
                    sandbox.restore(self.base_snapshot)
                with self._lock:
                    self._warm.append(sandbox)
            else:
                sandbox.close()
        except Exception:  # noqa: BLE001 - a sandbox that cannot be reset is closed instead
            sandbox.close()
        finally:
            self._slots.release()

    @contextlib.contextmanager
    def sandbox(self, snapshot: str | None = None, timeout: float | None = None):
        """``with pool.sandbox() as box``: acquire, then release however the block ends."""
        box = self.acquire(snapshot, timeout)
        try:
            yield box
        finally:
            self.release(box)

    async def acquire_async(self, snapshot: str | None = None, timeout: float | None = None) -> Sandbox:
        return await asyncio.to_thread(self.acquire, snapshot, timeout)

    async def release_async(self, sandbox: Sandbox) -> None:
        await asyncio.to_thread(self.release, sandbox)

    def snapshot(self, sandbox: Sandbox, pin: bool = True) -> str:
        """Snapshot ``sandbox`` and (by default) pin it in the store until ``store.unpin``."""
        with self._timer("snapshot"):
            snapshot = sandbox.snapshot()
        if pin and self.backend == "local":
            self.store.pin(snapshot)
        elif pin:
            with self._lock:
                self._vm_pins.add(snapshot)
        return snapshot

    def gc(self, min_age_s: float = 0.0) -> list[str]:
        """Drop layers (VM backend: snapshots) that no pinned snapshot and no open sandbox needs."""
        if self.backend == "vm":
            from k3.sandbox.vm.snapshots import SnapshotDir

            with self._lock:
                keep = self._vm_pins | {self.base_snapshot} - {None}
            return SnapshotDir(scratch_dir(self.home)).gc(keep, min_age_s)
        with self._lock:
            chains = [list(box.chain) for box in list(self._warm) + list(self._in_use)]
        return self.store.gc(chains, min_age_s)

    def metrics(self) -> dict:
        """Counts and latency percentiles (ms) of the pool's operations, and its occupancy."""
        with self._lock:
            out: dict = {"warm": len(self._warm), "in_use": len(self._in_use), "max_concurrency": self.max_concurrency}
            out.update({f"{name}_count": count for name, count in self._counts.items()})
            for name, samples in self._timings.items():
                if samples:
                    ordered = sorted(samples)
                    out[f"{name}_p50_ms"] = round(statistics.median(ordered) * 1000, 3)
                    out[f"{name}_p99_ms"] = round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1000, 3)
        out["layers"] = len(self.store.layers.list())
        return out

    def close(self) -> None:
        """Close every sandbox of the pool (those still acquired included)."""
        with self._lock:
            self._closed = True
            boxes = list(self._warm) + list(self._in_use)
            self._warm.clear()
            self._in_use.clear()
        for box in boxes:
            box.close()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
