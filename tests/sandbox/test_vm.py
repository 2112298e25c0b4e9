"""The microVM backend end to end: a process inside the guest (a shell loop counting in memory)
goes on from exactly its snapshot state after restore, forks diverge without seeing each other,
and a guest agent that stops answering makes the host call fail by its deadline.

Slow: the first sandbox boots the guest kernel (under TCG on hosts without hardware KVM, a minute
or more on a busy machine); later ones restore the boot snapshot."""

import shutil

import pytest

from k3.sandbox.local import SandboxError

pytestmark = pytest.mark.slow

COUNTER = ("i=0; while true; do if [ -e /tmp/poke ]; then rm /tmp/poke; i=$((i+1)); "
           "echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; fi; sleep 0.05; done")


def _vm_missing() -> str | None:
    from k3.sandbox.vm.config import VmConfig, VmUnavailable, qemu_path

    try:
        config = VmConfig().resolved()
        qemu_path(config)
    except VmUnavailable as error:
        return str(error)
    if shutil.which("mkfs.ext4") is None and shutil.which("mkfs.ext4", path="/sbin:/usr/sbin") is None:
        return "mkfs.ext4 is missing (apt-get install e2fsprogs)"
    return None


@pytest.fixture(scope="module")
def vm(sandbox_home):
    reason = _vm_missing()
    if reason:
        pytest.skip(f"no microVM here: {reason}")
    from k3.sandbox import Limits, Sandbox

    box = Sandbox(limits=Limits(memory_mb=256, cpus=1.0), backend="vm")
    yield box
    box.close()


def _poke(box, expected: int) -> None:
    """Ask the counting loop for one more step and wait (bounded) until it reports ``expected``."""
    box.write_file("/tmp/poke", "")
    result = box.exec(f"for n in $(seq 600); do [ \"$(cat /tmp/count 2>/dev/null)\" = {expected} ] && exit 0; "
                      "sleep 0.05; done; cat /tmp/count; exit 1", timeout=120)
    assert result.exit_code == 0, f"the counter did not reach {expected}: it says {result.stdout!r}"


def test_vm_backend_runs_commands(vm):
    assert vm.backend == "vm"
    result = vm.exec("echo hello; uname -s")
    assert result.ok and result.stdout == "hello\nLinux\n"
    vm.write_file("/work/x.txt", b"data\x00bytes")
    assert vm.read_file("/work/x.txt") == b"data\x00bytes"
    with pytest.raises(FileNotFoundError):
        vm.read_file("/work/none")


def test_upload_copies_a_host_tree(vm, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.sh").write_text("echo from-a\n")
    (tmp_path / "pkg" / "a.sh").chmod(0o755)
    (tmp_path / "one.txt").write_text("one")
    vm.upload(str(tmp_path / "pkg"), "/work/pkg")
    vm.upload(str(tmp_path / "one.txt"), "/work/one.txt")
    assert vm.exec("/work/pkg/a.sh").stdout == "from-a\n"
    assert vm.read_file("/work/one.txt") == b"one"


def test_counting_process_resumes_from_its_snapshot_state(vm):
    vm.exec(f"({COUNTER}) > /dev/null 2>&1 &")
    for expected in (1, 2, 3):
        _poke(vm, expected)
    snap = vm.snapshot()
    for expected in (4, 5):  # the original goes on past the snapshot
        _poke(vm, expected)
    vm.restore(snap)
    # The same process, with i == 3 in its memory: its next step is 4, not 6 and not 1.
    assert vm.read_file("/tmp/count") == b"3\n"
    _poke(vm, 4)
    assert vm.exec("ps -o comm= 2>/dev/null | grep -c sh || ls /proc | grep -c '^[0-9]'").ok


def test_forks_diverge_without_seeing_each_other(vm):
    snap = vm.snapshot()
    first, second = vm.fork(snap, 2)
    try:
        _poke(first, int(vm.read_file("/tmp/count")) + 1)
        _poke(first, int(vm.read_file("/tmp/count")) + 2)
        _poke(second, int(vm.read_file("/tmp/count")) + 1)
        first.write_file("/tmp/only-first", "1")
        assert int(first.read_file("/tmp/count")) == int(second.read_file("/tmp/count")) + 1
        assert not second.exec("test -e /tmp/only-first").ok
        assert not vm.exec("test -e /tmp/only-first").ok
    finally:
        first.close()
        second.close()


def test_command_timeout_kills_its_tree(vm):
    result = vm.exec("sleep 1000", timeout=1.0)
    assert result.timed_out and not result.ok


def test_agent_that_stops_answering_fails_by_its_deadline(vm):
    from dataclasses import replace

    from k3.sandbox.vm import VmSandbox

    # A fresh guest (the boot snapshot), with a short margin over the command's own timeout.
    box = VmSandbox(vm.image, vm.limits, home=vm.home, config=replace(vm.config, call_margin_s=3.0))
    snap = box.snapshot()
    try:
        # The command stops the agent that runs it (its parent): no answer will ever come.
        with pytest.raises(SandboxError, match="deadline"):
            # (a timeout long enough for the shell to start on a loaded TCG guest: the deadline is what is tested)
            box.exec("kill -STOP $PPID; sleep 1000", timeout=10.0)
        with pytest.raises(SandboxError, match="broken"):
            box.exec("true")
        box.restore(snap)  # a restore gives a fresh guest and channel
        assert box.exec("echo back").stdout == "back\n"
    finally:
        box.close()


def test_pool_hands_out_vm_sandboxes_and_wipes_them(vm):
    from k3.sandbox import SandboxPool

    with SandboxPool(vm.image, warm=1, max_concurrency=2, limits=vm.limits, home=vm.home, backend="vm") as pool:
        with pool.sandbox() as box:
            assert box.backend == "vm"
            box.write_file("/tmp/dirty", "x")
        with pool.sandbox() as box:
            assert not box.exec("test -e /tmp/dirty").ok  # released guests go back to the base snapshot


def test_owner_killed_leaves_no_qemu_running(vm):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = ("from k3.sandbox import Limits; from k3.sandbox.vm import VmSandbox; import time\n"
              "box = VmSandbox(limits=Limits(memory_mb=256, cpus=1.0))\n"
              "print(box.pids()[0], flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        line = owner.stdout.readline()  # the owner prints QEMU's pid once its guest runs
        assert line.strip().isdigit(), f"the owner did not start a guest: {line!r}"
        qemu_pid = int(line)
        assert os.path.exists(f"/proc/{qemu_pid}")
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=60)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{qemu_pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    # PDEATHSIG: QEMU dies with its owner (a zombie entry, if any, is reaped by init at once).
    assert not os.path.exists(f"/proc/{qemu_pid}/exe") or not os.readlink(f"/proc/{qemu_pid}/exe").endswith("qemu-system-x86_64")
    run_root = os.path.dirname(vm.run_dir)
    orphaned = [name for name in os.listdir(run_root) if _owner(run_root, name) == owner.pid]
    assert orphaned, "the killed owner's run directory should exist until the next sandbox sweeps it"
    from k3.sandbox.vm import VmSandbox

    VmSandbox(vm.image, vm.limits, home=vm.home, config=vm.config).close()
    assert not any(_owner(run_root, name) == owner.pid for name in os.listdir(run_root))


def _owner(run_root: str, name: str) -> int | None:
    import os

    try:
        with open(os.path.join(run_root, name, "owner")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
