"""The inference worker's face (protos/rlax_tpu/v1/inference.proto, DESIGN §4): what the
controller and a worker exchange — per-request sampling parameters, a generation request, a
finished rollout, the result of a weight load —, the worker's errors and the gRPC status
each maps to, the message codecs both ends use, and the controller's client. Plain
dataclasses and protobuf, no JAX: the engine, the worker (rlax_tpu/inference) and the
controller all speak these types.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import grpc
import numpy as np

from rlax_tpu.config import InferenceConfig
from rlax_tpu.rpc import get_status
from rlax_tpu.rpc.client import ComponentClient, RpcCallError, status_code_for
from rlax_tpu.rpc.liveness import Watch
from rlax_tpu.rpc.protos import common_pb2
from rlax_tpu.rpc.protos import inference_pb2 as pb
from rlax_tpu.rpc.protos import inference_pb2_grpc as pb_grpc

FinishReason = str  # "stop" | "length" | "paused" | "aborted" | "error"
LogprobsOf = Literal["full", "sampled"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Defaults for a worker: `SamplingParams.from_config(cfg)`.

    temperature: 0 = greedy (argmax). top_k: 0 = off. top_p: 1 = off. Top-k is applied
    first, then top-p on the top-k renormalised distribution (the smallest set of most
    likely tokens whose mass reaches top_p; the most likely token is always kept).
    logprobs_of: which distribution the returned behaviour log-probs are of —
      "full":    log softmax(logits / temperature), the whole temperature-scaled distribution;
      "sampled": the top-k/top-p truncated, renormalised distribution actually sampled from.
    At temperature 0 both are computed as at temperature 1 (a greedy token's point mass
    would say nothing): "full" is then log softmax(logits), what a trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    logprobs_of: LogprobsOf = "full"

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs_of not in ("full", "sampled"):
            raise ValueError(f"logprobs_of must be 'full' or 'sampled', got {self.logprobs_of!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def from_config(cls, config: InferenceConfig) -> SamplingParams:
        return cls(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            max_new_tokens=config.max_new_tokens,
            stop_token_ids=config.stop_token_ids,
            logprobs_of=config.logprobs_of,
        )


@dataclasses.dataclass(frozen=True)
class Partial:
    """A response generated so far by earlier calls, which a continuation extends.

    version: the request's original version, the one its sampling key derives from (what
    the earlier call's `Rollout.version` was); tokens, logprobs: the response so far;
    token_versions: the version that generated each token (None = every token is
    `version`'s). loss_mask: 1 for a token the policy sampled, 0 for one given (a multi-turn
    episode's observation tokens, appended after a turn: their log-probs and versions are
    placeholders); None = all sampled. Lengths are checked by the engine (a mismatch fails
    that request alone).
    """

    version: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    token_versions: tuple[int, ...] | None = None
    loss_mask: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "logprobs", tuple(float(x) for x in self.logprobs))
        versions = self.token_versions
        if versions is None:
            versions = (self.version,) * len(self.tokens)
        object.__setattr__(self, "token_versions", tuple(int(v) for v in versions))
        mask = self.loss_mask
        if mask is not None:
            mask = tuple(int(m) for m in mask)
            object.__setattr__(self, "loss_mask", None if all(mask) else mask)

    @property
    def mask(self) -> tuple[int, ...]:
        """`loss_mask`, one per token (all 1 when None)."""
        return self.loss_mask if self.loss_mask is not None else (1,) * len(self.tokens)

    @classmethod
    def of(cls, rollout: Rollout) -> Partial:
        """The response of `rollout` (typically "paused"; a logged `RolloutRecord` has the
        same fields) as a partial to continue."""
        mask = getattr(rollout, "loss_mask", None)
        return cls(rollout.version, rollout.tokens, rollout.logprobs, rollout.token_versions, mask)

    def extended(self, tokens: Sequence[int], version: int) -> Partial:
        """This partial with `tokens` given (not sampled) appended: a multi-turn episode's
        observation. Their log-probs are 0.0, their mask 0, their version `version` (the
        version the next turn starts under)."""
        n = len(tokens)
        return Partial(
            self.version,
            (*self.tokens, *tokens),
            (*self.logprobs, *(0.0,) * n),
            (*self.token_versions, *(version,) * n),
            (*self.mask, *(0,) * n),
        )


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate. (prompt_id, sample_index) with the model version and the
    engine seed fix the PRNG key, so the same request always gives the same rollout.

    partial: set for a continuation of a response begun by earlier calls (its tokens are
    the rollout's first tokens; the sampling key is the partial's version's, so response
    token t is sampled as in one call). max_tokens: the most new tokens this call generates
    (0 = until the response ends); a response that reaches it without ending finishes
    "paused". `sampling.max_new_tokens` bounds the whole response, partial included.
    """

    request_id: str
    prompt_id: str
    sample_index: int
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams | None = None  # None = the engine's defaults (from the config)
    partial: Partial | None = None
    max_tokens: int = 0
    keep_pages: bool = False  # a turn of an episode: park the pages when it ends at a stop


@dataclasses.dataclass(frozen=True)
class Rollout:
    """A finished request.

    tokens: the response (a stop token that ended it included; a continuation's partial
    tokens first); logprobs: the behaviour log-prob of each response token under the
    distribution named by the request's `SamplingParams.logprobs_of` ("full":
    temperature-scaled full softmax; "sampled": the top-k/top-p truncated, renormalised
    one), under the version that generated it; version: the version the request was
    submitted with, or its partial's (its sampling key's). token_versions: the version that
    generated each token when some token is not `version`'s (the weights changed under the
    request in flight with inference.in_flight_update "resume" / "keep", or between the
    calls of a continued response), else None (every token is `version`'s).
    finish_reason: "stop" (a stop token), "length" (max_new_tokens or the slot's maximum
    sequence length), "paused" (the call's max_tokens were generated: continue it with
    `Partial.of(rollout)`), "aborted" (weights reloaded mid-flight; tokens so far are kept
    but must be regenerated), "error" (see `error`; nothing was generated).
    """

    request_id: str
    prompt_id: str
    sample_index: int
    version: int
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    error: str = ""
    token_versions: tuple[int, ...] | None = None
    loss_mask: tuple[int, ...] | None = None  # None: every token sampled (`Partial.loss_mask`)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    version: int  # the version now held
    already_loaded: bool  # it was held before the call: nothing changed
    aborted: tuple[Rollout, ...]  # in-flight requests ended by the swap (also sent to callers)


# -- errors: each maps to one gRPC status ------------------------------------------------
class InferenceWorkerError(RuntimeError):
    """Base of the worker's errors; each subclass maps to one gRPC status (STATUS_CODES)."""


class NotLoadedError(InferenceWorkerError):
    """Generate before any Load: the worker holds no weights."""


class VersionMismatchError(InferenceWorkerError):
    """The caller asked for a version other than the one the worker holds."""


class NotLoadableError(InferenceWorkerError):
    """The version is not a multiple of η (staleness.reload_every)."""


class UnknownVersionError(InferenceWorkerError):
    """The parameter server does not have the version."""


class NoParamServerError(InferenceWorkerError):
    """Load without weights given and without a parameter server to pull them from."""


class PullFailedError(InferenceWorkerError):
    """Pulling the weights failed for another reason (server unreachable, layout mismatch)."""


class InvalidRequestError(InferenceWorkerError, ValueError):
    """A malformed batch: empty or repeated request ids, or an id reused for another request."""


class WorkerClosedError(InferenceWorkerError):
    """The worker was closed, or its engine failed and it can no longer generate."""


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
    return status_code_for(error, STATUS_CODES)


# -- message codecs (both ends) -------------------------------------------------------------
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "aborted": pb.FINISH_REASON_ABORTED,
    "error": pb.FINISH_REASON_ERROR,
    "paused": pb.FINISH_REASON_PAUSED,
}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}
SAMPLING_OVERRIDES = ("temperature", "top_p", "top_k", "max_new_tokens", "logprobs_of")


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
    partial = None
    if message.HasField("partial"):
        p = message.partial
        partial = Partial(
            version=p.version,
            tokens=tuple(p.tokens),
            logprobs=tuple(p.logprobs),  # float32 values, as the engine's
            token_versions=tuple(p.token_versions) or None,
            loss_mask=tuple(p.loss_mask) or None,
        )
    return GenerationRequest(
        request_id=message.request_id,
        prompt_id=message.prompt_id,
        sample_index=message.sample_index,
        prompt_tokens=tuple(message.prompt_tokens),
        sampling=sampling,
        partial=partial,
        max_tokens=message.max_tokens,
        keep_pages=message.keep_pages,
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
        token_versions=rollout.token_versions or (),
        loss_mask=rollout.loss_mask or (),
    )


def resolve_sampling(defaults: SamplingParams, overrides: Mapping[str, Any]) -> SamplingParams:
    """`defaults` with the given fields replaced; bad names or values: InvalidRequestError."""
    try:
        return dataclasses.replace(defaults, **overrides)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"bad sampling override: {e}") from e


def request_to_proto(request: GenerationRequest, defaults: SamplingParams | None = None):
    """A GenerationRequest message; sampling fields equal to `defaults` are left unset."""
    message = pb.GenerationRequest(
        request_id=request.request_id,
        prompt_id=request.prompt_id,
        sample_index=request.sample_index,
        prompt_tokens=[int(t) for t in request.prompt_tokens],
        max_tokens=request.max_tokens,
        keep_pages=request.keep_pages,
    )
    if request.partial is not None:
        p = request.partial
        message.partial.version = p.version
        message.partial.tokens.extend(p.tokens)
        message.partial.logprobs.extend(np.asarray(p.logprobs, np.float32).tolist())
        if any(v != p.version for v in p.token_versions):
            message.partial.token_versions.extend(p.token_versions)
        if p.loss_mask is not None:
            message.partial.loss_mask.extend(p.loss_mask)
        message.partial.SetInParent()  # present even with no tokens
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
        token_versions=tuple(message.token_versions) or None,
        loss_mask=tuple(message.loss_mask) or None,
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
        ended: Sequence[tuple[str, int, int]] = (),
    ) -> Iterator[Rollout]:
        """Rollouts of `requests` as the worker completes them. With `watch`, a worker that
        stops answering (or a call past the watch's deadline) ends the stream with
        ComponentLostError, and nothing that arrives after that is yielded. `ended`:
        episodes that ended ((prompt id, sample index, key version)), whose parked pages
        the worker drops."""
        message = pb.GenerateRequest(
            requests=[request_to_proto(r) for r in requests],
            ended=[pb.EpisodeEnd(prompt_id=p, sample_index=s, version=v) for p, s, v in ended],
        )
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
