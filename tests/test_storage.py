"""rlax_tpu.storage against a local directory, file:// URLs and a real GCS emulator (gs://)."""

import os
import random
import threading
import urllib.request

import pytest

from rlax_tpu import storage
from rlax_tpu.storage import gcs as gcs_backend
from rlax_tpu.storage import local as local_backend


@pytest.fixture(params=["local", "file", "gs"])
def root(request, tmp_path):
    """An empty directory on one backend: a plain path, a file:// URL or gs://<fresh bucket>/run."""
    if request.param == "local":
        return str(tmp_path / "run")
    if request.param == "file":
        return f"file://{tmp_path}/run"
    return request.getfixturevalue("gcs_bucket") + "/run"


def binary(n: int, seed: int = 0) -> bytes:
    """n arbitrary bytes, reproducible, not ending in b"\r": gcp-storage-emulator drops a
    trailing carriage return of an uploaded object (real GCS keeps it), which made tests
    with os.urandom data fail one run in 256."""
    data = bytearray(random.Random(seed).randbytes(n))
    if data and data[-1] == ord("\r"):
        data[-1] = 0
    return bytes(data)


def test_bytes_round_trip(root):
    url = storage.join(root, "a", "b.bin")
    data = bytes(range(256)) * 10
    storage.write_bytes(url, data)
    assert storage.read_bytes(url) == data
    assert storage.size(url) == len(data)


def test_text_round_trip(root):
    url = storage.join(root, "config.json")
    storage.write_text(url, '{"name": "ünïcode ✓"}')
    assert storage.read_text(url) == '{"name": "ünïcode ✓"}'


def test_overwrite_replaces_content(root):
    url = storage.join(root, "x")
    storage.write_bytes(url, b"old content that is longer")
    storage.write_bytes(url, b"new")
    assert storage.read_bytes(url) == b"new"


def test_read_range_returns_exactly_the_slice(root):
    url = storage.join(root, "blob")
    data = binary(10_000)
    storage.write_bytes(url, data)
    assert storage.read_range(url, 1234, 4321) == data[1234 : 1234 + 4321]
    assert storage.read_range(url, 0, 1) == data[:1]
    assert storage.read_range(url, 9_999, 1) == data[-1:]
    assert storage.read_range(url, 500, 0) == b""


def test_read_range_past_the_end_raises_eof_error(root):
    url = storage.join(root, "short")
    storage.write_bytes(url, b"0123456789")
    with pytest.raises(EOFError, match="ends at 10"):
        storage.read_range(url, 5, 10)


@pytest.mark.parametrize(
    "op",
    [
        storage.read_bytes,
        storage.read_text,
        storage.size,
        storage.listdir,
        storage.remove,
        lambda url: storage.read_range(url, 0, 4),
        lambda url: storage.read_range(url, 0, 0),
        lambda url: storage.copy_tree(url, url + "-copy"),
        lambda url: storage.copy(url, url + "-copy"),
    ],
)
def test_missing_file_raises_file_not_found_naming_the_url(root, op):
    url = storage.join(root, "missing", "file.bin")
    with pytest.raises(FileNotFoundError) as e:
        op(url)
    assert e.value.filename == url
    assert url in str(e.value)


def test_exists_for_files_and_directories(root):
    assert not storage.exists(storage.join(root, "d", "f"))
    storage.write_bytes(storage.join(root, "d", "f"), b"1")
    assert storage.exists(storage.join(root, "d", "f"))
    assert storage.exists(storage.join(root, "d"))
    assert not storage.exists(storage.join(root, "d", "g"))


def test_listdir_gives_sorted_names_of_files_and_subdirectories(root):
    for rel in ["b.txt", "a.txt", "sub/c.txt", "sub/deeper/d.txt"]:
        storage.write_bytes(storage.join(root, rel), b"x")
    assert storage.listdir(root) == ["a.txt", "b.txt", "sub"]
    assert storage.listdir(storage.join(root, "sub") + "/") == ["c.txt", "deeper"]


def test_listdir_keeps_a_subdirectory_named_like_its_parent(root):
    storage.write_bytes(storage.join(root, "run", "run", "f"), b"x")
    storage.write_bytes(storage.join(root, "run", "g"), b"x")
    assert storage.listdir(storage.join(root, "run")) == ["g", "run"]


def test_listdir_of_an_empty_bucket_is_empty(gcs_bucket):
    assert storage.listdir(gcs_bucket) == []


def test_makedirs_then_write_into_it(root):
    d = storage.join(root, "ckpt", "v3")
    storage.makedirs(d)
    storage.makedirs(d)  # idempotent
    storage.write_bytes(storage.join(d, "params"), b"p")
    assert storage.listdir(d) == ["params"]


def test_remove_file_and_tree(root):
    storage.write_bytes(storage.join(root, "keep"), b"k")
    storage.write_bytes(storage.join(root, "gone"), b"g")
    storage.write_bytes(storage.join(root, "tree", "a"), b"a")
    storage.write_bytes(storage.join(root, "tree", "sub", "b"), b"b")
    storage.remove(storage.join(root, "gone"))
    storage.remove(storage.join(root, "tree"), recursive=True)
    assert storage.listdir(root) == ["keep"]
    assert not storage.exists(storage.join(root, "tree", "sub", "b"))


@pytest.mark.parametrize("dst_kind", ["local", "gs"])
def test_copy_tree_copies_every_file_to_any_backend(root, dst_kind, tmp_path, request):
    files = {"config.json": b"{}", "model.safetensors": binary(3000), "tok/vocab.txt": b"a b"}
    src = storage.join(root, "model")
    for rel, data in files.items():
        storage.write_bytes(storage.join(src, rel), data)
    dst = str(tmp_path / "copy") if dst_kind == "local" else request.getfixturevalue("gcs_bucket")
    dst = storage.join(dst, "uploaded")
    assert storage.copy_tree(src, dst) == sorted(files)
    for rel, data in files.items():
        assert storage.read_bytes(storage.join(dst, rel)) == data
    assert storage.listdir(dst) == ["config.json", "model.safetensors", "tok"]


def test_gs_traffic_reaches_the_emulator(gcs_bucket, gcs_emulator):
    storage.write_bytes(storage.join(gcs_bucket, "probe.txt"), b"hello emulator")
    bucket = gcs_bucket.removeprefix("gs://")
    url = f"{gcs_emulator.url}/download/storage/v1/b/{bucket}/o/probe.txt?alt=media"
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.read() == b"hello emulator"
    assert gcs_backend.filesystem().credentials.token == "anon"  # no real credentials sent


def test_local_reader_never_sees_a_partial_file(tmp_path):
    url = str(tmp_path / "hot.bin")
    old, new = b"a" * 2**20, b"b" * 2**20
    storage.write_bytes(url, old)
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            storage.write_bytes(url, new)
            storage.write_bytes(url, old)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(200):
            assert storage.read_bytes(url) in (old, new)
    finally:
        stop.set()
        thread.join()


def test_failed_local_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    url = str(tmp_path / "state.json")
    storage.write_text(url, "old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(local_backend.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        storage.write_text(url, "new")
    monkeypatch.undo()
    assert storage.read_text(url) == "old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_join_keeps_the_scheme_and_drops_extra_slashes():
    assert storage.join("gs://b/run/", "/ckpt/", "v1") == "gs://b/run/ckpt/v1"
    assert storage.join("gs://", "b", "k") == "gs://b/k"
    assert storage.join("file:///tmp/run", "x") == "file:///tmp/run/x"
    assert storage.join("/", "tmp") == "/tmp"
    assert storage.join("runs/a", "", "b") == "runs/a/b"
    assert storage.join("runs/a") == "runs/a"


def test_is_remote_only_for_gs():
    assert storage.is_remote("gs://b/x")
    assert not storage.is_remote("file:///tmp/x")
    assert not storage.is_remote("/tmp/x")


def test_unsupported_scheme_is_rejected_with_the_alternatives():
    with pytest.raises(ValueError, match="s3.*local path, file:// or gs://"):
        storage.read_bytes("s3://bucket/key")
    with pytest.raises(ValueError, match="names no bucket"):
        storage.read_bytes("gs:///key")


@pytest.mark.slow  # gcsfs retries a refused connection for about 35 s before it gives up
def test_an_unreachable_bucket_is_one_error_naming_the_url_and_what_to_check(monkeypatch):
    import socket

    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(gcs_backend.EMULATOR_ENV, f"http://127.0.0.1:{port}")
    with pytest.raises(storage.StorageUnreachableError) as info:
        storage.read_text("gs://some-bucket/run/config.json")
    message = str(info.value)
    assert message.startswith("cannot reach gs://some-bucket/run/config.json: ")
    assert "credentials" in message and gcs_backend.EMULATOR_ENV in message
    # A local path keeps its own errors.
    with pytest.raises(FileNotFoundError):
        storage.read_text("/nonexistent/dir/file")
