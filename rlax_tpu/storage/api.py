"""The storage API every component uses: the same calls on local paths, file:// and gs:// URLs.

Each function takes a URL, picks the backend by its scheme and reports a missing file as
FileNotFoundError naming that URL, and a gs:// URL that cannot be reached (no network, no
credentials, after the client's own retries) as StorageUnreachableError naming the URL and
what to check.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from types import ModuleType

from rlax_tpu.storage import gcs, local

_GS, _FILE = "gs://", "file://"


class StorageUnreachableError(OSError):
    """A gs:// URL could not be reached; the message names it and what to check."""


def is_remote(url: str) -> bool:
    """Whether `url` lives in object storage (gs://) rather than on a local filesystem."""
    return url.startswith(_GS)


def join(base: str, *parts: str) -> str:
    """`base` and `parts` joined by single slashes, keeping the scheme ("gs://b/run", "ckpt")."""
    if not base:
        raise ValueError("join: base must be a path or URL, got ''")
    pieces = [p.strip("/") for p in parts if p.strip("/")]
    if not pieces:
        return base
    head = base.rstrip("/")
    if not head or head.endswith(":"):  # "/", "gs://", "file:///": keep the slashes
        head = base
    return head + ("" if head.endswith("/") else "/") + "/".join(pieces)


def exists(url: str) -> bool:
    """Whether a file, or a directory (gs://: any object under the prefix), exists at `url`."""
    backend, path = _resolve(url)
    with _named(url):
        return backend.exists(path)


def size(url: str) -> int:
    """The size of the file at `url` in bytes."""
    backend, path = _resolve(url)
    with _named(url):
        return backend.size(path)


def read_bytes(url: str) -> bytes:
    backend, path = _resolve(url)
    with _named(url):
        return backend.read_bytes(path)


def read_range(url: str, start: int, length: int) -> bytes:
    """Exactly `length` bytes from offset `start`; EOFError if the file is shorter."""
    if start < 0 or length < 0:
        raise ValueError(
            f"read_range({url!r}): start and length must be >= 0, got {start}, {length}"
        )
    backend, path = _resolve(url)
    with _named(url):
        if length == 0:
            backend.size(path)  # still report a missing file
            return b""
        data = backend.read_range(path, start, length)
    if len(data) != length:
        raise EOFError(
            f"{url}: asked for bytes [{start}, {start + length}) but the file ends at "
            f"{start + len(data)}; the file is truncated or the offsets are wrong"
        )
    return data


def write_bytes(url: str, data: bytes) -> None:
    """Write `data` to `url` atomically (readers see the old file or the new one, never a part);
    missing parent directories are created."""
    backend, path = _resolve(url)
    with _named(url):
        backend.write_bytes(path, bytes(data))


def read_text(url: str, encoding: str = "utf-8") -> str:
    return read_bytes(url).decode(encoding)


def write_text(url: str, text: str, encoding: str = "utf-8") -> None:
    write_bytes(url, text.encode(encoding))


def listdir(url: str) -> list[str]:
    """Names (not paths) of the entries of the directory at `url`, sorted."""
    backend, path = _resolve(url)
    with _named(url):
        return backend.listdir(path)


def makedirs(url: str) -> None:
    """Create the directory `url` and its parents (no-op on gs://: directories are implicit)."""
    backend, path = _resolve(url)
    with _named(url):
        backend.makedirs(path)


def remove(url: str, *, recursive: bool = False) -> None:
    """Delete the file at `url`; with recursive=True, a directory and everything under it."""
    backend, path = _resolve(url)
    with _named(url):
        backend.remove(path, recursive)


def copy(src: str, dst: str) -> None:
    """Copy one file between any two locations; `dst` appears atomically."""
    (src_backend, src_path), (dst_backend, dst_path) = _resolve(src), _resolve(dst)
    with _named(src):
        if src_backend is local and dst_backend is local:
            local.copy_file(src_path, dst_path)
        elif src_backend is local:
            gcs.upload(src_path, dst_path)
        elif dst_backend is gcs:
            gcs.copy(src_path, dst_path)
        else:
            with local.atomic_target(dst_path) as tmp:
                gcs.download(src_path, tmp)


def copy_tree(src: str, dst: str) -> list[str]:
    """Copy every file under the directory `src` to the same relative path under `dst`
    (e.g. upload a model directory to gs://). Returns the relative paths copied, sorted."""
    backend, path = _resolve(src)
    with _named(src):
        files = backend.list_files(path)
    for rel in files:
        copy(join(src, rel), join(dst, rel))
    return files


def _resolve(url: str) -> tuple[ModuleType, str]:
    """The backend for `url` and the path it understands ("bucket/key" or a local path)."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"expected a local path, file:// or gs:// URL, got {url!r}")
    if url.startswith(_GS):
        path = url[len(_GS) :]
        if not path.split("/", 1)[0]:
            raise ValueError(f"{url!r} names no bucket; expected gs://BUCKET/PATH")
        return gcs, path
    if url.startswith(_FILE):
        return local, url[len(_FILE) :]
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise ValueError(
            f"{url!r}: scheme {scheme!r} is not supported; use a local path, file:// or gs://"
        )
    return local, url


@contextlib.contextmanager
def _named(url: str) -> Iterator[None]:
    """Re-raise FileNotFoundError with `url` (not a backend-internal path) as its filename,
    and a remote URL's connection failure as StorageUnreachableError."""
    try:
        yield
    except FileNotFoundError as e:
        if e.filename == url:
            raise
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", url) from e
    except (PermissionError, StorageUnreachableError):
        raise
    except OSError as e:  # aiohttp's connection errors are OSErrors
        if not is_remote(url):
            raise
        raise StorageUnreachableError(
            f"cannot reach {url}: {type(e).__name__}: {e}. Check this host's network, its "
            "Google credentials (`gcloud auth application-default login`, or the service "
            f"account of the VM or pod) and the bucket's name; {gcs.EMULATOR_ENV} sends "
            "gs:// to an emulator"
        ) from e
