"""``VmSandbox``: the ``Sandbox`` API on a QEMU microVM whose snapshots hold the whole machine.

Create boots the image's guest once per machine shape and keeps that booted state as a snapshot
(its id is derived from the machine, so every later create of the same shape is a restore of it).
``snapshot`` stops the guest, saves its device state and its memory file (``snapshots.py``) and
lets it go on; ``restore`` and ``fork`` start QEMU on a snapshot's memory mapped private, so
every process of the guest, its files (they live in guest RAM) and its kernel go on from exactly
where the snapshot was taken.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import shutil
import threading
import time

from k3.sandbox.backend import DEFAULT_MAX_OUTPUT, ExecResult, check_path, command_argv, upload_entries
from k3.sandbox.cgroups import Limits
from k3.sandbox.image import Image, default_image
from k3.sandbox.local import SandboxError
from k3.sandbox.paths import sandbox_home, scratch_dir
from k3.sandbox.vm import guest, snapshots
from k3.sandbox.vm.config import VmConfig
from k3.sandbox.vm.qemu import Machine, Qemu

_boot_lock = threading.Lock()


class VmSandbox:
    """A sandbox in its own microVM (see the module doc and docs/sandbox.md).

    >>> with VmSandbox() as box:
    ...     box.exec("echo hi").stdout
    'hi\\n'
    """

    SNAPSHOT_HOLDS_MEMORY = True
    backend = "vm"

    def __init__(self, image: Image | str | None = None, limits: Limits | None = None, *,
                 snapshot: str | None = None, hostname: str = "sandbox", home: str | None = None,
                 config: VmConfig | None = None) -> None:
        self.home = home or sandbox_home()
        self.scratch = scratch_dir(self.home)
        self.store = snapshots.SnapshotDir(self.scratch)
        self.config = (config or VmConfig.from_env()).resolved()
        if image is None:
            image = default_image(self.home)
        elif isinstance(image, str):
            image = Image.from_dir(image)
        self.image = image
        self.limits = limits or Limits()
        self.hostname = hostname
        memory_mb = max(self.limits.memory_mb or self.config.memory_mb, 128)
        cpus = max(1, math.ceil(self.limits.cpus)) if self.limits.cpus else self.config.cpus
        self.machine = Machine(self.config, guest.initramfs(self.config, self.home),
                               guest.root_disk(image, self.home), memory_mb, cpus)
        self.id = snapshots.new_id()
        self.run_dir = os.path.join(self.scratch, "vm", "run", self.id)
        os.makedirs(os.path.dirname(self.run_dir), mode=0o700, exist_ok=True)  # QMP and agent sockets: root's only
        sweep_orphaned_run_dirs(os.path.dirname(self.run_dir))
        os.makedirs(self.run_dir, mode=0o700)
        with open(os.path.join(self.run_dir, "owner"), "w") as f:
            f.write(str(os.getpid()))
        self.closed = False
        self.paused = False
        self.parent: str | None = None  # the snapshot whose memory this guest maps private
        self._lock = threading.Lock()
        self._qemu: Qemu | None = None
        self._channel = None
        self._own_memory: str | None = None  # a booting guest's RAM file (shared), as /proc/self/fd/N
        self._own_memory_fd: int | None = None
        self._generation = 0
        self._reapers: list[threading.Thread] = []
        self._repls: dict = {}
        self._web = None  # (tools, socket path) once enable_web() was called
        self.last_pause_s = 0.0  # how long the last snapshot kept the guest stopped
        try:
            self._start_from(snapshot if snapshot is not None else self._boot_snapshot())
        except BaseException:
            self.close()
            raise

    # -- life cycle ----------------------------------------------------------------------------

    def _boot_snapshot(self) -> str:
        """The snapshot of this machine just booted (made now on first use: a boot takes seconds
        under KVM, a minute or more under TCG on a busy machine)."""
        key = json.dumps(self.machine.key(), sort_keys=True)
        boot_id = hashlib.sha256(key.encode()).hexdigest()[: snapshots.ID_CHARS]
        with _boot_lock:
            if not self.store.exists(boot_id):
                self._boot()
                self._snapshot_as(boot_id, boot=True)
                self._stop_current()
        return boot_id

    def _boot(self) -> None:
        os.makedirs(self.config.ram_dir, mode=0o700, exist_ok=True)
        memory = os.path.join(self.config.ram_dir, f"{self.id}.ram")
        with open(memory, "wb") as f:
            f.truncate(self.machine.memory_mb << 20)
        generation_dir = self._next_generation_dir()
        deadline = time.monotonic() + self.config.boot_timeout_s
        self._qemu = Qemu(self.machine, generation_dir, memory, share=True, incoming=False,
                          serial_log=os.path.join(generation_dir, "console.log"))
        # QEMU has mapped it: keep a descriptor and drop the name, so if this process is killed
        # (and QEMU with it, by PDEATHSIG) the kernel frees the guest's RAM file too.
        self._own_memory_fd = os.open(memory, os.O_RDONLY)
        os.unlink(memory)
        self._own_memory = f"/proc/self/fd/{self._own_memory_fd}"
        self._channel = self._qemu.connect_agent(deadline)
        try:
            hello = self._channel.receive(deadline)
        except SandboxError as error:
            raise SandboxError(f"the guest did not boot: {error}; console: {_tail(os.path.join(generation_dir, 'console.log'))}") from None
        if not hello.get("hello"):
            raise SandboxError(f"the guest agent's first frame was not its hello: {str(hello)[:200]}")

    def _next_generation_dir(self) -> str:
        self._generation += 1
        path = os.path.join(self.run_dir, str(self._generation))
        os.makedirs(path)
        return path

    def _start_from(self, snapshot: str) -> None:
        """Start a new QEMU on ``snapshot`` (memory mapped private) and connect to its agent."""
        meta = self.store.meta(snapshot)
        if meta["machine"] != self.machine.key():
            raise ValueError(f"VM snapshot {snapshot} was taken on another machine shape or image "
                             f"({meta['machine']}), this sandbox is {self.machine.key()}")
        path = self.store.path(snapshot)
        deadline = time.monotonic() + self.config.qmp_timeout_s
        generation_dir = self._next_generation_dir()
        with open(os.path.join(generation_dir, "parent"), "w") as f:
            f.write(snapshot)  # gc keeps it: this guest maps its memory, and its snapshots copy it
        qemu = Qemu(self.machine, generation_dir, os.path.join(path, "memory"), share=False, incoming=True)
        try:
            # Held open: this guest's next snapshot copies the file even if gc removed the snapshot.
            qemu.memory_fd = os.open(qemu.memory, os.O_RDONLY)
            qemu.load_device_state(os.path.join(path, "state"), deadline)
            qemu.command("cont")
            channel = qemu.connect_agent(deadline)
        except BaseException:
            qemu.kill()
            raise
        self._qemu, self._channel, self.parent = qemu, channel, snapshot

    def _stop_current(self) -> None:
        """Kill the current QEMU off the caller's path; ``close`` waits for it."""
        qemu, channel, own = self._qemu, self._channel, self._own_memory_fd
        self._qemu = self._channel = self._own_memory = self._own_memory_fd = None
        if qemu is None:
            return

        def reap() -> None:
            if channel is not None:
                channel.close()
            qemu.kill()
            if own is not None:
                os.close(own)
            shutil.rmtree(qemu.run_dir, ignore_errors=True)

        thread = threading.Thread(target=reap, name="k3-vm-reaper", daemon=True)
        thread.start()
        self._reapers = [t for t in self._reapers if t.is_alive()] + [thread]

    def close(self) -> None:
        """Kill the guest's QEMU and remove its run directory and memory file. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop_current()
        for thread in self._reapers:
            thread.join(timeout=60)
        if hasattr(self, "run_dir"):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> "VmSandbox":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _alive(self):
        if self.closed:
            raise SandboxError(f"VM sandbox {self.id} is closed")
        if self.paused:
            raise SandboxError(f"VM sandbox {self.id} is paused; call resume() first")
        return self._channel

    def _call(self, request: dict, timeout: float) -> dict:
        with self._lock:
            return self._alive().call(request, timeout)

    # -- commands and files --------------------------------------------------------------------

    def exec(self, cmd: str | list[str], timeout: float | None = 60.0, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | str | None = None, max_output: int = DEFAULT_MAX_OUTPUT) -> ExecResult:
        """Run ``cmd`` in the guest (a shell string for /bin/sh -c, or an argv list); as ``Sandbox.exec``."""
        argv = command_argv(cmd, timeout)
        if not 0 <= max_output <= self.config.max_reply_bytes // 3:
            raise ValueError(f"max_output must be between 0 and {self.config.max_reply_bytes // 3} bytes "
                             f"(VmConfig.max_reply_bytes / 3: output travels base64-encoded), got {max_output}")
        full_env = dict(self.image.env)
        full_env.update(env or {})
        if isinstance(stdin, str):
            stdin = stdin.encode()
        request = {"op": "exec", "argv": argv, "env": full_env, "cwd": check_path(cwd or self.image.workdir),
                   "timeout": timeout, "stdin": base64.b64encode(stdin or b"").decode(), "max_output": max_output,
                   "pids": self.limits.pids}
        wait = (timeout if timeout is not None else 24 * 3600.0) + self.config.call_margin_s
        answer = self._call(request, wait)
        if not answer.get("ok"):
            raise SandboxError(f"the guest agent failed to run {argv[0]!r}: {answer.get('error')}")
        stderr = _b64(answer.get("stderr"))
        if answer.get("start_error"):
            stderr += f"k3 sandbox: cannot run {argv[0]!r}: {answer['start_error']}\n".encode()
        return ExecResult(_b64(answer.get("stdout")), stderr, int(answer.get("exit_code", -1)),
                          float(answer.get("duration", 0.0)), bool(answer.get("timed_out")),
                          bool(answer.get("oom_killed")), bool(answer.get("truncated")))

    def read_file(self, path: str) -> bytes:
        """The content of ``path`` in the guest; FileNotFoundError when it does not exist."""
        answer = self._call({"op": "read", "path": check_path(path)}, self.config.call_margin_s)
        return _b64(self._data(answer, path).get("data"))

    def write_file(self, path: str, data: bytes | str, mode: int | None = None) -> None:
        """Write ``data`` to ``path`` in the guest, creating parent directories."""
        if isinstance(data, str):
            data = data.encode()
        entry = {"path": check_path(path), "data": base64.b64encode(bytes(data)).decode(), "mode": mode}
        self._data(self._call({"op": "write", "entries": [entry]}, self.config.call_margin_s), path)

    def upload(self, local_path: str, sandbox_path: str) -> None:
        """Copy a host file or directory tree into the guest (modes kept, symlinks skipped)."""
        entries = upload_entries(local_path, check_path(sandbox_path))
        for entry in entries:
            if "data" in entry:
                entry["data"] = base64.b64encode(entry["data"]).decode()
        self._data(self._call({"op": "write", "entries": entries}, self.config.call_margin_s), sandbox_path)

    @staticmethod
    def _data(answer: dict, path: str) -> dict:
        if answer.get("ok"):
            return answer
        if isinstance(answer.get("errno"), int):
            raise OSError(answer["errno"], f"in the sandbox: {answer.get('error')}", path)
        raise SandboxError(str(answer.get("error"))[:1000])

    # -- snapshots -----------------------------------------------------------------------------

    def snapshot(self, memory: bool = True) -> str:
        """Save the whole guest (every process, its files, its kernel); return the snapshot id.
        ``memory`` is accepted for the local API: a VM snapshot always holds memory."""
        with self._lock:
            self._alive()
            return self._snapshot_as(snapshots.new_id())

    def _snapshot_as(self, snapshot: str, boot: bool = False) -> str:
        qemu = self._qemu
        staging = self.store.staging()
        memory = os.path.join(staging, "memory")
        try:
            qemu.command("stop")
            start = time.perf_counter()
            try:
                qemu.save_device_state(os.path.join(staging, "state"))
                if self._own_memory is not None:  # the file is the RAM (shared): copy it now
                    dirty = snapshots.copy_sparse(self._own_memory, memory)
                else:  # only the pages this guest wrote since its restore need the guest stopped
                    private = snapshots.read_private_pages(qemu.pid, qemu.memory)
            finally:
                if not self.paused:
                    qemu.command("cont")
                self.last_pause_s = time.perf_counter() - start
            if self._own_memory is None:  # the parent's file never changes: copy it while the guest runs
                snapshots.clone_or_copy(f"/proc/self/fd/{qemu.memory_fd}", memory)
                dirty = snapshots.write_pages(memory, private)
                del private
            meta = snapshots.meta_for(snapshot, self.parent, self.machine.key(), memory, dirty, boot)
            self.store.commit(staging, snapshot, meta)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return snapshot

    def restore(self, snapshot: str) -> None:
        """Return this guest to ``snapshot``: its processes go on from where they were then."""
        with self._lock:
            if self.closed:
                raise SandboxError(f"VM sandbox {self.id} is closed")
            old = self._qemu, self._channel, self._own_memory, self._own_memory_fd
            self._start_from(snapshot)
            new = self._qemu, self._channel, self.parent
            self._qemu, self._channel, self._own_memory, self._own_memory_fd = old
            self._stop_current()
            self._qemu, self._channel, self.parent = new
            self.paused = False
        if self._web is not None:
            self.enable_web(*self._web)  # the host's end of the relay was the old QEMU's

    def fork(self, snapshot: str | None = None, n: int = 1) -> list["VmSandbox"]:
        """``n`` new guests from ``snapshot`` (default: one taken now), each on its own private
        copy-on-write mapping of the snapshot's memory: none sees another's writes."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs n >= 1 sandboxes, got {n!r}")
        if snapshot is None:
            snapshot = self.snapshot()
        forks: list[VmSandbox] = []
        try:
            for _ in range(n):
                forks.append(VmSandbox(self.image, self.limits, snapshot=snapshot, hostname=self.hostname,
                                       home=self.home, config=self.config))
                if self._web is not None:
                    forks[-1].enable_web(*self._web)
        except BaseException:
            for box in forks:
                box.close()
            raise
        return forks

    # -- long-lived tools: the Python REPL and the offline web ---------------------------------

    def repl(self, name: str = "python", python: str = "python3"):
        """The guest's persistent Python REPL called ``name`` (``k3.sandbox.vm.repl.VmRepl``, the
        ``Repl`` API); it starts on the first ``run`` and is part of every snapshot."""
        from k3.sandbox.vm.repl import VmRepl

        if name not in self._repls:
            self._repls[name] = VmRepl(self, name, python)
        return self._repls[name]

    def enable_web(self, tools=None, socket_path: str = "/run/k3/web.sock") -> None:
        """Let processes in the guest use the offline web (``k3.sandbox.web``): requests to the Unix
        socket ``socket_path`` reach ``tools`` on the host over the guest's second virtio-serial
        port, with no network device; ``/usr/local/bin/web`` is a client. Survives restore and fork."""
        from k3.sandbox.web import relay

        if tools is None:
            from k3.sandbox.web.tools import default_tools

            tools = default_tools()
        check_path(socket_path)
        with self._lock:
            qemu = self._qemu
            thread = getattr(qemu, "web_thread", None)
            if thread is None or not thread.is_alive():  # none yet, or it stopped on a hostile frame
                sock = qemu.connect_web()

                def serve() -> None:  # until QEMU exits (restore, close): its end of the socket closes
                    try:
                        relay.serve(sock, tools)
                    finally:
                        sock.close()

                qemu.web_thread = threading.Thread(target=serve, daemon=True, name=f"k3-vm-web-{self.id}")
                qemu.web_thread.start()
        self._web = (tools, socket_path)
        self._data(self._call({"op": "web_on", "path": socket_path}, self.config.call_margin_s), socket_path)
        with open(relay.CLIENT_SOURCE, "rb") as f:
            self.write_file(relay.CLIENT_PATH, f.read(), mode=0o755)

    # -- pause / resume / introspection --------------------------------------------------------

    def pause(self) -> None:
        """Stop the guest's CPUs (exec and file calls fail until resume())."""
        with self._lock:
            if self.closed:
                raise SandboxError(f"VM sandbox {self.id} is closed")
            if not self.paused:
                self._qemu.command("stop")
                self.paused = True

    def resume(self) -> None:
        with self._lock:
            if self.closed:
                raise SandboxError(f"VM sandbox {self.id} is closed")
            if self.paused:
                self._qemu.command("cont")
                self.paused = False

    def memory_bytes(self) -> int:
        """Host memory this guest holds on its own: its QEMU's private resident memory (guest
        pages written since restore, QEMU itself) plus its own memory file, if it booted here."""
        total = 0
        with open(f"/proc/{self._qemu.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Dirty:", "Private_Clean:")):
                    total += int(line.split()[1]) * 1024
        if self._own_memory is not None:
            total += snapshots.allocated_bytes(self._own_memory)
        return total

    def pids(self) -> list[int]:
        """Host pids of the sandbox: its QEMU process."""
        return [self._qemu.pid] if self._qemu is not None else []

    def __repr__(self) -> str:
        state = "closed" if self.closed else "paused" if self.paused else "running"
        return f"VmSandbox(id={self.id!r}, image={self.image.path!r}, parent={self.parent!r}, {state})"


def sweep_orphaned_run_dirs(run_root: str) -> None:
    """Remove run directories whose owner process is gone (killed before ``close``): their QEMU
    died with it (PDEATHSIG), only sockets and logs are left. A live pid, whoever has it, is kept."""
    for name in os.listdir(run_root):
        try:
            with open(os.path.join(run_root, name, "owner")) as f:
                owner = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not os.path.exists(f"/proc/{owner}"):
            shutil.rmtree(os.path.join(run_root, name), ignore_errors=True)


def _b64(value) -> bytes:
    return base64.b64decode(value or "")


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 1500))
            return f.read().decode(errors="replace")
    except OSError:
        return "(none)"
