"""Launching a test's worker script on N processes (torchrun for N > 1) and reading rank 0's JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CXX_ABORT = "terminate called without an active exception"


def run_launch(command: list[str], name: str, timeout: int) -> subprocess.CompletedProcess:
    """Run ``command`` (a torchrun or python command line) with the repo on PYTHONPATH and one thread per
    process; raise with its output if it fails.

    A gloo rank has aborted inside the C++ runtime, with no Python error, a few times on a loaded 2-core machine
    (2026-12: in test_distributed.py, test_sharded_checkpoint.py and test_ep_layer_bench.py, the last after its
    work and its JSON were done, in the teardown; each passed alone and in other full runs). Such an abort is
    retried once; a failure of k3's code fails both attempts."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and CXX_ABORT in done.stderr:
        print(f"{name}: a rank aborted in the C++ runtime; retrying once\n{done.stderr[-2000:]}")
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return done


def torchrun(nproc: int) -> list[str]:
    """The launcher prefix: plain python for one process, torchrun --standalone for more."""
    return ([sys.executable] if nproc == 1 else
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)])


def run_scenario(worker: Path, out: Path, name: str, nproc: int, args: tuple[str, ...], timeout: int) -> dict:
    """Run ``worker`` with ``args --out out`` on ``nproc`` processes (run_launch); return the JSON it wrote."""
    run_launch(torchrun(nproc) + [str(worker), *args, "--out", str(out)], name, timeout)
    return json.loads(out.read_text())
