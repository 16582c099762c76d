"""The Trainer gRPC service (protos/rlax_tpu/v1/trainer.proto) over a Trainer; its client and
wire format (the batch stream, its receiver, results) are rlax_tpu/api/trainer.py.

A thin layer: a TrainStep or SftStep batch arrives as a client stream of chunks, which
`api.trainer.BatchReceiver` reassembles and checks (header against the config first, then every
declared byte and the end mark) before the trainer sees it; a malformed or truncated batch is
INVALID_ARGUMENT naming the field or the problem, and trainer errors map to status codes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc
import numpy as np

from rlax_tpu.algorithms import RolloutBatch
from rlax_tpu.api.trainer import (
    DIGESTED_OPTIONAL_FIELDS,
    SFT_STEP,
    TRAIN_STEP,
    BatchFormatError,
    BatchLimits,
    BatchReceiver,
    StreamSchema,
    TruncatedStreamError,
    check_step,
    check_tokens,
    result_to_proto,
)
from rlax_tpu.rpc.client import status_code_for
from rlax_tpu.rpc.protos import trainer_pb2 as pb
from rlax_tpu.rpc.protos import trainer_pb2_grpc as pb_grpc
from rlax_tpu.trainer import (
    BatchSizeError,
    NotInitializedError,
    NoValidCheckpointError,
    OutOfOrderStepError,
    StaleRolloutError,
    Trainer,
)

STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    OutOfOrderStepError: grpc.StatusCode.FAILED_PRECONDITION,
    StaleRolloutError: grpc.StatusCode.FAILED_PRECONDITION,  # a rollout outside [s - N, s]
    NotInitializedError: grpc.StatusCode.FAILED_PRECONDITION,
    BatchFormatError: grpc.StatusCode.INVALID_ARGUMENT,  # also a truncated stream
    BatchSizeError: grpc.StatusCode.INVALID_ARGUMENT,  # the batch does not fit the config
    NoValidCheckpointError: grpc.StatusCode.NOT_FOUND,  # Restore of a step never saved
}


def status_code(error: BaseException) -> grpc.StatusCode:
    return status_code_for(error, STATUS_CODES)


def receive(
    chunks: Iterable[pb.BatchChunk], schema: StreamSchema, limits: BatchLimits
) -> tuple[int, dict[str, np.ndarray | None], BatchReceiver]:
    """(step, arrays, the receiver: its header's options) of a whole stream, or
    BatchFormatError at its first fault (the rest of the stream is then not read)."""
    receiver = BatchReceiver(schema, limits)
    try:
        for chunk in chunks:
            receiver.add(chunk)
    except grpc.RpcError:  # raised by gRPC's request iterator: the call is over
        raise TruncatedStreamError(
            f"the {schema.method} stream",
            f"was cut off after {receiver.received_bytes} of {receiver.declared_bytes} bytes "
            "(the client cancelled the call, or its deadline passed)",
        ) from None
    return (*receiver.finish(), receiver)


def batch_from_arrays(
    arrays: Mapping[str, np.ndarray | None], *, vocab_size: int | None = None
) -> RolloutBatch:
    """A RolloutBatch of TrainStep's host arrays, or BatchFormatError naming a bad value
    (token ids, group ids; a reward, advantage, return or baseline that is not finite)."""
    check_tokens(arrays["tokens"], "batch.tokens", vocab_size)
    group_ids, size = arrays["group_ids"], arrays["tokens"].shape[0]
    if group_ids.min() < 0 or group_ids.max() >= size:
        raise BatchFormatError("batch.group_ids", f"must lie in [0, {size}) (the batch size)")
    for name in DIGESTED_OPTIONAL_FIELDS:  # a NaN here would poison the whole update
        value = arrays.get(name)
        if value is not None and not np.isfinite(value).all():
            raise BatchFormatError(f"batch.{name}", "holds a value that is not finite")
    return RolloutBatch(**arrays)


def sft_arrays(
    arrays: Mapping[str, np.ndarray | None], *, vocab_size: int | None = None
) -> dict[str, np.ndarray]:
    """{tokens, targets, loss_mask} of SftStep's host arrays, with token ids checked."""
    for name in ("tokens", "targets"):
        check_tokens(arrays[name], name, vocab_size)
    return dict(arrays)


# -- server side --------------------------------------------------------------------------------
class TrainerServicer(pb_grpc.TrainerServicer):
    """Serves one Trainer; calls that change it run one at a time (`lock`), so a retry that
    arrives while its step is still training waits and then finds it done. A batch is
    received whole, outside the lock, before the trainer is touched."""

    def __init__(self, trainer: Trainer, *, limits: BatchLimits | None = None) -> None:
        self.trainer = trainer
        self.limits = limits or BatchLimits()
        self.lock = threading.Lock()
        # inference.colocated: the worker in this process loads a version the trainer has
        # just handed it (True: its requests from then on run with it); set once that
        # worker exists.
        self.load_colocated: Callable[[int], bool] | None = None

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_TrainerServicer_to_server(self, server)

    def TrainStep(
        self, request_iterator: Iterable[pb.BatchChunk], context: grpc.ServicerContext
    ) -> pb.TrainStepReply:
        start = time.perf_counter()
        try:
            step, arrays, receiver = receive(request_iterator, TRAIN_STEP, self.limits)
            batch = batch_from_arrays(arrays, vocab_size=self.limits.vocab_size)
            received = time.perf_counter()
            with self.lock:
                result = self.trainer.train_step(step, batch)
                trained = time.perf_counter()
                if receiver.load_colocated and self.load_colocated is not None:
                    # Under the lock: the next step cannot replace what the worker takes.
                    # The worker queues the swap and returns; its requests run after it.
                    loaded = self.load_colocated(result.version)
                    result = dataclasses.replace(result, colocated_loaded=loaded)
        except Exception as e:
            _abort(context, e)
        if not result.already_done:  # the handler's own time, around the trainer's figures
            result.metrics["time/receive_batch_s"] = received - start
            if result.colocated_loaded:
                result.metrics["time/colocated_handover_s"] = time.perf_counter() - trained
            result.metrics["time/handler_s"] = time.perf_counter() - start
        return result_to_proto(result)

    def SftStep(
        self, request_iterator: Iterable[pb.BatchChunk], context: grpc.ServicerContext
    ) -> pb.TrainStepReply:
        try:
            step, arrays, _ = receive(request_iterator, SFT_STEP, self.limits)
            arrays = sft_arrays(arrays, vocab_size=self.limits.vocab_size)
            with self.lock:
                result = self.trainer.sft_step(step, **arrays)
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
                check_step(step)
            with self.lock:
                step = self.trainer.restore(step)
        except Exception as e:
            _abort(context, e)
        return pb.RestoreReply(step=step)

    def Republish(
        self, request: pb.RepublishRequest, context: grpc.ServicerContext
    ) -> pb.RepublishReply:
        try:
            check_step(request.version)
            with self.lock:
                self.trainer.republish(request.version)
        except Exception as e:
            _abort(context, e)
        return pb.RepublishReply(version=request.version)


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
