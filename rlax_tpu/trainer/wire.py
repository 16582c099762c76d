"""The trainer's wire format (protos/rlax_tpu/v1/trainer.proto), shared by its client and its
servicer: arrays as raw-byte Tensors, a rollout batch of host arrays (`RolloutArrays`, what
the controller assembles), the checks a received batch must pass, and a step's result. No
JAX: the controller builds and sends batches without loading it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from rlax_tpu.param_server.layout import dtype_name, parse_dtype, to_bytes
from rlax_tpu.rpc.protos import trainer_pb2 as pb


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a train step reports: `version` = step + 1 was published."""

    step: int
    version: int
    metrics: dict[str, float]
    already_done: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "metrics": self.metrics}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepResult:
        metrics = {k: (math.nan if v is None else float(v)) for k, v in data["metrics"].items()}
        return cls(step=int(data["step"]), version=int(data["version"]), metrics=metrics)


@dataclasses.dataclass(frozen=True)
class RolloutArrays:
    """A rollout batch as host (numpy) arrays: what the controller assembles and sends, field
    for field `rlax_tpu.algorithms.RolloutBatch` (shapes and alignment documented there),
    which the trainer builds from it on its side.

    tokens: int32[batch, seq]; response_mask: bool[batch, seq]; group_ids: int32[batch];
    rewards: float32[batch]; behaviour_logprobs: float32[batch, seq]; versions: int32[batch]
    (the version that generated each row, checked against the staleness bound by the
    trainer); reference_logprobs, values: float32[batch, seq] or None.
    """

    tokens: np.ndarray
    response_mask: np.ndarray
    group_ids: np.ndarray
    rewards: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    reference_logprobs: np.ndarray | None = None
    values: np.ndarray | None = None


# (field, rank, kind): kind "int" -> int32, "float" -> float32, "mask" -> bool or float32.
BATCH_FIELDS = (
    ("tokens", 2, "int"),
    ("response_mask", 2, "mask"),
    ("group_ids", 1, "int"),
    ("rewards", 1, "float"),
    ("behaviour_logprobs", 2, "float"),
    ("versions", 1, "int"),
)
OPTIONAL_BATCH_FIELDS = (("reference_logprobs", 2, "float"), ("values", 2, "float"))
SFT_FIELDS = (("tokens", 2, "int"), ("targets", 2, "int"), ("loss_mask", 2, "mask"))


class BatchFormatError(ValueError):
    """A request's arrays are missing or inconsistent; `field` names the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


# -- conversions ------------------------------------------------------------------------------
def tensor_to_proto(array: Any, out: pb.Tensor | None = None) -> pb.Tensor:
    """`array` (numpy or JAX) as a Tensor: dtype name, shape, C-order little-endian bytes;
    written into `out` (a message's field) when given, saving a copy of the bytes."""
    array = np.asarray(array)
    out = pb.Tensor() if out is None else out
    out.dtype = dtype_name(array.dtype)
    out.shape[:] = array.shape
    out.data = bytes(to_bytes(array))
    return out


def tensor_from_proto(message: pb.Tensor, field: str) -> np.ndarray:
    """The array in `message` (read-only, no copy of the received bytes)."""
    try:
        dtype = parse_dtype(message.dtype)
    except (TypeError, ValueError):
        raise BatchFormatError(field, f"has unknown dtype {message.dtype!r}") from None
    if dtype.kind not in "biufV" or dtype.itemsize == 0:
        raise BatchFormatError(field, f"has non-numeric dtype {message.dtype!r}")
    shape = tuple(message.shape)
    if any(d < 0 for d in shape):
        raise BatchFormatError(field, f"has a negative dimension in shape {list(shape)}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(message.data) != expected:
        raise BatchFormatError(
            field,
            f"has {len(message.data)} bytes of data; {message.dtype}{list(shape)} needs {expected}",
        )
    return np.frombuffer(message.data, dtype.newbyteorder("<")).reshape(shape)


def _is_float(dtype: np.dtype) -> bool:
    # bfloat16 and the float8 types (ml_dtypes) are not np.floating subtypes.
    return np.issubdtype(dtype, np.floating) or (
        dtype.kind == "V" and dtype.name.startswith(("bfloat", "float"))
    )


def _cast(array: np.ndarray, field: str, kind: str) -> np.ndarray:
    dtype = array.dtype
    if kind == "int":
        if not np.issubdtype(dtype, np.integer):
            raise BatchFormatError(field, f"must be an integer array, got {dtype.name}")
        return array.astype(np.int32, copy=False)
    if kind == "mask" and dtype == np.bool_:
        return array
    if not (_is_float(dtype) or kind == "mask" and np.issubdtype(dtype, np.integer)):
        raise BatchFormatError(field, f"must be a floating-point array, got {dtype.name}")
    return array.astype(np.float32, copy=False)


def arrays_from_proto(
    message: Any, prefix: str, fields: tuple, *, optional: tuple = ()
) -> dict[str, np.ndarray | None]:
    """Decode and check `fields` of `message`: the rank, the dtype kind, and that every
    per-sequence dimension equals the batch size and every per-token one the length."""
    out: dict[str, np.ndarray | None] = {}
    batch = seq = None
    for (name, rank, kind), required in [
        *((f, True) for f in fields),
        *((f, False) for f in optional),
    ]:
        field = f"{prefix}{name}"
        if not message.HasField(name):
            if required:
                raise BatchFormatError(field, "is missing")
            out[name] = None
            continue
        array = _cast(tensor_from_proto(getattr(message, name), field), field, kind)
        if array.ndim != rank:
            dims = "[batch, seq]" if rank == 2 else "[batch]"
            raise BatchFormatError(field, f"must have shape {dims}, got {list(array.shape)}")
        if batch is None:
            batch = array.shape[0]
        if array.shape[0] != batch:
            raise BatchFormatError(
                field, f"has {array.shape[0]} sequences, {prefix}{fields[0][0]} has {batch}"
            )
        if rank == 2:
            if seq is None:
                seq = array.shape[1]
            if array.shape[1] != seq:
                raise BatchFormatError(
                    field, f"has length {array.shape[1]}, {prefix}{fields[0][0]} has {seq}"
                )
        out[name] = array
    if batch == 0 or seq == 0:
        raise BatchFormatError(f"{prefix}{fields[0][0]}", "is empty")
    return out


def batch_to_proto(
    batch: RolloutArrays | Any, out: pb.RolloutBatchMessage | None = None
) -> pb.RolloutBatchMessage:
    """`batch` as a message (written into `out` when given); None fields are left unset."""
    message = pb.RolloutBatchMessage() if out is None else out
    for name, _, _ in (*BATCH_FIELDS, *OPTIONAL_BATCH_FIELDS):
        value = getattr(batch, name)
        if value is not None:
            tensor_to_proto(value, getattr(message, name))
    return message


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
    )


def result_from_proto(reply: pb.TrainStepReply) -> StepResult:
    return StepResult(
        step=reply.step,
        version=reply.version,
        metrics=dict(reply.metrics),
        already_done=reply.already_done,
    )
