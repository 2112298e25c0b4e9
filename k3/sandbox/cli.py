"""``k3 sandbox``: doctor, bench, run, gc, web. Thin: parses, calls k3.sandbox, prints."""

from __future__ import annotations

import argparse
import json
import os
import sys

from k3.sandbox.cgroups import Limits


def _doctor(args: argparse.Namespace) -> int:
    from k3.sandbox.doctor import report, run_checks

    checks = run_checks()
    if args.json:
        print(json.dumps([check.__dict__ for check in checks], indent=2))
    else:
        print(report(checks))
    return 0 if all(check.ok for check in checks if check.required) else 1


def _bench(args: argparse.Namespace) -> int:
    from k3.sandbox import bench, bench_memory

    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    unknown = parts - {"base", "memory"}
    if unknown:
        print(f"k3 sandbox bench: unknown part(s) {sorted(unknown)}; use base and/or memory", file=sys.stderr)
        return 2
    results: dict = {}
    tables = []
    if args.backend == "vm":  # the microVM backend, with the local backend's memory bench beside it
        from k3.sandbox import bench_vm

        results = bench_vm.run(iterations=args.iterations, state_mb=args.state_mb, memory_mb=args.vm_memory_mb,
                               concurrent=args.concurrent)
        print(json.dumps(results, indent=2) if args.json else bench_vm.format_table(results))
        return 0
    if "base" in parts:
        results.update(bench.run(iterations=args.iterations, edits=args.edits, image_mb=args.image_mb,
                                 disk_mb=args.disk_mb or None))
        tables.append(bench.format_table(results))
    if "memory" in parts:
        memory = bench_memory.run(iterations=args.memory_iterations, state_mb=args.state_mb, disk_mb=args.disk_mb or None)
        results.update(memory)
        tables.append(bench_memory.format_table(memory))
    if args.pool:
        from k3.sandbox import bench_fleet

        pool = bench_fleet.run_pool(args.pool)
        results.update(pool)
        tables.append(f"pool of {pool['pool_sandboxes']} sandboxes: filled in {pool['pool_fill_s']} s, "
                      f"{pool['pool_memory_per_sandbox_mb']} MB charged per sandbox, "
                      f"{pool['pool_host_memory_per_sandbox_mb']} MB of host memory per sandbox")
    if args.ray_episodes:
        from k3.sandbox import bench_fleet

        fleet = bench_fleet.run_ray(args.ray_episodes, args.ray_workers)
        results.update(fleet)
        tables.append(f"Ray: {fleet['ray_episodes']} episodes on {fleet['ray_workers']} workers in {fleet['ray_wall_s']} s "
                      f"= {fleet['ray_episodes_per_s']} episodes/s; bound by {fleet['ray_bound_by']}; "
                      f"export {fleet['ray_export_bytes']} bytes in {fleet['ray_export_s']} s, "
                      f"{fleet['ray_branches_correct']}/{fleet['ray_branches']} branches correct")
    print(json.dumps(results, indent=2) if args.json else "\n\n".join(tables))
    return 0


def _web(args: argparse.Namespace) -> int:
    from k3.sandbox.web.tools import WebSession, default_tools

    tools = default_tools()
    if args.web_command == "tasks":
        from k3.sandbox.web.tasks import generate_browse_tasks

        tasks = generate_browse_tasks(args.n, seed=args.seed, split=args.split, corpus=tools.corpus)
        if args.json:
            print(json.dumps(tasks, indent=2))
        else:
            for task in tasks:
                print(f"[{task['kind']}] {task['prompt']}\n  answer: {task['answer']}  pages: {' '.join(task['pages'])}")
        return 0
    session = WebSession(tools)
    if args.web_command == "search":
        print(session.search(" ".join(args.query)))
    elif args.web_command == "open":
        print(session.open(args.url))
    else:
        kinds: dict = {}
        for page in tools.corpus.pages.values():
            kinds[page.kind] = kinds.get(page.kind, 0) + 1
        info = {"pages": len(tools.corpus.pages), "by_kind": kinds, "indexed": len(tools.index.urls),
                "source": tools.corpus.source}
        print(json.dumps(info, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))
    return 0


def _run(args: argparse.Namespace) -> int:
    from k3.sandbox import Limits, Sandbox

    limits = Limits(memory_mb=args.memory_mb, pids=args.pids, cpus=args.cpus, disk_mb=args.disk_mb or None)
    with Sandbox(args.image, limits, snapshot=args.snapshot) as box:
        result = box.exec(args.cmd, timeout=args.timeout)
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if args.snapshot_after:
            print(f"snapshot {box.snapshot()}", file=sys.stderr)
    if result.timed_out:
        print(f"k3 sandbox: timed out after {args.timeout} s", file=sys.stderr)
    return result.exit_code


def _gc(args: argparse.Namespace) -> int:
    from k3.sandbox import leftovers
    from k3.sandbox.layers import LayerStore
    from k3.sandbox.paths import scratch_dir
    from k3.sandbox.pool import SnapshotStore

    scratch = scratch_dir()
    # Leftovers of dead owners first: their run directories no longer keep layers in use.
    counts = leftovers.collect(scratch, min_age_s=args.min_age)
    store = SnapshotStore(LayerStore(scratch))
    keep = set(args.keep)
    vm_snapshots = os.path.join(scratch, "vm", "snapshots")
    for snapshot in keep:
        if not os.path.isfile(os.path.join(vm_snapshots, snapshot, "meta.json")):  # a VM snapshot is kept below
            store.pin(snapshot)
    removed = store.gc(min_age_s=args.min_age)
    counts = {"layers": len(removed), **counts, "layers_kept": len(store.layers.list())}
    if os.path.isdir(vm_snapshots):  # the microVM backend's snapshots
        from k3.sandbox.vm.snapshots import SnapshotDir

        from k3.sandbox.vm.sandbox import sweep_orphaned_run_dirs

        if os.path.isdir(os.path.join(scratch, "vm", "run")):  # owners killed before close: sockets and logs
            sweep_orphaned_run_dirs(os.path.join(scratch, "vm", "run"))
        vm_store = SnapshotDir(scratch)
        counts["vm_snapshots"] = len(vm_store.gc(keep, min_age_s=args.min_age))
        counts["vm_snapshots_kept"] = len(vm_store.list())
    if args.json:
        print(json.dumps(counts, indent=2))
    else:
        print(f"removed {counts['layers']} layers (kept {counts['layers_kept']}), {counts['processes']} processes, "
              f"{counts['cgroups']} cgroups, {counts['run_dirs']} run directories, {counts['staging']} staging "
              f"directories, {counts['owner_records']} owner records"
              + (f", {counts['vm_snapshots']} VM snapshots (kept {counts['vm_snapshots_kept']})" if "vm_snapshots" in counts else ""))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``k3 sandbox ...`` to the top-level parser."""
    parser = subparsers.add_parser("sandbox", help="isolated sandboxes: doctor, bench, run, gc, web")
    commands = parser.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])

    doctor = commands.add_parser("doctor", help="check what this machine offers the sandbox (CRIU included)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(func=_doctor)

    bench = commands.add_parser("bench", help="p50/p99 of create, exec, snapshot, restore, fork; sandboxes per GB")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--iterations", type=int, default=30, help="timed repetitions per operation (default 30)")
    bench.add_argument("--edits", type=int, default=100, help="files edited before snapshotting (default 100)")
    bench.add_argument("--image-mb", type=int, default=200, help="size of the benchmark image (default 200)")
    bench.add_argument("--parts", default="base,memory",
                       help="which benchmarks: base (files-only ops), memory (a 50 MB REPL); default both")
    bench.add_argument("--memory-iterations", type=int, default=20, help="timed repetitions of memory ops (default 20)")
    bench.add_argument("--state-mb", type=int, default=50, help="MB of state the benchmark REPL holds (default 50)")
    bench.add_argument("--vm-memory-mb", type=int, default=512, dest="vm_memory_mb",
                       help="--backend vm: guest RAM in MB (more than twice --state-mb; default 512)")
    bench.add_argument("--concurrent", type=int, default=0,
                       help="--backend vm: also run this many guests at once (memory per guest, start time)")
    bench.add_argument("--backend", default="local", choices=("local", "vm"),
                       help="vm: whole-machine snapshots of a microVM, beside the local memory bench")
    bench.add_argument("--disk-mb", type=int, default=Limits.disk_mb,
                       help=f"the sandboxes' writable layer in MiB (default {Limits.disk_mb}); 0 puts it on the scratch disk")
    bench.add_argument("--pool", type=int, default=0, help="also fill a SandboxPool with this many sandboxes (e.g. 200)")
    bench.add_argument("--ray-episodes", type=int, default=0, help="also run this many episodes on a local Ray fleet")
    bench.add_argument("--ray-workers", type=int, default=4, help="Ray workers for --ray-episodes (default 4)")
    bench.set_defaults(func=_bench)

    web = commands.add_parser("web", help="the offline web: info, search, open, browse tasks")
    web_commands = web.add_subparsers(dest="web_command", metavar="WEBCOMMAND")
    web.set_defaults(func=_web, web_command="info", json=False)
    info = web_commands.add_parser("info", help="build (once) and describe the corpus and its index")
    info.add_argument("--json", action="store_true")
    search = web_commands.add_parser("search", help="search the offline web")
    search.add_argument("query", nargs="+")
    open_ = web_commands.add_parser("open", help="print a page of the offline web")
    open_.add_argument("url")
    tasks = web_commands.add_parser("tasks", help="print browse tasks (multi-hop questions with answers)")
    tasks.add_argument("--n", type=int, default=5)
    tasks.add_argument("--seed", type=int, default=0)
    tasks.add_argument("--split", default="train", choices=("train", "test"))
    tasks.add_argument("--json", action="store_true")

    run = commands.add_parser("run", help="run one shell command in a fresh sandbox")
    run.add_argument("cmd", help="shell command, run with /bin/sh -c")
    run.add_argument("--image", default=None, help="image directory (default: the minimal host-built image)")
    run.add_argument("--snapshot", default=None, help="start from this snapshot id")
    run.add_argument("--snapshot-after", action="store_true", help="snapshot at the end and print its id")
    run.add_argument("--timeout", type=float, default=60.0)
    run.add_argument("--memory-mb", type=int, default=512)
    run.add_argument("--pids", type=int, default=256)
    run.add_argument("--cpus", type=float, default=1.0)
    run.add_argument("--disk-mb", type=int, default=1024,
                     help="size of the writable layer in MiB (a tmpfs; default 1024); 0 puts it on the scratch disk, unbounded")
    run.set_defaults(func=_run)

    gc = commands.add_parser("gc", help="delete snapshot layers no running sandbox needs, and what sandboxes of "
                             "crashed owners left (processes, cgroups, run and staging directories)")
    gc.add_argument("--json", action="store_true", help="print the counts as JSON")
    gc.add_argument("--keep", nargs="*", default=[], help="snapshot ids to keep (with their parents)")
    gc.add_argument("--min-age", type=float, default=3600.0, help="spare anything younger than this many seconds")
    gc.set_defaults(func=_gc)
