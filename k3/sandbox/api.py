"""The synchronous ``Sandbox``: create, exec, files, snapshot / restore / fork, pause, close.

A sandbox is a root filesystem made of overlay layers (image at the bottom, frozen snapshot layers
above it, one writable upper on top) and the processes that run on it, all in namespaces of their
own and in one cgroup. Snapshots hold the filesystem only by default: processes running at
snapshot time are not saved (``Sandbox.SNAPSHOT_HOLDS_MEMORY`` is False), and restore/fork start
with none running. ``snapshot(memory=True)`` also saves the sandbox's Python REPLs (``repl()``)
with their variables, and restore/fork bring them back (``memory.py`` says how, and why not CRIU).
``enable_web()`` gives processes inside the sandbox the offline web (``web/``) through PID 1.

Requests to one sandbox are served one at a time (a lock): run several sandboxes for parallelism.
"""

from __future__ import annotations

import os
import sys
import threading

from k3.sandbox import leftovers, local, seccomp, untrusted
from k3.sandbox import memory as memory_snapshots
# The result type and request checks live below both backends (the VM backend imports them too); re-exported.
from k3.sandbox.backend import (DEFAULT_MAX_OUTPUT, ExecResult, check_path, command_argv,  # noqa: F401
                                upload_entries)
from k3.sandbox.cgroups import Cgroup, Limits
from k3.sandbox.image import Image, default_image
from k3.sandbox.layers import LayerStore
from k3.sandbox.local import SandboxError
from k3.sandbox.paths import sandbox_home, scratch_dir

# Deadlines of host calls into a sandbox. Past one, the whole sandbox is killed (see
# Supervisor.expire): nothing done inside can hold the host longer.
FILE_TIMEOUT_S = 60.0  # read_file, write_file, upload and k3's own small requests
SETUP_TIMEOUT_S = 30.0  # mounting a new root (create, restore, fork)
# On top of a command's or a cell's own timeout: PID 1 answers by then even when the command held
# its manager (MANAGER_GRACE_S in supervisor.py) or a cell ignored its interrupt (REPL_GRACE_S in
# supervisor_extra.py), both 2 s.
HOST_GRACE_S = 10.0
MAX_READ_BYTES = 1 << 30  # read_file's default bound
# Deeper chains are squashed into one layer at the next snapshot: overlay's mount option must fit
# in a page (about 120 layers with our short names) and each layer adds a little lookup cost.
MAX_CHAIN = 48
# From this many files to copy, an idle sandbox's snapshot adopts its upper directory as the layer
# (a rename; a tmpfs upper is copied) and restarts on a fresh upper above it.
ADOPT_MIN_FILES = 16


class Sandbox:
    """An isolated Linux sandbox on this machine (needs root; see ``k3 sandbox doctor``).

    >>> with Sandbox() as box:
    ...     box.write_file("/work/hi.py", "print('hi')")
    ...     box.exec("python3 hi.py").stdout
    'hi\\n'
    """

    SNAPSHOT_HOLDS_MEMORY = False
    backend = "local"

    def __new__(cls, *args, backend: str = "local", **kwargs):
        # backend="vm": a microVM with the same API, whose snapshots hold the whole machine.
        if backend == "vm":
            from k3.sandbox.vm import VmSandbox

            return VmSandbox(*args, **kwargs)
        if backend != "local":
            raise ValueError(f"backend must be 'local' (namespaces) or 'vm' (QEMU microVM), got {backend!r}")
        return super().__new__(cls)

    def __init__(
        self,
        image: Image | str | None = None,
        limits: Limits | None = None,
        *,
        snapshot: str | None = None,
        hostname: str = "sandbox",
        home: str | None = None,
        backend: str = "local",
        _supervisor: local.Supervisor | None = None,
    ) -> None:
        """Create and start a sandbox from ``image`` (default: ``default_image()``), or from
        ``snapshot`` (a snapshot id; its image is used). ``limits`` default to ``Limits()``.
        ``backend="vm"`` returns a ``k3.sandbox.vm.VmSandbox`` instead (see docs/sandbox.md)."""
        self.home = home or sandbox_home()
        self.scratch = scratch_dir(self.home)
        self.store = LayerStore(self.scratch)
        chain: list[str] = []
        if snapshot is not None:
            chain = self.store.chain(snapshot)
            image_path = self.store.info(snapshot).image
            if image is None:
                image = Image.from_dir(image_path)
            elif (image.path if isinstance(image, Image) else os.path.abspath(image)) != image_path:
                raise ValueError(f"snapshot {snapshot} was taken on image {image_path}, not on {image}")
        if image is None:
            image = default_image(self.home)
        elif isinstance(image, str):
            image = Image.from_dir(image)
        if not isinstance(image, Image):
            raise ValueError(f"image must be an Image, a directory path or None; got {type(image).__name__}")
        self.image = image
        self.limits = limits or Limits()
        self.hostname = hostname
        self.chain = chain
        self.closed = False
        self.paused = False
        self._lock = threading.Lock()
        self._generation = 0
        self._pending: list = []
        self._repls: dict = {}
        self._services: dict[str, str] = {}  # name -> shell command (see start_service)
        self._web = None
        self._supervisor = supervisor = _supervisor or local.spares().take(1)[0]
        self.id = supervisor.name
        self.run_dir = os.path.join(self.scratch, "run", self.id)
        local.register(self)
        try:
            os.makedirs(self.run_dir)
            leftovers.record_owner(os.path.join(self.run_dir, leftovers.OWNER_FILE))  # for gc after a crash
            self._start(supervisor)
            if snapshot is not None:
                memory_snapshots.resume(self)
        except BaseException:
            self.close()
            raise

    # -- life cycle ---------------------------------------------------------------------------

    def _start(self, supervisor: local.Supervisor) -> None:
        """Mount a fresh upper over ``self.chain`` and hand it to ``supervisor``."""
        self._generation += 1
        generation_dir = os.path.join(self.run_dir, str(self._generation))
        upper, work, root = (os.path.join(generation_dir, name) for name in ("upper", "work", "root"))
        on_disk = self.limits.disk_mb is None  # else the supervisor mounts a tmpfs of that size for them
        for directory in (upper, work, root) if on_disk else (root,):
            os.makedirs(directory)
        with open(os.path.join(generation_dir, "chain"), "w") as f:
            f.write(" ".join(self.chain))  # read by the snapshot GC: these layers are in use
        if supervisor.limits != self.limits:
            supervisor.cgroup.set_limits(self.limits)
            supervisor.limits = self.limits
        self._supervisor, self._upper, self._generation_dir = supervisor, upper, generation_dir
        self._freeze_cache: dict = {}  # per upper directory: see LayerStore.freeze
        # A snapshot with memory adds its memory image on top: the REPLs load their state from it.
        lower = memory_snapshots.lower_for(self.scratch, self.chain)
        # Relative to the scratch directory (PID 1 mounts from there): shorter, and no host path
        # shows in the sandbox's /proc/self/mountinfo.
        lower += [os.path.join("layers", layer) for layer in self.chain] + [os.path.relpath(self.image.path, self.scratch)]
        answer = supervisor.call(
            {"op": "setup", "lower_base": self.scratch, "lower": lower, "upper": upper, "work": work,
             "root": root, "hostname": self.hostname, "open_files": self.limits.open_files,
             "seccomp": seccomp.filter_bpf(),
             "disk": None if on_disk else {"bytes": self.limits.disk_mb << 20, "inodes": self.limits.inodes or 1 << 20}},
            timeout=SETUP_TIMEOUT_S,
        )
        if not answer["ok"]:
            raise SandboxError(answer["error"])
        if not on_disk:  # reached through PID 1's descriptor: the tmpfs exists in its mount namespace only
            self._upper = f"/proc/{supervisor.host_pid}/fd/{answer['upper_fd']}/upper"

    def close(self) -> None:
        """Kill every process of the sandbox, drop its mounts, cgroup and files. Idempotent."""
        if self.closed:
            return
        self.closed = True
        supervisor, self._supervisor = self._supervisor, None
        supervisor.kill()
        if self.paused:
            supervisor.cgroup.thaw()  # a frozen task cannot die: thaw so the SIGKILL lands
            self.paused = False
        supervisor.wait()  # also removes its cgroup
        # Replaced generations are torn down by the janitor; wait for ours before removing the dir.
        for done in self._pending:
            done.wait()
        if hasattr(self, "run_dir"):
            try:
                untrusted.remove_tree(self.run_dir)  # iterative: the sandbox may have nested deep
            except OSError as error:
                print(f"k3 sandbox: could not remove {self.run_dir}: {error}", file=sys.stderr)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def cgroup(self) -> Cgroup:
        """The cgroup of the sandbox's current processes (a new one after each restore)."""
        if self._supervisor is None:
            raise SandboxError(f"sandbox {self.id} is closed")
        return self._supervisor.cgroup

    def _request(self, request: dict) -> dict:
        """One request to PID 1 under the sandbox's lock (REPL and web ops use it). A request with
        a "timeout" (a REPL call) gets that plus the graces as its deadline; others FILE_TIMEOUT_S."""
        if "timeout" in request:
            timeout = None if request["timeout"] is None else request["timeout"] + 2 * HOST_GRACE_S
        else:
            timeout = FILE_TIMEOUT_S
        with self._lock:
            return self._alive().call(request, timeout)

    def _alive(self) -> local.Supervisor:
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self.paused:
            raise SandboxError(f"sandbox {self.id} is paused; call resume() first")
        return self._supervisor

    # -- commands and files -------------------------------------------------------------------

    def exec(
        self,
        cmd: str | list[str],
        timeout: float | None = 60.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecResult:
        """Run ``cmd`` (a shell string for /bin/sh -c, or an argv list) and wait for it.

        timeout: seconds, or None for no limit; when it passes, the command and every process it
        started are killed and ``timed_out`` is set. env: added to the image's environment.
        cwd: working directory inside the sandbox (default: the image's workdir).
        """
        argv = command_argv(cmd, timeout)
        full_env = dict(self.image.env)
        full_env.update(env or {})
        if isinstance(stdin, str):
            stdin = stdin.encode()
        request = {"op": "exec", "argv": argv, "env": full_env, "cwd": check_path(cwd or self.image.workdir),
                   "timeout": timeout, "stdin": stdin, "max_output": max_output}
        with self._lock:
            supervisor = self._alive()
            oom_before = self.cgroup.oom_kills()
            answer = supervisor.call(request, None if timeout is None else timeout + HOST_GRACE_S)
            oom = self.cgroup.oom_kills() > oom_before
        if not answer["ok"]:
            raise SandboxError(answer["error"])
        stderr = answer["stderr"]
        if answer["start_error"]:
            stderr += f"k3 sandbox: cannot run {argv[0]!r}: {answer['start_error']}\n".encode()
        return ExecResult(answer["stdout"], stderr, answer["exit_code"], answer["duration"],
                          answer["timed_out"], oom, answer["truncated"])

    def read_file(self, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        """The content of the regular file ``path`` inside the sandbox; FileNotFoundError when it
        does not exist, OSError for a FIFO or device (never waited on) or a file over ``max_bytes``."""
        with self._lock:
            answer = self._alive().call({"op": "read", "path": check_path(path), "max_bytes": max_bytes},
                                        FILE_TIMEOUT_S)
        return self._data(answer, path)

    def write_file(self, path: str, data: bytes | str, mode: int | None = None) -> None:
        """Write ``data`` to ``path`` inside the sandbox, creating parent directories."""
        if isinstance(data, str):
            data = data.encode()
        self._write([{"path": check_path(path), "data": bytes(data), "mode": mode}], path)

    def upload(self, local_path: str, sandbox_path: str) -> None:
        """Copy a host file or directory tree to ``sandbox_path`` (modes kept, symlinks skipped)."""
        self._write(upload_entries(local_path, check_path(sandbox_path)), sandbox_path)

    def _write(self, entries: list[dict], shown_path: str) -> None:
        with self._lock:
            answer = self._alive().call({"op": "write", "entries": entries}, FILE_TIMEOUT_S)
        self._data(answer, shown_path)

    @staticmethod
    def _data(answer: dict, path: str) -> bytes | None:
        if answer["ok"]:
            return answer.get("data")
        if answer.get("errno") is not None:
            raise OSError(answer["errno"], f"in the sandbox: {answer['error']}", path)
        raise SandboxError(answer["error"])

    # -- snapshots ----------------------------------------------------------------------------

    def snapshot(self, memory: bool = False) -> str:
        """Freeze the current filesystem into an immutable layer; return its id.

        memory: also save the state of the sandbox's running Python REPLs, so that restore and fork
        bring them back with their variables (see ``k3.sandbox.memory``). Without it, only files
        are saved, not processes (see the module doc). Files unchanged since the previous snapshot are shared with it, not copied.
        When many files would have to be copied and no command is running, the upper directory
        itself becomes the layer and the sandbox continues on a fresh upper above it (its PID 1
        is replaced then, which nothing inside can notice: no other process exists).
        """
        if memory:
            return memory_snapshots.take(self)
        with self._lock:
            if self.closed:
                raise SandboxError(f"sandbox {self.id} is closed")
            # No process may write while the upper is read. With only unshare and PID 1 in the
            # group (and PID 1 busy with nothing: we hold the request lock) nothing can; otherwise
            # the freezer stops every task first.
            idle = not self.paused and len(self.cgroup.pids()) <= 2
            if len(self.chain) >= MAX_CHAIN:
                return self._frozen(idle, lambda: self.store.squash(self.chain, self._upper, self.image.path))
            parent = self.chain[0] if self.chain else None
            if not idle:  # scan and copy within one freeze: the files must not move in between
                return self._frozen(idle, lambda: self.store.freeze(self._upper, parent, self.image.path, self._freeze_cache))
            scan = self.store.scan(self._upper, parent, self.image.path, self._freeze_cache)
            if scan.to_copy >= ADOPT_MIN_FILES and not self.store.exists(scan.layer_id):
                old, old_dir = self._supervisor, self._generation_dir
                # Adopting renames the upper into the store: only when it lies on the store's
                # disk. A tmpfs upper (disk quota) is copied, and the sandbox goes on over a fresh
                # upper all the same: the next snapshots scan only new changes, and the tmpfs'
                # memory goes back.
                layer_id = self.store.commit(scan, adopt=self.limits.disk_mb is None)
                self._replace_generation(old, old_dir, [layer_id] + self.chain)
                return layer_id
            return self.store.commit(scan, self._freeze_cache)

    def _frozen(self, idle: bool, work):
        if idle or self.paused:
            return work()
        self.cgroup.freeze()
        try:
            return work()
        finally:
            self.cgroup.thaw()

    def _replace_generation(self, old: local.Supervisor, old_dir: str, chain: list[str]) -> None:
        """Start a fresh upper over ``chain``; ``old`` is killed and torn down by the janitor.

        The old processes live in their own namespaces and write, if at all, to an upper that is
        thrown away, so their last milliseconds cannot touch the new generation."""
        old.dead = True  # never talk to it again
        self.paused = False  # the janitor thaws the old group so its processes can die
        self._pending = [d for d in self._pending if not d.is_set()]
        self._pending.append(local.janitor.submit(old, old_dir))
        self.chain = chain
        # Ours from now on, before _start can fail: close() must end it, and leave ``old`` to the janitor.
        self._supervisor = local.spares().take(1)[0]
        self._start(self._supervisor)

    def restore(self, snapshot: str) -> None:
        """Return this sandbox to ``snapshot``: every process is killed, files are as they were."""
        chain = self.store.chain(snapshot)
        if self.store.info(snapshot).image != self.image.path:
            raise ValueError(f"snapshot {snapshot} belongs to image {self.store.info(snapshot).image}, "
                             f"this sandbox runs {self.image.path}")
        with self._lock:
            if self.closed:
                raise SandboxError(f"sandbox {self.id} is closed")
            self._replace_generation(self._supervisor, self._generation_dir, chain)
        if self._web is not None:
            self.enable_web(*self._web)  # the relay lived in the old generation's PID 1
        memory_snapshots.resume(self)

    def fork(self, snapshot: str | None = None, n: int = 1) -> list["Sandbox"]:
        """``n`` new sandboxes starting from ``snapshot`` (default: a snapshot taken now).

        Each has its own upper layer, processes and cgroup: none sees another's writes.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs n >= 1 sandboxes, got {n!r}")
        if snapshot is None:
            snapshot = self.snapshot()
        supervisors = local.spares().take(n)  # those not ready yet start in parallel
        forks: list[Sandbox] = []
        try:
            for supervisor in supervisors:
                forks.append(Sandbox(self.image, self.limits, snapshot=snapshot, hostname=self.hostname,
                                     home=self.home, _supervisor=supervisor))
                if self._web is not None:
                    forks[-1].enable_web(*self._web)
        except BaseException:
            for sandbox in forks:
                sandbox.close()
            for supervisor in supervisors[len(forks) :]:
                supervisor.kill()
                supervisor.wait()
            raise
        return forks

    # -- long-lived tools: the Python REPL and the offline web --------------------------------

    def repl(self, name: str = "python", python: str = "python3"):
        """The sandbox's persistent Python REPL called ``name`` (see ``k3.sandbox.repl.Repl``);
        its process starts on the first ``run``."""
        from k3.sandbox.repl import Repl

        if name not in self._repls:
            self._repls[name] = Repl(self, name, python)
        return self._repls[name]

    def start_service(self, name: str, command: str) -> None:
        """Start ``command`` (a shell string) in the background as the service ``name``; its output
        goes to /tmp/k3-service-<name>.log. A memory snapshot records it, and restore/fork from
        that snapshot start it again from its command (its own memory is not kept: only REPLs'
        is). Files-only snapshots do not restart it."""
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a service name is letters, digits, '-' and '_'; got {name!r}")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("start_service needs a non-empty shell command")
        self._services[name] = command
        memory_snapshots.launch_service(self, name, command)

    def enable_web(self, tools=None, socket_path: str = "/run/k3/web.sock") -> None:
        """Let processes in the sandbox use the offline web (``k3.sandbox.web``): requests to the
        Unix socket ``socket_path`` reach ``tools`` (default: the standard corpus) through PID 1,
        with the network still off; ``/usr/local/bin/web`` is a client (search, open, find).
        Survives restore and fork."""
        from k3.sandbox.web import relay

        if tools is None:
            from k3.sandbox.web.tools import default_tools

            tools = default_tools()
        self._web = (tools, socket_path)
        relay.attach(self, tools, socket_path)

    # -- pause / resume -----------------------------------------------------------------------

    def pause(self) -> None:
        """Freeze every process of the sandbox (cgroup freezer). exec and file calls fail until resume()."""
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if not self.paused:
            self.cgroup.freeze()
            self.paused = True

    def resume(self) -> None:
        """Let the processes of a paused sandbox run again."""
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        if self.paused:
            self.cgroup.thaw()
            self.paused = False

    # -- introspection ------------------------------------------------------------------------

    def memory_bytes(self) -> int:
        """Memory charged to the sandbox's cgroup now (processes, page cache, tmpfs)."""
        return self.cgroup.memory_bytes()

    def pids(self) -> list[int]:
        """Host pids of every process in the sandbox (its cgroup)."""
        return self.cgroup.pids()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "paused" if self.paused else "running"
        return f"Sandbox(id={self.id!r}, image={self.image.path!r}, layers={len(self.chain)}, {state})"

