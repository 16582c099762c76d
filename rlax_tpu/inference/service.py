"""The InferenceWorker gRPC service (protos/rlax_tpu/v1/inference.proto) over an InferenceWorker,
and the client the controller uses to drive a worker.

A thin layer: messages <-> engine dataclasses, worker errors -> status codes (STATUS_CODES).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from rlax_tpu.inference.engine import GenerationRequest, Rollout
from rlax_tpu.inference.sampling import SamplingParams
from rlax_tpu.inference.worker import (
    InferenceWorker,
    InferenceWorkerError,
    InvalidRequestError,
    LoadResult,
    NoParamServerError,
    NotLoadableError,
    NotLoadedError,
    PullFailedError,
    UnknownVersionError,
    VersionMismatchError,
    WorkerClosedError,
    resolve_sampling,
)
from rlax_tpu.rpc import get_status
from rlax_tpu.rpc.client import ComponentClient, RpcCallError
from rlax_tpu.rpc.protos import common_pb2
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
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "aborted": pb.FINISH_REASON_ABORTED,
    "error": pb.FINISH_REASON_ERROR,
}
_FINISH_NAMES = {v: k for k, v in _FINISH_REASONS.items()}
_SCALAR_OVERRIDES = ("temperature", "top_p", "top_k", "max_new_tokens", "logprobs_of")


def status_code(error: BaseException) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


# -- conversions ------------------------------------------------------------------------------
def request_to_proto(request: GenerationRequest, defaults: SamplingParams | None = None):
    """A GenerationRequest message; sampling fields equal to `defaults` are left unset."""
    message = pb.GenerationRequest(
        request_id=request.request_id,
        prompt_id=request.prompt_id,
        sample_index=request.sample_index,
        prompt_tokens=[int(t) for t in request.prompt_tokens],
    )
    if request.sampling is not None:
        sampling = request.sampling
        for name in _SCALAR_OVERRIDES:
            value = getattr(sampling, name)
            if defaults is None or value != getattr(defaults, name):
                setattr(message.sampling, name, value)
        if defaults is None or sampling.stop_token_ids != defaults.stop_token_ids:
            message.sampling.stop_token_ids.ids.extend(sampling.stop_token_ids)
        message.sampling.SetInParent()  # present even when nothing differs from `defaults`
    return message


def request_from_proto(message: pb.GenerationRequest, defaults: SamplingParams):
    """A GenerationRequest; unset sampling fields take `defaults` (the worker's config)."""
    sampling = None
    if message.HasField("sampling"):
        overrides: dict[str, Any] = {
            name: getattr(message.sampling, name)
            for name in _SCALAR_OVERRIDES
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
        finish_reason=_FINISH_REASONS[rollout.finish_reason],
        error=rollout.error,
    )


def rollout_from_proto(message: pb.RolloutMessage) -> Rollout:
    return Rollout(
        request_id=message.request_id,
        prompt_id=message.prompt_id,
        sample_index=message.sample_index,
        version=message.version,
        prompt_tokens=tuple(message.prompt_tokens),
        tokens=tuple(message.tokens),
        logprobs=tuple(message.logprobs),  # float32 values, as the engine's
        finish_reason=_FINISH_NAMES.get(message.finish_reason, "error"),
        error=message.error,
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
            result = self.worker.load(request.version)
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


# -- client side ------------------------------------------------------------------------------
class InferenceCallError(RpcCallError):
    """A call to an inference worker failed; `code` is its gRPC status."""


class InferenceWorkerClient(ComponentClient):
    """Drives one inference worker process: load versions, generate batches, read status."""

    def __init__(self, address: str, **channel_options: Any) -> None:
        super().__init__(address, **channel_options)
        self._stub = pb_grpc.InferenceWorkerStub(self._channel)

    def load(self, version: int) -> LoadResult:
        try:
            reply = self._stub.Load(pb.LoadRequest(version=version), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _call_error(e, f"Load({version}) on {self.address}") from None
        aborted = tuple(rollout_from_proto(m) for m in reply.aborted)
        return LoadResult(reply.version, reply.already_loaded, aborted)

    def generate(
        self, requests: Sequence[GenerationRequest], *, version: int | None = None
    ) -> Iterator[Rollout]:
        """Rollouts of `requests` as the worker completes them."""
        message = pb.GenerateRequest(requests=[request_to_proto(r) for r in requests])
        if version is not None:
            message.version = version
        call = self._stub.Generate(message, timeout=self.timeout_s)
        try:
            for rollout in call:
                yield rollout_from_proto(rollout)
        except grpc.RpcError as e:
            raise _call_error(e, f"Generate on {self.address}") from None
        finally:
            # A caller that stops early frees the stream; the worker finishes and records
            # the requests, so a retry with the same ids costs nothing.
            call.cancel()

    def status(self) -> common_pb2.ComponentStatus:
        try:
            return get_status(self._channel)
        except grpc.RpcError as e:
            raise _call_error(e, f"GetStatus on {self.address}") from None


def _call_error(e: grpc.RpcError, what: str) -> InferenceCallError:
    return InferenceCallError.from_rpc(e, what)
