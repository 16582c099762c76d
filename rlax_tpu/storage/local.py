"""Local-filesystem backend of rlax_tpu.storage (plain paths and file:// URLs).

Writes are atomic: data goes to a temporary file in the target directory, is fsynced and
then renamed over the target, so a reader (or a resumed run) never sees a partial file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

# Suffix of in-flight temporary files; listdir hides them.
TMP_SUFFIX = ".rlax-tmp"
_UMASK = os.umask(0)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK  # what open(path, "wb") would have created


def exists(path: str) -> bool:
    return os.path.exists(path)


def size(path: str) -> int:
    return os.path.getsize(path)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_range(path: str, start: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(length)


def write_bytes(path: str, data: bytes) -> None:
    with atomic_target(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def listdir(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.endswith(TMP_SUFFIX))


def list_files(path: str) -> list[str]:
    """Relative paths ("a/b.bin") of every file under the directory `path`."""
    if not os.path.isdir(path):
        raise FileNotFoundError(path) if not os.path.exists(path) else NotADirectoryError(path)
    out = []
    for root, _, names in os.walk(path):
        rel = os.path.relpath(root, path)
        out += [n if rel == "." else f"{rel}/{n}" for n in names if not n.endswith(TMP_SUFFIX)]
    return sorted(out)


def makedirs(path: str) -> None:
    os.makedirs(path, exist_ok=True)


def remove(path: str, recursive: bool) -> None:
    if recursive and os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def copy_file(src: str, dst: str) -> None:
    with atomic_target(dst) as tmp:
        shutil.copyfile(src, tmp)


@contextlib.contextmanager
def atomic_target(path: str) -> Iterator[str]:
    """A temporary path next to `path`, renamed over it (after fsync) if the block succeeds."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        yield tmp
        _fsync(tmp)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable where supported
        _fsync(parent)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
