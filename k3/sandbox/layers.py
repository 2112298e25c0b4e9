"""Immutable, content-addressed filesystem layers: what a snapshot is made of.

A sandbox's root is an overlay: a read-only base image, zero or more frozen layers, and one
writable upper directory. ``freeze`` copies an upper directory into a new layer whose id is the
SHA-256 of its parent's id and of every entry it holds (path, type, mode, owner, content), so the
same changes on the same parent always give the same id and are stored once.

Overlay's own markers are kept so that a layer means the same thing when it sits lower in a chain:
a whiteout (character device 0:0) hides a file of the layers below, and a directory marked opaque
(xattr ``trusted.overlay.opaque``) hides their whole directory.

Store layout under the sandbox home (see ``paths.py``)::

    layers/<id>/        the layer's files (an overlay lower directory; never written again)
    layers/<id>.json    {"id", "parent", "image", "created", "bytes", "files"}
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import shutil
import stat
import time
import uuid
from dataclasses import dataclass

from k3.sandbox import untrusted

OPAQUE_XATTR = "trusted.overlay.opaque"
ID_CHARS = 24  # hex digits kept in a layer id: short names keep the overlay mount option short
FRESH_NS = 50_000_000  # files changed this recently (ns) are not trusted to the freeze cache
# Apparent size (holes included) of the largest file a snapshot takes; holes are stored as holes,
# but hashing a hole costs as much as hashing data.
MAX_FILE_BYTES = 4 << 30


@dataclass
class Scan:
    """A walked and hashed upper directory, ready to be committed as layer ``layer_id``.

    to_copy: files that ``commit`` would have to read and copy (not shared with an earlier layer).
    """

    layer_id: str
    parent: str | None
    image: str
    upper: str
    entries: list
    total_bytes: int
    files: int
    to_copy: int
    fresh_after: int


@dataclass(frozen=True)
class LayerInfo:
    """Metadata of one frozen layer. ``image`` is the base image directory of its chain."""

    id: str
    parent: str | None
    image: str
    created: float
    bytes: int
    files: int


class LayerStore:
    """Content-addressed layers in ``<home>/layers``."""

    def __init__(self, home: str):
        self.home = home
        self.root = os.path.join(home, "layers")
        os.makedirs(self.root, exist_ok=True)

    def path(self, layer_id: str) -> str:
        return os.path.join(self.root, layer_id)

    def info(self, layer_id: str) -> LayerInfo:
        """Metadata of ``layer_id``; ValueError when the store has no such layer."""
        _check_id(layer_id)
        try:
            with open(os.path.join(self.root, layer_id + ".json")) as f:
                return LayerInfo(**json.load(f))
        except FileNotFoundError:
            raise ValueError(f"unknown snapshot {layer_id!r}: no layer with that id in {self.root}") from None

    def exists(self, layer_id: str) -> bool:
        return os.path.exists(os.path.join(self.root, layer_id + ".json"))

    def chain(self, layer_id: str | None) -> list[str]:
        """Layer ids from ``layer_id`` down to the first layer above the image (top first)."""
        ids = []
        while layer_id is not None:
            ids.append(layer_id)
            layer_id = self.info(layer_id).parent
        return ids

    def list(self) -> list[LayerInfo]:
        return [self.info(name[:-5]) for name in sorted(os.listdir(self.root)) if name.endswith(".json")]

    def freeze(self, upper: str, parent: str | None, image: str, cache: dict | None = None) -> str:
        """Copy the overlay upper directory ``upper`` into a new immutable layer; return its id."""
        return self.commit(self.scan(upper, parent, image, cache), cache)

    def scan(self, upper: str, parent: str | None, image: str, cache: dict | None = None) -> "Scan":
        """First half of ``freeze``: walk and hash ``upper``; nothing is written.

        The caller must keep writers out of ``upper`` while this runs (the sandbox is frozen or
        idle). One pass hashes everything; files are written only when the id is new, so freezing
        the same state twice costs a read, not a copy.

        ``cache`` (a dict the caller keeps per upper directory, empty at first) makes repeated
        snapshots incremental: a file whose inode, size, mode, owner, mtime and ctime are those it
        had at the previous freeze is neither read nor copied again, but hard-linked from the
        layer that already holds it (layers are immutable, so sharing their inodes is safe).
        """
        upper = upper.rstrip("/")
        digest = hashlib.sha256()
        digest.update(f"parent={parent or ''}\nimage={image}\n".encode())
        entries = []  # (relative path, stat, kind, payload[, digest]): what the second pass writes
        known = cache if cache is not None else {}
        fresh_after = time.time_ns() - FRESH_NS
        total_bytes, files, to_copy = 0, 0, 0
        for directory, dirnames, filenames in _walk_sorted(upper):
            rel_dir = directory[len(upper) + 1 :]
            for name in dirnames:
                rel = rel_dir + "/" + name if rel_dir else name
                source = directory + "/" + name
                st = os.lstat(source)
                opaque = _opaque(source)
                entries.append((rel, st, "dir", opaque))
                digest.update(_entry(rel, st, b"opaque=" + opaque))
            for name in filenames:
                rel = rel_dir + "/" + name if rel_dir else name
                source = directory + "/" + name
                st = os.lstat(source)
                if stat.S_ISREG(st.st_mode):
                    if st.st_size > MAX_FILE_BYTES:
                        raise untrusted.UntrustedFileError(
                            27, f"{st.st_size} bytes; a snapshot takes files up to {MAX_FILE_BYTES} bytes "
                            f"(holes count: truncate or delete it first)", "/" + rel)
                    signature = _signature(st)
                    hit = known.get(rel)
                    if hit is not None and hit[0] == signature:
                        content, payload = hit[1], hit[2]  # payload: the path of an identical layer file
                    else:
                        to_copy += 1
                        data = _read_small(source, st.st_size)
                        content = hashlib.sha256(data).digest() if data is not None else _hash_file(source)
                        payload = data
                    entries.append((rel, st, "file", payload))
                    total_bytes += st.st_size
                    files += 1
                elif stat.S_ISLNK(st.st_mode):
                    content = os.readlink(source).encode()
                    entries.append((rel, st, "link", content))
                elif _is_whiteout(st) or stat.S_ISFIFO(st.st_mode):
                    # Whiteouts are char devices 0:0; no other device node is kept (none can be
                    # made without CAP_MKNOD, and a layer must never carry one).
                    content = str(st.st_rdev).encode()
                    entries.append((rel, st, "node", None))
                else:
                    continue  # sockets do not survive a snapshot
                digest.update(_entry(rel, st, content))
                if stat.S_ISREG(st.st_mode):
                    entries[-1] += (content,)
        layer_id = digest.hexdigest()[:ID_CHARS]
        return Scan(layer_id, parent, image, upper, entries, total_bytes, files, to_copy, fresh_after)

    def commit(self, scan: "Scan", cache: dict | None = None, adopt: bool = False) -> str:
        """Second half of ``freeze``: store the scanned layer unless its id exists already.

        ``adopt=True`` renames the upper directory itself into the store instead of copying it:
        O(1), but the upper must never be written again (its overlay is about to be discarded).
        """
        layer_id, final = scan.layer_id, self.path(scan.layer_id)
        written = not self.exists(layer_id)
        if written:
            if adopt:
                # Copy-up left overlay's bookkeeping xattrs (origin, impure) on some entries;
                # overlay reads them on upper layers only (with index, metacopy and redirect_dir
                # off, as we mount it), so in a lower layer they are inert and stay.
                if os.path.exists(final):  # a half-written layer from a crash: replace it
                    untrusted.remove_tree(final)
                os.rename(scan.upper, final)
                _tame_adopted(final, scan.entries)
            else:
                self._write_layer(scan.upper, final, scan.entries)
            meta = LayerInfo(layer_id, scan.parent, scan.image, time.time(), scan.total_bytes, scan.files)
            tmp = os.path.join(self.root, f".{layer_id}.json.{uuid.uuid4().hex}")
            with open(tmp, "w") as f:
                json.dump(meta.__dict__, f)
            os.rename(tmp, final + ".json")  # the json appears last: a layer with metadata is complete
        if cache is not None:
            # A file changed in the same clock tick as it was read could keep its ctime: such
            # "racy" files are not remembered, so they are read again next time.
            cache.clear()
            for entry in scan.entries:
                rel, st, kind = entry[0], entry[1], entry[2]
                if kind == "file" and st.st_ctime_ns < scan.fresh_after:
                    # Link only from a layer written here: an older twin may differ in mtime.
                    cache[rel] = (_signature(st), entry[4], final + "/" + rel if written else None)
        return layer_id

    def _write_layer(self, upper: str, final: str, entries: list) -> None:
        staging = os.path.join(self.root, f".staging-{uuid.uuid4().hex}")
        os.mkdir(staging)
        try:
            for entry in entries:
                rel, st, kind, payload = entry[:4]
                target = staging + "/" + rel
                if kind == "dir":
                    os.mkdir(target)
                    if payload:
                        os.setxattr(target, OPAQUE_XATTR, payload)
                elif kind == "file":
                    if isinstance(payload, str):
                        try:
                            os.link(payload, target)  # same content and metadata, frozen before
                            continue
                        except FileNotFoundError:  # that layer was collected since: copy instead
                            payload = None
                    _write_file(upper + "/" + rel, target, payload, st)
                    continue  # metadata set through the open descriptor
                elif kind == "link":
                    os.symlink(payload.decode(), target)
                else:
                    os.mknod(target, st.st_mode, st.st_rdev)
                _copy_meta(st, target)
            for entry in reversed(entries):  # children first: their writes touch mtimes
                if entry[2] == "dir":
                    _copy_meta(entry[1], staging + "/" + entry[0])
            _copy_meta(os.lstat(upper), staging)
            if os.path.exists(final):  # a half-written layer from a crash: replace it
                untrusted.remove_tree(final)
            os.rename(staging, final)
        except BaseException:
            _remove_quietly(staging)
            raise

    def squash(self, chain: list[str], upper: str, image: str) -> str:
        """One layer equal to ``chain`` (top first) with ``upper`` on top, sitting right on the image.

        Overlay stacks at most a few hundred lower layers (and the mount option fits in one page),
        so a chain that has grown deep is flattened: applied bottom to top with overlay's rules,
        a whiteout deletes, an opaque directory replaces, anything else overwrites.
        """
        merged = os.path.join(self.root, f".squash-{uuid.uuid4().hex}")
        os.mkdir(merged)
        try:
            for source in [self.path(layer) for layer in reversed(chain)] + [upper]:
                _apply(source, merged)
            return self.freeze(merged, None, image)
        finally:
            _remove_quietly(merged)

    def remove(self, layer_id: str) -> None:
        """Delete one layer (metadata first, so a half-deleted layer is never seen as complete)."""
        _check_id(layer_id)
        try:
            os.unlink(os.path.join(self.root, layer_id + ".json"))
        except FileNotFoundError:
            pass
        _remove_quietly(self.path(layer_id))

    def export(self, layer_id: str) -> dict:
        """The layer and its ancestors as a picklable dict, to ship to another machine."""
        layers = []
        for one in self.chain(layer_id):
            buffer = io.BytesIO()
            base = self.path(one)
            with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
                # Entry by entry: tarfile's own recursion fails on very deep trees.
                for directory, _, filenames in untrusted.walk(base):
                    for path in [directory] + [os.path.join(directory, name) for name in filenames]:
                        tar.add(path, arcname=os.path.normpath("./" + os.path.relpath(path, base)), recursive=False)
            layers.append({"info": self.info(one).__dict__, "tar": buffer.getvalue(), "opaque": self._opaque_dirs(one)})
        return {"layers": layers}

    def import_(self, exported: dict, images: "list[str] | None" = None) -> str:
        """Store layers made by ``export`` (possibly on another machine); return the top id.

        The export is untrusted input: members are extracted with ``_layer_member`` (no path outside
        the layer, no link to outside, no device but whiteouts, no set-id bits), the chain must be
        consistent, each layer's content must hash to its id, and its image must be one of
        ``images`` (default: an image k3 built, see ``image.build_once``). ValueError says what was
        wrong; nothing is written outside ``layers/.staging-*``, which is removed on failure."""
        import tarfile

        layers = exported.get("layers") if isinstance(exported, dict) else None
        if not isinstance(layers, list) or not layers:
            raise ValueError("a snapshot export is a dict with a non-empty list 'layers' (made by LayerStore.export)")
        infos = [_import_info(layer, images) for layer in layers]
        for upper, lower in zip(infos, infos[1:] + [None]):
            if upper.parent != (lower.id if lower else None) or upper.image != infos[0].image:
                raise ValueError(f"forged snapshot export: layer {upper.id} names parent {upper.parent} and image "
                                 f"{upper.image}, but the chain has {lower.id if lower else None} on {infos[0].image}")
        for layer, info in reversed(list(zip(layers, infos))):
            if self.exists(info.id):
                continue
            staging = os.path.join(self.root, f".staging-{uuid.uuid4().hex}")
            os.mkdir(staging, 0o700)
            try:
                with tarfile.open(fileobj=io.BytesIO(layer["tar"])) as tar:
                    tar.extractall(staging, filter=_layer_member, numeric_owner=True)
                for rel in layer.get("opaque", []):
                    _set_opaque_beneath(staging, rel)
                scan = self.scan(staging, info.parent, info.image)
                if scan.layer_id != info.id:
                    raise ValueError(f"the content hashes to id {scan.layer_id}, not to its id")
            except (tarfile.TarError, OSError, TypeError, KeyError, ValueError) as error:
                _remove_quietly(staging)
                raise ValueError(f"forged or damaged snapshot export, layer {info.id}: {error}") from None
            except BaseException:
                _remove_quietly(staging)
                raise
            os.rename(staging, self.path(info.id))
            with open(self.path(info.id) + ".json", "w") as f:
                json.dump(info.__dict__, f)
        return infos[0].id

    def _opaque_dirs(self, layer_id: str) -> list[str]:
        base = self.path(layer_id)
        return [os.path.relpath(d, base) for d, _, _ in untrusted.walk(base) if _opaque(d)]


def _import_info(layer, images: "list[str] | None") -> LayerInfo:
    """The checked ``LayerInfo`` of one exported layer (ValueError when anything is off)."""
    try:
        info = LayerInfo(**layer["info"])
    except (TypeError, KeyError) as error:
        raise ValueError(f"forged snapshot export: a layer's info is not LayerInfo fields ({error})") from None
    _check_id(info.id)
    if info.parent is not None:
        _check_id(info.parent)
    if not isinstance(layer.get("tar"), bytes) or not isinstance(layer.get("opaque", []), list):
        raise ValueError(f"forged snapshot export: layer {info.id} needs 'tar' bytes and an 'opaque' list")
    _check_image(info.image, images)
    return info


def _check_image(image, images: "list[str] | None") -> None:
    """ValueError unless ``image`` is an allowed image directory (see ``LayerStore.import_``)."""
    if not isinstance(image, str) or not image.startswith("/") or os.path.normpath(image) != image:
        raise ValueError(f"forged snapshot export: image {image!r} is not a normalised absolute path")
    if images is not None:
        if image not in images:
            raise ValueError(f"snapshot export needs image {image}; this store accepts only {sorted(images)}")
        return
    if os.path.realpath(image) != image or not os.path.isfile(os.path.join(image, ".k3-image-complete")):
        raise ValueError(f"snapshot export names image {image!r}, which is not an image k3 built on this machine "
                         f"(pass images=[...] to import onto another image directory)")


def _layer_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile filter for imported layers: the ``data`` filter's path checks (nothing outside the
    layer, no hard link to outside), but symlinks may point anywhere (they resolve inside the
    sandbox), owners and modes are kept except set-id bits, and the only special files allowed are
    whiteouts (char 0:0) and FIFOs."""
    if member.ischr() or member.isblk() or member.isfifo():
        if not (member.isfifo() or (member.ischr() and member.devmajor == 0 and member.devminor == 0)):
            raise tarfile.SpecialFileError(member)  # a layer holds no device but whiteouts (char 0:0)
        tarfile.data_filter(member.replace(type=tarfile.REGTYPE, size=0, deep=False), dest)  # its path
        return member.replace(mode=member.mode & 0o777, deep=False)
    if member.issym():
        tarfile.data_filter(member.replace(type=tarfile.REGTYPE, linkname="", size=0, deep=False), dest)
        return member
    checked = tarfile.data_filter(member, dest)
    mode = member.mode & ~(stat.S_ISUID | stat.S_ISGID) if member.isfile() or member.islnk() else member.mode
    return checked.replace(mode=mode, uid=member.uid, gid=member.gid, uname="", gname="", deep=False)


def _set_opaque_beneath(staging: str, rel) -> None:
    """Mark ``staging/rel`` opaque, reaching it without following any link."""
    if not isinstance(rel, str):
        raise ValueError(f"an opaque directory is a relative path, got {rel!r}")
    parts = [part for part in rel.split("/") if part not in ("", ".")]
    if rel.startswith("/") or ".." in parts:
        raise ValueError(f"opaque directory {rel!r} is outside the layer")
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts:
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        os.setxattr(fd, OPAQUE_XATTR, b"y")
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        untrusted.remove_tree(path)
    except OSError:
        pass


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _clear(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        untrusted.remove_tree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _apply(source: str, merged: str) -> None:
    """Lay the overlay layer ``source`` over the flattened tree ``merged``."""
    for directory, dirnames, filenames in untrusted.walk(source):
        rel_dir = os.path.relpath(directory, source)
        target_dir = merged if rel_dir == "." else os.path.join(merged, rel_dir)
        for name in dirnames:
            src, dst = os.path.join(directory, name), os.path.join(target_dir, name)
            st = os.lstat(src)
            opaque = _opaque(src)
            if opaque or not os.path.isdir(dst) or os.path.islink(dst):
                _clear(dst)  # an opaque directory hides everything below it
                os.mkdir(dst)
                if opaque:
                    os.setxattr(dst, OPAQUE_XATTR, opaque)
            _copy_meta(st, dst)
        for name in filenames:
            src, dst = os.path.join(directory, name), os.path.join(target_dir, name)
            st = os.lstat(src)
            _clear(dst)
            if stat.S_ISREG(st.st_mode):
                shutil.copyfile(src, dst)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), dst)
            elif _is_whiteout(st) or stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode):
                os.mknod(dst, st.st_mode, st.st_rdev)  # a whiteout stays: it must still hide the image's file
            else:
                continue
            _copy_meta(st, dst)


def _check_id(layer_id: str) -> None:
    if not isinstance(layer_id, str) or len(layer_id) != ID_CHARS or any(c not in "0123456789abcdef" for c in layer_id):
        raise ValueError(f"snapshot id must be {ID_CHARS} lowercase hex digits, got {layer_id!r}")


def _walk_sorted(top: str):
    # Sorted so that the digest does not depend on directory order on disk; iterative, for trees
    # a sandbox nested deeper than Python's recursion limit.
    return untrusted.walk(top)


def _opaque(path: str) -> bytes:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False)
    except OSError:
        return b""


def _signature(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_size, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ctime_ns)


def _entry(rel: str, st: os.stat_result, content: bytes) -> bytes:
    head = f"{rel}\0{_stored_mode(st):o}\0{st.st_uid}\0{st.st_gid}\0{len(content)}\0".encode()
    return head + content + b"\n"


SMALL = 1 << 20  # files up to this size are held in memory between the two passes


def _read_small(path: str, size: int) -> bytes | None:
    if size > SMALL:
        return None
    fd, _ = _open_source(path)
    try:
        # No writer runs during a freeze, so the size from lstat is the size: stop there rather
        # than spend one more read per file on seeing EOF.
        data = os.read(fd, size)
        while len(data) < size:  # short reads are legal
            more = os.read(fd, size - len(data))
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    return data


def _stored_mode(st: os.stat_result) -> int:
    """The mode a layer keeps: a regular file loses setuid and setgid (see ``untrusted.safe_mode``)."""
    if stat.S_ISREG(st.st_mode):
        return stat.S_IFMT(st.st_mode) | untrusted.safe_mode(st.st_mode)
    return st.st_mode


def _open_source(path: str) -> tuple[int, os.stat_result]:
    # The upper directory was written by the sandbox: no link followed, no FIFO opened blocking.
    directory, name = os.path.split(path)
    return untrusted.open_beneath(directory, name, MAX_FILE_BYTES)


def _hash_file(path: str) -> bytes:
    fd, st = _open_source(path)
    try:
        return bytes.fromhex(untrusted.hash_fd(fd, st.st_size))
    finally:
        os.close(fd)


def _write_file(source: str, target: str, payload: bytes | None, st: os.stat_result) -> None:
    if payload is None:
        source_fd, source_st = _open_source(source)
        try:
            untrusted.copy_fd(source_fd, source_st.st_size, target, want_hash=False)  # holes stay holes
        finally:
            os.close(source_fd)
        fd = os.open(target, os.O_WRONLY | os.O_NOFOLLOW)
    else:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if payload is not None:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, untrusted.safe_mode(st.st_mode))
        os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(fd)


def _tame_adopted(final: str, entries: list) -> None:
    """Drop setuid/setgid from the regular files of an upper adopted as a layer."""
    for entry in entries:
        rel, st, kind = entry[0], entry[1], entry[2]
        if kind == "file" and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            fd, _ = untrusted.open_beneath(final, rel, MAX_FILE_BYTES)
            try:
                os.fchmod(fd, untrusted.safe_mode(st.st_mode))
            finally:
                os.close(fd)


def _copy_meta(st: os.stat_result, target: str) -> None:
    os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(target, stat.S_IMODE(_stored_mode(st)))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
