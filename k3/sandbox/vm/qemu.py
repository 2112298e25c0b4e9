"""One QEMU process running a microVM, and its monitor (QMP), every wait under a deadline.

The machine is the same for a boot and for every restore of its snapshots (the device state
only loads into an identical machine): ``-M microvm`` with virtio-mmio devices, a read-only root
disk, two virtio-serial ports (the agent's, and the offline web relay's), no network device, guest RAM as a memory-backend-file.
QEMU's own seccomp filter is on, and QEMU dies with the process that started it (``PDEATHSIG``
set in a launcher thread that lives as long as this process, since the signal follows the
thread that forked).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

from k3.sandbox.local import SandboxError
from k3.sandbox.vm.channel import Channel
from k3.sandbox.vm.config import VmConfig, qemu_path

PR_SET_PDEATHSIG = 1
# Bumped whenever the device list below changes: device state loads only into the same devices.
DEVICES_VERSION = 2
# Device state is written without a configuration section or section footers (that is what
# xen-save-devices-state writes), so the loading side must expect neither.
MIGRATION_GLOBALS = ("migration.send-configuration=off", "migration.send-section-footer=off")


@dataclass(frozen=True)
class Machine:
    """Everything that must be identical between a guest's boot and each restore of it."""

    config: VmConfig
    initrd: str
    root_disk: str
    memory_mb: int
    cpus: int

    def key(self) -> dict:
        return {"kernel": self.config.kernel, "initrd": self.initrd, "root_disk": self.root_disk,
                "memory_mb": self.memory_mb, "cpus": self.cpus, "accel": self.config.accel, "devices": DEVICES_VERSION}


class QemuError(SandboxError):
    """QEMU failed to start, or its monitor answered with an error or not at all."""


class Qemu:
    """A started QEMU. ``memory`` is the guest RAM file, mapped shared (a running guest's own
    file) or private (a snapshot's file: the guest's writes stay in this process)."""

    def __init__(self, machine: Machine, run_dir: str, memory: str, share: bool, incoming: bool,
                 serial_log: str | None = None) -> None:
        config = machine.config
        self.machine, self.run_dir, self.memory, self.share = machine, run_dir, memory, share
        self.qmp_path = os.path.join(run_dir, "qmp.sock")
        self.agent_path = os.path.join(run_dir, "agent.sock")
        self.web_path = os.path.join(run_dir, "web.sock")
        accel = "kvm" if config.accel == "kvm" else f"tcg,thread={'multi' if machine.cpus > 1 else 'single'}"
        cmdline = ["console=ttyS0", "quiet", "panic=-1", "rdinit=/init", "random.trust_cpu=on", *config.extra_cmdline]
        if config.accel == "tcg":
            cmdline.append("tsc_early_khz=2000000")  # TCG offers no clock to calibrate the TSC against
        args = [
            qemu_path(config), "-M", "microvm,pit=on,pic=on,rtc=on,memory-backend=ram,suppress-vmdesc=on",
            "-accel", accel, "-cpu", "host" if config.accel == "kvm" else "max",
            "-m", f"{machine.memory_mb}M", "-smp", str(machine.cpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-nic", "none",
            "-object", f"memory-backend-file,id=ram,size={machine.memory_mb}M,mem-path={memory},"
                       f"share={'on' if share else 'off'}",
            "-kernel", config.kernel, "-initrd", machine.initrd, "-append", " ".join(cmdline),
            "-drive", f"file={machine.root_disk},format=raw,if=none,id=root,readonly=on",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device",
            "-chardev", f"socket,id=agent,path={self.agent_path},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=k3.agent,nr=1",
            "-chardev", f"socket,id=web,path={self.web_path},server=on,wait=off",
            "-device", "virtserialport,chardev=web,name=k3.web,nr=2",
            "-serial", f"file:{serial_log}" if serial_log else "null",
            "-qmp", f"unix:{self.qmp_path},server=on,wait=off",
            "-sandbox", "on,obsolete=deny,elevateprivileges=deny,resourcecontrol=deny",
        ]
        for setting in MIGRATION_GLOBALS:
            args += ["-global", setting]
        if incoming:
            args += ["-S", "-incoming", "defer"]
        self.log_path = os.path.join(run_dir, "qemu.log")
        self.process = _launch(args, self.log_path)
        self.pid = self.process.pid
        self._pidfd = os.pidfd_open(self.pid)
        self.memory_fd: int | None = None  # the snapshot's memory file, open while this guest maps it
        self._qmp: socket.socket | None = None
        self._buffer = bytearray()
        try:
            self._connect_qmp(time.monotonic() + config.qmp_timeout_s)
        except BaseException:
            self.kill()
            raise

    # -- monitor -------------------------------------------------------------------------------

    def _connect_qmp(self, deadline: float) -> None:
        while True:
            if self.process.poll() is not None:
                raise QemuError(f"QEMU exited at start (status {self.process.returncode}): {self._log_tail()}")
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(self.qmp_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise QemuError("QEMU's monitor socket did not appear before the deadline") from None
                time.sleep(0.002)
        sock.setblocking(False)
        self._qmp = sock
        self._read_message(deadline)  # the greeting
        self.command("qmp_capabilities", timeout=deadline - time.monotonic())

    def command(self, name: str, timeout: float | None = None, **arguments) -> dict:
        """Run one QMP command; its ``return`` value, or QemuError with QEMU's message."""
        deadline = time.monotonic() + (self.machine.config.qmp_timeout_s if timeout is None else timeout)
        message = json.dumps({"execute": name, "arguments": arguments}).encode() + b"\n"
        try:
            self._qmp.sendall(message)
        except BlockingIOError:
            self._qmp.setblocking(True)
            self._qmp.settimeout(max(0.001, deadline - time.monotonic()))
            self._qmp.sendall(message)
            self._qmp.setblocking(False)
        except OSError as error:
            raise QemuError(f"QEMU's monitor is gone ({error}): {self._log_tail()}") from None
        while True:
            reply = self._read_message(deadline)
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise QemuError(f"QEMU refused {name}: {reply['error'].get('desc', reply['error'])}")

    def _read_message(self, deadline: float) -> dict:
        poller = select.poll()
        poller.register(self._qmp, select.POLLIN)
        while b"\n" not in self._buffer:
            if not poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise QemuError("QEMU's monitor did not answer before the deadline")
            chunk = self._qmp.recv(1 << 16)
            if not chunk:
                raise QemuError(f"QEMU exited: {self._log_tail()}")
            self._buffer += chunk
            if len(self._buffer) > 16 << 20:
                raise QemuError("QEMU's monitor sent a line over 16 MiB")
        line, _, rest = bytes(self._buffer).partition(b"\n")
        self._buffer = bytearray(rest)
        return json.loads(line)

    # -- what the sandbox does with it ---------------------------------------------------------

    def connect_agent(self, deadline: float) -> Channel:
        """Connect to the agent's virtio-serial port (QEMU's end of it)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(self.agent_path)
        except OSError as error:
            sock.close()
            raise QemuError(f"cannot connect to the agent port: {error}") from None
        return Channel(sock, self.machine.config.max_reply_bytes)

    def connect_web(self) -> socket.socket:
        """A blocking connection to the web relay's port (the host answers what comes on it)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.web_path)
        except OSError as error:
            sock.close()
            raise QemuError(f"cannot connect to the web relay's port: {error}") from None
        return sock

    def save_device_state(self, path: str) -> None:
        """Write CPU and device state, and no RAM, to ``path`` (the guest must be stopped)."""
        self.command("xen-save-devices-state", filename=path, live=False)

    def load_device_state(self, path: str, deadline: float) -> None:
        """Load state written by ``save_device_state`` into this ``incoming`` QEMU; RAM is the
        memory file it was started on. Leaves the guest paused."""
        self.command("migrate-incoming", uri=f"exec:cat {shlex.quote(path)}")
        while True:
            status = self.command("query-migrate", timeout=max(0.001, deadline - time.monotonic())).get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise QemuError(f"loading the device state {path} failed: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise QemuError(f"loading the device state {path} did not finish before the deadline")
            time.sleep(0.001)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL QEMU (through its pidfd: never a reused pid) and reap it."""
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(self._pidfd)
            self._pidfd = None
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if self._qmp is not None:
            self._qmp.close()
            self._qmp = None
        if self.memory_fd is not None:
            os.close(self.memory_fd)
            self.memory_fd = None

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 2000))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""


# -- a launcher thread: QEMU's PDEATHSIG follows the thread that forked it ----------------------

_requests: "queue.Queue" = queue.Queue()
_launcher: threading.Thread | None = None
_launcher_lock = threading.Lock()


def _set_pdeathsig() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _launcher_loop() -> None:
    while True:
        args, log_path, reply = _requests.get()
        try:
            with open(log_path, "ab") as log:
                reply.put(subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                           preexec_fn=_set_pdeathsig, close_fds=True))
        except BaseException as error:  # noqa: BLE001 - handed to the caller, which raises it
            reply.put(error)


def _launch(args: list[str], log_path: str) -> subprocess.Popen:
    global _launcher
    with _launcher_lock:
        if _launcher is None or not _launcher.is_alive():
            _launcher = threading.Thread(target=_launcher_loop, name="k3-vm-launcher", daemon=True)
            _launcher.start()
    reply: "queue.Queue" = queue.Queue()
    _requests.put((args, log_path, reply))
    result = reply.get(timeout=60)
    if isinstance(result, BaseException):
        raise QemuError(f"cannot start QEMU: {result}")
    return result
