"""The InferenceWorker gRPC servicer (protos/rlax_tpu/v1/inference.proto) over an
InferenceWorker. A thin layer: messages <-> the types of rlax_tpu.api.inference (its codecs),
worker errors -> status codes (its STATUS_CODES). The client is in rlax_tpu.api.inference.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import grpc

from rlax_tpu.api.inference import (
    InferenceWorkerError,
    request_from_proto,
    rollout_to_proto,
    status_code,
)
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.rpc.protos import inference_pb2 as pb
from rlax_tpu.rpc.protos import inference_pb2_grpc as pb_grpc


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
            ended = [(e.prompt_id, e.sample_index, e.version) for e in request.ended]
            stream = self.worker.generate(requests, version=version, ended=ended)
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
