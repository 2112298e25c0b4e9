"""The microVM backend against hostile guests, as tests/sandbox/test_hostile_*.py test the local backend: host
files, host processes, the host's loopback, sibling forks, what a kill -9 of the owner leaves; and what a VM
adds: the guest cannot reach the host's memory-file directory or QEMU's monitor, and a guest writing garbage
to its ports harms only itself. Also the guest-side features: repl(), Limits.pids, the web relay, gc.

Slow: the first sandbox of a session boots the guest kernel (under TCG where there is no hardware KVM)."""

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.sandbox.test_vm import _vm_missing

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vm(sandbox_home):
    reason = _vm_missing()
    if reason:
        pytest.skip(f"no microVM here: {reason}")
    from k3.sandbox import Limits, Sandbox

    box = Sandbox(limits=Limits(memory_mb=256, cpus=1.0, pids=64), backend="vm")
    yield box
    box.close()


def test_guest_cannot_read_host_files(vm, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host-only-7f3a")
    result = vm.exec(f"cat {secret}; grep -rl host-only-7f3a / --exclude-dir=proc --exclude-dir=sys 2>/dev/null; "
                     "cat /proc/mounts", timeout=300)
    assert "host-only-7f3a" not in result.stdout
    mounted = {line.split()[2] for line in result.stdout.splitlines() if len(line.split()) > 2}
    assert not mounted & {"9p", "virtiofs", "nfs", "fuse"}, mounted  # no host filesystem is shared in


def test_guest_sees_only_its_own_processes(vm):
    listing = vm.exec("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done").stdout
    assert "agent.py" in listing  # the guest's own PID 1 tree
    for host_only in ("pytest", "qemu-system", str(os.getpid())):
        assert host_only not in listing
    assert not vm.exec(f"kill -0 {os.getpid()}").ok or os.getpid() < 1000  # a host pid means nothing inside


def test_guest_cannot_reach_the_host_loopback(vm):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        probe = ("import socket\ns = socket.socket()\ns.settimeout(5)\n"
                 f"try:\n    s.connect(('127.0.0.1', {port})); print('connected')\n"
                 "except OSError as e:\n    print('refused', e)\n")
        result = vm.exec(["python3", "-c", probe], timeout=120)
        server.settimeout(0.5)
        with pytest.raises(socket.timeout):
            server.accept()  # nothing from the guest arrived
    assert result.stdout.startswith("refused"), result.stdout
    assert vm.exec("ls /sys/class/net").stdout.split() in ([], ["lo"])  # no network device at all


def test_guest_has_no_device_to_the_monitor_or_the_memory_files(vm):
    # virtio devices in the guest: block (2) and console (3) only; no net (1), vsock (19), 9p (9), fs (26).
    ids = vm.exec("cat /sys/bus/virtio/devices/*/device").stdout.split()
    assert sorted(set(ids)) == ["0x0002", "0x0003"], ids
    ports = vm.exec("cat /sys/class/virtio-ports/*/name").stdout.split()
    assert sorted(ports) == ["k3.agent", "k3.web"]
    for host_path in (vm.config.ram_dir, vm.run_dir, vm.store.root):
        assert not vm.exec(f"test -e {host_path}").ok, host_path
    # The agent's own port is held by the agent: a second opener in the guest is refused.
    port = vm.exec("grep -l k3.agent /sys/class/virtio-ports/*/name").stdout.split("/")[4]
    opened = vm.exec(["python3", "-c", f"import os\ntry:\n    os.open('/dev/{port}', os.O_RDWR); print('opened')\n"
                                       "except OSError as e:\n    print('refused', e.errno)"])
    assert opened.stdout.startswith("refused"), opened.stdout


def test_garbage_on_the_web_port_harms_only_the_guest(vm):
    from k3.sandbox.vm import VmSandbox

    box = VmSandbox(vm.image, vm.limits, home=vm.home, config=vm.config)
    try:
        box.enable_web()
        find = ("port=$(grep -l k3.web /sys/class/virtio-ports/*/name | cut -d/ -f5); "
                "for p in /proc/[0-9]*; do ls -l $p/fd 2>/dev/null | grep -q $port && echo ${p#/proc/}; done")
        relay = box.exec(find).stdout.split()
        assert relay, "the guest's web relay should hold the port"
        box.exec(f"kill -9 {' '.join(relay)}")  # the guest's relay is gone: anything in the guest may write the port
        hostile = ("import glob, os\nfor p in glob.glob('/sys/class/virtio-ports/*/name'):\n"
                   "    if open(p).read().strip() == 'k3.web':\n        port = '/dev/' + p.split('/')[4]\n"
                   "os.write(os.open(port, os.O_RDWR), b'\\xff\\xff\\xff\\xff' + b'x' * 64)\nprint('sent')")
        assert box.exec(["python3", "-c", hostile], timeout=60).stdout == "sent\n"
        thread = box._qemu.web_thread
        thread.join(timeout=30)
        assert not thread.is_alive()  # a frame over the limit ends the host's relay thread, nothing else
        assert box.exec("echo alive").stdout == "alive\n"
        box.enable_web()  # the host reconnects, the guest starts a new relay
        assert box.exec("web search json", timeout=120).ok
    finally:
        box.close()


def test_snapshot_memory_file_is_never_written_by_forks(vm):
    snap = vm.snapshot()
    memory = os.path.join(vm.store.path(snap), "memory")
    before = hashlib.sha256(open(memory, "rb").read()).hexdigest()
    first, second = vm.fork(snap, 2)
    try:
        first.exec("head -c 8000000 /dev/urandom > /tmp/noise")
        second.write_file("/tmp/mine", "second")
        assert not first.exec("test -e /tmp/mine").ok and not second.exec("test -e /tmp/noise").ok
    finally:
        first.close()
        second.close()
    assert hashlib.sha256(open(memory, "rb").read()).hexdigest() == before
    assert oct(os.stat(memory).st_mode & 0o777) == "0o400"


def test_fork_bomb_stops_at_the_pids_limit_and_the_guest_answers(vm):
    result = vm.exec("for i in $(seq 200); do sleep 30 & done; wait", timeout=120)
    assert not result.ok and "fork" in result.stderr.lower(), result.stderr
    assert vm.exec("cat /sys/fs/cgroup/k3/pids.max").stdout.strip() == "64"
    vm.exec("kill -9 $(cat /sys/fs/cgroup/k3/cgroup.procs) 2>/dev/null; true")
    assert vm.exec("echo alive").stdout == "alive\n"


def test_repl_keeps_every_variable_across_snapshot_restore_and_fork(vm):
    repl = vm.repl("hostile")
    assert repl.run("x = 21\nf = open('/tmp/held', 'w')\nx * 2").value == "42"
    out = repl.run("print(x); import sys; sys.stderr.write('err\\n')")
    assert (out.stdout, out.stderr) == ("21\n", "err\n")
    looped = repl.run("while True: pass", timeout=2)
    assert looped.timed_out and not looped.died and repl.run("x").value == "21"
    snap = vm.snapshot()
    repl.run("x = 99")
    vm.restore(snap)
    # An open file is in the snapshot too: the process was never stopped and started again.
    assert repl.run("(x, f.closed)").value == "(21, False)"
    (fork,) = vm.fork(snap, 1)
    try:
        fork.repl("hostile").run("x = 1")
        assert repl.run("x").value == "21" and fork.repl("hostile").run("x").value == "1"
    finally:
        fork.close()
    assert repl.run("import os; os._exit(3)").died and repl.run("'x' in dir()").value == "False"
    repl.close()
    assert not repl.alive


def test_web_relay_answers_in_the_guest_and_survives_restore(vm):
    vm.enable_web()
    snap = vm.snapshot()
    found = vm.exec("web search json decoder", timeout=120)
    assert found.ok and "json" in found.stdout, found.stderr
    vm.restore(snap)
    again = vm.exec("web search json decoder", timeout=120)
    assert again.ok and again.stdout == found.stdout


def test_gc_removes_unneeded_snapshots_and_only_what_the_store_made(vm, tmp_path):
    from k3.sandbox.vm.snapshots import SnapshotDir

    store = SnapshotDir(vm.scratch)
    (fork,) = vm.fork(None, 1)  # a snapshot taken now; the fork runs on it
    in_use = fork.parent
    spare = vm.snapshot()
    stranger = os.path.join(store.root, "not-a-snapshot")
    os.makedirs(stranger, exist_ok=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    link = os.path.join(store.root, "0" * 24)
    os.symlink(tmp_path, link)  # a link is never followed
    try:
        removed = store.gc()
        assert spare in removed and in_use not in removed  # the fork's guest maps it
        assert os.path.isdir(stranger) and outside.read_text() == "keep me" and os.path.islink(link)
        assert any(store.meta(s).get("boot") for s in store.list())  # the boot snapshot is a cache: kept
    finally:
        fork.close()
        os.rmdir(stranger)
        os.unlink(link)
    assert in_use in store.gc()  # its guest is gone
    assert {s for s in store.list() if not store.meta(s).get("boot")} <= {vm.parent}  # the running guest's own


def test_owner_killed_leaves_no_qemu_no_memory_file_no_mount(vm):
    script = ("from k3.sandbox import Limits; from k3.sandbox.vm import VmSandbox; import time\n"
              "box = VmSandbox(limits=Limits(memory_mb=256, cpus=1.0)); fork, = box.fork(None, 1)\n"
              "print(box.pids()[0], fork.pids()[0], flush=True)\ntime.sleep(600)\n")
    mounts_before = open("/proc/mounts").read()
    ram_before = set(os.listdir(vm.config.ram_dir)) if os.path.isdir(vm.config.ram_dir) else set()
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        line = owner.stdout.readline()
        assert len(line.split()) == 2, f"the owner did not start two guests: {line!r}"
        qemus = [int(pid) for pid in line.split()]
        assert all(_is_qemu(pid) for pid in qemus)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_is_qemu(pid) for pid in qemus):
        time.sleep(0.05)
    assert not any(_is_qemu(pid) for pid in qemus)  # PDEATHSIG: QEMU dies with its owner
    assert open("/proc/mounts").read() == mounts_before
    ram_after = set(os.listdir(vm.config.ram_dir)) if os.path.isdir(vm.config.ram_dir) else set()
    assert ram_after <= ram_before
    assert subprocess.run([sys.executable, "-m", "k3.cli", "sandbox", "gc", "--min-age", "0"], capture_output=True,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=300).returncode == 0
    run_root = os.path.dirname(vm.run_dir)
    assert sorted(os.listdir(run_root)) == [os.path.basename(vm.run_dir)]  # only the live sandbox's


def _is_qemu(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe").endswith("qemu-system-x86_64")
    except OSError:
        return False
