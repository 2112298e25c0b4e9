"""MicroVM sandboxes: the ``Sandbox`` API on QEMU ``-M microvm`` guests, whose snapshots hold the
whole machine (memory included). Entry points: ``VmSandbox``, ``VmConfig``, ``VmUnavailable``.

Files: ``config.py`` (what a VM is made of), ``guest.py`` (initramfs and root disk),
``agent.py`` (runs in the guest), ``channel.py`` (the host side of its protocol), ``qemu.py``
(the QEMU process and its monitor), ``snapshots.py`` (memory files), ``sandbox.py`` (the API).
"""

from k3.sandbox.vm.config import VmConfig, VmUnavailable
from k3.sandbox.vm.sandbox import VmSandbox

__all__ = ["VmConfig", "VmSandbox", "VmUnavailable"]
