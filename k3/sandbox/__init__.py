"""Isolated sandboxes with snapshot, restore and fork, for agentic RL rollouts.

Entry points: ``Sandbox`` (sync), ``AsyncSandbox`` (asyncio), ``SandboxPool`` (warm sandboxes,
concurrency limit, snapshot store), ``Image`` / ``default_image`` and ``Limits``; ``Repl`` /
``ReplResult`` (``Sandbox.repl()``, a persistent Python per sandbox). The Ray fleet is in
``k3.sandbox.fleet_ray`` (imported on demand, as Ray is optional); the offline web and the browse
tasks are in ``k3.sandbox.web``.
"""

from k3.sandbox.aio import AsyncSandbox
from k3.sandbox.api import ExecResult, Sandbox
from k3.sandbox.cgroups import Limits
from k3.sandbox.image import Image, default_image
from k3.sandbox.local import SandboxError, prewarm
from k3.sandbox.pool import SandboxPool, SnapshotStore
from k3.sandbox.repl import Repl, ReplResult

__all__ = ["AsyncSandbox", "ExecResult", "Image", "Limits", "Repl", "ReplResult", "Sandbox", "SandboxError", "SandboxPool", "SnapshotStore", "default_image", "prewarm"]
