"""VM snapshots as plain data: export, import (refused for another machine shape), and forks of an exported
whole-machine snapshot on a local Ray fleet of microVM workers (skipped without Ray or QEMU).

Slow: the first sandbox of a session boots the guest kernel (under TCG where there is no hardware KVM)."""

import os

import pytest

from tests.sandbox.test_vm import COUNTER, _poke, _vm_missing

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vm(sandbox_home):
    reason = _vm_missing()
    if reason:
        pytest.skip(f"no microVM here: {reason}")
    from k3.sandbox import Limits, Sandbox

    box = Sandbox(limits=Limits(memory_mb=256, cpus=1.0), backend="vm")
    yield box
    box.close()


def test_exported_snapshot_imports_and_runs_on(vm):
    from k3.sandbox.vm import VmSandbox, snapshots

    vm.exec(f"({COUNTER}) > /dev/null 2>&1 &")
    _poke(vm, 1)
    snap = vm.snapshot()
    exported = snapshots.export(vm.store, snap)
    memory = open(os.path.join(vm.store.path(snap), "memory"), "rb").read()
    vm.store.remove(snap)
    with pytest.raises(ValueError, match="machine"):
        snapshots.import_(vm.store, dict(exported, meta=dict(exported["meta"], machine={"memory_mb": 1})),
                          vm.machine.key())
    assert not vm.store.exists(snap)
    assert snapshots.import_(vm.store, exported, vm.machine.key()) == snap
    assert open(os.path.join(vm.store.path(snap), "memory"), "rb").read() == memory
    box = VmSandbox(vm.image, vm.limits, snapshot=snap, home=vm.home, config=vm.config)
    try:
        _poke(box, 2)  # the counting loop goes on from 1 in the imported machine
    finally:
        box.close()


def test_ray_fleet_of_vm_workers_forks_an_exported_machine(vm):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'k3[ray]')")
    from k3.sandbox.fleet_ray import RayFleet

    def _episode(box, item):  # defined here: Ray ships it by value
        box.exec("(i=0; while true; do i=$((i+1)); echo $i > /tmp/i.new; mv /tmp/i.new /tmp/i; sleep 0.2; done) "
                 "> /dev/null 2>&1 &")  # mv: a reader never sees the file half written
        box.exec("for n in $(seq 300); do [ -s /tmp/i ] && exit 0; sleep 0.1; done; exit 1", timeout=120)
        box.write_file("/tmp/item", str(item))
        return box.backend

    def _branch(box, index):  # the loop is still running from where the export was taken
        first = int(box.read_file("/tmp/i"))
        moved = box.exec(f"for n in $(seq 300); do [ $(cat /tmp/i) -gt {first} ] && exit 0; sleep 0.1; done; exit 1",
                         timeout=120).ok
        return box.read_file("/tmp/item").decode(), moved

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"K3_SANDBOX_HOME": vm.home, "K3_VM_ACCEL": vm.config.accel}})
    try:
        with RayFleet(num_workers=2, warm=1, max_concurrency=2, backend="vm",
                      limits=vm.limits) as fleet:
            result, exported = fleet.run_and_export(_episode, "seven")
            assert result == "vm" and exported["backend"] == "vm"
            assert fleet.fork(exported, 2, _branch) == [("seven", True), ("seven", True)]
    finally:
        ray.shutdown()
