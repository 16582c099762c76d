"""Tests of the metrics writer: metrics.jsonl and TensorBoard event files in the run directory."""

import json
import os
import struct

import google_crc32c
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlax_tpu import storage
from rlax_tpu.launch.metrics import MetricsWriter, read_metrics
from rlax_tpu.rpc.protos import tensorboard_pb2


def _scalars(tensorboard_dir) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def _records(data: bytes) -> list[bytes]:
    """TFRecords decoded from the spec (not from the writer's code): every CRC checked."""

    def masked(b: bytes) -> int:
        crc = google_crc32c.value(b)
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) % 2**32

    out, offset = [], 0
    while offset < len(data):
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        assert length_crc == masked(header)
        payload = data[offset + 12 : offset + 12 + length]
        (payload_crc,) = struct.unpack("<I", data[offset + 12 + length : offset + 16 + length])
        assert payload_crc == masked(payload)
        out.append(payload)
        offset += 16 + length
    assert offset == len(data)
    return out


def _event_files(run_dir) -> list[str]:
    return sorted(storage.listdir(storage.join(str(run_dir), "tensorboard")))


def test_tensorboard_reads_the_scalars(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(0, {"loss": 1.5, "reward/mean": 0.0})
        writer.write(1, {"loss": 1.25, "reward/mean": 0.5, "tokens": 300})

    assert _scalars(tmp_path / "tensorboard") == {
        "loss": [(0, 1.5), (1, 1.25)],
        "reward/mean": [(0, 0.0), (1, 0.5)],
        "tokens": [(1, 300.0)],
    }


def test_jsonl_has_one_line_per_write_with_step_and_time(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(3, {"loss": np.float32(0.25), "tokens": np.int64(12)})
        writer.write(4, {"loss": float("nan")})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert list(first) == ["step", "time", "loss", "tokens"]
    assert (first["step"], first["loss"], first["tokens"]) == (3, 0.25, 12)
    assert type(first["tokens"]) is int
    assert second["step"] == 4 and np.isnan(second["loss"])
    assert abs(first["time"] - os.path.getmtime(tmp_path / "metrics.jsonl")) < 60


def test_event_file_is_tfrecord_framed_events_starting_with_the_file_version(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(7, {"a": 1.0, "b": 0.0})
    (name,) = _event_files(tmp_path)
    assert name.startswith("events.out.tfevents.")

    events = [
        tensorboard_pb2.Event.FromString(r)
        for r in _records((tmp_path / "tensorboard" / name).read_bytes())
    ]

    assert events[0].file_version == "brain.Event:2"
    assert events[1].step == 7 and events[1].wall_time > 0
    values = [(v.tag, v.HasField("simple_value"), v.simple_value) for v in events[1].summary.value]
    assert values == [("a", True, 1.0), ("b", True, 0.0)]  # 0.0 is written, not left out


def test_a_resumed_run_appends_and_starts_a_new_event_file(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(0, {"loss": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a line torn by a crash
        f.write('{"step": 1, "lo')
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0]

    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(1, {"loss": 1.0})

    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [(0, 2.0), (1, 1.0)]
    assert len(_event_files(tmp_path)) == 2
    assert _scalars(tmp_path / "tensorboard") == {"loss": [(0, 2.0), (1, 1.0)]}


def test_file_url_run_dir(tmp_path):
    with MetricsWriter(f"file://{tmp_path}/run") as writer:
        writer.write(0, {"x": 1.0})
    assert read_metrics(f"file://{tmp_path}/run")[0]["x"] == 1.0
    assert _scalars(tmp_path / "run" / "tensorboard") == {"x": [(0, 1.0)]}


def test_gcs_run_dir_is_rewritten_on_every_write(gcs_bucket, tmp_path):
    run_dir = f"{gcs_bucket}/run"
    storage.write_text(f"{run_dir}/metrics.jsonl", '{"step": 0, "time": 1.0, "loss": 3.0}\n')
    writer = MetricsWriter(run_dir)
    writer.write(1, {"loss": 2.0})

    assert [r["loss"] for r in read_metrics(run_dir)] == [3.0, 2.0]  # earlier lines are kept
    (name,) = _event_files(run_dir)
    storage.copy(f"{run_dir}/tensorboard/{name}", str(tmp_path / name))
    assert _scalars(tmp_path) == {"loss": [(1, 2.0)]}
    writer.close()


def test_gcs_writes_wait_for_flush_when_an_interval_is_set(gcs_bucket):
    run_dir = f"{gcs_bucket}/run"
    writer = MetricsWriter(run_dir, flush_interval_s=3600)
    writer.write(0, {"loss": 1.0})
    assert read_metrics(run_dir) == []
    writer.flush()
    assert [r["loss"] for r in read_metrics(run_dir)] == [1.0]
    writer.write(1, {"loss": 0.5})
    writer.close()
    assert [r["loss"] for r in read_metrics(run_dir)] == [1.0, 0.5]


@pytest.mark.parametrize(
    ("step", "metrics", "error", "message"),
    [
        (-1, {"x": 1.0}, ValueError, "step must be an int >= 0"),
        (1.5, {"x": 1.0}, ValueError, "step must be an int >= 0"),
        (0, {"step": 1.0}, ValueError, "'step' is reserved"),
        (0, {"": 1.0}, ValueError, "non-empty strings"),
        (0, {"x": "1.0"}, TypeError, "metric 'x' must be a number"),
        (0, {"x": [1.0, 2.0]}, TypeError, "metric 'x' must be a number"),
    ],
)
def test_bad_metrics_are_refused_and_nothing_is_written(tmp_path, step, metrics, error, message):
    with MetricsWriter(str(tmp_path)) as writer:
        with pytest.raises(error, match=message):
            writer.write(step, metrics)
    assert read_metrics(str(tmp_path)) == []


def test_writing_after_close_is_an_error(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.close()
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(0, {"x": 1.0})
