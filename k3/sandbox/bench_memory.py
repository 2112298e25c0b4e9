"""Memory-snapshot latency (``k3 sandbox bench``): a live Python REPL holding 50 MB of state.

The REPL holds ``state_mb`` MB of random bytes (incompressible, as a model's working set would be)
plus a counter; each round changes the counter, so every snapshot is new. Timed, each
``iterations`` times, in steady state (spares ready, janitor idle, as in ``bench.py``):

  memory_snapshot   ``snapshot(memory=True)``: the REPL pickles its namespace, the host copies the
                    file into a memory image, the filesystem is snapshotted with the manifest
  memory_restore    ``restore`` of that snapshot: new root, a new REPL, its state loaded
  memory_fork       ``fork(snapshot, 1)``: a new sandbox with the REPL and its state
  fs_snapshot / fs_restore / fs_fork   the same sandbox, files-only (the REPL is lost on restore):
                    what memory costs on top
  repl_start        starting a fresh REPL (the floor under memory_restore and memory_fork)

Each restore and fork is checked: the counter and the size of the state must come back.
The K3 report's microVM numbers (133 ms snapshot, 49 ms restore, with memory) are printed beside.
"""

from __future__ import annotations

from k3.sandbox.api import Sandbox
from k3.sandbox.bench import percentiles, timed
from k3.sandbox.cgroups import Limits

K3_REPORT_MS = {"snapshot": 133.0, "restore": 49.0}


def run(iterations: int = 20, state_mb: int = 50, disk_mb: int | None = Limits.disk_mb) -> dict:
    """Time memory snapshot / restore / fork against the files-only path; return the results."""
    limits = Limits(memory_mb=max(512, 6 * state_mb), pids=256, cpus=1.0, disk_mb=disk_mb)
    results: dict = {"memory_state_mb": state_mb, "memory_iterations": iterations}
    with Sandbox(limits=limits) as box:
        repl = box.repl()
        made = repl.run(f"import os\nstate = bytearray(os.urandom({state_mb} << 20))\ncounter = 0", timeout=120)
        if not made.ok:
            raise RuntimeError(f"the benchmark REPL could not allocate {state_mb} MB: {made.error}")
        results["memory_sandbox_mb"] = round(box.memory_bytes() / (1 << 20), 1)
        rounds = iter(range(1, 10**9))

        def bump() -> None:
            repl.run(f"counter = {next(rounds)}")

        snapshots: list[str] = []
        samples = timed(lambda: box.snapshot(memory=True), iterations, before=bump, after=snapshots.append)
        results.update(percentiles("memory_snapshot", samples))
        snapshot, expected = snapshots[-1], f"({len(snapshots)}, {state_mb << 20})"

        def check(sandbox: Sandbox) -> None:
            got = sandbox.repl().run("counter, len(state)").value
            if got != expected:
                raise RuntimeError(f"memory restore lost the REPL's state: got {got}, expected {expected}")

        results.update(percentiles("memory_restore", timed(lambda: box.restore(snapshot), iterations,
                                                              after=lambda _: check(box))))

        def close_fork(forks: list) -> None:
            check(forks[0])
            forks[0].close()

        results.update(percentiles("memory_fork", timed(lambda: box.fork(snapshot, 1), iterations, after=close_fork)))

        # The same sandbox (REPL running, 50 MB in it), files only.
        fs_snapshots: list[str] = []
        results.update(percentiles("fs_snapshot", timed(box.snapshot, iterations, before=bump, after=fs_snapshots.append)))
        results.update(percentiles("fs_restore", timed(lambda: box.restore(fs_snapshots[-1]), iterations)))
        results.update(percentiles("fs_fork", timed(lambda: box.fork(fs_snapshots[-1], 1), iterations,
                                                      after=lambda forks: forks[0].close())))

        def fresh_repl() -> None:
            box.repl("probe").close()

        results.update(percentiles("repl_start", timed(lambda: box.repl("probe").run("0"), iterations,
                                                         before=fresh_repl)))
    results["k3_report_ms"] = K3_REPORT_MS
    results["memory_vs_k3_report"] = {
        "snapshot": round(results["memory_snapshot_p50_ms"] / K3_REPORT_MS["snapshot"], 2),
        "restore": round(results["memory_restore_p50_ms"] / K3_REPORT_MS["restore"], 2),
    }
    return results


def format_table(results: dict) -> str:
    lines = [f"memory snapshots: a live Python REPL holding {results['memory_state_mb']} MB "
             f"(sandbox charged {results['memory_sandbox_mb']} MB), {results['memory_iterations']} iterations"]
    lines.append(f"{'operation':<10} {'memory p50':>11} {'p99':>9} {'files-only p50':>15} {'p99':>9} {'K3 report':>10}")
    for name in ("snapshot", "restore", "fork"):
        report = K3_REPORT_MS.get(name)
        lines.append(f"{name:<10} {results[f'memory_{name}_p50_ms']:>11.2f} {results[f'memory_{name}_p99_ms']:>9.2f} "
                     f"{results[f'fs_{name}_p50_ms']:>15.2f} {results[f'fs_{name}_p99_ms']:>9.2f} "
                     f"{(f'{report:g}' if report else '-'):>10}")
    lines.append(f"fresh REPL start p50 {results['repl_start_p50_ms']} ms (the floor under memory restore and fork)")
    return "\n".join(lines)
