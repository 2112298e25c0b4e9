"""The Ray fleet on a local Ray cluster (skipped when Ray is not installed)."""

import os

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'k3[ray]')")


@pytest.fixture(scope="module")
def local_ray(sandbox_home):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"K3_SANDBOX_HOME": os.environ["K3_SANDBOX_HOME"]}})
    yield
    ray.shutdown()


def test_ray_fleet_map_and_fork(local_ray):
    from k3.sandbox import Sandbox
    from k3.sandbox.fleet_ray import RayFleet

    # Defined here, not at module level, so that Ray ships them by value to its workers.
    def _episode(box, task):
        box.write_file("/work/task.py", f"print({task} * {task})")
        return int(box.exec("python3 /work/task.py").stdout)

    def _branch(box, index):
        seen = box.read_file("/work/base.txt").decode()
        box.write_file("/work/base.txt", f"branch {index}")
        return seen, box.read_file("/work/base.txt").decode()

    with RayFleet(num_workers=2, warm=1, max_concurrency=2) as fleet:
        assert fleet.map(_episode, [1, 2, 3, 4]) == [1, 4, 9, 16]
        with Sandbox() as box:
            box.write_file("/work/base.txt", "base")
            exported = fleet.export_local(box.snapshot())
        results = fleet.fork(exported, 4, _branch)
        assert results == [("base", f"branch {i}") for i in range(4)]
        metrics = fleet.metrics()
        assert len(metrics) == 2 and sum(m["acquired_count"] for m in metrics) == 8
