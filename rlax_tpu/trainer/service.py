"""The Trainer gRPC service (protos/rlax_tpu/v1/trainer.proto) over a Trainer, and the client
the controller uses to drive it.

A thin layer: arrays travel as raw-byte Tensors (no per-element fields, no chunking),
a malformed batch is INVALID_ARGUMENT naming the field, and trainer errors map to status codes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np

from rlax_tpu.algorithms import RolloutBatch
from rlax_tpu.param_server.layout import dtype_name, parse_dtype, to_bytes
from rlax_tpu.rpc import MAX_MESSAGE_BYTES, get_status
from rlax_tpu.rpc.client import ComponentClient, RpcCallError
from rlax_tpu.rpc.protos import common_pb2
from rlax_tpu.rpc.protos import trainer_pb2 as pb
from rlax_tpu.rpc.protos import trainer_pb2_grpc as pb_grpc
from rlax_tpu.trainer import (
    BatchSizeError,
    NotInitializedError,
    NoValidCheckpointError,
    OutOfOrderStepError,
    StepResult,
    Trainer,
)

# (field, rank, kind): kind "int" -> int32, "float" -> float32, "mask" -> bool or float32.
_BATCH_FIELDS = (
    ("tokens", 2, "int"),
    ("response_mask", 2, "mask"),
    ("group_ids", 1, "int"),
    ("rewards", 1, "float"),
    ("behaviour_logprobs", 2, "float"),
    ("versions", 1, "int"),
)
_OPTIONAL_BATCH_FIELDS = (("reference_logprobs", 2, "float"), ("values", 2, "float"))
_SFT_FIELDS = (("tokens", 2, "int"), ("targets", 2, "int"), ("loss_mask", 2, "mask"))


class BatchFormatError(ValueError):
    """A request's arrays are missing or inconsistent; `field` names the culprit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    OutOfOrderStepError: grpc.StatusCode.FAILED_PRECONDITION,
    NotInitializedError: grpc.StatusCode.FAILED_PRECONDITION,
    BatchFormatError: grpc.StatusCode.INVALID_ARGUMENT,
    BatchSizeError: grpc.StatusCode.INVALID_ARGUMENT,  # the batch does not fit the config
    NoValidCheckpointError: grpc.StatusCode.NOT_FOUND,  # Restore of a step never saved
}


def status_code(error: BaseException) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


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


def _arrays_from_proto(
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
    batch: RolloutBatch, out: pb.RolloutBatchMessage | None = None
) -> pb.RolloutBatchMessage:
    """`batch` as a message (written into `out` when given); None fields are left unset."""
    message = pb.RolloutBatchMessage() if out is None else out
    for name, _, _ in (*_BATCH_FIELDS, *_OPTIONAL_BATCH_FIELDS):
        value = getattr(batch, name)
        if value is not None:
            tensor_to_proto(value, getattr(message, name))
    return message


def batch_from_proto(
    message: pb.RolloutBatchMessage, *, vocab_size: int | None = None
) -> RolloutBatch:
    """A RolloutBatch of host arrays, or BatchFormatError naming the first bad field."""
    arrays = _arrays_from_proto(message, "batch.", _BATCH_FIELDS, optional=_OPTIONAL_BATCH_FIELDS)
    _check_tokens(arrays["tokens"], "batch.tokens", vocab_size)
    group_ids, size = arrays["group_ids"], arrays["tokens"].shape[0]
    if group_ids.min() < 0 or group_ids.max() >= size:
        raise BatchFormatError("batch.group_ids", f"must lie in [0, {size}) (the batch size)")
    return RolloutBatch(**arrays)


def _check_tokens(tokens: np.ndarray, field: str, vocab_size: int | None) -> None:
    # An out-of-range id would be clamped silently inside the jitted embedding lookup.
    if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise BatchFormatError(field, f"must lie in [0, {vocab_size}) (model.vocab_size)")


def sft_arrays_from_proto(
    message: pb.SftStepRequest, *, vocab_size: int | None = None
) -> dict[str, np.ndarray]:
    """{tokens, targets, loss_mask} of an SftStep request, checked like a batch."""
    arrays = _arrays_from_proto(message, "", _SFT_FIELDS)
    for name in ("tokens", "targets"):
        _check_tokens(arrays[name], name, vocab_size)
    return arrays


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


# -- server side --------------------------------------------------------------------------------
class TrainerServicer(pb_grpc.TrainerServicer):
    """Serves one Trainer; calls that change it run one at a time (`lock`), so a retry that
    arrives while its step is still training waits and then finds it done."""

    def __init__(self, trainer: Trainer, *, vocab_size: int | None = None) -> None:
        self.trainer = trainer
        self.vocab_size = vocab_size
        self.lock = threading.Lock()

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_TrainerServicer_to_server(self, server)

    def TrainStep(
        self, request: pb.TrainStepRequest, context: grpc.ServicerContext
    ) -> pb.TrainStepReply:
        start = time.perf_counter()
        try:
            _check_step(request.step)
            if not request.HasField("batch"):
                raise BatchFormatError("batch", "is missing")
            batch = batch_from_proto(request.batch, vocab_size=self.vocab_size)
            decoded = time.perf_counter()
            with self.lock:
                result = self.trainer.train_step(request.step, batch)
        except Exception as e:
            _abort(context, e)
        if not result.already_done:  # the handler's own time, around the trainer's figures
            result.metrics["time/decode_batch_s"] = decoded - start
            result.metrics["time/handler_s"] = time.perf_counter() - start
        return result_to_proto(result)

    def SftStep(
        self, request: pb.SftStepRequest, context: grpc.ServicerContext
    ) -> pb.TrainStepReply:
        try:
            _check_step(request.step)
            arrays = sft_arrays_from_proto(request, vocab_size=self.vocab_size)
            with self.lock:
                result = self.trainer.sft_step(request.step, **arrays)
        except Exception as e:
            _abort(context, e)
        return result_to_proto(result)

    def Save(self, request: pb.SaveRequest, context: grpc.ServicerContext) -> pb.SaveReply:
        try:
            with self.lock:
                step = self.trainer.save(wait=request.wait)
        except Exception as e:
            _abort(context, e)
        return pb.SaveReply(step=step)

    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreReply:
        try:
            step = request.step if request.HasField("step") else None
            if step is not None:
                _check_step(step)
            with self.lock:
                step = self.trainer.restore(step)
        except Exception as e:
            _abort(context, e)
        return pb.RestoreReply(step=step)


def _check_step(step: int) -> None:
    if step < 0:
        raise BatchFormatError("step", f"must be >= 0, got {step}")


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    """End the call with `error`'s status; unexpected errors say what they were (INTERNAL)."""
    code = status_code(error)
    if code == grpc.StatusCode.INTERNAL:
        context.abort(code, f"{type(error).__name__}: {error}")
    context.abort(code, str(error))


def trainer_status(trainer: Trainer, *, instance_id: str, config_digest: str) -> Mapping[str, Any]:
    """ComponentStatus fields for the Health service: the version held (= the next step)
    and, in details, the trainer's status as text, with the last step's metrics each as
    `metrics/<name>` (repr: exact floats)."""
    details: dict[str, str] = {}
    for key, value in trainer.status().items():
        if isinstance(value, Mapping):
            details.update({f"{key}/{k}": repr(float(v)) for k, v in value.items()})
        else:
            details[str(key)] = str(value)
    return {
        "component": "trainer",
        "instance_id": instance_id,
        "version": int(trainer.step),
        "config_digest": config_digest,
        "details": details,
    }


# -- client side ------------------------------------------------------------------------------
class TrainerCallError(RpcCallError):
    """A call to the trainer failed; `code` is its gRPC status."""


class TrainerClient(ComponentClient):
    """Drives one trainer process: train and SFT steps, save, restore, status."""

    def __init__(self, address: str, **channel_options: Any) -> None:
        super().__init__(address, **channel_options)
        self._stub = pb_grpc.TrainerStub(self._channel)

    def train_step(self, step: int, batch: RolloutBatch) -> StepResult:
        """Train step `step` on `batch` (publishing version step + 1), or its recorded result."""
        request = pb.TrainStepRequest(step=step)
        batch_to_proto(batch, request.batch)
        return result_from_proto(self._call("TrainStep", request, f"TrainStep({step})"))

    def sft_step(self, step: int, tokens: Any, targets: Any, loss_mask: Any) -> StepResult:
        """tokens, targets: int32[batch, seq]; loss_mask: bool|float32[batch, seq]."""
        request = pb.SftStepRequest(step=step)
        for name, array in (("tokens", tokens), ("targets", targets), ("loss_mask", loss_mask)):
            tensor_to_proto(array, getattr(request, name))
        return result_from_proto(self._call("SftStep", request, f"SftStep({step})"))

    def save(self, wait: bool = True) -> int:
        """Checkpoint the trainer; returns the step the checkpoint holds."""
        return self._call("Save", pb.SaveRequest(wait=wait), "Save").step

    def restore(self, step: int | None = None) -> int:
        """Restore checkpoint `step` (default: the newest complete one); returns the step."""
        request = pb.RestoreRequest() if step is None else pb.RestoreRequest(step=step)
        return self._call("Restore", request, f"Restore({step})").step

    def status(self) -> common_pb2.ComponentStatus:
        try:
            return get_status(self._channel)
        except grpc.RpcError as e:
            raise _call_error(e, f"GetStatus on {self.address}") from None

    def _call(self, method: str, request: Any, what: str) -> Any:
        size = request.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise TrainerCallError(
                f"{what}: the request is {size / 2**20:.1f} MiB, over the "
                f"{MAX_MESSAGE_BYTES // 2**20} MiB gRPC message limit "
                "(rlax_tpu.rpc.MAX_MESSAGE_BYTES); send fewer or shorter sequences per step",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _call_error(e, f"{what} on {self.address}") from None


def _call_error(e: grpc.RpcError, what: str) -> TrainerCallError:
    return TrainerCallError.from_rpc(e, what)
