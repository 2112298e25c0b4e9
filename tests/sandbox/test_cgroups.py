"""Cgroup back ends. The v1 one is exercised by every sandbox test on a v1 machine; here the v2
freeze/kill/remove path runs on whatever cgroup2 hierarchy is mounted (possibly one without
controllers, next to v1), and limits are checked to reach the kernel."""

import os
import subprocess

import pytest

from k3.sandbox import Limits, Sandbox
from k3.sandbox.cgroups import CgroupV1, CgroupV2, cgroup2_mount, detect


def test_cgroup_v2_freeze_kill_and_remove(sandbox_home):
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("the kernel has no cgroup2 hierarchy mounted")
    group = CgroupV2(f"test-{os.getpid()}", root=mount)
    sleeper = subprocess.Popen(["sleep", "1000"])
    try:
        group.add(sleeper.pid)
        assert group.pids() == [sleeper.pid]
        group.freeze()
        with open(os.path.join(group.path, "cgroup.events")) as f:
            assert "frozen 1" in f.read()
        group.thaw()
        group.set_limits(Limits())  # only the controllers this hierarchy has are written
        group.kill_all()
        assert sleeper.wait(timeout=30) == -9
        group.remove()
        assert not os.path.exists(group.path)
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_limits_reach_the_kernel(sandbox_home):
    with Sandbox(limits=Limits(memory_mb=100, pids=50, cpus=0.5)) as box:
        group = box.cgroup
        if group.version == "v1":
            read = lambda controller, name: open(os.path.join(group.paths[controller], name)).read().strip()  # noqa: E731
            assert read("memory", "memory.limit_in_bytes") == str(100 << 20)
            assert read("pids", "pids.max") == "50"
            assert read("cpu", "cpu.cfs_quota_us") == "50000"
        else:
            read = lambda name: open(os.path.join(group.path, name)).read().strip()  # noqa: E731
            assert read("memory.max") == str(100 << 20)
            assert read("pids.max") == "50"


def test_v1_memory_limit_can_be_raised_and_lowered_with_swap_accounting(sandbox_home):
    if detect() != "v1":
        pytest.skip("a cgroup v1 hierarchy only")
    group = CgroupV1(f"test-{os.getpid()}-memsw")
    read = lambda name: int(open(os.path.join(group.paths["memory"], name)).read())  # noqa: E731
    memsw = os.path.exists(os.path.join(group.paths["memory"], "memory.memsw.limit_in_bytes"))
    try:
        for mb in (512, 1536, 256):  # a spare's default, then a larger sandbox's (EINVAL before), then smaller
            group.set_limits(Limits(memory_mb=mb))
            assert read("memory.limit_in_bytes") == mb << 20
            if memsw:
                assert read("memory.memsw.limit_in_bytes") == mb << 20
    finally:
        group.remove()
