"""The scale benchmarks at a small size, so they keep working (slow: not in the default run)."""

import pytest

pytestmark = pytest.mark.slow


def test_memory_bench_reports_its_keys_and_checks_every_restore(sandbox_home):
    from k3.sandbox import bench_memory

    results = bench_memory.run(iterations=3, state_mb=8)
    for key in ("memory_snapshot_p50_ms", "memory_restore_p50_ms", "memory_fork_p50_ms", "fs_restore_p50_ms"):
        assert results[key] > 0
    assert "K3 report" in bench_memory.format_table(results)


def test_pool_bench_fills_a_pool_and_runs_in_each(sandbox_home):
    from k3.sandbox import bench_fleet

    results = bench_fleet.run_pool(12)
    assert results["pool_sandboxes"] == 12 and results["pool_memory_per_sandbox_mb"] > 0


def test_ray_bench_runs_episodes_and_carries_a_memory_snapshot_across_workers(sandbox_home):
    pytest.importorskip("ray")
    from k3.sandbox import bench_fleet

    results = bench_fleet.run_ray(episodes=24, workers=2, branches=4)
    assert results["ray_episodes_per_s"] > 0 and results["ray_branches_correct"] == 4
