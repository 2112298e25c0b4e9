"""A sandbox fleet on a Ray cluster: one worker actor per slot of machines, each with its own
``SandboxPool``; rollouts are placed on the workers, snapshots travel through the object store.

    import ray
    from k3.sandbox.fleet_ray import RayFleet

    ray.init()
    with RayFleet(num_workers=4) as fleet:
        results = fleet.map(run_episode, tasks)          # run_episode(sandbox, task) -> result
        snapshot = fleet.export_local(snapshot_id)       # a snapshot taken on this machine
        branches = fleet.fork(snapshot, 8, run_branch)   # run_branch(sandbox, index) -> result

``RayFleet(backend="vm")`` runs microVM sandboxes (``k3.sandbox.vm``); their snapshots export as
the whole machine (device state and the memory file's data) and fork only on nodes whose guests
have the same machine shape (kernel, initramfs, root disk, RAM, vCPUs, accelerator).

Workers are spread over the nodes (Ray's SPREAD strategy). Every node builds its own default image
from its own binaries, so a snapshot can be forked on another node only when both nodes build the
same image (same distribution and packages); otherwise the import says which image is missing.
Ray is optional: this module imports it, nothing else in k3.sandbox does.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

try:
    import ray
except ImportError as error:  # pragma: no cover - exercised only without ray
    raise ImportError("k3.sandbox.fleet_ray needs Ray: pip install 'k3[ray]'") from error

from k3.sandbox.cgroups import Limits


@ray.remote
class SandboxWorker:
    """One pool of sandboxes in one Ray worker process (on whichever node Ray placed it)."""

    def __init__(self, image: str | None, limits: Limits | None, warm: int, max_concurrency: int,
                 backend: str = "local") -> None:
        from k3.sandbox.pool import SandboxPool

        self.pool = SandboxPool(image, warm=warm, max_concurrency=max_concurrency, limits=limits, backend=backend)
        self.node = ray.get_runtime_context().get_node_id()

    def node_id(self) -> str:
        return self.node

    def run(self, fn: Callable, item: Any, snapshot: str | None = None) -> Any:
        with self.pool.sandbox(snapshot=snapshot) as box:
            return fn(box, item)

    def import_snapshot(self, exported: dict) -> str:
        if exported.get("backend") == "vm":  # a whole microVM: device state and memory file
            from k3.sandbox.vm import snapshots

            if self.pool.backend != "vm":
                raise ValueError("a VM snapshot forks only on a RayFleet(backend='vm')")
            with self.pool.sandbox() as box:  # the machine shape this worker's guests have
                store, machine = box.store, box.machine.key()
            return snapshots.import_(store, exported, machine)
        image = exported["layers"][0]["info"]["image"]
        if not os.path.isdir(image):
            raise ValueError(f"snapshot needs image {image}, which this node ({self.node}) does not have")
        from k3.sandbox import memory

        memory.import_images(self.pool.store.layers.home, exported.get("memory", {}))
        return self.pool.store.layers.import_(exported, images=[self.pool.image.path])

    def run_and_export(self, fn: Callable, item: Any, memory: bool = False) -> tuple[Any, dict]:
        """``fn(sandbox, item)`` in a clean sandbox, then its snapshot (``memory``: with its
        REPLs), exported for another worker: (result, exported snapshot)."""
        with self.pool.sandbox() as box:
            result = fn(box, item)
            snapshot = box.snapshot(memory=memory)
            if self.pool.backend == "vm":
                return result, RayFleet.export_local(snapshot, box.store)
        return result, RayFleet.export_local(snapshot, self.pool.store.layers)

    def run_from(self, fn: Callable, item: Any, exported: dict) -> Any:
        return self.run(fn, item, self.import_snapshot(exported))

    def metrics(self) -> dict:
        return self.pool.metrics() | {"node": self.node, "pid": os.getpid()}

    def close(self) -> None:
        from k3.sandbox import local

        self.pool.close()
        local.spares().shutdown()


class RayFleet:
    """``num_workers`` sandbox workers on the current Ray cluster (``ray.init`` first)."""

    def __init__(
        self,
        num_workers: int = 2,
        *,
        image: str | None = None,
        limits: Limits | None = None,
        warm: int = 1,
        max_concurrency: int = 4,
        num_cpus_per_worker: float = 0.5,
        backend: str = "local",
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("RayFleet needs a Ray cluster: call ray.init() (or ray.init(address=...)) first")
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        options = {"num_cpus": num_cpus_per_worker, "scheduling_strategy": "SPREAD", "max_concurrency": max_concurrency}
        self.workers = [SandboxWorker.options(**options).remote(image, limits, warm, max_concurrency, backend)
                        for _ in range(num_workers)]
        self._next = 0

    def _pick(self):
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        return worker

    def map(self, fn: Callable[[Any, Any], Any], items: Iterable[Any]) -> list:
        """``fn(sandbox, item)`` for every item, each in a clean sandbox of some worker; results in order."""
        return ray.get([self._pick().run.remote(fn, item) for item in items])

    @staticmethod
    def export_local(snapshot: str, store=None) -> dict:
        """Pack a snapshot of this machine's store (with its parent layers, and its memory image
        when it was taken with ``memory=True``) for other nodes. ``store``: a LayerStore, or a
        VM sandbox's ``store`` (``k3.sandbox.vm.snapshots.SnapshotDir``) for a whole-machine snapshot."""
        from k3.sandbox.vm import snapshots as vm_snapshots

        if isinstance(store, vm_snapshots.SnapshotDir):
            return vm_snapshots.export(store, snapshot)
        from k3.sandbox.layers import LayerStore
        from k3.sandbox.paths import scratch_dir

        from k3.sandbox import memory

        store = store or LayerStore(scratch_dir())
        exported = store.export(snapshot)
        exported["memory"] = memory.export_images(store.home, store.chain(snapshot))  # {} for files-only
        return exported

    def run_and_export(self, fn: Callable[[Any, Any], Any], item: Any, memory: bool = False, worker: int = 0):
        """Run ``fn(sandbox, item)`` on worker ``worker`` and export its sandbox's snapshot from
        there: (result, exported), ready for ``fork`` onto the other workers."""
        return ray.get(self.workers[worker % len(self.workers)].run_and_export.remote(fn, item, memory))

    def fork(self, exported: dict, n: int, fn: Callable[[Any, int], Any]) -> list:
        """``n`` branches from one exported snapshot, spread over the workers: ``fn(sandbox, i)``."""
        if n < 1:
            raise ValueError(f"fork needs n >= 1 branches, got {n}")
        ref = ray.put(exported)  # shipped once per node, not once per branch
        return ray.get([self._pick().run_from.remote(fn, index, ref) for index in range(n)])

    def metrics(self) -> list[dict]:
        return ray.get([worker.metrics.remote() for worker in self.workers])

    def close(self) -> None:
        """Close every sandbox on every worker, then stop the workers."""
        try:
            ray.get([worker.close.remote() for worker in self.workers])
        finally:
            for worker in self.workers:
                ray.kill(worker)
            self.workers = []

    def __enter__(self) -> "RayFleet":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
