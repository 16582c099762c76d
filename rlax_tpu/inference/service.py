"""The InferenceWorker gRPC service (protos/rlax_tpu/v1/inference.proto) over an InferenceWorker,
and the client the controller uses to drive a worker.

A thin layer: messages <-> engine dataclasses, worker errors -> status codes (STATUS_CODES).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import numpy as np

from rlax_tpu.inference.client import FINISH_REASONS, SAMPLING_OVERRIDES
from rlax_tpu.inference.types import GenerationRequest, Rollout, SamplingParams
from rlax_tpu.inference.worker import (
    InferenceWorker,
    InferenceWorkerError,
    InvalidRequestError,
    NoParamServerError,
    NotLoadableError,
    NotLoadedError,
    PullFailedError,
    UnknownVersionError,
    VersionMismatchError,
    WorkerClosedError,
    resolve_sampling,
)
from rlax_tpu.rpc.protos import inference_pb2 as pb
from rlax_tpu.rpc.protos import inference_pb2_grpc as pb_grpc

STATUS_CODES: dict[type[InferenceWorkerError], grpc.StatusCode] = {
    NotLoadedError: grpc.StatusCode.FAILED_PRECONDITION,
    VersionMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    NoParamServerError: grpc.StatusCode.FAILED_PRECONDITION,
    NotLoadableError: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownVersionError: grpc.StatusCode.NOT_FOUND,
    PullFailedError: grpc.StatusCode.UNAVAILABLE,
    WorkerClosedError: grpc.StatusCode.UNAVAILABLE,
}


def status_code(error: BaseException) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


# -- conversions ------------------------------------------------------------------------------
def request_from_proto(message: pb.GenerationRequest, defaults: SamplingParams):
    """A GenerationRequest; unset sampling fields take `defaults` (the worker's config)."""
    sampling = None
    if message.HasField("sampling"):
        overrides: dict[str, Any] = {
            name: getattr(message.sampling, name)
            for name in SAMPLING_OVERRIDES
            if message.sampling.HasField(name)
        }
        if message.sampling.HasField("stop_token_ids"):
            overrides["stop_token_ids"] = tuple(message.sampling.stop_token_ids.ids)
        sampling = resolve_sampling(defaults, overrides)
    return GenerationRequest(
        request_id=message.request_id,
        prompt_id=message.prompt_id,
        sample_index=message.sample_index,
        prompt_tokens=tuple(message.prompt_tokens),
        sampling=sampling,
    )


def rollout_to_proto(rollout: Rollout) -> pb.RolloutMessage:
    return pb.RolloutMessage(
        request_id=rollout.request_id,
        prompt_id=rollout.prompt_id,
        sample_index=rollout.sample_index,
        version=rollout.version,
        prompt_tokens=np.asarray(rollout.prompt_tokens, np.int32).tolist(),
        tokens=np.asarray(rollout.tokens, np.int32).tolist(),
        logprobs=np.asarray(rollout.logprobs, np.float32).tolist(),
        finish_reason=FINISH_REASONS[rollout.finish_reason],
        error=rollout.error,
    )


# -- server side --------------------------------------------------------------------------------
class InferenceWorkerServicer(pb_grpc.InferenceWorkerServicer):
    """Serves one InferenceWorker; `add_to_server` registers it."""

    def __init__(self, worker: InferenceWorker) -> None:
        self.worker = worker

    def add_to_server(self, server: grpc.Server) -> None:
        pb_grpc.add_InferenceWorkerServicer_to_server(self, server)

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.RolloutMessage]:
        try:
            defaults = self.worker.default_sampling
            requests = [request_from_proto(r, defaults) for r in request.requests]
            version = request.version if request.HasField("version") else None
            stream = self.worker.generate(requests, version=version)
        except Exception as e:
            _abort(context, e)
        # A client that goes away must not hold this thread until its requests finish;
        # they keep running and their results are recorded for a retry.
        context.add_callback(stream.cancel)
        try:
            for rollout in stream:
                yield rollout_to_proto(rollout)
        finally:
            stream.close()

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.LoadReply:
        try:
            result = self.worker.load(request.version, evaluation=request.evaluation)
        except Exception as e:
            _abort(context, e)
        return pb.LoadReply(
            version=result.version,
            already_loaded=result.already_loaded,
            aborted=[rollout_to_proto(r) for r in result.aborted],
        )


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    """End the call with `error`'s status; unexpected errors say what they were (INTERNAL)."""
    if isinstance(error, InferenceWorkerError):
        context.abort(status_code(error), str(error))
    context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


def worker_status(
    worker: InferenceWorker, *, instance_id: str, config_digest: str
) -> Mapping[str, Any]:
    """ComponentStatus fields for the Health service: the version held and, in details,
    every engine and worker stat (free pages, queue depth, counters) as text."""
    stats = worker.stats()
    return {
        "component": "inference_worker",
        "instance_id": instance_id,
        "version": int(stats["version"]),
        "config_digest": config_digest,
        "details": {str(k): str(v) for k, v in stats.items()},
    }
