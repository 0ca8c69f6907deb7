"""The files a build writes beside its bundle, and which of them a later build may remove.

Every file is written as a temporary ``.NAME.HOST-PID.*.partial`` beside its target, fsynced and
renamed into place (``atomic_file``). Its writer holds an exclusive ``flock`` on it from creation
to rename, so whether a partial is stale is the lock's answer, not the process id's: a process id
names another process, or none, in another PID namespace, but a lock is released only when its
holder closes it or dies. A partial nobody holds is a dead build's and is removed; partials named
for another machine are left alone, since a lock may not reach across a network file system.

Split weights (``NAME.weights.SHA.safetensors``) are named by content. A build holds a shared lock
on the one it uses from the moment it is in place (checked by content, rewritten when it differs)
until its bundle is; afterwards ``collect_weights`` removes the other ``NAME.weights.*`` files that
no bundle in the folder refers to and that no running build holds.

On a file system without ``flock`` a build still writes (unlocked), and nothing is removed: a
lock that cannot be tried cannot tell a dead build's file from a live one's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from aot import schema
from aot.errors import EnvError

LOCK_ATTEMPTS = 5  # a partial removed between its creation and its lock, or weights between rename and lock
HASH_CHUNK = 1 << 20
# A neighbour whose manifest is larger is not read, and every weights file is kept.
MAX_MANIFEST_BYTES = 16 << 20
ZIP_MAGIC = b"PK\x03\x04"


def host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A file that appears at ``path`` whole or not at all: written beside it under a lock,
    fsynced, renamed while still locked."""
    fd, tmp = _locked_partial(path)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


@contextlib.contextmanager
def weights_in_place(path: Path, data: bytes, sha256: str) -> Iterator[None]:
    """``path`` holding ``data`` (whose hash is ``sha256``) while the block runs: an existing file
    is kept only when its content hashes the same (a damaged one is rewritten), and a shared lock
    keeps other builds' ``collect_weights`` from removing it before the bundle that uses it is in
    place."""
    for _ in range(LOCK_ATTEMPTS):
        fd = _open_locked(path, fcntl.LOCK_SH)
        if fd is not None and _sha256(fd) == sha256:
            try:
                yield
            finally:
                os.close(fd)
            return
        if fd is not None:
            os.close(fd)
        write_atomic(path, data)
    raise EnvError(
        f"{path} changed under this build {LOCK_ATTEMPTS} times while it was put in place; "
        f"is another program writing it? Build again"
    )


def partial_pattern(bundle: Path) -> re.Pattern[str]:
    """The partials of ``bundle`` and of its split weights files, named for this machine."""
    targets = rf"{re.escape(bundle.name)}|{re.escape(bundle.stem)}\.weights\.[0-9a-f]{{16}}\.safetensors"
    return re.compile(rf"\.(?:{targets})\.{re.escape(host())}-\d+\.\w+\.partial")


def weights_pattern(bundle: Path) -> re.Pattern[str]:
    """The split weights files of ``bundle``: ``NAME.weights.<16 hex>.safetensors``."""
    return re.compile(rf"{re.escape(bundle.stem)}\.weights\.[0-9a-f]{{16}}\.safetensors")


def remove_stale_partials(path: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that dead builds of ``path`` (the bundle and its split weights)
    left beside it: those named for this machine that no process holds locked. Returns them."""
    path = Path(path)
    pattern = partial_pattern(path)
    removed = []
    for partial in sorted(_names(path.parent)):
        if pattern.fullmatch(partial):
            fd = _open_locked(path.parent / partial, fcntl.LOCK_EX | fcntl.LOCK_NB, follow=False)
            if fd is not None and _unlink_held(path.parent / partial, fd):
                removed.append(path.parent / partial)
    return removed


def collect_weights(bundle: str | os.PathLike) -> list[Path]:
    """Delete the ``NAME.weights.*.safetensors`` files beside ``bundle`` that no bundle in that
    folder refers to and no running build holds; nothing when a bundle there cannot be read (it
    may refer to any of them). Returns what was removed."""
    bundle = Path(bundle)
    pattern = weights_pattern(bundle)
    held: dict[Path, int] = {}
    try:
        for name in sorted(_names(bundle.parent)):
            if pattern.fullmatch(name):
                fd = _open_locked(bundle.parent / name, fcntl.LOCK_EX | fcntl.LOCK_NB, follow=False)
                if fd is not None:
                    held[bundle.parent / name] = fd
        # read only now: a build keeps its weights locked until its bundle is in place, so those
        # held here belong to no build in progress (one that comes later writes them again)
        referenced = referenced_weights(bundle.parent) if held else set()
        if referenced is None:
            return []
        return [p for p, fd in held.items() if p.name not in referenced and _unlink_held(p, fd, close=False)]
    finally:
        for fd in held.values():
            os.close(fd)


def referenced_weights(folder: Path) -> set[str] | None:
    """The external weights names of the bundles in ``folder``; None when one cannot be read."""
    names = set()
    try:
        neighbours = os.listdir(folder)
    except OSError:
        return None
    for name in neighbours:
        path = folder / name
        try:
            if name.endswith(".partial") or not path.is_file():
                continue
            with open(path, "rb") as f:
                if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
                    continue
            manifest = _manifest_of(path)
        except (OSError, ValueError, zipfile.BadZipFile, RecursionError):
            return None
        if isinstance(manifest, dict) and manifest.get("format") == schema.FORMAT_NAME:
            names.add(str(manifest.get("external_weights", "")))
    return names


def is_bundle(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a zip archive holding a bundle manifest (what a build may replace)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return schema.MANIFEST_PATH in zf.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def _manifest_of(path: Path) -> object:
    """The parsed manifest of a zip at ``path``, or None when it has none (not a bundle)."""
    with zipfile.ZipFile(path) as zf:
        try:
            info = zf.getinfo(schema.MANIFEST_PATH)
        except KeyError:
            return None
        if info.file_size > MAX_MANIFEST_BYTES:
            raise ValueError(f"{path}: manifest of {info.file_size} bytes")
        return json.loads(zf.read(info))


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _open_locked(path: Path, operation: int, follow: bool = True) -> int | None:
    """A descriptor of the regular file at ``path`` holding ``flock(operation)``, or None when
    there is none, the lock is not granted (``LOCK_NB``), or the file was replaced meanwhile.
    Where the file system has no locks, a blocking request goes on unlocked and a ``LOCK_NB`` one
    (asked only to remove the file) is refused."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        granted = _flock(fd, operation) or not operation & fcntl.LOCK_NB
        if granted and stat.S_ISREG(os.fstat(fd).st_mode) and _same_file(fd, path):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _flock(fd: int, operation: int) -> bool:
    """``flock``; False where the file system has no such locks. A lock held by another process
    raises ``BlockingIOError`` under ``LOCK_NB``."""
    try:
        fcntl.flock(fd, operation)
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            return False
        raise
    return True


def _unlink_held(path: Path, fd: int, close: bool = True) -> bool:
    """Unlink ``path``, which ``fd`` holds locked; True when it was removed."""
    try:
        path.unlink()
        return True
    except OSError:
        return False
    finally:
        if close:
            os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, HASH_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def _locked_partial(path: Path) -> tuple[int, str]:
    """A temporary file in the target's directory (so ``os.replace`` is atomic), locked, with the
    permissions a plain ``open`` would give it; stale ones of dead builds are removed first."""
    remove_stale_partials(path)
    for _ in range(LOCK_ATTEMPTS):
        fd, tmp = tempfile.mkstemp(
            prefix=f".{path.name}.{host()}-{os.getpid()}.", suffix=".partial", dir=path.parent
        )
        _flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, Path(tmp)):  # not removed by another build between mkstemp and flock
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)
            return fd, tmp
        os.close(fd)
    raise EnvError(
        f"temporary files beside {path} vanish as they are made; is another program removing them?"
    )


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (the new directory entry survives a power loss)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
