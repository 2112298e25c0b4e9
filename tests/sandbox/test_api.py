"""The Sandbox API: exec, files, snapshot / restore / fork, pause / resume, close."""

import os
import threading
import time
import uuid

import pytest

from k3.sandbox import Image, Limits, Sandbox, SandboxError


def test_exec_returns_output_exit_code_and_duration(box):
    result = box.exec("echo out; echo err >&2; exit 3")
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 3
    assert result.duration_s > 0
    assert not result.timed_out and not result.ok


def test_exec_env_cwd_argv_and_stdin(box):
    assert box.exec("echo $GREETING", env={"GREETING": "hello"}).stdout == "hello\n"
    assert box.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert box.exec("pwd").stdout == "/work\n"  # the default image's workdir
    assert box.exec(["python3", "-c", "import sys; print(sys.argv[1])", "a b"]).stdout == "a b\n"
    assert box.exec("tr a-z A-Z", stdin="shout").stdout == "SHOUT"


def test_exec_of_a_missing_program_is_exit_127(box):
    result = box.exec(["/no/such/program"])
    assert result.exit_code == 127
    assert "/no/such/program" in result.stderr


def test_exec_output_is_capped(box):
    result = box.exec("yes | head -c 100000", max_output=1000)
    assert len(result.stdout_bytes) == 1000
    assert result.truncated


def test_exec_rejects_bad_arguments(box):
    with pytest.raises(ValueError, match="cmd must be"):
        box.exec([])
    with pytest.raises(ValueError, match="timeout must be"):
        box.exec("true", timeout=0)
    with pytest.raises(ValueError, match="absolute"):
        box.exec("true", cwd="relative/dir")


def test_hostname_and_pid_namespace(box):
    assert box.exec("uname -n").stdout == "sandbox\n"
    # PID 1 is the sandbox's supervisor: the sandbox has a pid namespace of its own.
    assert "supervisor.py" in box.exec("cat /proc/1/cmdline | tr '\\0' ' '").stdout


def test_write_read_and_upload(box, tmp_path):
    box.write_file("/work/pkg/hello.txt", "hi there")
    assert box.read_file("/work/pkg/hello.txt") == b"hi there"
    assert box.exec("cat /work/pkg/hello.txt").stdout == "hi there"
    box.write_file("/work/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert box.exec("/work/run.sh").stdout == "ran\n"

    (tmp_path / "project" / "src").mkdir(parents=True)
    (tmp_path / "project" / "src" / "a.py").write_text("A = 1\n")
    (tmp_path / "project" / "README").write_text("readme\n")
    box.upload(str(tmp_path / "project"), "/work/project")
    assert box.read_file("/work/project/src/a.py") == b"A = 1\n"
    assert box.exec("cat /work/project/README").stdout == "readme\n"
    box.upload(str(tmp_path / "project" / "README"), "/work/single")
    assert box.read_file("/work/single") == b"readme\n"


def test_file_errors(box):
    with pytest.raises(FileNotFoundError):
        box.read_file("/work/missing")
    with pytest.raises(ValueError, match="absolute"):
        box.read_file("work/relative")


def test_snapshot_restore_brings_files_back(box):
    box.write_file("/work/state.txt", "v1")
    box.exec("rm /usr/bin/yes")  # a deletion of an image file must be restored too
    snapshot = box.snapshot()
    box.write_file("/work/state.txt", "v2")
    box.write_file("/work/later.txt", "created after the snapshot")
    box.exec("cp /bin/true /usr/bin/yes")
    box.restore(snapshot)
    assert box.read_file("/work/state.txt") == b"v1"
    assert box.exec("test -e /work/later.txt").exit_code == 1
    assert box.exec("test -e /usr/bin/yes").exit_code == 1  # the whiteout was frozen into the layer
    assert box.exec("test -e /usr/bin/head").exit_code == 0


def test_snapshot_keeps_opaque_directories(box):
    box.exec("mkdir -p /work/d && echo old > /work/d/old")
    first = box.snapshot()
    box.restore(first)  # /work/d/old now lives in a lower layer
    box.exec("rm -rf /work/d && mkdir /work/d && echo new > /work/d/new")
    second = box.snapshot()
    [fork] = box.fork(second)
    with fork:
        assert fork.exec("ls /work/d").stdout == "new\n"


def test_snapshot_ids_are_content_addresses(sandbox_home):
    with Sandbox() as a, Sandbox() as b:
        a.write_file("/work/same.txt", "same content")
        b.write_file("/work/same.txt", "same content")
        assert a.snapshot() == b.snapshot()
        b.write_file("/work/same.txt", "different content")
        assert a.snapshot() != b.snapshot()


def test_snapshots_stack_across_restores(box):
    box.write_file("/work/one", "1")
    box.restore(box.snapshot())
    box.write_file("/work/two", "2")
    top = box.snapshot()
    assert len(box.store.chain(top)) == 2
    with Sandbox(snapshot=top) as again:
        assert again.exec("cat /work/one /work/two").stdout == "12"


def test_fork_gives_independent_copies(box):
    box.write_file("/work/base.txt", "base")
    forks = box.fork(n=3)
    try:
        for index, fork in enumerate(forks):
            fork.write_file("/work/base.txt", f"fork {index}")
        for index, fork in enumerate(forks):
            assert fork.read_file("/work/base.txt") == f"fork {index}".encode()
        assert box.read_file("/work/base.txt") == b"base"
    finally:
        for fork in forks:
            fork.close()


def test_pause_freezes_every_process(box):
    box.exec("echo start > /tmp/ticks; (while true; do echo x >> /tmp/ticks; done) > /dev/null 2>&1 &")
    box.pause()
    with pytest.raises(SandboxError, match="paused"):
        box.exec("true")
    ticks = os.path.join(box._upper, "tmp", "ticks")
    size = os.path.getsize(ticks)
    time.sleep(0.2)  # frozen processes make no progress, however long we look
    assert os.path.getsize(ticks) == size
    box.resume()
    assert box.exec("echo awake").stdout == "awake\n"


def test_close_is_idempotent_and_final(sandbox_home):
    sandbox = Sandbox()
    sandbox.close()
    sandbox.close()
    with pytest.raises(SandboxError, match="closed"):
        sandbox.exec("true")


def test_close_after_a_failed_restore_raises_nothing_and_leaves_no_cgroup(sandbox_home, monkeypatch):
    sandbox = Sandbox(limits=Limits(memory_mb=300))  # not the spares' limits: restore writes them
    snapshot = sandbox.snapshot()
    cgroup_class = type(sandbox.cgroup)
    original, test_thread, failed = cgroup_class.set_limits, threading.get_ident(), []

    def refuse(group, limits):
        if threading.get_ident() != test_thread:  # the spares' refill threads set their own limits meanwhile
            return original(group, limits)
        failed.append(group)
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(cgroup_class, "set_limits", refuse)
    with pytest.raises(OSError, match="Invalid argument"):
        sandbox.restore(snapshot)
    monkeypatch.undo()
    sandbox.close()  # must not raise on top of the restore's error
    [group] = failed  # the new generation's supervisor: killed, its cgroup removed, not leaked
    paths = group.paths.values() if group.version == "v1" else [group.path]
    assert not any(os.path.exists(path) for path in paths)


def test_a_supervisor_can_be_waited_for_twice(sandbox_home):
    from k3.sandbox import local

    [supervisor] = local.spares().take(1)
    supervisor.kill()
    supervisor.wait()
    supervisor.wait()  # a second waiter (close beside the janitor) finds it gone and returns


def test_image_from_a_directory(sandbox_home, tmp_path):
    from k3.sandbox import default_image

    # An image is any directory tree: here the default image plus one file, as a second layer-free dir.
    base = default_image()
    with Sandbox(Image.from_dir(base.path, workdir="/tmp")) as sandbox:
        assert sandbox.exec("pwd").stdout == "/tmp\n"
    with pytest.raises(ValueError, match="existing directory"):
        Image.from_dir(str(tmp_path / "nope"))


def test_limits_are_validated():
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=1)
    with pytest.raises(ValueError, match="cpus"):
        Limits(cpus=0)


def test_exec_returns_when_the_command_exits_even_if_a_background_child_holds_its_output(box):
    result = box.exec("echo started; sleep 1000 & echo $!", timeout=None)
    started, pid = result.stdout.split()
    assert started == "started" and result.exit_code == 0 and not result.timed_out
    # The background process lives on. Ask by pid, not by name: right after the fork it may still be
    # called "sh" until it has exec'd sleep.
    assert box.exec(f"kill -0 {pid}").exit_code == 0


def test_deep_chains_are_squashed_with_overlay_semantics(box, monkeypatch):
    import k3.sandbox.api as api

    monkeypatch.setattr(api, "MAX_CHAIN", 4)
    steps = [
        "echo 1 > /work/a; mkdir -p /work/d; echo old > /work/d/old",
        "rm /work/a; rm /usr/bin/yes; echo 2 > /work/b",
        "rm -rf /work/d; mkdir /work/d; echo new > /work/d/new",
        "echo 3 > /work/a; ln -s /work/b /work/link",
    ]
    for step in steps:
        assert box.exec(step).exit_code == 0
        box.restore(box.snapshot())
    assert len(box.chain) == 4
    squashed = box.snapshot()
    assert box.store.chain(squashed) == [squashed]  # one layer right on the image
    with Sandbox(snapshot=squashed) as flat:
        listing = "cat /work/a /work/b /work/link; ls /work/d; test -e /usr/bin/yes || echo no-yes"
        assert flat.exec(listing).stdout == box.exec(listing).stdout == "3\n2\n2\nnew\nno-yes\n"


def test_incremental_snapshots_share_unchanged_files(box):
    # A running background process keeps the sandbox busy: snapshots copy (or link), never adopt.
    box.exec("sleep 1000 > /dev/null 2>&1 &")
    box.exec("mkdir -p /work/many && for i in $(seq 50); do echo $i > /work/many/$i; done")
    box.exec("sleep 0.1")  # let the files age past the freeze cache's racy-timestamp window
    first = box.snapshot()
    box.write_file("/work/many/7", "seven")
    second = box.snapshot()
    assert box.chain == []  # copied: the sandbox still runs on its own upper
    first_dir, second_dir = box.store.path(first), box.store.path(second)
    inode = lambda layer, name: os.stat(os.path.join(layer, "work/many", name)).st_ino  # noqa: E731
    assert inode(first_dir, "8") == inode(second_dir, "8")  # unchanged: hard-linked, not copied
    assert inode(first_dir, "7") != inode(second_dir, "7")
    [fork] = box.fork(second)
    with fork:
        assert fork.exec("cat /work/many/7 /work/many/8").stdout == "seven8\n"
    box.write_file("/work/many/7", "7\n")  # same size and content as at the first snapshot
    assert box.snapshot() == first  # content-addressed: back to the first id


def test_idle_snapshot_adopts_the_upper_and_keeps_it_immutable(sandbox_home):
    with Sandbox(limits=Limits(disk_mb=None)) as box:  # an upper on the store's disk can be adopted
        _adopt_and_check(box)


def _adopt_and_check(box):
    box.exec("mkdir -p /work/many && for i in $(seq 50); do echo $i > /work/many/$i; done")
    box.write_file("/work/unique", uuid.uuid4().hex)  # content no earlier test has frozen
    snapshot = box.snapshot()
    assert box.chain == [snapshot]  # the upper became the layer; a fresh upper sits on it
    assert box.exec("cat /work/many/8").stdout == "8\n"
    box.write_file("/work/many/8", "changed after the snapshot")
    layer_file = os.path.join(box.store.path(snapshot), "work", "many", "8")
    assert open(layer_file).read() == "8\n"
    [fork] = box.fork(snapshot)
    with fork:
        assert fork.exec("cat /work/many/8").stdout == "8\n"


def test_image_paths_that_overlay_cannot_parse_are_refused(tmp_path):
    odd = tmp_path / "a,b"
    odd.mkdir()
    with pytest.raises(ValueError, match="must not contain"):
        Image.from_dir(str(odd))


def test_supervisor_wait_works_with_descriptors_past_1024(box):
    """A process holding hundreds of sandboxes has file descriptors past 1024, where select() fails; waiting
    for a supervisor whose pidfd lies there must still work (it once raised 'filedescriptor out of range')."""
    import resource

    from k3.sandbox import local

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard open-file limit {hard} is below the 1,200 the test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1200 if soft == resource.RLIM_INFINITY else max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        supervisor = local.Supervisor()
        supervisor.wait_hello()
        assert supervisor._pidfd > 1024
        supervisor.kill()
        supervisor.wait()
        assert supervisor._pidfd is None and supervisor.process.returncode is not None
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
