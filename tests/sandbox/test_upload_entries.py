"""What an upload sends, the same for both backends (k3.sandbox.backend.upload_entries); no sandbox needed."""

import os

import pytest

from k3.sandbox.backend import upload_entries


def test_a_tree_gives_its_directories_and_files_with_their_modes(tmp_path):
    (tmp_path / "pkg" / "src").mkdir(parents=True)
    (tmp_path / "pkg" / "src" / "run.sh").write_text("echo hi\n")
    (tmp_path / "pkg" / "src" / "run.sh").chmod(0o750)
    entries = {e["path"]: e for e in upload_entries(str(tmp_path / "pkg"), "/work/pkg")}
    assert sorted(entries) == ["/work/pkg", "/work/pkg/src", "/work/pkg/src/run.sh"]
    assert entries["/work/pkg/src"]["dir"] is True
    assert entries["/work/pkg/src/run.sh"]["data"] == b"echo hi\n"
    assert entries["/work/pkg/src/run.sh"]["mode"] == 0o750


def test_a_link_inside_a_tree_is_not_followed(tmp_path):
    (tmp_path / "secret").write_text("host secret")
    (tmp_path / "pkg").mkdir()
    os.symlink(tmp_path / "secret", tmp_path / "pkg" / "leak")
    entries = upload_entries(str(tmp_path / "pkg"), "/work/pkg")
    assert [e["path"] for e in entries] == ["/work/pkg"]


def test_a_single_file_goes_to_the_target_path(tmp_path):
    (tmp_path / "one.txt").write_text("one")
    assert upload_entries(str(tmp_path / "one.txt"), "/work/x") == [
        {"path": "/work/x", "data": b"one", "mode": os.stat(tmp_path / "one.txt").st_mode & 0o7777}]


def test_a_missing_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="existing file or directory"):
        upload_entries(str(tmp_path / "none"), "/work/x")
