"""Files written so that a reader never finds half of one: a hidden temporary sibling, fsync, rename.

    temp = write_temp(path, write)     # .<name>.tmp-<8 hex>, beside path: the bytes of write(fd), fsynced
    replace(temp, path)                # atomic on POSIX: a reader opens the old file or the new one
    fsync_directory(path.parent)       # the rename itself survives a power cut

A temporary name starts with "." and ends ".tmp-<8 hex>" (HIDDEN), so it matches no checkpoint name
(model.safetensors, model-*-of-*.safetensors, *.safetensors globs): after a SIGKILL it is debris a reader
never takes, which the next save removes (hidden_for). Every write goes through write_all (os.write in a
loop): one place where a full disk (ENOSPC), a file-size limit (EFBIG) or a test's injected error surfaces.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

# a hidden sibling of a file of ours: "tmp" a new file not yet renamed in, "old" a link keeping an old file
HIDDEN = re.compile(r"\..+\.(tmp|old)-[0-9a-f]{8}")


def hidden_name(path: Path, kind: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{kind}-{secrets.token_hex(4)}")


def hidden_for(name: str) -> str | None:
    """The file a hidden name stands for (".a.old-<hex>" -> "a", "..a.old-<hex>.old-<hex>" -> "a"), or None
    if `name` is not a hidden name of ours."""
    if HIDDEN.fullmatch(name) is None:
        return None
    while (match := HIDDEN.fullmatch(name)) is not None:
        name = name[1 : match.start(1) - 1]
    return name


def write_all(fd: int, data) -> None:
    """All of `data` (bytes or a buffer) to the descriptor, however many os.write calls that takes."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def write_temp(path: str | os.PathLike, write: Callable[[int], None]) -> Path:
    """A new hidden sibling of `path` holding what write(fd) writes, flushed to disk (fsync); removed again
    if anything fails (the exception propagates). Returns its path, for replace."""
    temp = hidden_name(Path(path))
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            write(fd)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:  # KeyboardInterrupt too: no debris
        remove(temp)
        raise
    return temp


def write_bytes_temp(path: str | os.PathLike, data: bytes) -> Path:
    return write_temp(path, lambda fd: write_all(fd, data))


def replace(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rename source over target in one step (same directory, so the same filesystem)."""
    os.replace(source, target)


def link(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """A second name for source's file (no bytes copied; the old file stays readable under either name)."""
    os.link(source, target)


def keep(path: str | os.PathLike) -> Path:
    """A hidden second name (".<name>.old-<hex>") for the existing file `path`: a hard link, or a copy on a
    filesystem without them."""
    kept = hidden_name(Path(path), "old")
    try:
        link(path, kept)
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        with open(path, "rb") as source:
            copied = write_temp(path, lambda fd: _copy(source, fd))
        replace(copied, kept)
    return kept


def _copy(source, fd: int) -> None:
    while chunk := source.read(1 << 24):
        write_all(fd, chunk)


def remove(path: str | os.PathLike) -> None:
    """Unlink path if it exists."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make the directory's entries (renames, new and removed names) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
