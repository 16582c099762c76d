"""Google Cloud Storage backend of rlax_tpu.storage (gs:// URLs), via gcsfs.

Paths here are "bucket/key". A single-object upload is atomic on GCS, so readers never see
partial objects. When STORAGE_EMULATOR_HOST is set (tests, local runs), every call goes to
that emulator without credentials.
"""

from __future__ import annotations

import os
from typing import Any

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"


def filesystem() -> Any:
    """The gcsfs filesystem for the current environment (fsspec caches the instance)."""
    # The plain JSON-API filesystem, not gcsfs's default ExtendedGcsFileSystem: that one first
    # asks the gRPC Storage Control API for the bucket layout (zonal/HNS), which emulators do
    # not serve (it hangs in retries). Run directories live in standard buckets.
    from gcsfs.core import GCSFileSystem

    # Listings are not cached: other processes write the same run directory.
    kwargs: dict[str, Any] = {"use_listings_cache": False}
    emulator = os.environ.get(EMULATOR_ENV, "")
    if emulator and emulator != "default":
        # gcsfs reads the variable too, but would still look for Google credentials.
        kwargs["endpoint_url"] = emulator if "://" in emulator else f"http://{emulator}"
        kwargs["token"] = "anon"
    return GCSFileSystem(**kwargs)


def exists(path: str) -> bool:
    return filesystem().exists(path)


def size(path: str) -> int:
    return filesystem().size(path)


def read_bytes(path: str) -> bytes:
    return filesystem().cat_file(path)


def read_range(path: str, start: int, length: int) -> bytes:
    try:
        return filesystem().cat_file(path, start=start, end=start + length)
    except OSError as e:
        if getattr(e, "code", None) == 416:  # range starts past the end of the object
            return b""
        raise


def write_bytes(path: str, data: bytes) -> None:
    filesystem().pipe_file(path, data)


def listdir(path: str) -> list[str]:
    path = path.rstrip("/")
    entries = filesystem().ls(path, detail=True)
    if len(entries) == 1 and entries[0]["name"] == path and entries[0]["type"] == "file":
        raise NotADirectoryError(path)
    # Skip the directory's own marker object ("run/"), if a tool created one.
    names = {e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["name"] != path}
    if not names and "/" in path:  # a prefix with no objects; an empty bucket lists as []
        raise FileNotFoundError(path)
    return sorted(names)


def list_files(path: str) -> list[str]:
    """Relative keys ("a/b.bin") of every object under the prefix `path`/."""
    prefix = path.rstrip("/") + "/"
    found = filesystem().find(prefix)
    if not found:
        raise FileNotFoundError(path)
    return sorted(p[len(prefix) :] for p in found if p.startswith(prefix) and not p.endswith("/"))


def makedirs(path: str) -> None:
    """GCS has no directories: a prefix exists once an object is written under it."""


def remove(path: str, recursive: bool) -> None:
    fs = filesystem()
    if recursive and fs.isdir(path):
        fs.rm(path.rstrip("/"), recursive=True)
    else:
        fs.rm_file(path)


def upload(local_path: str, path: str) -> None:
    filesystem().put_file(local_path, path)


def download(path: str, local_path: str) -> None:
    filesystem().get_file(path, local_path)


def copy(src: str, dst: str) -> None:
    filesystem().cp_file(src, dst)
