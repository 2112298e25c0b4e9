"""Clean after a crash: the owner of busy, idle and paused sandboxes is killed with SIGKILL; its
sandboxes' processes end by themselves, and ``leftovers.collect`` (``k3 sandbox gc``) removes the
rest. Every wait is bounded."""

import json
import os
import signal
import subprocess
import sys
import time

from k3.sandbox import leftovers
from k3.sandbox.cgroups import Cgroup, leftover_groups
from k3.sandbox.paths import scratch_dir

OWNER = r"""
import json, sys, threading, time
from k3.sandbox import Limits, Sandbox
busy, cell, idle, paused = (Sandbox(limits=Limits(disk_mb=None)) for _ in range(4))
busy.write_file("/work/file", "x")  # something in the run directory on the host's disk
threading.Thread(target=busy.exec, args=("while :; do :; done",), kwargs={"timeout": None}, daemon=True).start()
repl = cell.repl()
repl.run("x = 1")
threading.Thread(target=repl.run, args=("while True: pass",), kwargs={"timeout": None}, daemon=True).start()
paused.exec("sleep 1000 &")
paused.pause()
time.sleep(0.5)
boxes = {"busy": busy, "cell": cell, "idle": idle, "paused": paused}
print(json.dumps({name: {"id": box.id, "cgroup": box._supervisor.name, "run_dir": box.run_dir}
                  for name, box in boxes.items()}), flush=True)
time.sleep(1000)
"""


def _pids(name: str) -> list[int]:
    return Cgroup.create(name).pids() if any(path.endswith("/" + name) for path in leftover_groups()) else []


def test_sandboxes_of_a_killed_owner_end_and_gc_removes_every_leftover(sandbox_home):
    env = dict(os.environ, K3_SANDBOX_HOME=sandbox_home, K3_SANDBOX_SPARES="1",
               PYTHONPATH=os.pathsep.join(sys.path))
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = owner.stdout.readline()
        assert line, "the owner process did not start its sandboxes"
        boxes = json.loads(line)
        assert all(_pids(box["cgroup"]) for box in boxes.values())
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        owner.stdout.close()

    # Busy or idle, a sandbox whose owner died ends by itself (a frozen one cannot notice).
    deadline = time.monotonic() + 30
    running = ["busy", "cell", "idle"]
    while any(_pids(boxes[name]["cgroup"]) for name in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {name: _pids(boxes[name]["cgroup"]) for name in running} == {name: [] for name in running}

    # Not 0: a cgroup made this very moment (a spare of another process, about to be joined) is spared.
    time.sleep(2.5)
    counts = leftovers.collect(scratch_dir(), min_age_s=2)
    assert counts["cgroups"] >= 4 and counts["run_dirs"] >= 4 and counts["processes"] >= 1, counts
    groups = leftover_groups()
    for box in boxes.values():
        assert not any(path.endswith("/" + box["cgroup"]) for path in groups), box
        assert not os.path.exists(box["run_dir"]), box
        assert not os.path.exists(os.path.join(leftovers.owners_dir(), box["cgroup"])), box
