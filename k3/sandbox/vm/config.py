"""``VmConfig``: what a microVM sandbox is made of (kernel, accelerator, size, deadlines).

Every field has a default that works on a Debian host where ``.ci/install-system-deps.sh`` ran
(``qemu-system-x86`` and ``linux-image-cloud-amd64``). The environment is read only in
``VmConfig.from_env`` (the edge), never below it.
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass, field, replace

# Guest modules the initramfs loads, in order: virtio-mmio transport, the root disk, the agent's
# serial port, and overlayfs for the writable layer. Debian's kernels build them as modules.
GUEST_MODULES = (
    "kernel/drivers/virtio/virtio_ring.ko",
    "kernel/drivers/virtio/virtio.ko",
    "kernel/drivers/virtio/virtio_mmio.ko",
    "kernel/drivers/block/virtio_blk.ko",
    "kernel/drivers/char/virtio_console.ko",
    "kernel/fs/overlayfs/overlay.ko",
)


class VmUnavailable(RuntimeError):
    """This machine cannot run microVM sandboxes (the message says what is missing, and names
    the local backend, which needs no virtualisation)."""


@dataclass(frozen=True)
class VmConfig:
    """How microVM sandboxes are launched.

    kernel: a bzImage (``/boot/vmlinuz-*``); its modules must be under ``/lib/modules/<version>``.
    accel: "kvm", "tcg" (QEMU's software CPU: slow to boot and to compute, but snapshot, restore
        and fork cost the same host work), or "auto" (kvm where it can boot a stock kernel, see
        ``choose_accel``).
    memory_mb: guest RAM when the sandbox's ``Limits`` say nothing; it is also the memory file's size.
    ram_dir: where running guests' memory files live (a tmpfs: they are the guest's RAM).
    boot_timeout_s / call_margin_s / qmp_timeout_s: deadlines of every host-side wait (a boot,
        the slack over a command's own timeout, one QEMU monitor command).
    max_reply_bytes: the largest frame the host accepts from a guest agent.
    """

    kernel: str | None = None
    accel: str = "auto"
    memory_mb: int = 256
    cpus: int = 1
    ram_dir: str = "/dev/shm/k3-vm"
    qemu: str = "qemu-system-x86_64"
    busybox: str = "/bin/busybox"
    boot_timeout_s: float = 300.0
    call_margin_s: float = 30.0
    qmp_timeout_s: float = 60.0
    max_reply_bytes: int = 64 << 20
    extra_cmdline: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"VmConfig.accel must be 'auto', 'kvm' or 'tcg', got {self.accel!r}")
        if not 64 <= self.memory_mb <= 1 << 20:
            raise ValueError(f"VmConfig.memory_mb must be between 64 and 1048576 (MiB), got {self.memory_mb}")
        if not 1 <= self.cpus <= 64:
            raise ValueError(f"VmConfig.cpus must be between 1 and 64, got {self.cpus}")

    @staticmethod
    def from_env() -> "VmConfig":
        """Defaults, overridden by ``K3_VM_KERNEL``, ``K3_VM_ACCEL`` and ``K3_VM_RAM_DIR``."""
        config = VmConfig()
        overrides = {key: os.environ[name] for key, name in
                     (("kernel", "K3_VM_KERNEL"), ("accel", "K3_VM_ACCEL"), ("ram_dir", "K3_VM_RAM_DIR"))
                     if os.environ.get(name)}
        return replace(config, **overrides)

    def resolved(self) -> "VmConfig":
        """This config with the kernel and accelerator chosen; VmUnavailable when impossible."""
        kernel = self.kernel or find_kernel()
        accel = choose_accel() if self.accel == "auto" else self.accel
        if accel == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
            raise VmUnavailable("accel='kvm' needs a readable and writable /dev/kvm; use accel='tcg' "
                                "or the local backend (backend='local')")
        return replace(self, kernel=kernel, accel=accel)


def qemu_path(config: VmConfig) -> str:
    path = shutil.which(config.qemu)
    if path is None:
        raise VmUnavailable(f"{config.qemu} is not installed: run .ci/install-system-deps.sh (apt-get install "
                            "qemu-system-x86), or use the local backend (backend='local')")
    return path


def find_kernel() -> str:
    """The newest Debian kernel in /boot whose modules are installed."""
    for path in sorted(glob.glob("/boot/vmlinuz-*"), reverse=True):
        if os.path.isdir(modules_dir(path)):
            return path
    raise VmUnavailable("no guest kernel: /boot/vmlinuz-* with /lib/modules/<version> is needed (apt-get "
                        "install linux-image-cloud-amd64), or use the local backend (backend='local')")


def modules_dir(kernel: str) -> str:
    version = os.path.basename(kernel).removeprefix("vmlinuz-")
    return os.path.join("/lib/modules", version)


def kvm_problem() -> str | None:
    """Why hardware KVM cannot run a stock guest kernel here, or None when it can."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "/dev/kvm is missing or not readable and writable"
    if os.path.isdir("/sys/module/kvm_pvm"):
        return ("/dev/kvm is PVM (the kvm_pvm module: nested virtualisation that runs only PVM-enabled guest "
                "kernels; Debian's kernel does not boot under it)")
    return None


def require_kvm(config: VmConfig) -> VmConfig:
    """``config`` resolved, when it can run guests at KVM speed (or the caller asked for TCG by name);
    else VmUnavailable saying why and naming the local backend. For work that would crawl under
    QEMU's software CPU (RL rollouts: thousands of commands)."""
    resolved = config.resolved()
    qemu_path(resolved)
    if resolved.accel == "tcg" and config.accel == "auto":
        raise VmUnavailable(f"no usable KVM on this machine: {kvm_problem()}. MicroVM sandboxes would run under "
                            "QEMU's software CPU (TCG), where each command costs about a second; use the local "
                            "backend (--sandbox-backend local), or set K3_VM_ACCEL=tcg to run under TCG anyway")
    return resolved


def choose_accel() -> str:
    """"kvm" where /dev/kvm is hardware-assisted KVM; else "tcg".

    Some hosts expose /dev/kvm through PVM (the ``kvm_pvm`` module: pagetable-based nesting
    inside a VM), which runs only PVM-enabled guest kernels: a stock kernel crawls through its
    decompressor there (measured: about 250 KB/s) and never boots, so such a host gets "tcg".
    """
    return "tcg" if kvm_problem() else "kvm"
