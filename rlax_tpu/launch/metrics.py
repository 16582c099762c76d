"""Training metrics of a run: one JSON line per step in <run_dir>/metrics.jsonl and scalar
summaries in a TensorBoard event file under <run_dir>/tensorboard/.

The event file is written here, without TensorFlow: TFRecord framing around `Event` protos
(protos/rlax_tpu/v1/tensorboard.proto). Local files are appended to; gs:// objects cannot be
appended to, so they are kept in memory and rewritten whole on `flush()`. Sinks (W&B:
controller/wandb_logging.py) get every row too.
"""

from __future__ import annotations

import json
import numbers
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, Self

import google_crc32c

from rlax_tpu import storage
from rlax_tpu.rpc.protos import tensorboard_pb2

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
FILE_VERSION = "brain.Event:2"
_RESERVED_KEYS = ("step", "time")
_CRC_MASK_DELTA = 0xA282EAD8
_file_counter = 0  # distinguishes event files one process opens within the same second
_file_counter_lock = threading.Lock()


def masked_crc32c(data: bytes) -> int:
    """The CRC TFRecord stores: crc32c rotated right by 15 bits plus a constant."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _CRC_MASK_DELTA) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """`data` framed as one TFRecord: uint64 length, masked crc of the length, data, masked crc
    of the data (all little-endian)."""
    length = struct.pack("<Q", len(data))
    return (
        length
        + struct.pack("<I", masked_crc32c(length))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class MetricsWriter:
    """Writes each step's metrics to <run_dir>/metrics.jsonl and a TensorBoard event file.

    A resumed run appends to the existing metrics.jsonl and starts a new event file (TensorBoard
    reads all of them). On gs:// the objects are rewritten at most every `flush_interval_s`
    seconds (0: on every write) and on `close()`. Each of `sinks` (`log(step, values)`,
    `close()`; e.g. a wandb_logging.WandbSink) gets every row too, and is closed with it.
    """

    def __init__(
        self, run_dir: str, *, flush_interval_s: float = 0.0, sinks: Sequence[Any] = ()
    ) -> None:
        if flush_interval_s < 0:
            raise ValueError(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        self.run_dir = run_dir
        self.sinks = list(sinks)
        self.metrics_url = storage.join(run_dir, METRICS_FILE)
        self.event_url = storage.join(run_dir, TENSORBOARD_DIR, _event_file_name())
        self._remote = storage.is_remote(run_dir)
        self._flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._closed = False
        self._last_flush = time.monotonic()
        first_event = tfrecord(
            tensorboard_pb2.Event(
                wall_time=time.time(), file_version=FILE_VERSION
            ).SerializeToString()
        )
        if self._remote:
            self._jsonl = bytearray(_complete_lines(_read_if_exists(self.metrics_url)))
            self._events = bytearray(first_event)
            self._write_remote()
        else:
            storage.makedirs(storage.join(run_dir, TENSORBOARD_DIR))
            self._jsonl_file = _open_append(self.metrics_url)
            self._event_file = _open_append(self.event_url)
            self._event_file.write(first_event)
            self._event_file.flush()

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (name -> number) of `step`: one JSON line and one summary event."""
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        values = {name: _number(name, value) for name, value in metrics.items()}
        now = time.time()
        line = json.dumps({"step": int(step), "time": now, **values}) + "\n"
        summary = tensorboard_pb2.Summary(
            value=[
                tensorboard_pb2.Summary.Value(tag=name, simple_value=float(value))
                for name, value in values.items()
            ]
        )
        record = tfrecord(
            tensorboard_pb2.Event(
                wall_time=now, step=int(step), summary=summary
            ).SerializeToString()
        )
        with self._lock:
            self._check_open()
            if self._remote:
                self._jsonl += line.encode()
                self._events += record
                if time.monotonic() - self._last_flush >= self._flush_interval_s:
                    self._write_remote()
            else:
                self._jsonl_file.write(line.encode())
                self._jsonl_file.flush()
                self._event_file.write(record)
                self._event_file.flush()
            for sink in self.sinks:
                sink.log(int(step), values)

    def flush(self) -> None:
        """Make everything written so far visible to readers (on gs://: rewrite both objects)."""
        with self._lock:
            self._check_open()
            if self._remote:
                self._write_remote()
            else:
                self._jsonl_file.flush()
                self._event_file.flush()

    def close(self) -> None:
        """Flush and close; closing twice is harmless, writing after closing is an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._remote:
                self._write_remote()
            else:
                self._jsonl_file.close()
                self._event_file.close()
            for sink in self.sinks:
                sink.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the metrics writer of {self.run_dir} is closed")

    def _write_remote(self) -> None:
        storage.write_bytes(self.metrics_url, bytes(self._jsonl))
        storage.write_bytes(self.event_url, bytes(self._events))
        self._last_flush = time.monotonic()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of <run_dir>/metrics.jsonl, in order ([] if there is none yet); a last line
    torn by a crash is left out."""
    data = _complete_lines(_read_if_exists(storage.join(run_dir, METRICS_FILE)))
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


# -- helpers ----------------------------------------------------------------------------------


def _number(name: str, value: Any) -> int | float:
    if not isinstance(name, str) or not name:
        raise ValueError(f"metric names must be non-empty strings, got {name!r}")
    if name in _RESERVED_KEYS:
        raise ValueError(f"metric name {name!r} is reserved (metrics.jsonl has it per line)")
    if isinstance(value, str | bytes):
        raise TypeError(f"metric {name!r} must be a number, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        return float(value)  # Python, NumPy and JAX scalars; NaN and inf are kept
    except (TypeError, ValueError):
        raise TypeError(f"metric {name!r} must be a number, got {value!r:.80}") from None


def _event_file_name() -> str:
    """TensorFlow's name for an event file: events.out.tfevents.<time>.<host>.<pid>.<n>."""
    global _file_counter
    with _file_counter_lock:
        _file_counter += 1
        n = _file_counter
    return f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{n}"


def _read_if_exists(url: str) -> bytes:
    return storage.read_bytes(url) if storage.exists(url) else b""


def _complete_lines(data: bytes) -> bytes:
    """`data` up to its last newline (drops a line a crash left half-written)."""
    return data[: data.rfind(b"\n") + 1]


def _open_append(url: str) -> BinaryIO:
    """A local file at `url` (a path or file:// URL), opened for appending; a half-written last
    line of an earlier process is cut off first so the next record starts a line."""
    path = url.removeprefix("file://")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    f = open(path, "a+b")  # closed by MetricsWriter.close
    if path.endswith(".jsonl"):
        f.seek(0)
        keep = len(_complete_lines(f.read()))
        f.truncate(keep)
    return f
