"""The trainer's face (protos/rlax_tpu/v1/trainer.proto): a rollout batch of host arrays
(`RolloutArrays`, what the controller assembles) and its wire format — a stream of chunks (a
header declaring every array, the arrays' raw bytes cut below `trainer.max_message_bytes`,
an end mark) and the receiver that reassembles and checks one —, a step's result, and the
controller's client (train and SFT steps, save, restore, status). No JAX: the controller
builds and sends batches without loading it; the servicer (rlax_tpu/trainer/service.py) is
the other end of the same messages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import grpc
import numpy as np

from rlax_tpu.api.tensors import dtype_name, parse_dtype, to_bytes
from rlax_tpu.config import RunConfig, TrainerConfig
from rlax_tpu.rpc import get_status
from rlax_tpu.rpc.client import ComponentClient, RpcCallError
from rlax_tpu.rpc.protos import common_pb2
from rlax_tpu.rpc.protos import trainer_pb2 as pb
from rlax_tpu.rpc.protos import trainer_pb2_grpc as pb_grpc

# A data chunk's own bytes around its payload (oneof tag, length varint): what a chunk of
# `max_message_bytes` leaves for data, with room to spare.
CHUNK_OVERHEAD_BYTES = 64


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a train step reports: `version` = step + 1, the version it made; it is published
    only if a worker may load it (a multiple of η) or it is the run's last
    (`StalenessPolicy.publishes`)."""

    step: int
    version: int
    metrics: dict[str, float]
    already_done: bool = False
    # The trained batch's content (`batch_digest`): a repeat of the step must send the same.
    batch_digest: str = ""
    # The call's, not the step's (not recorded): the co-located worker's requests run with
    # `version` from the reply on (TrainerClient.train_step's load_colocated).
    colocated_loaded: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {"step": self.step, "version": self.version, "metrics": self.metrics}
        if self.batch_digest:
            out["batch_digest"] = self.batch_digest
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepResult:
        metrics = {k: (math.nan if v is None else float(v)) for k, v in data["metrics"].items()}
        return cls(
            step=int(data["step"]),
            version=int(data["version"]),
            metrics=metrics,
            batch_digest=str(data.get("batch_digest", "")),
        )


# What a batch's digest covers: what was trained on (the log-probs follow from the tokens
# and versions, and the recomputed ones from the weights) ...
DIGESTED_FIELDS = ("tokens", "response_mask", "group_ids", "rewards", "versions")
# ... and, each where the batch carries it, what the sender computed beside the rewards.
DIGESTED_OPTIONAL_FIELDS = (
    "token_rewards",
    "token_advantages",
    "returns",
    "baseline_rewards",
    "token_versions",
)


def batch_digest(batch: Any) -> str:
    """A digest of `batch`'s DIGESTED_FIELDS and of those of DIGESTED_OPTIONAL_FIELDS it
    carries (host or device arrays; shapes and dtypes included), the same for the same
    rollouts on any host. A batch without the optional fields has the digest it had before
    they existed."""
    h = hashlib.blake2b(digest_size=16)
    for name in DIGESTED_FIELDS + DIGESTED_OPTIONAL_FIELDS:
        value = getattr(batch, name, None)
        if value is None:  # only optional fields may be absent
            continue
        a = np.ascontiguousarray(np.asarray(value))
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a)  # the contiguous buffer itself: no copy
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class RolloutArrays:
    """A rollout batch as host (numpy) arrays: what the controller assembles and sends, field
    for field `rlax_tpu.algorithms.RolloutBatch` (shapes and alignment documented there),
    which the trainer builds from it on its side.

    tokens: int32[batch, seq]; response_mask: bool[batch, seq]; group_ids: int32[batch];
    rewards: float32[batch]; behaviour_logprobs: float32[batch, seq] (the inference workers'
    log-probs; the trainer's π_rollout when it recomputes π_old for a rollout correction);
    versions: int32[batch] (the version of each row's oldest token, checked against the
    staleness bound by the trainer); reference_logprobs, values: float32[batch, seq] or None.
    What only the sender knows, None when absent (not sent): token_rewards,
    token_advantages, returns: float32[batch, seq], aligned like behaviour_logprobs;
    baseline_rewards: float32[batch]; token_versions: int32[batch, seq], the version of each
    response token (mixed-version rollouts: weights changed under them in flight), aligned
    like behaviour_logprobs, 0 off the response; absent when every token of a row is
    `versions[row]`'s. The trainer checks the staleness bound on every response token.

    response_mask is the loss mask: 1 where the target is a response token the policy
    sampled, 0 on the prompt, on padding and on a multi-turn episode's given tokens
    (observations, `RolloutRecord.loss_mask`). Nothing is learnt from a 0 position and
    nothing read there (behaviour log-probs, token versions, rewards ...) counts: "every
    response token" above means every sampled one, and `versions[row]` is the row's
    oldest sampled token's.
    """

    tokens: np.ndarray
    response_mask: np.ndarray
    group_ids: np.ndarray
    rewards: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    reference_logprobs: np.ndarray | None = None
    values: np.ndarray | None = None
    token_rewards: np.ndarray | None = None
    token_advantages: np.ndarray | None = None
    returns: np.ndarray | None = None
    baseline_rewards: np.ndarray | None = None
    token_versions: np.ndarray | None = None


# -- what a stream carries ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Field:
    """One array of a request. kind "int" -> int32, "float" -> float32, "mask" -> bool or
    float32 (as sent); rank 2 is [batch, seq], rank 1 [batch]."""

    name: str
    rank: int
    kind: Literal["int", "float", "mask"]


@dataclasses.dataclass(frozen=True)
class StreamSchema:
    """The arrays of one streaming method; `prefix` is how errors name them."""

    method: str
    prefix: str
    required: tuple[Field, ...]
    optional: tuple[Field, ...] = ()

    @property
    def fields(self) -> tuple[Field, ...]:
        return (*self.required, *self.optional)

    def arrays_of(self, batch: Any) -> dict[str, Any]:
        """{field: batch.field} of an object with the fields as attributes (RolloutArrays,
        RolloutBatch): what `batch_stream` and `pack_batch` take."""
        return {f.name: getattr(batch, f.name) for f in self.fields}


TRAIN_STEP = StreamSchema(
    "TrainStep",
    "batch.",
    (
        Field("tokens", 2, "int"),
        Field("response_mask", 2, "mask"),
        Field("group_ids", 1, "int"),
        Field("rewards", 1, "float"),
        Field("behaviour_logprobs", 2, "float"),
        Field("versions", 1, "int"),
    ),
    (
        Field("reference_logprobs", 2, "float"),
        Field("values", 2, "float"),
        Field("token_rewards", 2, "float"),
        Field("token_advantages", 2, "float"),
        Field("returns", 2, "float"),
        Field("baseline_rewards", 1, "float"),
        Field("token_versions", 2, "int"),
    ),
)
SFT_STEP = StreamSchema(
    "SftStep",
    "",
    (Field("tokens", 2, "int"), Field("targets", 2, "int"), Field("loss_mask", 2, "mask")),
)


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """What a received batch may declare and hold, from the trainer's config; None = no
    limit. Checked on the header, before any data is received or memory allocated."""

    max_rows: int | None = None  # controller.global_batch_size
    max_seq_len: int | None = None  # trainer.max_seq_len
    vocab_size: int | None = None  # model.vocab_size: token ids lie in [0, vocab_size)

    @classmethod
    def from_config(cls, config: RunConfig) -> BatchLimits:
        return cls(
            max_rows=config.controller.global_batch_size,
            max_seq_len=config.trainer.max_seq_len,
            vocab_size=config.model.vocab_size,
        )


class BatchFormatError(ValueError):
    """A request's arrays are missing or inconsistent; `field` names the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


class TruncatedStreamError(BatchFormatError):
    """A stream that stopped before every declared byte and its end mark arrived."""


# -- sending -----------------------------------------------------------------------------------
def batch_stream(
    step: int,
    arrays: Mapping[str, Any],
    *,
    max_message_bytes: int = TrainerConfig.max_message_bytes,
    load_colocated: bool = False,
) -> Iterator[pb.BatchChunk]:
    """The messages of one TrainStep / SftStep call: the header, data chunks of at most
    `max_message_bytes` each, the end mark. `arrays`: name -> numpy (or JAX) array; None
    values are left out. The header is built here, the chunks as they are sent: at most one
    chunk's bytes are copied at a time (none of an array already C-order little-endian).
    `load_colocated`: the header's flag (TrainStep only)."""
    header, buffers = _header_and_buffers(step, arrays)
    header.load_colocated = load_colocated
    if header.ByteSize() + CHUNK_OVERHEAD_BYTES > max_message_bytes:
        raise ValueError(
            f"the header alone ({header.ByteSize()} bytes) does not fit max_message_bytes = "
            f"{max_message_bytes}; raise trainer.max_message_bytes"
        )
    return _chunks(header, buffers, max_message_bytes - CHUNK_OVERHEAD_BYTES)


def _header_and_buffers(
    step: int, arrays: Mapping[str, Any]
) -> tuple[pb.BatchHeader, list[memoryview]]:
    header, buffers = pb.BatchHeader(step=step), []
    for name, array in arrays.items():
        if array is None:
            continue
        array = np.asarray(array)
        header.tensors.add(name=name, dtype=dtype_name(array.dtype), shape=array.shape)
        buffers.append(to_bytes(array))
    return header, buffers


def _chunks(
    header: pb.BatchHeader, buffers: list[memoryview], payload_bytes: int
) -> Iterator[pb.BatchChunk]:
    yield pb.BatchChunk(header=header)
    for buffer in buffers:  # a chunk never spans two arrays: no copy to join them
        for start in range(0, len(buffer), payload_bytes):
            yield pb.BatchChunk(data=bytes(buffer[start : start + payload_bytes]))
    yield pb.BatchChunk(end=pb.BatchEnd())


def pack_batch(step: int, arrays: Mapping[str, Any]) -> list[bytes | memoryview]:
    """The stream as parts of one byte string (a length-prefixed header, then the data), for
    a channel without a message limit (the multi-host trainer's broadcast); join them once."""
    header, buffers = _header_and_buffers(step, arrays)
    encoded = header.SerializeToString()
    return [struct.pack("<Q", len(encoded)), encoded, *buffers]


def unpack_batch(
    packed: bytes | memoryview, schema: StreamSchema, limits: BatchLimits | None = None
) -> tuple[int, dict[str, np.ndarray | None]]:
    """The inverse of `pack_batch`, with the checks of `BatchReceiver`."""
    packed = memoryview(packed)
    (size,) = struct.unpack_from("<Q", packed)
    receiver = BatchReceiver(schema, limits)
    receiver.header(pb.BatchHeader.FromString(packed[8 : 8 + size]))
    receiver.data(packed[8 + size :])
    receiver.end()
    return receiver.finish()


# -- receiving ---------------------------------------------------------------------------------
class BatchReceiver:
    """Reassembles and checks one stream of BatchChunks (docs/trainer.md, "The wire").

        receiver = BatchReceiver(TRAIN_STEP, limits)
        for chunk in chunks:
            receiver.add(chunk)
        step, arrays = receiver.finish()

    The header is checked against the schema and `limits` before anything is allocated;
    then each array is allocated once at its declared size and the data is copied into it as
    it arrives, so the receiver holds one copy of the batch and one chunk. Any breach raises
    BatchFormatError (TruncatedStreamError for a stream cut short) naming the problem.
    """

    def __init__(self, schema: StreamSchema, limits: BatchLimits | None = None) -> None:
        self.schema, self.limits = schema, limits or BatchLimits()
        self.step: int | None = None
        self.load_colocated = False  # the header's (TrainStep only)
        self._arrays: dict[str, np.ndarray] = {}
        self._targets: list[tuple[str, np.ndarray]] = []  # (field, flat uint8 view), in order
        self._index = self._offset = 0  # where the next byte goes: target, byte in it
        self.received_bytes = self.declared_bytes = 0
        self._ended = False

    @property
    def _stream(self) -> str:
        return f"the {self.schema.method} stream"

    def add(self, chunk: pb.BatchChunk) -> None:
        part = chunk.WhichOneof("part")
        if part == "header":
            self.header(chunk.header)
        elif part == "data":
            self.data(chunk.data)
        elif part == "end":
            self.end()
        else:
            raise BatchFormatError(self._stream, "has an empty message (no header, data or end)")

    def _check_order(self, part: Literal["header", "data", "end"]) -> None:
        """Refuse `part` where the stream's order (header, data..., end) does not allow it."""
        if self._ended:
            raise BatchFormatError(self._stream, "has a message after its end")
        if part == "header" and self.step is not None:
            raise BatchFormatError(self._stream, "has a second header: one stream is one batch")
        if part != "header" and self.step is None:
            raise BatchFormatError(
                self._stream, f"sent {part} before its header: the header comes first"
            )

    def header(self, header: pb.BatchHeader) -> None:
        self._check_order("header")
        check_step(header.step)
        declared = self._check_header(header)
        for name, (dtype, shape) in declared.items():
            little = dtype.newbyteorder("<")  # the wire's byte order (== dtype on most hosts)
            array = np.empty(shape, dtype if little == dtype else little)
            self._arrays[name] = array
            self._targets.append((f"{self.schema.prefix}{name}", array.reshape(-1).view(np.uint8)))
        self.declared_bytes = sum(target.size for _, target in self._targets)
        if header.load_colocated and self.schema is not TRAIN_STEP:
            raise BatchFormatError(
                self._stream, "asks for load_colocated, which only TrainStep makes a version for"
            )
        self.load_colocated = header.load_colocated
        self.step = header.step

    def data(self, data: bytes | memoryview) -> None:
        self._check_order("data")
        source = np.frombuffer(data, np.uint8)
        if self.received_bytes + source.size > self.declared_bytes:
            raise BatchFormatError(
                self._stream,
                f"carries more data than its header declares ({self.declared_bytes} bytes): "
                "each array's dtype and shape in the header must match the bytes sent",
            )
        done = 0
        while done < source.size:
            target = self._targets[self._index][1]
            n = min(target.size - self._offset, source.size - done)
            target[self._offset : self._offset + n] = source[done : done + n]
            done += n
            self._offset += n
            if self._offset == target.size:
                self._index, self._offset = self._index + 1, 0
        self.received_bytes += source.size

    def end(self) -> None:
        self._check_order("end")
        if self.received_bytes < self.declared_bytes:
            raise TruncatedStreamError(
                self._targets[self._index][0],
                f"is incomplete: {self._stream} ended after {self.received_bytes} of the "
                f"{self.declared_bytes} bytes its header declares (chunks are missing); "
                "send the whole batch again",
            )
        self._ended = True

    def finish(self) -> tuple[int, dict[str, np.ndarray | None]]:
        """(step, {field: array or None}) once the stream has ended; the arrays are cast to
        their field's dtype (int32, float32, bool|float32 for masks)."""
        if self.step is None:
            raise TruncatedStreamError(
                self._stream, "ended without a header: no batch was sent; send the step again"
            )
        if not self._ended:
            where = (
                f" ({self._targets[self._index][0]} is incomplete)"
                if self.received_bytes < self.declared_bytes
                else ""
            )
            raise TruncatedStreamError(
                self._stream,
                f"stopped without its end message after {self.received_bytes} of "
                f"{self.declared_bytes} bytes{where}: the client stopped midway; send the "
                "step again",
            )
        out: dict[str, np.ndarray | None] = {}
        for field in self.schema.fields:
            array = self._arrays.get(field.name)
            out[field.name] = None if array is None else _cast(array, field.kind)
        return self.step, out

    def _check_header(self, header: pb.BatchHeader) -> dict[str, tuple[np.dtype, tuple]]:
        """{name: (dtype, shape)} of a header that fits the schema and the limits."""
        schema, limits, prefix = self.schema, self.limits, self.schema.prefix
        by_name = {f.name: f for f in schema.fields}
        declared: dict[str, tuple[np.dtype, tuple]] = {}
        batch = seq = None
        first = f"{prefix}{schema.required[0].name}"
        for spec in header.tensors:
            name = f"{prefix}{spec.name}"
            field = by_name.get(spec.name)
            if field is None:
                known = ", ".join(f.name for f in schema.fields)
                raise BatchFormatError(name, f"is not a {schema.method} field (fields: {known})")
            if spec.name in declared:
                raise BatchFormatError(name, "is declared twice in the header")
            dtype = _check_dtype(spec.dtype, name, field.kind)
            shape = tuple(spec.shape)
            if len(shape) != field.rank:
                dims = "[batch, seq]" if field.rank == 2 else "[batch]"
                raise BatchFormatError(name, f"must have shape {dims}, got {list(shape)}")
            if any(d < 0 for d in shape):
                raise BatchFormatError(name, f"has a negative dimension in shape {list(shape)}")
            batch = shape[0] if batch is None else batch
            if shape[0] != batch:
                raise BatchFormatError(name, f"has {shape[0]} sequences, {first} has {batch}")
            if limits.max_rows is not None and batch > limits.max_rows:
                raise BatchFormatError(
                    name,
                    f"declares {batch} sequences, more than the global batch of "
                    f"{limits.max_rows} (controller.prompts_per_batch × "
                    "controller.samples_per_prompt); a step takes exactly the global batch",
                )
            if field.rank == 2:
                seq = shape[1] if seq is None else seq
                if shape[1] != seq:
                    raise BatchFormatError(name, f"has length {shape[1]}, {first} has {seq}")
                if limits.max_seq_len is not None and seq > limits.max_seq_len:
                    raise BatchFormatError(
                        name,
                        f"declares length {seq}, over trainer.max_seq_len "
                        f"({limits.max_seq_len}): cut the sequences to at most "
                        f"{limits.max_seq_len} tokens, or raise trainer.max_seq_len",
                    )
            declared[spec.name] = (dtype, shape)
        for field in schema.required:
            if field.name not in declared:
                raise BatchFormatError(f"{prefix}{field.name}", "is missing")
        if batch == 0 or seq == 0:
            raise BatchFormatError(first, "is empty")
        return declared


def _check_dtype(name: str, field: str, kind: str) -> np.dtype:
    try:
        dtype = parse_dtype(name)
    except (TypeError, ValueError):
        raise BatchFormatError(field, f"has unknown dtype {name!r}") from None
    if dtype.kind not in "biufV" or dtype.itemsize == 0:
        raise BatchFormatError(field, f"has non-numeric dtype {name!r}")
    if kind == "int" and not np.issubdtype(dtype, np.integer):
        raise BatchFormatError(field, f"must be an integer array, got {dtype.name}")
    mask_ok = kind == "mask" and (dtype == np.bool_ or np.issubdtype(dtype, np.integer))
    if kind != "int" and not (mask_ok or _is_float(dtype)):
        raise BatchFormatError(field, f"must be a floating-point array, got {dtype.name}")
    return dtype


def _is_float(dtype: np.dtype) -> bool:
    # bfloat16 and the float8 types (ml_dtypes) are not np.floating subtypes.
    return np.issubdtype(dtype, np.floating) or (
        dtype.kind == "V" and dtype.name.startswith(("bfloat", "float"))
    )


def _cast(array: np.ndarray, kind: str) -> np.ndarray:
    """`array` (dtype checked by `_check_dtype`) as its field's dtype; no copy when it
    already is (the usual case: int32, float32, bool)."""
    if kind == "int":
        return array.astype(np.int32, copy=False)
    if kind == "mask" and array.dtype == np.bool_:
        return array
    return array.astype(np.float32, copy=False)


def check_step(step: int) -> None:
    if step < 0:
        raise BatchFormatError("step", f"must be >= 0, got {step}")


def check_tokens(tokens: np.ndarray, field: str, vocab_size: int | None) -> None:
    # An out-of-range id would be clamped silently inside the jitted embedding lookup.
    if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise BatchFormatError(field, f"must lie in [0, {vocab_size}) (model.vocab_size)")


def result_to_proto(result: StepResult) -> pb.TrainStepReply:
    return pb.TrainStepReply(
        step=result.step,
        version=result.version,
        already_done=result.already_done,
        metrics={str(k): float(v) for k, v in result.metrics.items()},
        colocated_loaded=result.colocated_loaded,
    )


def result_from_proto(reply: pb.TrainStepReply) -> StepResult:
    return StepResult(
        step=reply.step,
        version=reply.version,
        metrics=dict(reply.metrics),
        already_done=reply.already_done,
        colocated_loaded=reply.colocated_loaded,
    )


# -- client side -------------------------------------------------------------------------------
class TrainerCallError(RpcCallError):
    """A call to the trainer failed; `code` is its gRPC status."""


class TrainerClient(ComponentClient):
    """Drives one trainer process: train and SFT steps, save, restore, status.

    `max_message_bytes`: the largest message of a step's stream; at most the trainer's
    `trainer.max_message_bytes` (default: the config's default)."""

    def __init__(
        self, address: str, *, max_message_bytes: int | None = None, **channel_options: Any
    ) -> None:
        super().__init__(address, **channel_options)
        self.max_message_bytes = max_message_bytes or TrainerConfig.max_message_bytes
        self._stub = pb_grpc.TrainerStub(self._channel)

    def train_step(
        self, step: int, batch: RolloutArrays | Any, *, load_colocated: bool = False
    ) -> StepResult:
        """Train step `step` on `batch` (making version step + 1, published only if workers
        may load it or it is the run's last), or its recorded result. `load_colocated`
        (inference.colocated): the worker in the trainer's process queues its load of the
        new version before the reply, so every request after it runs with that version
        (`StepResult.colocated_loaded` says whether it did)."""
        arrays = TRAIN_STEP.arrays_of(batch)
        return self._stream("TrainStep", step, arrays, load_colocated=load_colocated)

    def sft_step(self, step: int, tokens: Any, targets: Any, loss_mask: Any) -> StepResult:
        """tokens, targets: int32[batch, seq]; loss_mask: bool|float32[batch, seq]."""
        arrays = {"tokens": tokens, "targets": targets, "loss_mask": loss_mask}
        return self._stream("SftStep", step, arrays)

    def save(self, wait: bool = True) -> int:
        """Checkpoint the trainer; returns the step the checkpoint holds."""
        return self._call("Save", pb.SaveRequest(wait=wait), "Save").step

    def restore(self, step: int | None = None) -> int:
        """Restore checkpoint `step` (default: the newest complete one); returns the step."""
        request = pb.RestoreRequest() if step is None else pb.RestoreRequest(step=step)
        return self._call("Restore", request, f"Restore({step})").step

    def republish(self, version: int) -> int:
        """Publish `version`, the one the trainer holds, again (a restarted parameter server
        lost it); FAILED_PRECONDITION for any other version."""
        request = pb.RepublishRequest(version=version)
        return self._call("Republish", request, f"Republish({version})").version

    def warm_start_step(self) -> int:
        """The SFT warm start's next step (== trainer.warm_start.steps once version 0 exists)."""
        return int(self.status().details.get("warm_start_step", "0"))

    def status(self) -> common_pb2.ComponentStatus:
        try:
            return get_status(self._channel)
        except grpc.RpcError as e:
            raise _call_error(e, f"GetStatus on {self.address}") from None

    def _stream(
        self, method: str, step: int, arrays: Mapping[str, Any], load_colocated: bool = False
    ) -> StepResult:
        chunks = batch_stream(
            step, arrays, max_message_bytes=self.max_message_bytes, load_colocated=load_colocated
        )
        try:
            reply = getattr(self._stub, method)(chunks, timeout=self.timeout_s)
        except grpc.RpcError as e:
            error = _call_error(e, f"{method}({step}) on {self.address}")
            if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a message over its limit
                error = TrainerCallError(
                    f"{error}; this client sends messages of up to {self.max_message_bytes} "
                    "bytes: give the controller and `serve trainer` the same "
                    "trainer.max_message_bytes",
                    error.code,
                )
            raise error from None
        return result_from_proto(reply)

    def _call(self, method: str, request: Any, what: str) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _call_error(e, f"{what} on {self.address}") from None


def _call_error(e: grpc.RpcError, what: str) -> TrainerCallError:
    return TrainerCallError.from_rpc(e, what)
