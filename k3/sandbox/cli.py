"""``k3 sandbox``: doctor, bench, run, gc. Thin: parses, calls k3.sandbox, prints."""

from __future__ import annotations

import argparse
import json
import sys


def _doctor(args: argparse.Namespace) -> int:
    from k3.sandbox.doctor import report, run_checks

    checks = run_checks()
    if args.json:
        print(json.dumps([check.__dict__ for check in checks], indent=2))
    else:
        print(report(checks))
    return 0 if all(check.ok for check in checks if check.required) else 1


def _bench(args: argparse.Namespace) -> int:
    from k3.sandbox import bench

    results = bench.run(iterations=args.iterations, edits=args.edits, image_mb=args.image_mb)
    print(json.dumps(results, indent=2) if args.json else bench.format_table(results))
    return 0


def _run(args: argparse.Namespace) -> int:
    from k3.sandbox import Limits, Sandbox

    limits = Limits(memory_mb=args.memory_mb, pids=args.pids, cpus=args.cpus)
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
    from k3.sandbox.layers import LayerStore
    from k3.sandbox.paths import scratch_dir
    from k3.sandbox.pool import SnapshotStore

    store = SnapshotStore(LayerStore(scratch_dir()))
    keep = set(args.keep)
    for snapshot in keep:
        store.pin(snapshot)
    removed = store.gc(min_age_s=args.min_age)
    print(f"removed {len(removed)} layers; kept {len(store.layers.list())}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``k3 sandbox ...`` to the top-level parser."""
    parser = subparsers.add_parser("sandbox", help="isolated sandboxes: doctor, bench, run, gc")
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
    bench.set_defaults(func=_bench)

    run = commands.add_parser("run", help="run one shell command in a fresh sandbox")
    run.add_argument("cmd", help="shell command, run with /bin/sh -c")
    run.add_argument("--image", default=None, help="image directory (default: the minimal host-built image)")
    run.add_argument("--snapshot", default=None, help="start from this snapshot id")
    run.add_argument("--snapshot-after", action="store_true", help="snapshot at the end and print its id")
    run.add_argument("--timeout", type=float, default=60.0)
    run.add_argument("--memory-mb", type=int, default=512)
    run.add_argument("--pids", type=int, default=256)
    run.add_argument("--cpus", type=float, default=1.0)
    run.set_defaults(func=_run)

    gc = commands.add_parser("gc", help="delete snapshot layers no running sandbox needs")
    gc.add_argument("--keep", nargs="*", default=[], help="snapshot ids to keep (with their parents)")
    gc.add_argument("--min-age", type=float, default=3600.0, help="spare layers younger than this many seconds")
    gc.set_defaults(func=_gc)
