"""``k3 sandbox bench --backend vm``: whole-machine snapshot, restore and fork of a microVM.

The guest holds ``state_mb`` MB of random bytes in a file under /tmp (guest RAM: the writable
layer is a tmpfs) and runs a shell loop counting in memory, so each snapshot is of a machine
whose memory changes. Timed, ``iterations`` times each, after the previous operation's
background work (QEMU processes being killed) is done:

  vm_snapshot          stop the guest, save its device state and read the pages it wrote since its
                       restore, let it go on, then write the memory file (parent's + those pages)
  vm_snapshot_pause    the part of vm_snapshot during which the guest is stopped
  vm_restore           a new QEMU on the snapshot's memory (mapped private), device state loaded,
                       guest running (the old QEMU is killed off the critical path)
  vm_restore_exec      restore, then one ``exec("true")`` answered by the guest
  vm_fork              ``fork(snapshot, 1)``: a second guest from the snapshot
  vm_memory_per_sandbox_mb   host memory a forked, idle guest holds on its own (private pages
                       and QEMU), and sandboxes per GB from it
  vm_concurrent_*      with ``concurrent`` > 0: that many guests forked at once from a quiet
                       snapshot (the counting loop stopped), each answering one exec; the time to
                       start them all, the memory each holds on its own, and the host's available
                       memory before and after (so page cache shared between them shows too)

Every restore is checked (the state file's size and a counter that goes on). With
``compare_local`` the local backend's memory benchmark (``bench_memory``: a Python REPL holding
the same number of MB) runs in the same process, for a side-by-side table.
"""

from __future__ import annotations

import statistics
import time

from k3.sandbox.bench import fork_memory_bytes, percentiles
from k3.sandbox.cgroups import Limits

K3_REPORT_MS = {"snapshot": 133.0, "restore": 49.0}
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done"


def run(iterations: int = 10, state_mb: int = 64, memory_mb: int = 512, compare_local: bool = True,
        concurrent: int = 0) -> dict:
    """Time the VM backend's snapshot / restore / fork; return the results (see the module doc)."""
    from k3.sandbox.vm import VmSandbox

    if iterations < 1 or not 0 <= state_mb < memory_mb // 2:
        raise ValueError(f"need iterations >= 1 and 0 <= state_mb < memory_mb / 2; got {iterations}, {state_mb}, {memory_mb}")
    results: dict = {"vm_iterations": iterations, "vm_state_mb": state_mb, "vm_memory_mb": memory_mb}
    start = time.perf_counter()
    box = VmSandbox(limits=Limits(memory_mb=memory_mb, cpus=1.0))
    results["vm_create_first_s"] = round(time.perf_counter() - start, 2)  # a boot when no boot snapshot exists yet
    results["vm_accel"] = box.config.accel
    taken: list[str] = []
    try:
        made = box.exec(f"head -c {state_mb << 20} /dev/urandom > /tmp/state || exit 1; "
                        f"({COUNTER}) > /dev/null 2>&1 & echo $! > /tmp/counter.pid; "
                        "for n in $(seq 600); do [ -e /tmp/count ] && exit 0; sleep 0.1; done; exit 1", timeout=600)
        if not made.ok:
            raise RuntimeError(f"the benchmark guest could not hold {state_mb} MB: {made.stderr}")
        samples, dirty, pauses = [], [], []
        for _ in range(iterations):
            _settle(box)
            start = time.perf_counter()
            snapshot = box.snapshot()
            samples.append(time.perf_counter() - start)
            pauses.append(box.last_pause_s)
            taken.append(snapshot)
            dirty.append(box.store.meta(snapshot)["dirty_bytes"])
        results.update(percentiles("vm_snapshot", samples))
        results.update(percentiles("vm_snapshot_pause", pauses))  # the guest stopped: state + its private pages
        results["vm_snapshot_written_mb_p50"] = round(statistics.median(dirty) / (1 << 20), 1)
        results["vm_snapshot_file_mb"] = round(box.store.meta(taken[-1])["memory_bytes"] / (1 << 20), 1)
        snapshot = taken[-1]
        expected = int(box.read_file("/tmp/count").strip() or 0)

        samples = []
        for _ in range(iterations):
            _settle(box)
            start = time.perf_counter()
            box.restore(snapshot)
            samples.append(time.perf_counter() - start)
        results.update(percentiles("vm_restore", samples))
        _check(box, state_mb)

        samples = []
        for _ in range(iterations):
            _settle(box)
            start = time.perf_counter()
            box.restore(snapshot)
            box.exec(["true"])
            samples.append(time.perf_counter() - start)
        results.update(percentiles("vm_restore_exec", samples))

        samples = []
        for _ in range(iterations):
            _settle(box)
            start = time.perf_counter()
            fork = box.fork(snapshot, 1)[0]
            samples.append(time.perf_counter() - start)
            _check(fork, state_mb)
            fork.close()
        results.update(percentiles("vm_fork", samples))

        per_sandbox = fork_memory_bytes(box, snapshot, 4, ["true"])
        results["vm_memory_per_sandbox_mb"] = round(per_sandbox / (1 << 20), 1)
        results["vm_sandboxes_per_gb"] = round((1 << 30) / per_sandbox, 1)
        results["vm_counter_at_snapshot"] = expected
        if concurrent:
            box.restore(snapshot)
            box.exec("kill $(cat /tmp/counter.pid)")
            quiet = box.snapshot()
            taken.append(quiet)
            results.update(_concurrent(box, quiet, concurrent))
    finally:
        box.close()
        for snapshot in taken:
            box.store.remove(snapshot)
    if compare_local:
        from k3.sandbox import bench_memory

        try:
            results.update(bench_memory.run(iterations=iterations, state_mb=state_mb))
        except Exception as error:  # noqa: BLE001 - the VM numbers stand; say why the comparison is missing
            results["local_error"] = f"{type(error).__name__}: {error}"
    results["k3_report_ms"] = K3_REPORT_MS
    return results


def _concurrent(box, snapshot: str, n: int) -> dict:
    """``n`` guests at once from ``snapshot``, each answering one exec; memory each holds on its own."""
    before = _available_bytes()
    start = time.perf_counter()
    forks = []
    try:
        for _ in range(n):
            forks += box.fork(snapshot, 1)
        started = time.perf_counter() - start
        for fork in forks:
            if not fork.exec(["true"], timeout=300).ok:
                raise RuntimeError("a concurrent guest did not run `true`")
        answered = time.perf_counter() - start
        time.sleep(5)  # idle
        per_sandbox = statistics.mean(fork.memory_bytes() for fork in forks)
        after = _available_bytes()
    finally:
        for fork in forks:
            fork.close()
    return {"vm_concurrent": n, "vm_concurrent_started_s": round(started, 1), "vm_concurrent_answered_s": round(answered, 1),
            "vm_concurrent_memory_per_sandbox_mb": round(per_sandbox / (1 << 20), 1),
            "vm_concurrent_host_available_drop_mb": round((before - after) / (1 << 20), 1),
            "vm_concurrent_host_mb_per_sandbox": round((before - after) / n / (1 << 20), 1)}


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _settle(box) -> None:
    for thread in box._reapers:
        thread.join(timeout=60)


def _check(box, state_mb: int) -> None:
    size = box.exec("wc -c < /tmp/state").stdout.strip()
    if size != str(state_mb << 20):
        raise RuntimeError(f"a restored guest lost its state: /tmp/state holds {size} bytes, not {state_mb << 20}")
    before = int(box.read_file("/tmp/count").strip() or 0)
    moved = box.exec(f"for n in $(seq 300); do [ \"$(cat /tmp/count)\" -gt {before} ] && exit 0; sleep 0.1; done; exit 1",
                     timeout=120)
    if not moved.ok:
        raise RuntimeError("the counting loop did not go on after a restore")


def format_table(results: dict) -> str:
    lines = [f"microVM ({results['vm_accel']}), {results['vm_memory_mb']} MB guest holding {results['vm_state_mb']} MB "
             f"of state and a counting shell loop, {results['vm_iterations']} iterations",
             f"{'operation':<16} {'p50 ms':>9} {'p99 ms':>9} {'K3 report':>10}"]
    for name, report in (("snapshot", "133"), ("restore", "49"), ("restore_exec", ""), ("fork", "")):
        lines.append(f"{name:<16} {results[f'vm_{name}_p50_ms']:>9.1f} {results[f'vm_{name}_p99_ms']:>9.1f} {report:>10}")
    lines.append(f"guest stopped during a snapshot: p50 {results['vm_snapshot_pause_p50_ms']} ms, "
                 f"p99 {results['vm_snapshot_pause_p99_ms']} ms")
    lines.append(f"snapshot memory file {results['vm_snapshot_file_mb']} MB, of which written from the guest's "
                 f"private pages: {results['vm_snapshot_written_mb_p50']} MB (p50)")
    lines.append(f"memory per idle forked guest {results['vm_memory_per_sandbox_mb']} MB -> "
                 f"{results['vm_sandboxes_per_gb']} sandboxes per GB")
    if "vm_concurrent" in results:
        lines.append(f"{results['vm_concurrent']} guests at once: started in {results['vm_concurrent_started_s']} s, all "
                     f"answered by {results['vm_concurrent_answered_s']} s; {results['vm_concurrent_memory_per_sandbox_mb']} MB "
                     f"each on its own; host MemAvailable fell {results['vm_concurrent_host_available_drop_mb']} MB "
                     f"({results['vm_concurrent_host_mb_per_sandbox']} MB per guest)")
    if "local_error" in results:
        lines.append(f"local backend comparison failed: {results['local_error']}")
    if "memory_snapshot_p50_ms" in results:
        lines.append(f"local backend, same run (REPL with {results['memory_state_mb']} MB): memory snapshot / restore / fork "
                     f"p50 {results['memory_snapshot_p50_ms']} / {results['memory_restore_p50_ms']} / "
                     f"{results['memory_fork_p50_ms']} ms; files only {results['fs_snapshot_p50_ms']} / "
                     f"{results['fs_restore_p50_ms']} / {results['fs_fork_p50_ms']} ms")
    return "\n".join(lines)
