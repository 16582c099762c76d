"""The controller's client of an inference worker (protos/rlax_tpu/v1/inference.proto):
load a version, generate a batch of requests, read status. It speaks the plain types of
`rlax_tpu.inference.types` and imports no JAX; the servicer (inference/service.py) is the
other end of the same messages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from rlax_tpu.inference.types import GenerationRequest, LoadResult, Rollout, SamplingParams
from rlax_tpu.rpc import get_status
from rlax_tpu.rpc.client import ComponentClient, RpcCallError
from rlax_tpu.rpc.liveness import Watch
from rlax_tpu.rpc.protos import common_pb2
from rlax_tpu.rpc.protos import inference_pb2 as pb
from rlax_tpu.rpc.protos import inference_pb2_grpc as pb_grpc

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "aborted": pb.FINISH_REASON_ABORTED,
    "error": pb.FINISH_REASON_ERROR,
}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}
SAMPLING_OVERRIDES = ("temperature", "top_p", "top_k", "max_new_tokens", "logprobs_of")


# -- conversions (the servicer uses them too) --------------------------------------------
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
        for name in SAMPLING_OVERRIDES:
            value = getattr(sampling, name)
            if defaults is None or value != getattr(defaults, name):
                setattr(message.sampling, name, value)
        if defaults is None or sampling.stop_token_ids != defaults.stop_token_ids:
            message.sampling.stop_token_ids.ids.extend(sampling.stop_token_ids)
        message.sampling.SetInParent()  # present even when nothing differs from `defaults`
    return message


def rollout_from_proto(message: pb.RolloutMessage) -> Rollout:
    return Rollout(
        request_id=message.request_id,
        prompt_id=message.prompt_id,
        sample_index=message.sample_index,
        version=message.version,
        prompt_tokens=tuple(message.prompt_tokens),
        tokens=tuple(message.tokens),
        logprobs=tuple(message.logprobs),  # float32 values, as the engine's
        finish_reason=FINISH_NAMES.get(message.finish_reason, "error"),
        error=message.error,
    )


# -- client side ------------------------------------------------------------------------------
class InferenceCallError(RpcCallError):
    """A call to an inference worker failed; `code` is its gRPC status."""


class InferenceWorkerClient(ComponentClient):
    """Drives one inference worker process: load versions, generate batches, read status."""

    def __init__(self, address: str, **channel_options: Any) -> None:
        super().__init__(address, **channel_options)
        self._stub = pb_grpc.InferenceWorkerStub(self._channel)

    def load(
        self, version: int, *, evaluation: bool = False, watch: Watch | None = None
    ) -> LoadResult:
        """Hold `version` (a multiple of η; any published version with `evaluation`). With
        `watch` (rpc/liveness.py), a worker that stops answering fails the call with
        ComponentLostError instead of holding it."""
        request = pb.LoadRequest(version=version, evaluation=evaluation)
        future = self._stub.Load.future(request, timeout=self.timeout_s)
        if watch is not None:
            watch.start(future.cancel)
        try:
            reply = future.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            if watch is not None and not watch.accepts():
                raise watch.error() from None
            if isinstance(e, grpc.FutureCancelledError):
                raise
            raise _call_error(e, f"Load({version}) on {self.address}") from None
        finally:
            if watch is not None:
                watch.stop()
        aborted = tuple(rollout_from_proto(m) for m in reply.aborted)
        return LoadResult(reply.version, reply.already_loaded, aborted)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        *,
        version: int | None = None,
        watch: Watch | None = None,
    ) -> Iterator[Rollout]:
        """Rollouts of `requests` as the worker completes them. With `watch`, a worker that
        stops answering (or a call past the watch's deadline) ends the stream with
        ComponentLostError, and nothing that arrives after that is yielded."""
        message = pb.GenerateRequest(requests=[request_to_proto(r) for r in requests])
        if version is not None:
            message.version = version
        call = self._stub.Generate(message, timeout=self.timeout_s)
        if watch is not None:
            watch.start(call.cancel)
        try:
            for rollout in call:
                if watch is not None and not watch.accepts():
                    break  # fenced: a late answer of a worker given up
                yield rollout_from_proto(rollout)
        except grpc.RpcError as e:
            if watch is None or watch.accepts():
                raise _call_error(e, f"Generate on {self.address}") from None
        finally:
            if watch is not None:
                watch.stop()
            # A caller that stops early frees the stream; the worker finishes and records
            # the requests, so a retry with the same ids costs nothing.
            call.cancel()
        if watch is not None and not watch.accepts():
            raise watch.error()

    def status(self, timeout_s: float = 10.0) -> common_pb2.ComponentStatus:
        try:
            return get_status(self._channel, timeout_s=timeout_s)
        except grpc.RpcError as e:
            raise _call_error(e, f"GetStatus on {self.address}") from None

    def status_details(self, timeout_s: float) -> dict[str, str]:
        """The status's details (a `Watch`'s health check: compile_s among them)."""
        return dict(self.status(timeout_s).details)


def _call_error(e: grpc.RpcError, what: str) -> InferenceCallError:
    return InferenceCallError.from_rpc(e, what)
