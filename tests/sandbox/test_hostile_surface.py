"""Less surface: system calls no task needs are denied inside (seccomp), and the sandbox's /proc
shows no host path. One call or one file per test."""

import pytest

from k3.sandbox import seccomp

# Prints the errno of one raw system call (0 when it succeeded) made from inside the sandbox.
SYSCALL = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
args = [int(a, 0) for a in sys.argv[2:]]
result = libc.syscall(int(sys.argv[1]), *[ctypes.c_long(a) for a in args])
print(ctypes.get_errno() if result == -1 else 0)
"""
X86_64 = {"unshare": 272, "clone3": 435, "io_uring_setup": 425, "socket": 41, "keyctl": 250, "ptrace": 101,
          "add_key": 248, "bpf": 321, "userfaultfd": 323}
EPERM, ENOSYS = 1, 38


def _errno(box, name: str, *args: int) -> int:
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the syscall numbers of these tests are x86_64's")
    box.write_file("/tmp/syscall.py", SYSCALL)
    result = box.exec(["python3", "/tmp/syscall.py", str(X86_64[name]), *map(str, args)])
    assert result.exit_code == 0, result.stderr
    return int(result.stdout)


@pytest.fixture(autouse=True)
def _needs_filter():
    if seccomp.filter_bpf() is None:
        pytest.skip(seccomp.status())


def test_a_new_user_namespace_is_denied(box):
    assert _errno(box, "unshare", 0x10000000) == EPERM  # CLONE_NEWUSER


def test_clone3_is_refused_so_that_libc_falls_back_to_the_filtered_clone(box):
    assert _errno(box, "clone3", 0, 0) == ENOSYS


def test_io_uring_is_denied(box):
    assert _errno(box, "io_uring_setup", 8, 0) == EPERM


def test_vsock_sockets_are_denied(box):
    assert _errno(box, "socket", 40, 1, 0) == EPERM  # AF_VSOCK, SOCK_STREAM


def test_the_kernel_keyring_is_denied(box):
    assert _errno(box, "keyctl", 0, -3, 0) == EPERM  # KEYCTL_GET_KEYRING_ID of the session keyring


def test_ptrace_is_denied(box):
    assert _errno(box, "ptrace", 0, 0, 0, 0) == EPERM  # PTRACE_TRACEME


def test_ordinary_calls_still_work(box):
    assert _errno(box, "socket", 1, 1, 0) == 0  # AF_UNIX
    assert _errno(box, "unshare", 0) == 0  # no namespace flag: nothing to deny
    assert box.exec("echo fine | cat").stdout == "fine\n"


def test_mountinfo_names_no_host_path(box):
    mountinfo = box.read_file("/proc/self/mountinfo").decode()
    for host_path in (box.scratch, box.image.path, box.home):
        assert host_path not in mountinfo, (host_path, mountinfo)


def test_pid1_command_line_names_no_host_path(box):
    import os

    cmdline = box.read_file("/proc/1/cmdline").decode()
    k3_dir = os.path.dirname(os.path.dirname(seccomp.__file__))
    assert k3_dir not in cmdline and "/tmp" not in cmdline, cmdline
