"""Shared fixtures: one sandbox home per test session, and a skip only where the kernel lacks a
feature the sandbox needs (overlayfs, namespaces, cgroups) or the run is not root."""

import os
import shutil
import subprocess

import pytest


def _missing_feature() -> str | None:
    if os.geteuid() != 0:
        return "the local sandbox backend needs root (mounts, cgroups, namespaces)"
    with open("/proc/filesystems") as f:
        if "overlay" not in f.read():
            return "the kernel has no overlayfs"
    from k3.sandbox.cgroups import detect

    if detect() is None:
        return "no usable cgroup hierarchy (v2 with memory+pids, or v1 memory/pids/cpu/freezer)"
    unshare = shutil.which("unshare")
    if unshare is None:
        return "unshare(1) is not installed"
    probe = subprocess.run([unshare, "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"the kernel refuses new namespaces: {probe.stderr.decode().strip()}"
    return None


@pytest.fixture(scope="session")
def sandbox_home(tmp_path_factory):
    reason = _missing_feature()
    if reason:
        pytest.skip(reason)
    home = str(tmp_path_factory.mktemp("k3-sandbox-home"))
    previous = os.environ.get("K3_SANDBOX_HOME")
    os.environ["K3_SANDBOX_HOME"] = home
    yield home
    if previous is None:
        os.environ.pop("K3_SANDBOX_HOME", None)
    else:
        os.environ["K3_SANDBOX_HOME"] = previous


@pytest.fixture
def box(sandbox_home):
    from k3.sandbox import Sandbox

    sandbox = Sandbox()
    yield sandbox
    sandbox.close()
