"""The Linux side of a sandbox: starting supervisors in fresh namespaces and talking to them.

``unshare(1)`` (util-linux) creates the mount, pid, net, ipc and uts namespaces and runs
``supervisor.py`` as PID 1 inside them. A new network namespace has only a loopback device, and
it is down, so nothing, not even 127.0.0.1, can be reached. Mounts live in the sandbox's private
mount namespace: when its last process dies, the kernel drops them, so no mount can outlive it.

Starting Python takes tens of milliseconds, far more than mounting an overlay, so a few supervisors
are started ahead of need (``Spares``) and wait, namespaces made, for their filesystem; restore and
fork take one, which is what brings them down to a few milliseconds.
"""

from __future__ import annotations

import atexit
import marshal
import os
import queue
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref

from k3.sandbox import leftovers, untrusted
from k3.sandbox.cgroups import Cgroup, Limits
from k3.sandbox.paths import spare_supervisors, supervisor_debug

SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")
SUPERVISOR_EXTRA = os.path.join(os.path.dirname(SUPERVISOR), "supervisor_extra.py")
# The supervisor's command line: it reads its code and arguments from stdin (a frame of marshal),
# so that no host path shows in the sandbox's /proc/1/cmdline.
BOOT = ("import marshal, os, struct\n"
        "def take(n):\n"
        "    data = b''\n"
        "    while len(data) < n:\n"
        "        chunk = os.read(0, n - len(data))\n"
        "        if not chunk:\n"
        "            raise SystemExit(1)\n"
        "        data += chunk\n"
        "    return data\n"
        "BOOT = marshal.loads(take(struct.unpack('<I', take(4))[0]))\n"
        "exec(compile(BOOT['source'], 'supervisor.py', 'exec'), {'__name__': '__main__', 'BOOT': BOOT})\n")
_sources: tuple[str, str] | None = None


def _supervisor_sources() -> tuple[str, str]:
    global _sources
    if _sources is None:
        with open(SUPERVISOR) as main, open(SUPERVISOR_EXTRA) as extra:
            _sources = (main.read(), extra.read())
    return _sources
NAMESPACES = ("--mount", "--pid", "--net", "--ipc", "--uts")
REFILL_DELAY_S = 0.02  # background work waits this long after the operation that caused it


class SandboxError(RuntimeError):
    """A sandbox operation failed (the message says which and why)."""


class SandboxTimeout(SandboxError):
    """The sandbox did not answer a host call by its deadline: every process of it was killed."""


HELLO_TIMEOUT_S = 60.0  # a supervisor's start (a Python start on a loaded machine)


_python: str | None = None
_python_lock = threading.Lock()


def supervisor_python() -> str:
    """The interpreter that runs supervisors: the distribution's python3 when it is 3.9 or newer
    (it often starts several times faster than a self-built one), else this interpreter. The wire
    format, marshal of plain dicts, is the same across Python 3 versions."""
    global _python
    with _python_lock:  # the spares' thread asks too: every caller must get the same answer
        if _python is None:
            chosen = sys.executable
            candidate = "/usr/bin/python3"
            if os.path.exists(candidate) and os.path.realpath(candidate) != os.path.realpath(sys.executable):
                probe = subprocess.run([candidate, "-I", "-S", "-c", "import sys; print(sys.version_info >= (3, 9))"],
                                       capture_output=True, text=True)
                if probe.stdout.strip() == "True":
                    chosen = candidate
            _python = chosen
    return _python


def stage_dir() -> str:
    """An empty directory that supervisors cover with a tmpfs of their own (only they see it)."""
    path = os.path.join(tempfile.gettempdir(), ".k3-sandbox-stage")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def unshare_path() -> str:
    path = shutil.which("unshare") or shutil.which("unshare", path="/usr/bin:/bin")
    if not path:
        raise RuntimeError("the sandbox needs unshare(1) from util-linux (apt-get install util-linux)")
    return path


class Supervisor:
    """One supervisor process (see supervisor.py) in a cgroup of its own, and the pipe to it.

    The process joins its cgroup before anything else runs (a shell writes its own pid to the
    group, then execs unshare), so all its memory is charged there and nothing can slip out.
    Joining a v1 memory cgroup costs a kernel RCU grace period (~10 ms); it happens here, while
    the supervisor is a spare, not when a sandbox is waiting for it.
    """

    def __init__(self) -> None:
        debug = supervisor_debug()
        self.name = uuid.uuid4().hex[:12]
        self._owner_record = os.path.join(leftovers.owners_dir(), self.name)
        leftovers.record_owner(self._owner_record)  # before the cgroup: gc must never see it ownerless
        self.cgroup = Cgroup.create(self.name)
        join = "".join(f"echo $$ > {shlex.quote(path)} && " for path in self.cgroup.procs_files())
        command = [unshare_path(), *NAMESPACES, "--fork", "--kill-child", "--propagation", "private"]
        # Calls from inside the sandbox to the host (the offline web) come back on this pair.
        self.upcall, upcall_child = socket.socketpair()
        command += [supervisor_python(), "-I", "-S", "-c", BOOT]
        source, extra = _supervisor_sources()
        boot = {"source": source, "extra": extra, "stage": stage_dir(), "upcall_fd": upcall_child.fileno()}
        try:
            self.process = subprocess.Popen(
                ["/bin/sh", "-c", join + "exec " + shlex.join(command)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(upcall_child.fileno(),),
                stderr=None if debug else subprocess.DEVNULL, bufsize=0, close_fds=True, env={},
            )
        except BaseException:
            self.cgroup.remove()
            self.upcall.close()
            _unlink_quietly(self._owner_record)
            raise
        finally:
            upcall_child.close()
        self._in = self.process.stdin.fileno()
        self._out = self.process.stdout.fileno()
        os.set_blocking(self._in, False)  # a PID 1 that stops reading must not hold a host write
        self.host_pid: int | None = None
        self._pidfd: int | None = None
        self.dead = False
        self._wait_lock = threading.Lock()  # close and the janitor may both wait for one supervisor
        self._reaped = False
        try:
            self._send(boot, time.monotonic() + HELLO_TIMEOUT_S)
        except (OSError, TimeoutError):
            pass  # it died at start: wait_hello says so
        self.limits: Limits | None = None  # the limits its cgroup has now

    def wait_hello(self, timeout: float = HELLO_TIMEOUT_S) -> None:
        """Block until the supervisor has started (at most ``timeout`` s); learn its pid on the host."""
        try:
            hello = self._recv(time.monotonic() + timeout)
        except TimeoutError:
            self.kill()
            raise SandboxTimeout(f"the sandbox supervisor did not start within {timeout} s") from None
        if hello is None or not hello["ok"]:
            raise SandboxError(
                "the sandbox supervisor exited at start: run `k3 sandbox doctor` (are you root, "
                f"and does unshare(1) work here?) {hello['error'] if hello else ''}"
            )
        self.host_pid = hello["host_pid"]
        # A pidfd names this very process, so a later kill can never hit a reused pid.
        self._pidfd = os.pidfd_open(self.host_pid)

    def call(self, request: dict, timeout: float | None = None) -> dict:
        """Send one request and return its answer; SandboxError when the supervisor is gone.

        timeout: seconds the answer may take (None: no limit). Past it the whole sandbox is killed
        (``expire``), whatever its processes did, and SandboxTimeout is raised."""
        if self.dead:
            raise SandboxError("the sandbox's processes are gone (killed, or closed)")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._send(request, deadline)
            answer = self._recv(deadline)
        except (BrokenPipeError, ConnectionResetError):
            answer = None
        except TimeoutError:
            self.expire()
            raise SandboxTimeout(
                f"the sandbox did not answer {request.get('op')!r} within {timeout:.1f} s: every process of it was "
                f"killed; restore() a snapshot or create a new sandbox") from None
        if answer is None:
            self.dead = True
            raise SandboxError(
                "the sandbox supervisor died (its PID 1 was killed, perhaps by the memory limit); "
                "restore() a snapshot or create a new sandbox"
            )
        return answer

    def expire(self) -> None:
        """Kill every process of the sandbox at once, through its cgroup (freeze, then SIGKILL):
        nothing a process inside did (a stopped manager, a new session, a double fork) survives."""
        self.dead = True
        try:
            self.cgroup.kill_all()
        except OSError as error:  # the group may be half gone; PID 1's SIGKILL below still ends it
            print(f"k3 sandbox: could not kill cgroup of {self.name}: {error}", file=sys.stderr)
        self.kill()

    def kill(self) -> None:
        """SIGKILL PID 1 of the sandbox: the kernel then kills every process in its namespace."""
        self.dead = True
        if self._pidfd is not None:
            # Only PID 1: unshare must stay alive to reap it, or it would linger as a zombie.
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif self.process.poll() is None:
            self.process.kill()  # before hello: unshare --kill-child passes SIGKILL on to its child

    def wait(self) -> None:
        """Wait until the whole namespace is gone (unshare exits only after PID 1 is reaped),
        then remove the cgroup. Safe to call again, and from several threads: later calls return once it is gone."""
        with self._wait_lock:
            if not self._reaped:
                self._reap()
                self._reaped = True

    def _reap(self) -> None:
        self.process.wait()
        if self._pidfd is not None:
            # Readable once the process has exited. poll, not select: select() rejects descriptors >= 1024,
            # which a process holding hundreds of sandboxes (each with pipes and a pidfd) reaches.
            waiter = select.poll()
            waiter.register(self._pidfd, select.POLLIN)
            waiter.poll()
            os.close(self._pidfd)
            self._pidfd = None
        for stream in (self.process.stdin, self.process.stdout, self.upcall):
            try:
                stream.close()
            except OSError:
                pass
        self.cgroup.remove()
        _unlink_quietly(self._owner_record)

    def _send(self, message: dict, deadline: float | None = None) -> None:
        body = marshal.dumps(message)
        view = memoryview(struct.pack("<I", len(body)) + body)
        while view:
            try:
                view = view[os.write(self._in, view) :]
            except BlockingIOError:  # the pipe is full: PID 1 is busy (or held); wait for room
                _wait(self._in, select.POLLOUT, deadline)

    def _recv(self, deadline: float | None = None) -> dict | None:
        header = _read_exact(self._out, 4, deadline)
        if header is None:
            return None
        body = _read_exact(self._out, struct.unpack("<I", header)[0], deadline)
        return None if body is None else marshal.loads(body)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _wait(fd: int, event: int, deadline: float | None) -> None:
    """Block until ``fd`` is ready for ``event``; TimeoutError when ``deadline`` passes first."""
    waiter = select.poll()  # poll, not select: descriptors past 1024 are common with many sandboxes
    waiter.register(fd, event)
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError
        if waiter.poll(None if left is None else int(left * 1000) + 1):
            return


def _read_exact(fd: int, n: int, deadline: float | None = None) -> bytes | None:
    chunks = []
    while n:
        if deadline is not None:
            _wait(fd, select.POLLIN, deadline)
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class Spares:
    """Supervisors started ahead of need: in their cgroup, namespaces made, Python loaded,
    waiting for a filesystem. A background thread keeps ``target`` of them ready, so taking one
    costs no process start on the caller's side."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._lock = threading.Condition()
        self._ready: list[Supervisor] = []
        self._stopped = False
        self._thread: threading.Thread | None = None

    def take(self, n: int = 1) -> list[Supervisor]:
        """``n`` started supervisors (fewer ready means the rest start now, in parallel)."""
        with self._lock:
            taken, self._ready = self._ready[:n], self._ready[n:]
            self._wake()
        fresh = [Supervisor() for _ in range(n - len(taken))]
        try:
            for supervisor in fresh:
                supervisor.wait_hello()
        except BaseException:
            for supervisor in taken + fresh:
                supervisor.kill()
                supervisor.wait()
            raise
        return taken + fresh

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Block until ``target`` spares are ready (benchmarks use it to measure steady state)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._wake()
            while len(self._ready) < self.target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _wake(self) -> None:
        if self.target > 0 and not self._stopped:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._refill, name="k3-sandbox-spares", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def _refill(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and len(self._ready) >= self.target:
                    self._lock.wait()
                if self._stopped:
                    return
            # Let the restore or fork that took a spare finish before competing with it for CPU.
            time.sleep(REFILL_DELAY_S)
            try:
                supervisor = Supervisor()
                supervisor.wait_hello()
                supervisor.cgroup.set_limits(Limits())  # most sandboxes use the defaults
                supervisor.limits = Limits()
            except Exception as error:  # noqa: BLE001 - the caller will start its own and see why
                print(f"k3 sandbox: could not start a spare supervisor: {error}", file=sys.stderr)
                return
            with self._lock:
                if self._stopped:
                    supervisor.kill()
                    supervisor.wait()
                    return
                self._ready.append(supervisor)
                self._lock.notify_all()

    def drain(self) -> None:
        """Stop the spares that are ready now (they are started again on the next take)."""
        with self._lock:
            ready, self._ready = self._ready, []
        for supervisor in ready:
            supervisor.kill()
        for supervisor in ready:
            supervisor.wait()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            ready, self._ready = self._ready, []
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for supervisor in ready:
            supervisor.kill()
        for supervisor in ready:
            supervisor.wait()


_spares: Spares | None = None
_spares_lock = threading.Lock()


def spares() -> Spares:
    """The process-wide spare supervisors (``K3_SANDBOX_SPARES``, default 2; 0 disables)."""
    global _spares
    with _spares_lock:
        if _spares is None:
            _spares = Spares(spare_supervisors())
        return _spares


def prewarm(n: int, timeout: float = 60.0) -> bool:
    """Keep at least ``n`` spare supervisors ready from now on, and wait until they are.

    Call it before a burst of forks or restores (``fork(snapshot, n)``) so that none of them waits
    for a Python start; each spare costs a few MB of memory while it waits."""
    if n < 0:
        raise ValueError(f"prewarm needs n >= 0 spares, got {n}")
    pool = spares()
    pool.target = max(pool.target, n)
    return pool.wait_ready(timeout)


class Janitor:
    """Tears down replaced supervisors and their directories off the caller's critical path.

    ``restore`` must not wait for the old namespace to die; ``close`` waits for its own jobs.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, supervisor: Supervisor, directory: str) -> threading.Event:
        done = threading.Event()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="k3-sandbox-janitor", daemon=True)
                self._thread.start()
        self._jobs.put((supervisor, directory, done))
        return done

    def idle(self) -> None:
        """Block until every submitted teardown has finished."""
        self._jobs.join()

    def _run(self) -> None:
        while True:
            supervisor, directory, done = self._jobs.get()
            # The caller that queued this is still finishing a restore; teardown can wait a little
            # rather than compete with it for the GIL and the CPU.
            time.sleep(REFILL_DELAY_S)
            try:
                supervisor.kill()
                supervisor.cgroup.thaw()  # in case it was paused: a frozen task cannot die
                supervisor.wait()
                untrusted.remove_tree(directory)  # iterative: the sandbox may have nested deep
            except Exception as error:  # noqa: BLE001 - keep serving other jobs; say what failed
                print(f"k3 sandbox: cleanup of {directory} failed: {error}", file=sys.stderr)
            finally:
                done.set()
                self._jobs.task_done()


janitor = Janitor()

# Sandboxes still open when the interpreter exits are closed, so a crash leaves nothing running.
_live: "weakref.WeakSet" = weakref.WeakSet()


def register(sandbox) -> None:
    _live.add(sandbox)


@atexit.register
def _close_everything() -> None:
    for sandbox in list(_live):
        try:
            sandbox.close()
        except Exception:  # noqa: BLE001 - best effort at exit; the error was already visible
            pass
    if _spares is not None:
        _spares.shutdown()
