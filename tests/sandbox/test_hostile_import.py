"""Imports are untrusted input: a forged snapshot export fails with a clear error and writes nothing
outside the store. One forged property per test, each built from a genuine export."""

import io
import os
import tarfile

import pytest

from k3.sandbox import memory
from k3.sandbox.layers import LayerStore


@pytest.fixture
def exported(box):
    box.write_file("/work/a.txt", "genuine")
    snapshot = box.snapshot()
    return box.store.export(snapshot)


@pytest.fixture
def other_store(tmp_path):
    return LayerStore(str(tmp_path / "elsewhere"))


def _forge(exported: dict, members, opaque=None) -> dict:
    """``exported`` with its top layer's tar replaced by ``members`` [(TarInfo, bytes or None)]."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    layers = [dict(layer) for layer in exported["layers"]]
    layers[0]["tar"] = buffer.getvalue()
    if opaque is not None:
        layers[0]["opaque"] = opaque
    return {"layers": layers}


def _file(name: str, data: bytes = b"pwned"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def _nothing_outside(store: LayerStore, outside) -> None:
    assert not os.path.lexists(outside), f"the import wrote {outside}"
    assert not [name for name in os.listdir(store.root) if not name.startswith(".")], os.listdir(store.root)


def test_an_absolute_member_path_is_refused(exported, other_store, tmp_path):
    outside = tmp_path / "absolute-pwned"
    with pytest.raises(ValueError, match="export"):
        other_store.import_(_forge(exported, [_file(str(outside))]))
    _nothing_outside(other_store, outside)


def test_a_dot_dot_member_path_is_refused(exported, other_store, tmp_path):
    outside = tmp_path / "dotdot-pwned"
    with pytest.raises(ValueError, match="export"):
        other_store.import_(_forge(exported, [_file("../../../" + outside.name)]))
    _nothing_outside(other_store, tmp_path / "elsewhere" / outside.name)
    _nothing_outside(other_store, outside)


def test_a_member_written_through_a_symlink_member_is_refused(exported, other_store, tmp_path):
    target = tmp_path / "victim-dir"
    target.mkdir()
    with pytest.raises(ValueError, match="export"):
        other_store.import_(_forge(exported, [_link("escape", str(target)), _file("escape/pwned")]))
    _nothing_outside(other_store, target / "pwned")


def test_a_hard_link_to_a_host_file_is_refused(exported, other_store, tmp_path):
    victim = tmp_path / "host-file"
    victim.write_text("host")
    with pytest.raises(ValueError, match="export"):
        other_store.import_(_forge(exported, [_link("grab", str(victim), tarfile.LNKTYPE)]))
    assert os.stat(victim).st_nlink == 1


def test_a_device_node_is_refused(exported, other_store):
    disk = tarfile.TarInfo("disk")
    disk.type, disk.devmajor, disk.devminor = tarfile.BLKTYPE, 8, 0
    with pytest.raises(ValueError, match="export"):
        other_store.import_(_forge(exported, [(disk, None)]))


def test_an_opaque_directory_outside_the_layer_is_refused(exported, other_store, tmp_path):
    victim = tmp_path / "victim-xattr"
    victim.mkdir()
    with pytest.raises(ValueError, match="export"):
        other_store.import_(_forge(exported, [_file("work/a.txt")], opaque=[os.path.relpath(victim, tmp_path / "elsewhere" / "layers" / "x")]))
    with pytest.raises(OSError):
        os.getxattr(victim, "trusted.overlay.opaque")


def test_an_image_path_that_is_not_an_image_is_refused(exported, other_store):
    forged = {"layers": [dict(layer, info=dict(layer["info"], image="/")) for layer in exported["layers"]]}
    with pytest.raises(ValueError, match="image"):
        other_store.import_(forged)
    assert other_store.list() == []


def test_a_layer_whose_content_does_not_match_its_id_is_refused(exported, other_store):
    # Same id, other content: stored, it would stand in for the genuine layer wherever that id is used.
    with pytest.raises(ValueError, match="id"):
        other_store.import_(_forge(exported, [_file("work/a.txt", b"forged!")]))
    assert other_store.list() == []


def test_a_memory_image_with_a_bad_id_or_file_name_is_refused(tmp_path):
    scratch = str(tmp_path / "scratch")
    with pytest.raises(ValueError, match="hexadecimal"):
        memory.import_images(scratch, {"../../etc": {"python.pkl": b"x"}})
    with pytest.raises(ValueError, match="file name"):
        memory.import_images(scratch, {"ab12": {"../python.pkl": b"x"}})
    assert not os.path.exists(os.path.join(scratch, memory.IMAGES, "ab12"))
