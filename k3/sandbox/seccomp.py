"""The seccomp filter of every process a sandbox runs (commands, REPLs, the web relay).

Built on the host with libseccomp (the library behind Docker's and systemd's filters, called
through ctypes: its Python binding is not on PyPI) and exported as raw BPF; PID 1 loads those bytes
into each process it starts, after dropping capabilities and setting ``no_new_privs``
(``supervisor.drop_privileges``), so nothing inside can remove or loosen it.

Default allow, and these calls fail with EPERM (ENOSYS for clone3), each for a reason:
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

# syscall -> why it is denied (the table docs/sandbox.md shows)
DENIED = {
    "unshare": "with CLONE_NEWUSER: a new user namespace gives full capabilities inside it (mounts, "
               "nf_tables, ...), a large kernel surface no task needs",
    "clone": "with CLONE_NEWUSER: the same, through clone",
    "setns": "joining other namespaces",
    "mount": "mounting (only reachable from a nested user namespace, which is denied too)",
    "umount2": "unmounting", "pivot_root": "changing the root",
    "open_tree": "the new mount API", "move_mount": "the new mount API", "fsopen": "the new mount API",
    "fsconfig": "the new mount API", "fsmount": "the new mount API", "fspick": "the new mount API",
    "mount_setattr": "the new mount API",
    "io_uring_setup": "io_uring: a large, often-patched kernel surface that bypasses this filter's view "
                      "of each operation",
    "io_uring_enter": "io_uring", "io_uring_register": "io_uring",
    "socket": "with AF_VSOCK: vsock is not confined by the network namespace (it reaches the hypervisor)",
    "socketpair": "with AF_VSOCK",
    "keyctl": "the kernel keyring is not namespaced", "add_key": "the kernel keyring",
    "request_key": "the kernel keyring",
    "ptrace": "tracing: k3's own processes in the sandbox (the web relay, REPL servers) must not be taken "
              "over; debuggers do not work inside",
    "process_vm_readv": "reading another process's memory", "process_vm_writev": "writing another process's memory",
    "bpf": "eBPF programs", "perf_event_open": "performance counters (side channels, kernel surface)",
    "userfaultfd": "a tool for kernel race exploits",
    "kexec_load": "loading a kernel", "kexec_file_load": "loading a kernel",
    "init_module": "kernel modules", "finit_module": "kernel modules", "delete_module": "kernel modules",
    "open_by_handle_at": "opening files by handle, around path checks",
}
CLONE3_ERRNO = errno.ENOSYS  # clone3's flags are behind a pointer; ENOSYS makes libc fall back to clone
CLONE_NEWUSER = 0x10000000
AF_VSOCK = 40

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 4, 7


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


_cached: tuple[bytes | None, str] | None = None
_lock = threading.Lock()


def filter_bpf() -> bytes | None:
    """The filter as raw BPF (``struct sock_filter`` array), or None when libseccomp is missing."""
    return _build()[0]


def status() -> str:
    """One line for ``k3 sandbox doctor``: whether the filter is in force and why not."""
    return _build()[1]


def _build() -> tuple[bytes | None, str]:
    global _cached
    with _lock:
        if _cached is None:
            try:
                _cached = (_compile(), f"libseccomp: {len(DENIED) + 1} system calls denied to sandboxed processes")
            except OSError as error:
                _cached = (None, f"no seccomp filter: {error}")
    return _cached


def _compile() -> bytes:
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        raise OSError("libseccomp.so.2 is not installed (apt-get install libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    context = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not context:
        raise OSError("seccomp_init failed")
    try:
        deny = _errno_action(errno.EPERM)
        for name in DENIED:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a call of this architecture
            if name in ("unshare", "clone"):
                # unshare(flags) / clone(flags, ...): the flags are argument 0 on every architecture
                # libseccomp knows (it reorders clone's arguments itself where they differ).
                conditions = [_ArgCmp(0, SCMP_CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER)]
            elif name in ("socket", "socketpair"):
                conditions = [_ArgCmp(0, SCMP_CMP_EQ, AF_VSOCK, 0)]
            else:
                conditions = []
            array = (_ArgCmp * max(1, len(conditions)))(*conditions)
            result = lib.seccomp_rule_add_array(context, deny, number, len(conditions), array)
            if result < 0:
                raise OSError(f"seccomp_rule_add for {name} failed: {os.strerror(-result)}")
        clone3 = lib.seccomp_syscall_resolve_name(b"clone3")
        if clone3 >= 0:
            lib.seccomp_rule_add_array(context, _errno_action(CLONE3_ERRNO), clone3, 0, (_ArgCmp * 1)())
        memory = os.memfd_create("k3-seccomp")  # a file, not a pipe: no size can block the export
        try:
            result = lib.seccomp_export_bpf(context, memory)
            if result < 0:
                raise OSError(f"seccomp_export_bpf failed: {os.strerror(-result)}")
            os.lseek(memory, 0, os.SEEK_SET)
            program = b""
            while chunk := os.read(memory, 65536):
                program += chunk
        finally:
            os.close(memory)
        return program
    finally:
        lib.seccomp_release(context)
