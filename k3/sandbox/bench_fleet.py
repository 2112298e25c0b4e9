"""Fleet scale (``k3 sandbox bench --pool N --ray-episodes N``): a big pool, and a Ray fleet run.

pool: a ``SandboxPool`` holding ``n`` warm sandboxes at once on this machine. Reported: the time to
fill it, the memory charged per sandbox (its cgroup: PID 1, the namespaces' own processes, page
cache of its upper) and the drop of the host's MemAvailable per sandbox (everything, kernel
structures included), and one exec in each of them.

ray: ``episodes`` short episodes (write a file, run python3 on it, read the answer) across
``workers`` local Ray workers, each with its own pool; then one worker runs a step, snapshots
(with memory: a REPL variable) and exports it, and the others import it and go on from it.
Reported: episodes/s, the mean time an episode spends inside its worker (acquire, exec, release),
and from the two what bounds the rate: sandbox work (CPU-bound on the cores given) or overhead.
"""

from __future__ import annotations

import os
import resource
import statistics
import time


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    return 0


def _raise_fd_limit() -> None:
    # Each sandbox holds four descriptors on the host (two pipes, the upcall pair, a pidfd).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_pool(n: int = 200) -> dict:
    """Fill a pool with ``n`` warm sandboxes; return fill time and memory per sandbox."""
    from k3.sandbox import local
    from k3.sandbox.pool import SandboxPool

    _raise_fd_limit()
    before = _mem_available()
    start = time.perf_counter()
    pool = SandboxPool(warm=n, max_concurrency=n)
    try:
        filled = time.perf_counter() - start
        boxes = [pool.acquire() for _ in range(n)]
        start = time.perf_counter()
        outputs = [box.exec(["true"]).exit_code for box in boxes]
        exec_all = time.perf_counter() - start
        charged = [box.memory_bytes() for box in boxes]
        local.janitor.idle()
        used = before - _mem_available()
        if any(outputs):
            raise RuntimeError(f"{sum(1 for code in outputs if code)} of {n} pooled sandboxes failed to run `true`")
        for box in boxes:
            pool.release(box)
        return {"pool_sandboxes": n, "pool_fill_s": round(filled, 2), "pool_fill_per_sandbox_ms": round(filled / n * 1000, 1),
                "pool_exec_all_s": round(exec_all, 2),
                "pool_memory_per_sandbox_mb": round(statistics.mean(charged) / (1 << 20), 2),
                "pool_host_memory_per_sandbox_mb": round(used / n / (1 << 20), 2),
                "pool_sandboxes_per_gb": round((1 << 30) / max(1, used / n), 1)}
    finally:
        pool.close()


def _episode(box, index):
    box.write_file("/work/episode.py", f"print({index} * 3)")
    return int(box.exec("python3 /work/episode.py").stdout)


def _step(box, item):
    box.write_file("/work/base.txt", f"base {item}")
    return box.repl().run(f"carried = {item!r}").ok


def _branch(box, index):
    return box.read_file("/work/base.txt").decode(), box.repl().run("carried").value, index


def run_ray(episodes: int = 1000, workers: int = 4, branches: int = 40) -> dict:
    """``episodes`` episodes over ``workers`` local Ray workers, then cross-worker export/import."""
    import ray

    from k3.sandbox.fleet_ray import RayFleet
    from k3.sandbox.paths import sandbox_home

    cpus = os.cpu_count() or 1
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=max(cpus, workers), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"K3_SANDBOX_HOME": sandbox_home()}})
    try:
        with RayFleet(num_workers=workers, warm=2, max_concurrency=4, num_cpus_per_worker=0.5) as fleet:
            fleet.map(_episode, list(range(workers * 4)))  # warm every worker: pools filled, functions shipped
            start = time.perf_counter()
            results = fleet.map(_episode, list(range(episodes)))
            wall = time.perf_counter() - start
            if results != [3 * i for i in range(episodes)]:
                raise RuntimeError("some Ray episodes returned wrong answers")
            metrics = fleet.metrics()
            inside = statistics.mean(m.get("reset_p50_ms", 0.0) for m in metrics)
            start = time.perf_counter()
            _, exported = fleet.run_and_export(_step, "from worker 0", memory=True, worker=0)
            export_s = time.perf_counter() - start
            size = sum(len(layer["tar"]) for layer in exported["layers"]) + sum(
                len(data) for files in exported.get("memory", {}).values() for data in files.values())
            start = time.perf_counter()
            forks = fleet.fork(exported, branches, _branch)
            fork_s = time.perf_counter() - start
            good = sum(1 for seen, carried, _ in forks if seen == "base from worker 0" and carried == "'from worker 0'")
            pids = {m["pid"] for m in fleet.metrics()}
    finally:
        if started_here:
            ray.shutdown()
    rate = episodes / wall
    per_worker_ms = wall / episodes * 1000 * workers
    return {"ray_episodes": episodes, "ray_workers": workers, "ray_cpus": cpus, "ray_wall_s": round(wall, 2),
            "ray_episodes_per_s": round(rate, 1), "ray_episode_ms_per_worker": round(per_worker_ms, 1),
            "ray_reset_p50_ms": round(inside, 2), "ray_worker_processes": len(pids),
            "ray_export_s": round(export_s, 3), "ray_export_bytes": size, "ray_branches": branches,
            "ray_branches_s": round(fork_s, 2), "ray_branches_correct": good,
            "ray_bound_by": (f"CPU: {cpus} cores for {workers} workers, each episode starts python3 in a sandbox "
                             f"and resets it" if cpus <= workers else "per-episode overhead (Ray calls, sandbox reset)")}
