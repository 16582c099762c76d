"""The persistent copy of the parameter server's versions: TensorStore zarr3 arrays and the
JSON files that commit them (DESIGN §3: "written continuously, so a lost server restarts from
storage"). `VersionStore` (store.py) decides what to write and when; this module knows where
and how, and what a restart finds.

Storage layout under the store's root (under `replica-I-of-R/` when there are R > 1 replicas):

    LAYOUT.json                       the first version's pieces: every version must match them
    CONSUMERS.json                    consumer -> oldest version it still needs (survives restarts)
    versions/0000000042/MANIFEST.json pieces, their sha256 digests, the version digest
    versions/0000000042/00003-layers.0.wq/zarr.json, c/0/0, ...   one zarr3 array per piece

zarr3 rather than ocdbt: one self-contained directory per version makes garbage collection and
crash cleanup a plain recursive delete, whereas ocdbt shares data files between versions and
needs its own compaction to give deleted bytes back.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorstore as ts

from rlax_tpu import storage
from rlax_tpu.api import tensors
from rlax_tpu.api.tensors import Piece
from rlax_tpu.param_server.records import VersionRecord, without_digests

FORMAT = "rlax_tpu.param_server/1"
# zarr chunks of at most this size: TensorStore writes them in parallel and a box read touches
# only the chunks it overlaps. Dimensions are split from the first, so chunks are row blocks.
CHUNK_TARGET_BYTES = 8 * 2**20
_COLD_HANDLES = 256  # opened persistent arrays kept for reads of versions not in memory


@dataclasses.dataclass(frozen=True)
class Recovered:
    """What a restart finds on storage: the committed versions, the layout, the consumers."""

    versions: dict[int, VersionRecord]
    layout: dict[str, Piece] | None
    consumers: dict[str, int]


class PersistentCopy:
    """The versions of one replica on storage under `root` (a directory, file:// or gs://)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._kvstore = _kvstore(root)
        # Shared by every persistent array (connection pools, I/O concurrency limits).
        self._context = ts.Context()
        self._lock = threading.Lock()  # the opened arrays below; held briefly
        self._cold: collections.OrderedDict[tuple[int, str], ts.TensorStore] = (
            collections.OrderedDict()
        )
        self.layout_written = False  # LAYOUT.json is on storage

    def url(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def version_url(self, version: int) -> str:
        return self.url("versions", f"{version:010d}")

    def _manifest_url(self, version: int) -> str:
        return storage.join(self.version_url(version), "MANIFEST.json")

    def _array_kvstore(self, version: int, key: str) -> dict[str, Any]:
        prefix = f"versions/{version:010d}/{key}/"
        return {**self._kvstore, "path": self._kvstore["path"] + prefix}

    # -- writes ----------------------------------------------------------------------------
    def write_array(self, version: int, key: str, piece: Piece, data: np.ndarray) -> None:
        spec = _array_spec(self._array_kvstore(version, key), piece)
        # Not delete_existing: its ranged delete wipes a whole bucket on the GCS emulator.
        array = ts.open(spec, create=True, context=self._context).result()
        array.write(data).result()

    def write_manifest(self, record: VersionRecord) -> None:
        """Commit `record` on storage: call only once every array of it is written."""
        storage.write_text(self._manifest_url(record.version), _manifest_json(record))

    def write_layout(self, version: int, pieces: dict[str, Piece]) -> None:
        storage.write_text(self.url("LAYOUT.json"), _layout_json(version, pieces))
        self.layout_written = True

    def write_consumers(self, consumers: dict[str, int]) -> None:
        text = json.dumps({"format": FORMAT, "consumers": consumers}, sort_keys=True)
        storage.write_text(self.url("CONSUMERS.json"), text)

    def delete(self, version: int) -> None:
        """Manifest first: a crash half-way leaves an uncommitted directory, removed on restart."""
        for url, recursive in (
            (self._manifest_url(version), False),
            (self.version_url(version), True),
        ):
            try:
                storage.remove(url, recursive=recursive)
            except FileNotFoundError:
                pass

    # -- reads -----------------------------------------------------------------------------
    def open_array(self, record: VersionRecord, path: str) -> ts.TensorStore:
        """The persistent array of `path` in `record` (opened handles are kept, LRU)."""
        key = (record.version, path)
        with self._lock:
            array = self._cold.get(key)
            if array is not None:
                self._cold.move_to_end(key)
                return array
        spec = {
            "driver": "zarr3",
            "kvstore": self._array_kvstore(record.version, record.keys[path]),
            "fill_missing_data_reads": False,
        }
        array = ts.open(spec, open=True, context=self._context).result()
        with self._lock:
            self._cold[key] = array
            while len(self._cold) > _COLD_HANDLES:
                self._cold.popitem(last=False)
        return array

    def forget(self, versions: Iterable[int]) -> None:
        """Close the opened arrays of `versions` (they are being deleted)."""
        versions = set(versions)
        with self._lock:
            for key in [k for k in self._cold if k[0] in versions]:
                del self._cold[key]

    def recover(self) -> Recovered:
        """The committed versions on storage; uncommitted leftovers are deleted."""
        try:
            names = storage.listdir(self.url("versions"))
        except FileNotFoundError:
            names = []
        versions: dict[int, VersionRecord] = {}
        for name in names:
            if not name.isdigit():
                continue
            version = int(name)
            try:
                manifest = json.loads(storage.read_text(self._manifest_url(version)))
            except FileNotFoundError:  # a publish that never committed, or a half-done GC
                self.delete(version)
                continue
            versions[version] = _record_from_manifest(manifest)
            versions[version].persisted_event.set()
        first_layout = None
        if storage.exists(self.url("LAYOUT.json")):
            first_layout = _pieces_from_json(json.loads(storage.read_text(self.url("LAYOUT.json"))))
        elif versions:  # the commit of the first version died before LAYOUT.json
            first = versions[min(versions)]
            storage.write_text(self.url("LAYOUT.json"), _layout_json(first.version, first.pieces))
            first_layout = without_digests(first.pieces)
        self.layout_written = first_layout is not None
        consumers: dict[str, int] = {}
        if storage.exists(self.url("CONSUMERS.json")):
            consumers = json.loads(storage.read_text(self.url("CONSUMERS.json")))["consumers"]
        return Recovered(versions, first_layout, consumers)


def array_keys(pieces: dict[str, Piece]) -> dict[str, str]:
    """A directory name per piece: its rank in path order (unique) and a readable path."""
    return {
        p: f"{i:05d}-{re.sub(r'[^A-Za-z0-9_.-]+', '.', p)[:80]}"
        for i, p in enumerate(sorted(pieces))
    }


def read_array(source: ts.TensorStore, dtype: str) -> np.ndarray:
    """`source` read into a new numpy array: dtype[source shape].

    Not `source.read()`: numpy backs large arrays with transparent huge pages (where the
    kernel offers them, `madvise` mode included) and TensorStore's own result buffer does
    not. Reading 100 MB from a memory kvstore this way takes about a quarter of the page
    faults and half the CPU time, which is most of a cold pull's store read.
    """
    out = np.empty(source.shape, tensors.parse_dtype(dtype))
    ts.array(out, copy=False, write=True).write(source).result()
    return out


def _kvstore(url: str) -> dict[str, Any]:
    """The TensorStore kvstore spec of a storage URL (its "path" ends in "/" or is "")."""
    if url.startswith("gs://"):
        bucket, _, path = url[len("gs://") :].partition("/")
        path = path.strip("/")
        return {"driver": "gcs", "bucket": bucket, "path": path + "/" if path else ""}
    if url.startswith("file://"):
        url = url[len("file://") :]
    return {"driver": "file", "path": os.path.abspath(url) + "/"}


def _array_spec(kvstore: dict[str, Any], piece: Piece) -> dict[str, Any]:
    shape = tensors.box_shape(piece.domain)
    chunk = [max(1, n) for n in shape]
    itemsize = tensors.parse_dtype(piece.dtype).itemsize
    for d in range(len(chunk)):
        while chunk[d] > 1 and math.prod(chunk) * itemsize > CHUNK_TARGET_BYTES:
            chunk[d] = -(-chunk[d] // 2)
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": list(shape),
            "data_type": piece.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        },
        # A missing chunk is an error, never zeros: a version deleted under a reader, or a
        # damaged copy, must not be served as zeros. So all-zero chunks must be stored too.
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,
    }


def _piece_json(p: Piece) -> dict[str, Any]:
    return {
        "path": p.path,
        "dtype": p.dtype,
        "shape": list(p.shape),
        "domain": [list(b) for b in p.domain],
    }


def _piece_from_json(d: dict[str, Any]) -> Piece:
    domain = tuple((int(lo), int(hi)) for lo, hi in d["domain"])
    return Piece(d["path"], d["dtype"], tuple(d["shape"]), domain, d.get("digest", ""))


def _pieces_from_json(d: dict[str, Any]) -> dict[str, Piece]:
    return {p["path"]: _piece_from_json(p) for p in sorted(d["pieces"], key=lambda p: p["path"])}


def _layout_json(version: int, pieces: dict[str, Piece]) -> str:
    body = {
        "format": FORMAT,
        "first_version": version,
        "pieces": [_piece_json(p) for p in pieces.values()],
    }
    return json.dumps(body, indent=1)


def _manifest_json(r: VersionRecord) -> str:
    pieces = [
        {**_piece_json(p), "digest": p.digest, "key": r.keys[p.path]} for p in r.pieces.values()
    ]
    body = {
        "format": FORMAT,
        "version": r.version,
        "version_digest": r.digest,
        "num_bytes": r.num_bytes,
        "pieces": pieces,
    }
    return json.dumps(body, indent=1)


def _record_from_manifest(m: dict[str, Any]) -> VersionRecord:
    if m.get("format") != FORMAT:
        raise ValueError(
            f"MANIFEST.json of version {m.get('version')} has format {m.get('format')!r}, "
            f"expected {FORMAT!r}: it was written by another version of rlax_tpu"
        )
    pieces = _pieces_from_json(m)
    keys = {p["path"]: p["key"] for p in m["pieces"]}
    return VersionRecord(int(m["version"]), m["version_digest"], pieces, keys, persisted=True)
