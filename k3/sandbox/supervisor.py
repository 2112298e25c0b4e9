"""The process that runs as PID 1 inside one sandbox.

This file is sent on stdin to ``python -I -S -c BOOT`` (see ``local.BOOT``) run by ``unshare(1)``,
which has already given it fresh mount, pid, net, ipc and uts namespaces. It must not import anything from
``k3``: after ``pivot_root`` the host's files are gone, so every module it needs is imported up
front, before the host hands over the filesystem layout.

Life of a supervisor:
1. start, import what it needs, send ``hello`` (its pid on the host) and wait: this is a warm spare;
1b. before that hello, ``prepare`` builds /dev and a /proc (with its dangerous files masked);
2. ``setup``: mount the overlay (layers + fresh upper), move /dev and /proc into it, pivot into
   it, set the hostname, answer ``ready``;
3. serve requests one at a time (exec, read, write, upload, the REPL and web ops of
   ``supervisor_extra.py``) until its stdin closes.

Each ``exec`` is run by a forked manager that is a child subreaper: every descendant of the command,
even one that daemonises, stays below the manager, so a timeout can stop and kill the whole tree
without touching other processes of the sandbox. The command itself runs with no capabilities
(bounding set emptied) and ``no_new_privs``, so root inside the sandbox cannot mount, load modules,
change the hostname of the host, or gain privileges from a setuid file.

Wire format in both directions: 4-byte little-endian length, then ``marshal`` of a dict. Host and
supervisor run the same interpreter, so ``marshal`` is compatible and needs no import after pivot.
"""

import ctypes
import marshal
import os
import resource
import select
import signal
import socket  # noqa: F401 - used by supervisor_extra.py, run into these globals
import struct
import sys
import time
from stat import S_ISREG

libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc; find_library would fork

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC = 32, 4096, 8192, 16384
MNT_DETACH = 2
PR_SET_CHILD_SUBREAPER, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 36, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}.get(os.uname().machine, 155)
SYS_CAPSET = {"x86_64": 126, "aarch64": 91, "ppc64le": 184, "s390x": 185}.get(os.uname().machine, 126)

with open("/proc/sys/kernel/cap_last_cap") as _f:
    CAP_LAST = int(_f.read())

errno_enoent, errno_einval, errno_efbig = 2, 22, 27
IN, OUT = sys.stdin.buffer.raw, sys.stdout.buffer.raw
# Nothing but frames may ever reach the host's pipe; stray prints would corrupt the stream.
sys.stdout = sys.stderr


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags=0, data=None):
    _check(
        libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype or source} on {target}",
    )


def read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv():
    header = read_exact(IN.fileno(), 4)
    if header is None:
        return None
    body = read_exact(IN.fileno(), struct.unpack("<I", header)[0])
    return None if body is None else marshal.loads(body)


def send(message):
    body = marshal.dumps(message)
    data = struct.pack("<I", len(body)) + body
    view = memoryview(data)
    while view:
        view = view[os.write(OUT.fileno(), view) :]


def reap(signum=None, frame=None):
    # PID 1 inherits every orphan of the sandbox; reap them so no zombie outlives its parent.
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# The host started this code through ``local.BOOT`` with ``BOOT`` in its globals: no host path is
# on the command line, where the sandbox could read it in /proc/1/cmdline.
# STAGE: an empty host directory; a tmpfs is mounted on it in this namespace only.
STAGE = BOOT["stage"]  # noqa: F821 - set by local.BOOT
# One end of a socket pair to the host, for calls made from inside the sandbox (the offline web).
UPCALL_FD = BOOT["upcall_fd"]  # noqa: F821
# The REPL and web-relay ops live in a second file, sent with this one.
exec(compile(BOOT["extra"], "supervisor_extra.py", "exec"))  # noqa: F821


def prepare():
    """Build /dev and /proc ahead of need, while this supervisor is a spare; ``setup`` then only
    moves them into the sandbox's root, which keeps restore and fork short."""
    mount("stage", STAGE, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=700,size=64k")
    dev, proc = os.path.join(STAGE, "dev"), os.path.join(STAGE, "proc")
    os.mkdir(dev)
    os.mkdir(proc)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=65536k")
    for name, major, minor in (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)):
        path = os.path.join(dev, name)
        os.mknod(path, 0o666 | 0o020000, os.makedev(major, minor))
        os.chmod(path, 0o666)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(dev, name))
    os.mkdir(os.path.join(dev, "shm"))
    mount("shm", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=65536k")
    # We are PID 1 of the new pid namespace, so this proc shows the sandbox's processes only.
    mount("proc", proc, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mask_proc(proc, os.path.join(dev, "null"))


def mask_proc(proc, null):
    # Root without capabilities may still write files owned by uid 0: /proc/sys and
    # /proc/sysrq-trigger are global, so they are made read-only or hidden.
    for name in ("sys", "bus", "fs", "irq"):
        path = os.path.join(proc, name)
        if os.path.isdir(path):
            mount(path, path, None, MS_BIND | MS_REC)
            mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in ("sysrq-trigger", "kcore", "keys", "timer_list", "sched_debug", "kmsg"):
        path = os.path.join(proc, name)
        if os.path.exists(path):
            mount(null, path, None, MS_BIND)


UPPER_FD = -1  # with a disk quota: the size-limited tmpfs holding upper/ and work/ (the host reads it here)


def setup(request):
    global UPPER_FD, SECCOMP_BPF
    SECCOMP_BPF = request.get("seccomp")
    root = request["root"]
    upper, work = request["upper"], request["work"]
    quota = request.get("disk")
    if quota is not None:
        # The writable layer on a tmpfs of its own, in this mount namespace only: its size and
        # inode count are the sandbox's disk quota, and it is gone when the namespace is.
        rw = os.path.join(STAGE, "rw")
        os.mkdir(rw)
        mount("upper", rw, "tmpfs", MS_NOSUID | MS_NODEV,
              "mode=755,size={},nr_inodes={}".format(quota["bytes"], quota["inodes"]))
        os.mkdir(os.path.join(rw, "upper"), 0o755)
        os.mkdir(os.path.join(rw, "work"), 0o700)
        UPPER_FD = os.open(rw, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # Relative to the lower base (the cwd at mount): /proc/self/mountinfo shows no host path.
        upper = os.path.relpath(os.path.join(rw, "upper"), request["lower_base"])
        work = os.path.relpath(os.path.join(rw, "work"), request["lower_base"])
    if request.get("open_files") is not None:
        # Inherited by every process of the sandbox; with the pids limit it bounds its open files.
        resource.setrlimit(resource.RLIMIT_NOFILE, (request["open_files"], request["open_files"]))
    os.chdir(request["lower_base"])  # lower dirs are given relative to it: keeps the option short
    options = "lowerdir={},upperdir={},workdir={},redirect_dir=off,index=off,metacopy=off,xino=off,volatile".format(
        ":".join(request["lower"]), upper, work
    )
    mount("overlay", root, "overlay", 0, options)
    for name, mode in (("proc", 0o555), ("dev", 0o755), ("tmp", 0o1777)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            os.mkdir(path, mode)
    mount(os.path.join(STAGE, "dev"), os.path.join(root, "dev"), None, MS_MOVE)
    mount(os.path.join(STAGE, "proc"), os.path.join(root, "proc"), None, MS_MOVE)
    os.chdir(root)
    # The old root now lies stacked over the new one at "/"; detach_old_root() drops it.
    _check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    hostname = request.get("hostname", "sandbox").encode()
    _check(libc.sethostname(hostname, len(hostname)), "sethostname")


def detach_old_root():
    # Detaching the host's mount tree waits for an RCU grace period (milliseconds on a busy
    # machine), so it runs just after the "ready" reply, overlapped with the host's next step.
    # It always finishes before the next request is read: no command can ever see the old root.
    _check(libc.umount2(b"/", MNT_DETACH), "umount old root")
    os.chdir("/")


SECCOMP_BPF = None  # the filter's raw BPF, built by the host (k3/sandbox/seccomp.py) and sent with setup
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp():
    if not SECCOMP_BPF:
        return
    program = ctypes.create_string_buffer(SECCOMP_BPF, len(SECCOMP_BPF))
    fprog = SockFprog(len(SECCOMP_BPF) // 8, ctypes.addressof(program))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def drop_privileges():
    for cap in range(CAP_LAST + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
    _check(libc.syscall(SYS_CAPSET, header, data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    load_seccomp()  # last: no_new_privs makes it loadable, and nothing after it needs a denied call


def execvpe(argv, env):
    # os.execvpe imports modules lazily, and after pivot_root the host's stdlib is gone.
    name = argv[0]
    if "/" in name:
        os.execve(name, argv, env)
    error = FileNotFoundError(errno_enoent, f"{name}: command not found")
    for directory in env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(":"):
        try:
            os.execve(os.path.join(directory or ".", name), argv, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError as denied:
            error = denied
    raise error


def process_table():
    """{pid: (parent pid, start time in clock ticks)} of the sandbox's pid namespace, from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        table[int(name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(ancestor, table=None):
    """Pids below ``ancestor``, read from /proc (the sandbox's own pid namespace)."""
    children = {}
    for pid, (ppid, _) in (table or process_table()).items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [ancestor]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def start_ticks(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def kill_started_since(ticks):
    """Kill every process started at or after ``ticks`` (clock ticks since boot) except PID 1 and
    k3's long-lived ones (REPLs and what runs below them, the web relay): what an exec left behind
    when its manager was stopped or killed, wherever it re-parented. Stop, then kill, until none."""
    for _ in range(1000):
        table = process_table()
        keep = {os.getpid(), WEB["pid"]}  # noqa: F821 - supervisor_extra.py
        for repl in REPLS.values():  # noqa: F821 - supervisor_extra.py
            keep.add(repl["pid"])
            keep.update(descendants(repl["pid"], table))
        doomed = [pid for pid, (_, started) in table.items() if started >= ticks and pid not in keep]
        if not doomed:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in doomed:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        reap()
        time.sleep(0.001)


def kill_tree(ancestor):
    # Stop first so nothing can fork while we look, then kill what is stopped; repeat until empty.
    for _ in range(1000):
        pids = descendants(ancestor)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        for pid in descendants(ancestor):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.001)


def keep(buffer, chunk, limit):
    """Append what fits of ``chunk`` to ``buffer``; True when something had to be cut."""
    room = limit - len(buffer)
    buffer += chunk[: max(room, 0)]
    return room < len(chunk)


def run_command(request, result_fd):
    """Body of the per-exec manager process; writes one marshal'd result to ``result_fd``."""
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    exec_r, exec_w = os.pipe()  # close-on-exec: EOF means the command started
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.set_inheritable(exec_w, False)
            os.closerange(3, exec_w)
            os.closerange(exec_w + 1, 65536)
            for sig in (signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            os.setsid()
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            try:
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("500")  # under memory pressure the command goes before PID 1
            except OSError:
                pass
            os.umask(0o022)
            os.chdir(request["cwd"])
            drop_privileges()
            execvpe(request["argv"], request["env"])
        except BaseException as error:  # noqa: BLE001 - report any failure to start, then die
            message = f"{type(error).__name__}: {error}".encode()
            os.write(exec_w, message[:4000])
        os._exit(127)
    for fd in (in_r, out_w, err_w, exec_w):
        os.close(fd)
    start_error = b""
    while True:
        chunk = os.read(exec_r, 4096)
        if not chunk:
            break
        start_error += chunk
    os.close(exec_r)

    stdin_data = memoryview(request.get("stdin") or b"")
    limit = request["max_output"]
    outputs = {out_r: bytearray(), err_r: bytearray()}
    truncated = False
    deadline = None if request["timeout"] is None else started + request["timeout"]
    poller = select.poll()
    poller.register(out_r, select.POLLIN)
    poller.register(err_r, select.POLLIN)
    if stdin_data:
        poller.register(in_w, select.POLLOUT)
    else:
        os.close(in_w)
        in_w = -1  # closed: its number may be reused below (the pidfd)
    open_fds = {out_r, err_r} | ({in_w} if stdin_data else set())
    # A pidfd turns "the command exited" into a poll event, next to its output pipes.
    pidfd = os.pidfd_open(pid)
    poller.register(pidfd, select.POLLIN)
    timed_out = False
    status = None
    # The command's exit ends the exec: output still in the pipes is drained below, but a
    # background process it left holding them (`server &`) does not keep the caller waiting.
    while status is None:
        wait_ms = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            wait_ms = int(left * 1000) + 1
        for fd, event in poller.poll(wait_ms):
            if fd == pidfd:
                poller.unregister(pidfd)
                status = os.waitpid(pid, 0)[1]
                continue
            if fd == in_w:
                try:
                    written = os.write(in_w, stdin_data[:65536])
                    stdin_data = stdin_data[written:]
                except BrokenPipeError:
                    stdin_data = stdin_data[:0]
                if not stdin_data:
                    poller.unregister(in_w)
                    os.close(in_w)
                    open_fds.discard(in_w)
                    in_w = -1
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                poller.unregister(fd)
                os.close(fd)
                open_fds.discard(fd)
                continue
            truncated |= keep(outputs[fd], chunk, limit)
    os.close(pidfd)
    for fd in open_fds - {in_w}:
        os.set_blocking(fd, False)
        try:
            while chunk := os.read(fd, 65536):
                truncated |= keep(outputs[fd], chunk, limit)
        except BlockingIOError:
            pass
    if timed_out:
        kill_tree(os.getpid())
        try:
            status = os.waitpid(pid, 0)[1]
        except ChildProcessError:
            status = status if status is not None else 9
    duration = time.monotonic() - started
    if os.WIFSIGNALED(status):
        exit_code, term_signal = 128 + os.WTERMSIG(status), os.WTERMSIG(status)
    else:
        exit_code, term_signal = os.WEXITSTATUS(status), 0
    result = {
        "ok": True,
        "stdout": bytes(outputs[out_r]),
        "stderr": bytes(outputs[err_r]),
        "exit_code": exit_code,
        "signal": term_signal,
        "timed_out": timed_out,
        "truncated": truncated,
        "duration": duration,
        "start_error": start_error.decode(errors="replace"),
    }
    data = marshal.dumps(result)
    view = memoryview(struct.pack("<I", len(data)) + data)
    while view:
        view = view[os.write(result_fd, view) :]


# A manager answers right after its command's timeout; past this much more it is held (stopped by
# the command, say), and PID 1 kills it and everything the exec started.
MANAGER_GRACE_S = 2.0


def do_exec(request):
    result_r, result_w = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(result_r)
            # Point 0 and 1 (the host's pipe) at /dev/null rather than closing them, so that the
            # command's pipes never land on 0/1, where dup2 onto themselves would keep CLOEXEC.
            null = os.open("/dev/null", os.O_RDWR)
            os.dup2(null, IN.fileno(), inheritable=False)
            os.dup2(null, OUT.fileno(), inheritable=False)
            os.close(null)
            run_command(request, result_w)
        except BaseException as error:  # noqa: BLE001 - the manager must always answer
            try:
                data = marshal.dumps({"ok": False, "error": f"exec failed: {type(error).__name__}: {error}"})
                os.write(result_w, struct.pack("<I", len(data)) + data)
            except OSError:
                pass
            code = 1
        os._exit(code)
    os.close(result_w)
    since = start_ticks(pid)
    deadline = None if request["timeout"] is None else started + request["timeout"] + MANAGER_GRACE_S
    body = read_until(result_r, deadline)
    os.close(result_r)
    if body is None or body is False:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if since is not None:
            kill_started_since(since)  # the command's processes, wherever they went
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass  # already reaped by the SIGCHLD handler
    if body is False:
        return {"ok": True, "stdout": b"", "stderr": b"k3 sandbox: the exec's manager was held past the timeout "
                b"(stopped by the command?); every process the command started was killed\n", "exit_code": 137,
                "signal": 9, "timed_out": True, "truncated": False, "duration": time.monotonic() - started,
                "start_error": ""}
    if body is None:
        return {"ok": False, "error": "exec manager died without a result (killed by the memory limit, or by the "
                "command); every process the command started was killed"}
    return marshal.loads(body)


def owner_gone():
    """The host's end of the request pipe closed (its process died) while PID 1 waited on a
    command or a cell: exit now, and the kernel kills every process of the namespace."""
    os._exit(0)


def read_until(fd, deadline):
    """One frame (4-byte length + body) from ``fd``; None at EOF, False when ``deadline`` passes."""
    data = bytearray()
    need = 4
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(IN.fileno(), 0)  # only POLLHUP: the host went away (see owner_gone)
    while len(data) < need:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        events = poller.poll(None if left is None else int(left * 1000) + 1)
        if any(ready == IN.fileno() for ready, _ in events):
            owner_gone()
        if not any(ready == fd for ready, _ in events):
            continue
        chunk = os.read(fd, min(need - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
        if need == 4 and len(data) == 4:
            need = 4 + struct.unpack("<I", data)[0]
    return bytes(data[4:])


def do_write(entry):
    path, data, mode = entry["path"], entry.get("data"), entry.get("mode")
    parent = os.path.dirname(path)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    if entry.get("dir"):
        os.makedirs(path, exist_ok=True)
        if mode is not None:
            os.chmod(path, mode)
        return
    # Non-blocking open: a FIFO at the path fails (ENXIO) or is refused below, never waits for a reader.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644 if mode is None else mode)
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno_einval, "not a regular file", path)
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if mode is not None:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def read_regular(path, max_bytes):
    """The content of a regular file (a FIFO or device is refused at once, never waited on)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno_einval, "not a regular file", path)
        os.set_blocking(fd, True)
        data = bytearray()
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - len(data))):
            data += chunk
            if len(data) > max_bytes:
                raise OSError(errno_efbig, f"larger than the {max_bytes} bytes read_file returns", path)
        return bytes(data)
    finally:
        os.close(fd)


def handle(request):
    op = request["op"]
    if op == "exec":
        return do_exec(request)
    if op == "read":
        return {"ok": True, "data": read_regular(request["path"], request.get("max_bytes", 1 << 30))}
    if op == "write":
        for entry in request["entries"]:
            do_write(entry)
        return {"ok": True}
    if op == "ping":
        return {"ok": True}
    if op in EXTRA_OPS:  # noqa: F821 - defined by supervisor_extra.py (see the top of this file)
        return EXTRA_OPS[op](request)  # noqa: F821
    return {"ok": False, "error": f"unknown request {op!r}"}


SUPERVISOR_NICE = -10


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # The supervisor only wakes to serve a request and goes back to sleep; a higher priority keeps
    # its wake-up latency short on a busy machine. Commands go back to nice 0 before they start.
    try:
        os.setpriority(os.PRIO_PROCESS, 0, SUPERVISOR_NICE)
    except OSError:
        pass
    # /proc is still the host's procfs here, so /proc/self names our pid on the host.
    host_pid = int(os.readlink("/proc/self"))
    try:
        prepare()
    except OSError as error:
        send({"ok": False, "error": f"sandbox preparation failed: {error}"})
        return
    send({"ok": True, "host_pid": host_pid})
    request = recv()
    if request is None:
        return
    try:
        setup(request)
    except OSError as error:
        send({"ok": False, "error": f"sandbox setup failed: {error}"})
        return
    signal.signal(signal.SIGCHLD, reap)
    send({"ok": True, "upper_fd": UPPER_FD})
    try:
        detach_old_root()
    except OSError:
        return  # fail closed: never serve a request with the host's tree in view
    while True:
        request = recv()
        if request is None:
            return
        try:
            response = handle(request)
        except OSError as error:
            response = {"ok": False, "error": f"{error.strerror or error}: {error.filename or ''}".strip(": "), "errno": error.errno}
        send(response)


if __name__ == "__main__":
    main()
