"""``k3 sandbox bench``: latency of create, exec, snapshot, restore and fork, and sandboxes per GB.

The workload is the issue's: a 200 MB image (the default image plus a synthetic repository), and a
sandbox in which 100 files of that repository have been edited, so each snapshot freezes 100
copied-up files. Each operation is timed ``iterations`` times; p50 and p99 are reported.

``snapshot_*`` times the issue's case: 100 files of the repository are edited (untimed, from a
clean restore each round), then the sandbox is snapshotted. An idle sandbox adopts its upper
directory as the new layer (a rename) and restarts on a fresh upper; ``snapshot_copy_*`` is the
same with a background process running, where the files are copied instead; and
``snapshot_incremental_*`` is one more edit after a snapshot of an idle sandbox (the common case
in a rollout that snapshots every step), where only what changed since is stored.

Between two timed operations the bench waits for the background work of the previous one (spare
supervisors started again, replaced generations torn down): the numbers are the latency of one
operation in steady state. ``*_cold_p50_ms`` are restore and fork with no spare ready, i.e. with
a Python start on the critical path.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import uuid

from k3.sandbox import local
from k3.sandbox.api import Sandbox
from k3.sandbox.cgroups import Limits
from k3.sandbox.image import Image, build_once, default_image, tree_bytes
from k3.sandbox.paths import sandbox_home

TARGET_MS = {"snapshot_p50_ms": 20.0, "restore_p50_ms": 20.0, "fork_p50_ms": 20.0}
SOURCE_FILES = 400  # small files of the synthetic repository (100 of them get edited)
SOURCE_BYTES = 6 * 1024


def bench_image(size_mb: int = 200, home: str | None = None) -> Image:
    """The default image plus a synthetic repository under /work/repo, ``size_mb`` in all."""
    home = home or sandbox_home()
    base = default_image(home)
    target = os.path.join(home, "images", f"bench-{size_mb}mb-{os.path.basename(base.path)}")
    build_once(target, lambda staging: _build_bench_image(base, staging, size_mb))
    return Image(target, "/work/repo", base.env)


def _build_bench_image(base: Image, staging: str, size_mb: int) -> None:
    shutil.copytree(base.path, staging, symlinks=True, copy_function=os.link)
    os.unlink(os.path.join(staging, ".k3-image-complete"))
    repo = os.path.join(staging, "work", "repo")
    os.makedirs(os.path.join(repo, "src"))
    os.makedirs(os.path.join(repo, "data"))
    for index in range(SOURCE_FILES):
        line = f"def function_{index}(x):\n    return x * {index} + 1\n\n"
        with open(os.path.join(repo, "src", f"module_{index:04d}.py"), "w") as f:
            f.write(line * (SOURCE_BYTES // len(line)))
    used = tree_bytes(staging)
    blob = 0
    while used < size_mb << 20:
        chunk = min(4 << 20, (size_mb << 20) - used)
        with open(os.path.join(repo, "data", f"blob_{blob:04d}.bin"), "wb") as f:
            f.write(os.urandom(chunk))
        used += chunk
        blob += 1


def fork_memory_bytes(box, snapshot: str, count: int, argv: list[str]) -> float:
    """Mean memory of ``count`` forks of ``snapshot`` (either backend), each after running ``argv`` once; the
    forks are closed after."""
    forks = box.fork(snapshot, count)
    try:
        for fork in forks:
            fork.exec(argv)
        return statistics.mean(fork.memory_bytes() for fork in forks)
    finally:
        for fork in forks:
            fork.close()


def percentiles(name: str, samples: list[float]) -> dict:
    """{NAME_p50_ms, NAME_p99_ms} of samples in seconds."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {f"{name}_p50_ms": round(statistics.median(ordered) * 1000, 2), f"{name}_p99_ms": round(p99 * 1000, 2)}


def _settle() -> None:
    local.janitor.idle()
    local.spares().wait_ready()


def timed(operation, iterations: int, before=None, after=None) -> list[float]:
    """Seconds of each of `iterations` calls of operation(); before() runs untimed ahead of each, after(result) after."""
    samples = []
    for _ in range(iterations):
        if before:
            before()
        _settle()
        start = time.perf_counter()
        value = operation()
        samples.append(time.perf_counter() - start)
        if after:
            after(value)
    return samples


def run(iterations: int = 30, edits: int = 100, image_mb: int = 200, density_sandboxes: int = 16,
        disk_mb: int | None = Limits.disk_mb) -> dict:
    """Run the whole benchmark; return a dict of results (see the module doc). ``disk_mb``: the
    sandboxes' writable layer (``Limits.disk_mb``; None puts it on the scratch disk)."""
    if not 1 <= edits <= SOURCE_FILES:
        raise ValueError(f"edits must be between 1 and {SOURCE_FILES}, got {edits}")
    image = bench_image(image_mb)
    results: dict = {"image_mb": round(tree_bytes(image.path) / (1 << 20), 1), "edits": edits, "iterations": iterations}
    limits = Limits(memory_mb=512, pids=256, cpus=1.0, disk_mb=disk_mb)
    results["disk_mb"] = disk_mb

    results.update(percentiles("create", timed(lambda: Sandbox(image, limits), iterations, after=lambda box: box.close())))

    with Sandbox(image, limits) as box:
        results.update(percentiles("exec", timed(lambda: box.exec(["true"]), iterations)))
        clean = box.snapshot()  # the image as it is, to come back to before each round of edits

        def edit() -> None:
            # 100 files of the repository edited (copied up), plus one file of random content so
            # that a layer left by an earlier run can never turn a timed snapshot into a reuse.
            box.restore(clean)
            done = box.exec(
                f"for f in $(ls src | head -n {edits}); do echo '# edited' >> src/$f; done; "
                f"head -c 16 /dev/urandom | od -x > step.txt; ls src | head -n {edits} | wc -l"
            )
            if done.stdout.strip() != str(edits):
                raise RuntimeError(f"the benchmark could not edit {edits} files: {done.stdout} {done.stderr}")

        # The case: a sandbox with 100 edited files is snapshotted. Idle, with its upper
        # on the scratch disk, it adopts the upper as the layer and goes on over a fresh upper
        # (see Sandbox.snapshot); with a disk quota (a tmpfs upper) the files are copied.
        taken: list[str] = []
        samples = timed(box.snapshot, iterations, before=edit, after=taken.append)
        results.update(percentiles("snapshot", samples))
        snapshot = taken[-1]
        results["snapshot_layer_files"] = box.store.info(snapshot).files

        # A busy sandbox (a background process runs) cannot be restarted: the files are copied.
        def edit_busy() -> None:
            edit()
            box.exec("sleep 1000 > /dev/null 2>&1 &")

        results.update(percentiles("snapshot_copy", timed(box.snapshot, max(5, iterations // 3), before=edit_busy)))

        # Incremental: one more edit after an (idle) snapshot, the common case in a rollout that
        # snapshots every step: only what changed since is stored.
        edit()
        box.snapshot()
        step = lambda: box.write_file("/work/repo/step.txt", uuid.uuid4().hex)  # noqa: E731
        results.update(percentiles("snapshot_incremental", timed(box.snapshot, max(5, iterations // 3), before=step)))
        results.update(percentiles("restore", timed(lambda: box.restore(snapshot), iterations)))
        check = box.exec("grep -c '# edited' src/* | grep -c ':1$'").stdout.strip()
        if check != str(edits):
            raise RuntimeError(f"restore lost edits: {check} of {edits} files carry the edit")
        results.update(percentiles("fork", timed(lambda: box.fork(snapshot, 1), iterations, after=lambda f: f[0].close())))

        # Cold: no spare supervisor ready, so a Python start is on the critical path.
        spares = local.spares()
        target, spares.target = spares.target, 0
        try:
            count = max(3, iterations // 5)
            cold = timed(lambda: box.restore(snapshot), count, before=spares.drain)
            results["restore_cold_p50_ms"] = round(statistics.median(cold) * 1000, 2)
            cold = timed(lambda: box.fork(snapshot, 1), count, before=spares.drain, after=lambda f: f[0].close())
            results["fork_cold_p50_ms"] = round(statistics.median(cold) * 1000, 2)
        finally:
            spares.target = target

        per_sandbox = fork_memory_bytes(box, snapshot, density_sandboxes, ["python3", "-c", "print(1)"])
    results["memory_per_sandbox_mb"] = round(per_sandbox / (1 << 20), 2)
    results["sandboxes_per_gb"] = round((1 << 30) / per_sandbox, 1)
    results["targets_ms"] = TARGET_MS
    results["targets_met"] = all(results[key] <= limit for key, limit in TARGET_MS.items())
    return results


def format_table(results: dict) -> str:
    lines = [f"image {results['image_mb']} MB, {results['edits']} file edits, {results['iterations']} iterations each"]
    lines.append(f"{'operation':<10} {'p50 ms':>9} {'p99 ms':>9} {'target':>8}")
    for name in ("create", "exec", "snapshot", "restore", "fork"):
        target = TARGET_MS.get(f"{name}_p50_ms")
        lines.append(
            f"{name:<10} {results[f'{name}_p50_ms']:>9.2f} {results[f'{name}_p99_ms']:>9.2f} "
            f"{('<= %g' % target) if target else '':>8}"
        )
    lines.append(f"snapshot of a busy sandbox (files copied): p50 {results['snapshot_copy_p50_ms']} ms, "
                 f"p99 {results['snapshot_copy_p99_ms']} ms")
    lines.append(f"snapshot after one more edit (incremental): p50 {results['snapshot_incremental_p50_ms']} ms, "
                 f"p99 {results['snapshot_incremental_p99_ms']} ms")
    lines.append(f"cold (no spare ready): restore p50 {results['restore_cold_p50_ms']} ms, fork p50 {results['fork_cold_p50_ms']} ms")
    lines.append(f"memory per idle sandbox {results['memory_per_sandbox_mb']} MB -> {results['sandboxes_per_gb']} sandboxes per GB")
    lines.append("targets met" if results["targets_met"] else "targets NOT met")
    return "\n".join(lines)
