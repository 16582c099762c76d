"""Controller snapshots and the rollout log: atomic, verified, never silently wrong."""

import dataclasses
import threading

import pytest

from rlax_tpu import storage
from rlax_tpu.api.records import RolloutRecord
from rlax_tpu.controller.snapshots import (
    RolloutLog,
    Snapshot,
    SnapshotError,
    SnapshotStore,
    snapshot_name,
)
from rlax_tpu.shapes import padded_seq_len


def snapshot(step: int, digest: str = "d" * 64) -> Snapshot:
    return Snapshot(
        step=step,
        checkpoint_step=step - step % 4,
        config_digest=digest,
        mixture={"rng": {"state": step}, "counters": {"a": step * 8}},
        stats={"rejected_stale": 0},
        versions={"trainer": step},
    )


@pytest.fixture(params=["local", "gcs"])
def run_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"{request.getfixturevalue('gcs_bucket')}/run"


def test_snapshots_round_trip_newest_first_and_keep_the_last_few(run_dir):
    store = SnapshotStore(run_dir, keep=3)
    for step in range(6):
        store.write(snapshot(step))
    assert store.steps() == [3, 4, 5]
    assert [s.step for s in store.candidates("d" * 64)] == [5, 4, 3]
    assert store.read(5) == snapshot(5)


def test_a_truncated_snapshot_is_skipped_for_the_previous_one(run_dir, caplog):
    store = SnapshotStore(run_dir, keep=5)
    store.write(snapshot(1))
    store.write(snapshot(2))
    url = storage.join(store.directory, snapshot_name(2))
    storage.write_text(url, storage.read_text(url)[:-20])
    with pytest.raises(SnapshotError, match="truncated"):
        store.read(2)
    assert [s.step for s in store.candidates("d" * 64)] == [1]
    assert "truncated" in caplog.text


def test_an_edited_snapshot_fails_its_checksum(tmp_path):
    store = SnapshotStore(str(tmp_path), keep=5)
    store.write(snapshot(3))
    url = storage.join(store.directory, snapshot_name(3))
    storage.write_text(url, storage.read_text(url).replace('"step": 3', '"step": 4'))
    with pytest.raises(SnapshotError, match="checksum"):
        store.read(3)


def test_a_snapshot_of_another_config_is_an_error_naming_the_fix(tmp_path):
    store = SnapshotStore(str(tmp_path), keep=5)
    store.write(snapshot(2, digest="a" * 64))
    with pytest.raises(
        SnapshotError, match="config digest aaaaaaaaaaaa.*resume with the run's own"
    ):
        list(store.candidates("b" * 64))


def test_rollout_log_keeps_each_rollout_once_by_key_and_skips_torn_entries(tmp_path):
    log = RolloutLog(str(tmp_path))
    record = RolloutRecord(
        batch=0, prompt_id="b0:arith:1", sample_index=1, version=0, prompt_tokens=(1,),
        tokens=(5, 6), logprobs=(-0.5, -0.5), finish_reason="stop",
    )  # fmt: skip
    log.append(0, [record])
    log.append(0, [record])  # a repeat overwrites, never duplicates
    log.append(
        0,
        [
            dataclasses.replace(record, sample_index=0),
            dataclasses.replace(record, sample_index=2, tokens=(7,)),
        ],
    )
    log.append(0, [])  # nothing to write
    log.flush()
    batch_dir = tmp_path / "rollouts" / "batch_000000000"
    assert len(list(batch_dir.iterdir())) == 2  # one file per write of distinct rollouts
    (batch_dir / "rollouts-torn.jsonl").write_text('{"prompt_id": "b0:arith:1", "sample_index": 3')
    logged = log.read_batch(0)
    assert sorted(logged) == [("b0:arith:1", 0, 0), ("b0:arith:1", 1, 0), ("b0:arith:1", 2, 0)]
    assert logged[("b0:arith:1", 1, 0)]["tokens"] == [5, 6]
    assert logged[("b0:arith:1", 2, 0)]["tokens"] == [7]
    assert log.read_batch(1) == {}


def test_rollout_log_writes_in_the_background_in_order_until_a_flush(tmp_path, monkeypatch):
    """An append returns before its write (a local file's fsyncs, an upload) is done; the
    writes land in order; flush (what a snapshot waits for) and a read of the batch wait for
    them; a write that failed raises there."""
    record = RolloutRecord(
        batch=0, prompt_id="b0:arith:1", sample_index=0, version=0, prompt_tokens=(1,),
        tokens=(5, 6), logprobs=(-0.5, -0.5), finish_reason="stop",
    )  # fmt: skip
    gate, landed, real = threading.Event(), [], storage.write_text

    def held(url, text):
        gate.wait(30)
        real(url, text)
        landed.append(url.split("/")[-2])

    monkeypatch.setattr(storage, "write_text", held)
    log = RolloutLog(str(tmp_path))
    log.append(0, [record])
    log.append(1, [dataclasses.replace(record, batch=1)])
    log.record_consumed(0, [("b0:arith:1", 0, 0)])
    assert landed == [] and not (tmp_path / "rollouts").exists()
    flusher = threading.Thread(target=log.flush)
    flusher.start()
    flusher.join(0.3)
    assert flusher.is_alive()  # waiting for the held writes
    gate.set()
    flusher.join(30)
    assert landed == ["batch_000000000", "batch_000000001", "consumed"]
    assert sorted(log.read_batch(1)) == [("b0:arith:1", 0, 0)]

    def broken(url, text):
        raise OSError(f"no space left writing {url}")

    monkeypatch.setattr(storage, "write_text", broken)
    log.append(2, [dataclasses.replace(record, batch=2)])
    with pytest.raises(OSError, match="no space left"):
        log.flush()
    log.append(3, [dataclasses.replace(record, batch=3)])
    with pytest.raises(OSError, match="batch_000000003"):
        log.read_batch(3)
    log.close()


def test_consumed_rows_are_recorded_per_batch(tmp_path):
    log = RolloutLog(str(tmp_path))
    log.record_consumed(0, [("p", 0, 0), ("p", 1, 0)])
    log.record_consumed(1, [("q", 0, 1)])
    assert log.consumed() == {0: [("p", 0, 0), ("p", 1, 0)], 1: [("q", 0, 1)]}


def test_batches_are_padded_to_few_shapes():
    lengths = [1, 16, 17, 33, 48, 49, 64, 65, 100, 129, 300, 5000]
    assert [padded_seq_len(n, 4096) for n in lengths] == [
        64, 64, 64, 64, 64, 64, 64, 80, 112, 160, 320, 4096,
    ]  # fmt: skip
    padded = {n: padded_seq_len(n, 4096) for n in range(1, 4097)}
    assert all(p == 64 for n, p in padded.items() if n <= 64)  # one shape for short batches
    assert all(n <= p < 1.25 * n for n, p in padded.items() if n > 64)  # < 25% padding
    assert len(set(padded.values())) == 25  # 64, then four per octave up to 4096
    assert padded_seq_len(60, 50) == 50 and padded_seq_len(3, 32) == 32  # never beyond max
    with pytest.raises(ValueError, match="at least one token"):
        padded_seq_len(0, 64)
