"""Nothing a sandbox wrote is trusted on the host: one hostile state file (or layer file) per test.

The hostile code runs in the sandbox's REPL and swaps k3's own ``dump`` (the function that writes the
REPL's state file before a memory snapshot) for one that leaves something else at that path: a link
to a host file, a FIFO, a setuid file, a hard link it keeps. The host must not follow, block on,
keep or share any of them.
"""

import os
import stat
import threading

import pytest

from k3.sandbox import Limits, Sandbox, memory, untrusted
from k3.sandbox.local import SandboxError

# Runs in the REPL: wrap the server's dump so that ``AFTER`` (Python source using ``path``) runs
# right after the real state file is written, before the host takes it.
HOOK = """
import os, sys
_server = sys._getframe().f_back.f_globals
_real_dump = _server["dump"]
def _hostile_dump(path):
    answer = _real_dump(path)
    {after}
    return answer
_server["dump"] = _hostile_dump
"""


def _hook(after: str) -> str:
    return HOOK.format(after=after.strip().replace("\n", "\n    "))


def _store_files(scratch: str):
    for top in (memory.IMAGES, "layers"):
        for directory, _, files in untrusted.walk(os.path.join(scratch, top)):  # other tests nest deep
            for name in files:
                yield os.path.join(directory, name)


def _within(seconds: float, fn):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) when it takes longer."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the host call did not return within {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "host-secret.txt"
    path.write_text("HOST-SECRET-4711")
    path.chmod(0o600)
    return path


def _assert_secret_nowhere(box, secret_text: str) -> None:
    for path in _store_files(box.scratch):
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, "rb") as f:
                assert secret_text.encode() not in f.read(), path


def test_a_state_file_replaced_by_a_symlink_to_a_host_file_is_not_followed(box, secret):
    repl = box.repl()
    repl.run("x = 1")
    repl.run(_hook(f"os.unlink(path)\nos.symlink({str(secret)!r}, path)"))
    with pytest.raises(SandboxError, match="regular file|link"):
        box.snapshot(memory=True)
    _assert_secret_nowhere(box, "HOST-SECRET-4711")


def test_a_state_directory_replaced_by_a_symlink_to_a_host_directory_is_not_followed(box, secret):
    # The host directory holds a file under the state file's name: following the parent link finds it.
    os.rename(secret, secret.parent / "python.pkl")
    repl = box.repl()
    repl.run("x = 1")
    repl.run(_hook(f"import shutil\nshutil.rmtree(os.path.dirname(path))\nos.symlink({str(secret.parent)!r}, os.path.dirname(path))"))
    with pytest.raises(SandboxError, match="regular file|link|directory"):
        box.snapshot(memory=True)
    _assert_secret_nowhere(box, "HOST-SECRET-4711")


def test_a_hard_link_kept_in_the_sandbox_cannot_change_a_snapshot(box):
    repl = box.repl()
    repl.run("x = 'taken'")
    repl.run(_hook("os.link(path, '/tmp/keep.pkl')"))
    snapshot = box.snapshot(memory=True)
    # Rewrite the inode the sandbox still holds with a valid pickle of another value.
    rewrite = repl.run("import pickle\nwith open('/tmp/keep.pkl', 'r+b') as f:\n"
                       "    f.write(pickle.dumps({'x': 'forged'}))\n    f.truncate()")
    assert rewrite.ok, rewrite.stderr
    box.restore(snapshot)
    assert box.repl().run("x").value == "'taken'"


def test_a_state_file_replaced_by_a_fifo_does_not_hold_the_host(box):
    repl = box.repl()
    repl.run("x = 1")
    repl.run(_hook("os.unlink(path)\nos.mkfifo(path)"))
    with pytest.raises(SandboxError, match="regular file"):
        _within(30, lambda: box.snapshot(memory=True))


def test_a_setuid_state_file_is_stored_without_its_setuid_bit(box):
    repl = box.repl()
    repl.run("x = 1")
    repl.run(_hook("import shutil\nshutil.copyfile(sys.executable, path)\nos.chmod(path, 0o6755)"))
    try:
        box.snapshot(memory=True)
    except SandboxError:
        pass  # refusing the file is as good as storing it tamed
    for path in _store_files(box.scratch):
        mode = os.lstat(path).st_mode
        assert not mode & (stat.S_ISUID | stat.S_ISGID), (path, oct(mode))
    for top in (memory.IMAGES, "layers", "run"):
        assert stat.S_IMODE(os.stat(os.path.join(box.scratch, top)).st_mode) == 0o700, top


@pytest.mark.parametrize("files", [1, 40], ids=["copied", "adopted"])
def test_a_setuid_file_in_a_files_only_snapshot_loses_its_setuid_bit(sandbox_home, files):
    # 40 files on an upper on the store's disk: the idle sandbox's upper itself becomes the layer.
    with Sandbox(limits=Limits(disk_mb=None)) as box:
        for index in range(files):
            box.write_file(f"/work/f{index}", "x")
        box.exec("cp /bin/sh /work/sh && chmod 6755 /work/sh")
        snapshot = box.snapshot()
        assert (box.chain == [snapshot]) == (files == 40)  # adopted, or copied
        mode = os.lstat(os.path.join(box.store.path(snapshot), "work", "sh")).st_mode
        assert not mode & (stat.S_ISUID | stat.S_ISGID), oct(mode)


def test_a_memory_image_changed_after_the_snapshot_is_refused_on_restore(box):
    repl = box.repl()
    repl.run("x = 'taken'")
    snapshot = box.snapshot(memory=True)
    image_id = memory.manifest_in_chain(box.scratch, box.store.chain(snapshot))["image"]
    state = os.path.join(memory.image_dir(box.scratch, image_id), "root", memory.MEMORY_DIR.lstrip("/"), "python.pkl")
    with open(state, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises((SandboxError, PermissionError), match="changed|hash"):
        box.restore(snapshot)
