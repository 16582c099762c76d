"""VersionStore in-process: atomic publish, immutability, layout checks, retention, restart."""

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from rlax_tpu import storage
from rlax_tpu.api import tensors as layout
from rlax_tpu.api.param_server import (
    InvalidPublishError,
    InvalidReadError,
    LayoutMismatchError,
    PublishInProgressError,
    StorageFailedError,
    VersionConflictError,
    VersionNotFoundError,
)
from rlax_tpu.api.tensors import Piece
from rlax_tpu.param_server import VersionStore


def tree(seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny model: bfloat16 with arbitrary bit patterns (NaNs, -0, subnormals), float32, int32."""
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.integers(0, 2**16, (8, 4), dtype=np.uint16).view(ml_dtypes.bfloat16),
        "layers/0/wq": rng.standard_normal((6, 5)).astype(np.float32),
        "step": np.array(seed, np.int32),
    }


def pieces_of(arrays, boxes=None, shapes=None) -> list[Piece]:
    """Pieces for `arrays`; `boxes`/`shapes` make an array a shard of a larger one."""
    boxes, shapes = boxes or {}, shapes or {}
    return [
        Piece(
            path,
            layout.dtype_name(a.dtype),
            tuple(shapes.get(path, a.shape)),
            boxes.get(path, layout.full_box(a.shape)),
            layout.digest_bytes(layout.to_bytes(a)),
        )
        for path, a in arrays.items()
    ]


def send(txn, arrays, chunk_bytes=16):
    for path, a in arrays.items():
        data = layout.to_bytes(a)
        for offset in range(0, len(data), chunk_bytes):
            txn.write(path, offset, data[offset : offset + chunk_bytes])


def publish(store, version, arrays, **piece_kwargs):
    """Publish and wait for the persistent copy (the tests below are about what is on
    storage; the ones on persisting in the background publish without waiting)."""
    pieces = pieces_of(arrays, **piece_kwargs)
    txn = store.begin_publish(version, pieces, layout.version_digest(pieces))
    send(txn, arrays)
    result = txn.commit()
    if store.storage_url is not None:
        assert store.wait_persisted(version, timeout_s=30), store.persist_error
    return result


def bits(a):
    return np.asarray(a).reshape(-1).view(np.uint8).tobytes()


def assert_version(store, version, arrays):
    for path, a in arrays.items():
        got = store.read(version, path)
        assert got.dtype == a.dtype and got.shape == a.shape and bits(got) == bits(a), path


def version_dirs(root) -> list[str]:
    return sorted(os.listdir(root / "versions")) if (root / "versions").exists() else []


@pytest.fixture(params=["memory", "disk"])
def store_url(request, tmp_path):
    return None if request.param == "memory" else str(tmp_path / "params")


# -- publish ---------------------------------------------------------------------------------
def test_round_trip_is_bit_exact_for_bfloat16_float32_int32(store_url):
    store = VersionStore(store_url, hot_versions=2)
    result = publish(store, 0, tree(0))
    assert not result.already_present
    assert result.version_digest == layout.version_digest(pieces_of(tree(0)))
    assert result.bytes_received == sum(a.nbytes for a in tree(0).values())
    assert_version(store, 0, tree(0))
    [info] = store.versions()
    assert (info.version, info.in_memory, info.persisted) == (0, True, store_url is not None)


def test_version_is_invisible_until_commit(store_url):
    store = VersionStore(store_url, hot_versions=2)
    pieces = pieces_of(tree(0))
    txn = store.begin_publish(0, pieces, layout.version_digest(pieces))
    send(txn, tree(0))
    assert store.versions() == []
    with pytest.raises(VersionNotFoundError):
        store.read(0, "step")
    txn.commit()
    assert [v.version for v in store.versions()] == [0]


def test_aborted_publish_leaves_no_trace(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    publish(store, 0, tree(0))
    pieces = pieces_of(tree(1))
    txn = store.begin_publish(1, pieces, layout.version_digest(pieces))
    send(txn, tree(1))  # every piece complete, in memory; storage is written after commit
    assert version_dirs(tmp_path) == ["0000000000"]
    txn.abort()
    assert version_dirs(tmp_path) == ["0000000000"]
    assert [v.version for v in store.versions()] == [0]
    publish(store, 1, tree(1))  # the version is free again
    assert_version(store, 1, tree(1))


def test_failed_publish_aborts_and_leaves_no_trace(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    publish(store, 0, tree(0))
    arrays = tree(1)
    pieces = pieces_of(arrays)
    txn = store.begin_publish(1, pieces, layout.version_digest(pieces))
    send(txn, {"embed": arrays["embed"]})
    with pytest.raises(InvalidPublishError, match="'layers/0/wq'.*sha256"):
        send(txn, {"layers/0/wq": arrays["layers/0/wq"] + 1, "step": arrays["step"]})
        txn.commit()  # the bytes of wq are not the declared ones; hashing may end only here
    assert version_dirs(tmp_path) == ["0000000000"]
    with pytest.raises(InvalidPublishError, match="aborted"):
        txn.commit()
    assert [v.version for v in store.versions()] == [0]


def test_commit_with_missing_bytes_names_the_array(store_url):
    store = VersionStore(store_url, hot_versions=2)
    arrays = tree(0)
    pieces = pieces_of(arrays)
    txn = store.begin_publish(0, pieces, "")
    send(txn, {"embed": arrays["embed"], "step": arrays["step"]})
    txn.write("layers/0/wq", 0, layout.to_bytes(arrays["layers/0/wq"])[:40])
    with pytest.raises(InvalidPublishError, match=r"'layers/0/wq' has 40 of 120 bytes"):
        txn.commit()
    assert store.versions() == []


@pytest.mark.parametrize(
    ("offset", "size", "match"),
    [(100, 40, "outside the piece"), (-1, 4, "outside the piece"), (8, 4, "overlap")],
)
def test_bytes_outside_a_piece_or_sent_twice_are_rejected(offset, size, match):
    store = VersionStore(None, hot_versions=2)
    pieces = pieces_of(tree(0))
    txn = store.begin_publish(0, pieces, "")
    txn.write("layers/0/wq", 0, bytes(16))
    with pytest.raises(InvalidPublishError, match=match):
        txn.write("layers/0/wq", offset, bytes(size))
    with pytest.raises(InvalidPublishError, match="undeclared|did not declare"):
        store.begin_publish(0, pieces, "").write("nope", 0, b"x")


def test_version_digest_must_match_the_pieces():
    store = VersionStore(None, hot_versions=2)
    with pytest.raises(InvalidPublishError, match="version_digest"):
        store.begin_publish(0, pieces_of(tree(0)), layout.version_digest(pieces_of(tree(1))))
    pieces = [Piece(p.path, p.dtype, p.shape, p.domain) for p in pieces_of(tree(0))]  # no digests
    txn = store.begin_publish(0, pieces, "0" * 64)
    send(txn, tree(0))
    with pytest.raises(InvalidPublishError, match="version_digest"):
        txn.commit()
    assert store.versions() == []


def test_republishing_the_same_content_is_a_noop_without_bytes(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    first = publish(store, 0, tree(0))
    manifest = tmp_path / "versions" / "0000000000" / "MANIFEST.json"
    before = manifest.stat().st_mtime_ns
    pieces = pieces_of(tree(0))
    again = store.begin_publish(0, pieces, layout.version_digest(pieces)).commit()  # no bytes
    assert again.already_present and again.version_digest == first.version_digest
    assert manifest.stat().st_mtime_ns == before
    # Without a declared digest the bytes are compared at commit.
    undeclared = [Piece(p.path, p.dtype, p.shape, p.domain) for p in pieces]
    txn = store.begin_publish(0, undeclared, "")
    send(txn, tree(0))
    assert txn.commit().already_present
    assert_version(store, 0, tree(0))


def test_different_content_under_an_existing_version_is_a_conflict(store_url):
    store = VersionStore(store_url, hot_versions=2)
    publish(store, 0, tree(0))
    other = pieces_of(tree(1))
    with pytest.raises(VersionConflictError, match="version 0 exists"):
        store.begin_publish(0, other, layout.version_digest(other))
    txn = store.begin_publish(0, [Piece(p.path, p.dtype, p.shape, p.domain) for p in other], "")
    send(txn, tree(1))
    with pytest.raises(VersionConflictError, match="immutable"):
        txn.commit()
    assert_version(store, 0, tree(0))


def test_concurrent_publish_of_one_version_is_refused():
    store = VersionStore(None, hot_versions=2)
    pieces = pieces_of(tree(0))
    txn = store.begin_publish(0, pieces, layout.version_digest(pieces))
    with pytest.raises(PublishInProgressError, match="retry"):
        store.begin_publish(0, pieces, layout.version_digest(pieces))
    txn.abort()
    store.begin_publish(0, pieces, layout.version_digest(pieces)).abort()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda t: {**t, "layers/0/wq": t["layers/0/wq"].astype(np.float16)}, "float16"),
        (lambda t: {**t, "layers/0/wq": t["layers/0/wq"][:, :4]}, r"float32\[6, 4\]"),
        (lambda t: {k: v for k, v in t.items() if k != "layers/0/wq"}, "is missing"),
        (lambda t: {**t, "layers/1/wq": t["layers/0/wq"]}, "'layers/1/wq' is not in"),
    ],
)
def test_layout_mismatch_names_the_array_and_stores_nothing(tmp_path, change, match):
    store = VersionStore(str(tmp_path), hot_versions=2)
    publish(store, 0, tree(0))
    with pytest.raises(LayoutMismatchError, match=match) as e:
        publish(store, 1, change(tree(1)))
    assert "wq" in str(e.value) and "first version" in str(e.value)
    assert version_dirs(tmp_path) == ["0000000000"]
    assert [v.version for v in store.versions()] == [0]


def test_layout_check_survives_gc_of_the_first_version_and_a_restart(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    publish(store, 0, tree(0))
    publish(store, 1, tree(1))
    assert store.garbage_collect(2) == [0]
    restarted = VersionStore(str(tmp_path), hot_versions=2)
    assert [(p.path, p.dtype, p.shape) for p in restarted.layout()] == [
        (p.path, p.dtype, p.shape) for p in pieces_of(tree(0))
    ]
    with pytest.raises(LayoutMismatchError, match="'step'"):
        publish(restarted, 2, {**tree(2), "step": np.zeros(2, np.int32)})


# -- reads -----------------------------------------------------------------------------------
def test_box_reads_return_exactly_the_box(store_url):
    store = VersionStore(store_url, hot_versions=2)
    publish(store, 0, tree(0))
    wq = tree(0)["layers/0/wq"]
    np.testing.assert_array_equal(store.read(0, "layers/0/wq", ((0, 6), (0, 3))), wq[:, :3])
    np.testing.assert_array_equal(store.read(0, "layers/0/wq", ((2, 4), (1, 5))), wq[2:4, 1:5])
    with pytest.raises(InvalidReadError, match=r"box \[\(0, 6\), \(0, 5\)\]"):
        store.read(0, "layers/0/wq", ((0, 6), (3, 7)))
    with pytest.raises(InvalidReadError, match="no array 'nope'"):
        store.read(0, "nope")


def test_a_replica_serves_its_shard_of_a_tensor_sharded_array(tmp_path):
    """Replica 1 of 2 holds columns [4, 8) of an [6, 8] array and serves boxes inside them."""
    full = np.arange(48, dtype=np.float32).reshape(6, 8)
    store = VersionStore(str(tmp_path), hot_versions=2, replica=1, num_replicas=2)
    boxes, shapes = {"w": ((0, 6), (4, 8))}, {"w": (6, 8)}
    publish(store, 0, {"w": full[:, 4:]}, boxes=boxes, shapes=shapes)
    np.testing.assert_array_equal(store.read(0, "w", ((0, 6), (6, 8))), full[:, 6:])
    with pytest.raises(InvalidReadError, match=r"\[\(0, 6\), \(4, 8\)\] that replica 1 of 2"):
        store.read(0, "w", ((0, 6), (0, 4)))
    assert (tmp_path / "replica-1-of-2" / "versions" / "0000000000" / "MANIFEST.json").exists()


def test_not_found_names_the_oldest_and_newest_versions(store_url):
    store = VersionStore(store_url, hot_versions=5)
    with pytest.raises(VersionNotFoundError, match="no versions are available"):
        store.read(0, "step")
    for v in (3, 4, 5):
        publish(store, v, tree(v))
    store.garbage_collect(4)
    for missing in (3, 9):
        with pytest.raises(VersionNotFoundError, match="oldest 4 to newest 5"):
            store.pieces(missing)


def test_evicted_version_is_still_served_from_storage(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    for v in range(4):
        publish(store, v, tree(v))
    assert [(v.version, v.in_memory) for v in store.versions()] == [
        (0, False),
        (1, False),
        (2, True),
        (3, True),
    ]
    for v in range(4):
        assert_version(store, v, tree(v))
    assert [v.in_memory for v in store.versions()] == [False, False, True, True]


# -- retention -------------------------------------------------------------------------------
def test_a_consumer_holds_back_gc_and_the_newest_version_is_never_deleted(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    for v in range(5):
        publish(store, v, tree(v))
    store.confirm("worker-0", 2)
    assert store.garbage_collect(4) == [0, 1]  # worker-0 still needs 2 and 3
    store.confirm("worker-0", 10)
    assert store.garbage_collect(100) == [2, 3]  # 4 is the newest: kept
    assert [v.version for v in store.versions()] == [4]
    assert version_dirs(tmp_path) == ["0000000004"]
    assert store.garbage_collect(100) == []


def test_confirmations_survive_a_restart(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    for v in range(3):
        publish(store, v, tree(v))
    store.confirm("worker-0", 1)
    restarted = VersionStore(str(tmp_path), hot_versions=2)
    assert restarted.consumers() == {"worker-0": 1}
    assert restarted.garbage_collect(3) == [0]


def rss_mb() -> float:
    """This process's resident memory (MiB), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def publish_whole(store, version, arrays):
    """`publish` with one write per array: thousands of publishes stay fast."""
    pieces = pieces_of(arrays)
    txn = store.begin_publish(version, pieces, layout.version_digest(pieces))
    for path, a in arrays.items():
        txn.write(path, 0, layout.to_bytes(a))
    return txn.commit()


def test_memory_only_store_keeps_k_versions_over_many_publishes():
    k = 3
    store = VersionStore(None, hot_versions=k)
    for v in range(2000):
        publish_whole(store, v, {"w": np.full(4, v, np.float32)})
        store.garbage_collect(v - 4)
        if v % 97 == 0:
            assert sum(i.in_memory for i in store.versions()) <= k
    # Nothing to serve evicted versions from: only the K hot ones remain.
    assert [v.version for v in store.versions()] == [1997, 1998, 1999]
    assert_version(store, 1999, {"w": np.full(4, 1999, np.float32)})


@pytest.fixture
def local_dir(tmp_path):
    """A local directory on tmpfs where there is one, else tmp_path: the same code path as any
    directory, without waiting thousands of times for a disk's fsync."""
    if not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="rlax-tpu-params-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_memory_and_storage_stay_bounded_over_thousands_of_publishes(local_dir):
    """2000 publishes of 32 KiB to a local directory with K=3, a GC keeping the newest 5 and a
    read of an evicted (cold) version now and then. Resident memory may not grow by more than
    24 MiB after a warm-up: keeping each version's hot copy, handles or buffers by mistake
    would add 62 MiB of array data alone."""
    k, keep, warm_up, publishes = 3, 5, 100, 2000
    store = VersionStore(str(local_dir), hot_versions=k)
    base = np.arange(8192, dtype=np.float32)  # 32 KiB

    def step(v):
        publish_whole(store, v, {"w": base + v, "step": np.array(v, np.int32)})
        store.garbage_collect(v - keep + 1)
        if v % 25 == 0 and v >= keep:  # a cold read: the version is on disk, not in memory
            assert_version(store, v - keep + 1, {"w": base + (v - keep + 1)})
        if v % 97 == 0:
            infos = store.versions()
            assert len(infos) <= keep
            # Beyond the newest K, a version stays in memory only while its persistent copy
            # is being written (on a loaded host the background writes fall behind) ...
            beyond_k = [i for i in infos[:-k] if i.in_memory]
            assert not any(i.persisted for i in beyond_k), beyond_k
            # ... and once they are on storage, only K are.
            assert all(store.wait_persisted(i.version, timeout_s=30) for i in infos)
            assert sum(i.in_memory for i in store.versions()) <= k

    for v in range(warm_up):
        step(v)
    before = rss_mb()
    for v in range(warm_up, warm_up + publishes):
        step(v)
    grown = rss_mb() - before
    assert grown < 24, f"resident memory grew by {grown:.1f} MiB over {publishes} publishes"
    newest = list(range(warm_up + publishes - keep, warm_up + publishes))
    assert all(store.wait_persisted(v, timeout_s=30) for v in newest)  # written in background
    assert [v.version for v in store.versions()] == newest
    assert [v.in_memory for v in store.versions()] == [False, False, True, True, True]
    assert version_dirs(local_dir) == [f"{v:010d}" for v in newest]
    assert_version(store, newest[-1], {"w": base + newest[-1]})


def test_evicted_versions_give_their_memory_back():
    """40 versions of 4 MiB with K=3: resident memory must not grow by the 160 MB a leak takes."""

    store = VersionStore(None, hot_versions=3)
    big = np.ones(2**20, np.float32)
    publish(store, 0, {"w": big})
    baseline = rss_mb()
    for v in range(1, 40):
        pieces = pieces_of({"w": big + v})
        txn = store.begin_publish(v, pieces, "")
        txn.write("w", 0, layout.to_bytes(big + v))
        txn.commit()
    assert len(store.versions()) == 3
    assert rss_mb() - baseline < 80


# -- persisting in the background ----------------------------------------------------------
def publish_now(store, version, arrays):
    """Publish without waiting for the persistent copy."""
    pieces = pieces_of(arrays)
    txn = store.begin_publish(version, pieces, layout.version_digest(pieces))
    send(txn, arrays)
    return txn.commit()


def gate_storage_writes(monkeypatch, store, version, failure=None):
    """Hold back (or, with `failure`, fail) the persistent array writes of `version`;
    returns the event that lets them through."""
    gate, write = threading.Event(), store._write_persistent

    def gated(v, *args):
        if v == version:
            assert gate.wait(30)
            if failure is not None:
                raise failure
        write(v, *args)

    monkeypatch.setattr(store, "_write_persistent", gated)
    return gate


def manifest(root, version):
    return root / "versions" / f"{version:010d}" / "MANIFEST.json"


def test_a_publish_returns_with_the_memory_copy_and_persists_in_the_background(
    tmp_path, monkeypatch
):
    store = VersionStore(str(tmp_path), hot_versions=2)
    gate = gate_storage_writes(monkeypatch, store, 0)
    publish_now(store, 0, tree(0))  # returns although no array is on storage yet
    [info] = store.versions()
    assert (info.in_memory, info.persisted) == (True, False)
    assert_version(store, 0, tree(0))  # served from memory meanwhile
    assert not store.wait_persisted(0, timeout_s=0.2) and not manifest(tmp_path, 0).exists()
    gate.set()
    assert store.wait_persisted(0, timeout_s=30)
    assert manifest(tmp_path, 0).exists() and store.versions()[0].persisted
    assert_version(VersionStore(str(tmp_path), hot_versions=2), 0, tree(0))  # a restart
    memory_only = VersionStore(None, hot_versions=1)
    publish_now(memory_only, 0, tree(0))
    assert not memory_only.wait_persisted(0)  # no storage: never, and at once


def test_a_version_stays_in_memory_until_it_is_on_storage(tmp_path, monkeypatch):
    store = VersionStore(str(tmp_path), hot_versions=1)
    gate = gate_storage_writes(monkeypatch, store, 0)
    publish_now(store, 0, tree(0))
    publish_now(store, 1, tree(1))  # K = 1: version 0 would leave memory, but has nowhere to go
    assert [(v.version, v.in_memory) for v in store.versions()] == [(0, True), (1, True)]
    assert_version(store, 0, tree(0))
    gate.set()
    assert store.wait_persisted(0, timeout_s=30) and store.wait_persisted(1, timeout_s=30)
    assert [(v.version, v.in_memory) for v in store.versions()] == [(0, False), (1, True)]
    assert_version(store, 0, tree(0))  # now from storage


def test_garbage_collection_waits_for_writes_in_flight_and_leaves_no_files(tmp_path, monkeypatch):
    store = VersionStore(str(tmp_path), hot_versions=3)
    gate = gate_storage_writes(monkeypatch, store, 1)
    for v in range(3):
        publish_now(store, v, tree(v))
    collected: list[int] = []
    collector = threading.Thread(target=lambda: collected.extend(store.garbage_collect(2)))
    collector.start()
    collector.join(0.3)
    assert collector.is_alive()  # version 1's arrays are still being written
    gate.set()
    collector.join(30)
    assert collected == [0, 1]
    assert not store.wait_persisted(1, timeout_s=30)  # gone, never committed on storage
    assert store.wait_persisted(2, timeout_s=30)  # storage commits go in publish order
    assert version_dirs(tmp_path) == ["0000000002"]
    assert [v.version for v in VersionStore(str(tmp_path), hot_versions=3).versions()] == [2]
    publish(store, 1, tree(1))  # the version number is free again, and whole
    assert_version(store, 1, tree(1))


def test_a_failed_persistent_copy_refuses_later_publishes_and_says_why(tmp_path, monkeypatch):
    store = VersionStore(str(tmp_path), hot_versions=2)
    publish(store, 0, tree(0))
    gate = gate_storage_writes(monkeypatch, store, 1, failure=OSError("disk full"))
    publish_now(store, 1, tree(1))
    gate.set()
    assert not store.wait_persisted(1, timeout_s=30)
    assert "persisting version 1" in store.persist_error and "disk full" in store.persist_error
    with pytest.raises(
        StorageFailedError, match="version 2 refused: persisting version 1.*restart"
    ):
        publish_now(store, 2, tree(2))
    assert_version(store, 1, tree(1))  # still served from memory
    restarted = VersionStore(str(tmp_path), hot_versions=2)
    assert [v.version for v in restarted.versions()] == [0]  # 1 never reached storage
    publish(restarted, 1, tree(1))


# -- restart ---------------------------------------------------------------------------------
def test_restart_serves_committed_versions_and_removes_uncommitted_ones(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    for v in range(3):
        publish(store, v, tree(v))
    pieces = pieces_of(tree(3))
    crashed = store.begin_publish(3, pieces, layout.version_digest(pieces))
    send(crashed, tree(3))
    crashed.commit()
    store.wait_persisted(3)
    # The process "dies" after writing version 3's arrays and before its manifest.
    storage.remove(os.path.join(tmp_path, "versions", "0000000003", "MANIFEST.json"))
    assert "0000000003" in version_dirs(tmp_path)
    del store, crashed

    restarted = VersionStore(str(tmp_path), hot_versions=2)
    assert [v.version for v in restarted.versions()] == [0, 1, 2]
    assert version_dirs(tmp_path) == ["0000000000", "0000000001", "0000000002"]
    for v in range(3):
        assert_version(restarted, v, tree(v))
    assert [v.in_memory for v in restarted.versions()] == [False, True, True]  # loaded lazily
    publish(restarted, 3, tree(3))
    assert_version(restarted, 3, tree(3))


def test_restart_rebuilds_a_missing_layout_file(tmp_path):
    store = VersionStore(str(tmp_path), hot_versions=2)
    publish(store, 0, tree(0))
    (tmp_path / "LAYOUT.json").unlink()  # as if we died between MANIFEST.json and LAYOUT.json
    restarted = VersionStore(str(tmp_path), hot_versions=2)
    assert json.loads((tmp_path / "LAYOUT.json").read_text())["first_version"] == 0
    with pytest.raises(LayoutMismatchError):
        publish(restarted, 1, {"other": np.zeros(3, np.float32)})


def test_file_url_storage_is_the_same_as_a_local_path(tmp_path):
    url = f"file://{tmp_path}/params"
    assert url.startswith("file:///")
    store = VersionStore(url, hot_versions=1)
    for v in range(3):
        publish(store, v, tree(v))
    assert store.garbage_collect(1) == [0]
    assert version_dirs(tmp_path / "params") == ["0000000001", "0000000002"]
    for reopened in (url, str(tmp_path / "params")):  # a restart, by URL and by path
        restarted = VersionStore(reopened, hot_versions=1)
        assert [v.version for v in restarted.versions()] == [1, 2]
        for v in (1, 2):  # 1 is read from storage (cold), 2 is loaded into memory
            assert_version(restarted, v, tree(v))
        assert [v.in_memory for v in restarted.versions()] == [False, True]
    publish(restarted, 3, tree(3))
    assert_version(VersionStore(url, hot_versions=1), 3, tree(3))


def test_restart_on_gcs(gcs_bucket):
    url = f"{gcs_bucket}/run/params"
    store = VersionStore(url, hot_versions=2)
    for v in range(3):
        publish(store, v, tree(v))
    assert store.garbage_collect(1) == [0]
    restarted = VersionStore(url, hot_versions=2)
    assert [v.version for v in restarted.versions()] == [1, 2]
    for v in (1, 2):
        assert_version(restarted, v, tree(v))
    assert storage.listdir(f"{url}/versions") == ["0000000001", "0000000002"]


# -- concurrency -----------------------------------------------------------------------------
def test_concurrent_publishes_and_reads():
    store = VersionStore(None, hot_versions=40)
    publish(store, 0, tree(0))
    errors = []

    def publisher(first):
        try:
            for v in range(first, 40, 4):
                publish(store, v, tree(v))
        except Exception as e:  # reported below
            errors.append(e)

    def reader():
        try:
            for _ in range(200):
                assert_version(store, 0, tree(0))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=publisher, args=(i,)) for i in (1, 2, 3, 4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [v.version for v in store.versions()] == list(range(40))
    for v in range(40):
        assert_version(store, v, tree(v))


def test_a_stopping_server_ends_the_waits_for_a_version_and_keeps_committed_ones():
    """stop_waiting (the server is stopping): a pull waiting for a version that has not
    committed returns at once as for a missing version, instead of holding the server's
    stop for its grace period; later waits do not block, and committed versions still are."""
    store = VersionStore(None, hot_versions=2)
    publish_now(store, 0, tree(0))
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(store.wait_committed(1, 120.0)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # version 1 is not published: it waits
    store.stop_waiting()
    waiter.join(30)
    assert not waiter.is_alive() and waited == [False]
    assert store.wait_committed(2, 120.0) is False  # returns at once
    assert store.wait_committed(0, 120.0) is True
