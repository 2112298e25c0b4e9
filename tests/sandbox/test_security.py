"""Hostile programs, one property per test: each asserts that the sandbox held."""

import os
import socket

import pytest

from k3.sandbox import Limits, Sandbox
from k3.sandbox.cgroups import leftover_groups

CONNECT = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=3).close()
    print("connected")
except OSError as error:
    print("refused", error)
"""


def test_no_network_not_even_loopback(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        box.write_file("/tmp/connect.py", CONNECT)
        for host, target_port in (("127.0.0.1", port), ("1.1.1.1", 80), ("8.8.8.8", 53)):
            result = box.exec(["python3", "/tmp/connect.py", host, str(target_port)])
            assert result.stdout.startswith("refused"), (host, result.stdout, result.stderr)
        # The only interface is the namespace's own loopback, and it is down.
        interfaces = [line.split(":")[0].strip() for line in box.read_file("/proc/net/dev").decode().splitlines()[2:]]
        assert interfaces == ["lo"]
    finally:
        server.close()


def test_no_write_outside(box, tmp_path):
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_text("untouched")
    image_file = os.path.join(box.image.path, "etc", "passwd")
    image_before = open(image_file, "rb").read()
    hostile = f"""
echo pwned > {sentinel} 2>/dev/null
echo pwned > /etc/passwd
rm -rf /usr/bin/* /etc/hosts
echo pwned > /proc/1/root{sentinel} 2>/dev/null
echo c > /proc/sysrq-trigger 2>/dev/null
echo 1 > /proc/sys/vm/drop_caches 2>/dev/null
mount -t tmpfs none /mnt 2>/dev/null
python3 -c "import os; os.chroot('/tmp')" 2>/dev/null
exit 0
"""
    box.exec(hostile)
    assert sentinel.read_text() == "untouched"
    assert open(image_file, "rb").read() == image_before  # the image stays read-only
    assert os.path.exists(os.path.join(box.image.path, "etc", "hosts"))
    assert open("/etc/hostname").read() != "pwned\n"


def test_no_capabilities_inside(box):
    status = box.exec("grep -E '^Cap(Eff|Prm|Bnd|Amb)' /proc/self/status").stdout.split()
    assert status[1::2] == ["0000000000000000"] * 4
    assert box.exec("grep NoNewPrivs /proc/self/status").stdout.split() == ["NoNewPrivs:", "1"]


def test_fork_bomb_is_contained_by_the_pids_limit(sandbox_home):
    with Sandbox(limits=Limits(pids=64)) as sandbox:
        result = sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 30", timeout=5)
        assert sandbox.cgroup.pids_max_hits() > 0  # the kernel refused forks at the limit
        assert len(sandbox.pids()) <= 64
        assert result.exit_code != 0 or result.timed_out
        assert sandbox.exec("echo alive").stdout == "alive\n"


def test_memory_bomb_is_killed_by_the_memory_limit(sandbox_home):
    with Sandbox(limits=Limits(memory_mb=64)) as sandbox:
        result = sandbox.exec("python3 -c 'x = [bytearray(1 << 20) for _ in range(1 << 12)]'", timeout=60)
        assert result.oom_killed
        assert result.exit_code == 137  # SIGKILL from the OOM killer
        assert sandbox.exec("echo alive").stdout == "alive\n"


def test_timeout_kills_the_whole_process_tree(box):
    baseline = set(box.pids())  # the supervisor and unshare
    result = box.exec("sleep 1000 & (setsid sleep 1000 &) ; sh -c 'sleep 1000 & wait' & sleep 1000", timeout=1)
    assert result.timed_out
    assert set(box.pids()) == baseline
    assert "sleep" not in box.exec("cat /proc/[0-9]*/comm").stdout


def test_forks_never_see_each_others_writes(box):
    box.write_file("/work/shared.txt", "original")
    first, second = box.fork(n=2)
    with first, second:
        first.write_file("/work/shared.txt", "first")
        first.exec("echo secret > /tmp/only-first; sleep 100 &")
        assert second.read_file("/work/shared.txt") == b"original"
        assert second.exec("test -e /tmp/only-first").exit_code == 1
        assert "sleep" not in second.exec("cat /proc/[0-9]*/comm").stdout  # nor each other's processes
        assert box.read_file("/work/shared.txt") == b"original"


def _mounts() -> str:
    with open("/proc/self/mountinfo") as f:
        return f.read()


def test_nothing_left_after_close(sandbox_home):
    sandbox = Sandbox()
    sandbox.exec("sleep 1000 > /dev/null 2>&1 &")
    sandbox.restore(sandbox.snapshot())  # a replaced generation must be cleaned up too
    sandbox.exec("sleep 1000 > /dev/null 2>&1 &")
    pids, run_dir, groups = sandbox.pids(), sandbox.run_dir, sandbox.cgroup.procs_files()
    assert len(pids) >= 3
    started = {pid: _start_time(pid) for pid in pids}
    sandbox.close()
    for pid, start in started.items():
        assert _start_time(pid) != start  # gone (or the pid now names an unrelated, newer process)
    assert not any(os.path.exists(os.path.dirname(path)) for path in groups)
    assert not any(sandbox.id in path for path in leftover_groups())
    assert not os.path.exists(run_dir)
    assert run_dir not in _mounts() and sandbox_home not in _mounts()


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("path", ["/proc/sysrq-trigger", "/proc/sys/kernel/hostname"])
def test_global_proc_files_are_not_writable(box, path):
    result = box.exec(f"echo x > {path}")
    assert result.exit_code != 0


def test_commands_run_at_normal_priority(box):
    # The supervisor runs at a raised priority; nothing it starts may inherit that.
    assert box.exec("cut -d' ' -f19 /proc/self/stat").stdout.strip() == "0"
