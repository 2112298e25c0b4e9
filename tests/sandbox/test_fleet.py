"""AsyncSandbox, SandboxPool (warm sandboxes, concurrency limit, snapshot GC, metrics) and the CLI."""

import asyncio
import json
import threading

import pytest

from k3.sandbox import AsyncSandbox, SandboxPool


def test_async_sandbox_exec_snapshot_fork(sandbox_home):
    async def main():
        async with await AsyncSandbox.create() as box:
            await box.write_file("/work/a.txt", "async")
            assert (await box.exec("cat /work/a.txt")).stdout == "async"
            forks = await box.fork(n=3)
            try:
                results = await asyncio.gather(*(f.exec(f"echo {i} > /work/a.txt; cat /work/a.txt") for i, f in enumerate(forks)))
                assert [r.stdout for r in results] == ["0\n", "1\n", "2\n"]
                assert await box.read_file("/work/a.txt") == b"async"
            finally:
                await asyncio.gather(*(f.close() for f in forks))

    asyncio.run(main())


def test_pool_reuses_wiped_warm_sandboxes(sandbox_home):
    with SandboxPool(warm=1, max_concurrency=2) as pool:
        with pool.sandbox() as box:
            box.write_file("/work/left-behind.txt", "dirty")
            box.exec("sleep 1000 > /dev/null 2>&1 &")
            first_id = box.id
        with pool.sandbox() as box:
            assert box.id == first_id  # the warm one, reused
            assert box.exec("test -e /work/left-behind.txt").exit_code == 1
            assert "sleep" not in box.exec("cat /proc/[0-9]*/comm").stdout
        metrics = pool.metrics()
        assert metrics["acquired_count"] == 2 and metrics["warm"] == 1 and metrics["in_use"] == 0
        assert "reset_p50_ms" in metrics


def test_pool_concurrency_limit(sandbox_home):
    with SandboxPool(warm=0, max_concurrency=1) as pool:
        held = pool.acquire()
        with pytest.raises(TimeoutError):
            pool.acquire(timeout=0.2)
        released = threading.Event()

        def wait_for_slot():
            box = pool.acquire(timeout=60)
            released.set()
            pool.release(box)

        waiter = threading.Thread(target=wait_for_slot)
        waiter.start()
        assert not released.is_set()
        pool.release(held)
        waiter.join(60)
        assert released.is_set()


def test_pool_snapshot_store_gc(sandbox_home):
    with SandboxPool(warm=0, max_concurrency=4) as pool:
        with pool.sandbox() as box:
            box.write_file("/work/keep.txt", "keep")
            kept = pool.snapshot(box)  # pinned
            box.write_file("/work/drop.txt", "drop")
            dropped = pool.snapshot(box, pin=False)
        with pool.sandbox(snapshot=kept) as box:
            assert box.read_file("/work/keep.txt") == b"keep"
        removed = pool.gc()
        assert dropped in removed and kept not in removed
        assert pool.store.layers.exists(kept) and not pool.store.layers.exists(dropped)
        pool.store.unpin(kept)
        assert kept in pool.gc()


def test_gc_keeps_layers_of_running_sandboxes(sandbox_home):
    from k3.sandbox import Sandbox

    with SandboxPool(warm=0) as pool, Sandbox() as box:
        box.write_file("/work/x", "x")
        snapshot = box.snapshot()
        box.restore(snapshot)  # now mounted as a lower layer
        assert snapshot not in pool.gc()
        assert box.read_file("/work/x") == b"x"


def test_cli_doctor_and_run(sandbox_home, capsys):
    from k3.cli import main

    assert main(["sandbox", "doctor", "--json"]) == 0
    checks = json.loads(capsys.readouterr().out)
    assert {check["name"] for check in checks} >= {"root", "overlayfs", "cgroups", "criu (memory snapshots)"}
    assert main(["sandbox", "run", "echo hi; exit 3"]) == 3
    assert capsys.readouterr().out == "hi\n"
