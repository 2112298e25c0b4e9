"""The `k3` command. Thin: it parses, calls the library, prints.

Each subsystem owns its subcommands in a `cli.py` of its own exposing `register(subparsers)`;
this file only lists them. Subsystems are imported lazily, so a missing optional
dependency of one command never breaks another.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

# Modules that register subcommands, in the order `k3 --help` lists them.
SUBSYSTEMS = [
    "k3.info_cli",
    "k3.train.cli",
    "k3.infer.cli",
    "k3.infer.serve_cli",
    "k3.eval.cli",
    "k3.vision.cli",
    "k3.checkpoint.cli",
    "k3.sandbox.cli",
    "k3.rl.cli",
    "k3.rl.distill_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 architecture: inspect, train, generate, convert checkpoints, run sandboxes.")
    parser.add_argument("--traceback", action="store_true",
                        help="print an error's whole traceback, not only its message (or K3_TRACEBACK=1)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBSYSTEMS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and error.name.startswith(module_name.rsplit(".", 1)[0]):
                continue  # subsystem not built yet
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        # Before anything imports fla: K3_AUTOTUNE_CONFIGS=N keeps N autotune configs per fla kernel on a GPU.
        from k3.ops.triton_support import limit_triton_autotune_from_env
        limit_triton_autotune_from_env()
        result = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        # Library errors are written to be read by people: show the message, not a traceback.
        show_traceback(args)
        print(f"k3: error: {error}{raised_at(error)}", file=sys.stderr)
        return 1
    except OSError as error:  # a file the command reads or writes: a full disk, no permission, a file as a folder
        show_traceback(args)
        where = f" ({error.filename})" if error.filename else ""
        print(f"k3: error: {error.strerror or error}{where}", file=sys.stderr)
        return 1
    return int(result or 0)


def show_traceback(args: argparse.Namespace) -> None:
    if args.traceback or os.environ.get("K3_TRACEBACK", "") not in ("", "0"):  # the edge: scripts, bug reports
        traceback.print_exc(file=sys.stderr)


def raised_at(error: BaseException) -> str:
    """Where in k3 an error that k3 did not raise itself came from (an allocation that failed, a shape torch
    refused): " (at k3/FILE:LINE in FUNCTION)", the last of k3's frames it passed; "" for k3's own `raise`s,
    whose messages say what was wrong."""
    frames = traceback.extract_tb(error.__traceback__)
    package = os.path.dirname(os.path.abspath(__file__))
    ours = [frame for frame in frames if os.path.abspath(frame.filename).startswith(package + os.sep)]
    if not ours or (ours[-1] is frames[-1] and (frames[-1].line or "").lstrip().startswith("raise")):
        return ""
    where = ours[-1]
    return f" (at {os.path.relpath(where.filename, os.path.dirname(package))}:{where.lineno} in {where.name})"


if __name__ == "__main__":
    raise SystemExit(main())
