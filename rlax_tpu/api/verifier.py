"""The verifiers' face (protos/rlax_tpu/v1/verifier.proto, DESIGN §7): what every verifier
takes and returns (a request; a verdict, a reward and a reason a human can read), the
service's errors and the gRPC status each maps to, the message codecs both ends use, and the
controller's client. The math and code verifiers, the task adapters, the verifier service
and the controller all speak these types; the service carries them over gRPC unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import grpc

from rlax_tpu.rpc import MAX_MESSAGE_BYTES, get_status
from rlax_tpu.rpc.client import ComponentClient, RpcCallError, status_code_for
from rlax_tpu.rpc.liveness import Watch
from rlax_tpu.rpc.protos import common_pb2
from rlax_tpu.rpc.protos import verifier_pb2 as pb
from rlax_tpu.rpc.protos import verifier_pb2_grpc as pb_grpc

# How long past a batch's deadline the client waits for the reply (the service answers every
# request by its deadline, judged or not).
_CLIENT_MARGIN_S = 30.0


class Verdict(enum.StrEnum):
    """The outcome of one check. Math uses ACCEPTED / WRONG_ANSWER / NO_ANSWER / TIME_LIMIT;
    code uses all but NO_ANSWER (a response with no code block is NO_ANSWER too); a reward
    function of the user's names any of them."""

    ACCEPTED = "accepted"
    WRONG_ANSWER = "wrong_answer"
    NO_ANSWER = "no_answer"  # nothing to check: no final answer or no code found
    TIME_LIMIT = "time_limit"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    RUNTIME_ERROR = "runtime_error"
    COMPILE_ERROR = "compile_error"
    CHECKER_FAILURE = "checker_failure"  # the checker itself crashed or misbehaved
    # The verifier could not judge (sandbox missing and not allowed, test data unreachable,
    # deadline of the whole request passed): no reward, and the reason says what to fix.
    VERIFIER_ERROR = "verifier_error"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TestCaseResult:
    """One test case of a code verification."""

    name: str
    verdict: Verdict
    time_s: float = 0.0
    reason: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerificationResult:
    """reward: the sequence's reward; token_rewards: dense per-token rewards, one per token
    of the request's `response_tokens` (a reward function of the user's may give them;
    docs/datasets.md), or None."""

    reward: float
    verdict: Verdict
    reason: str
    tests: tuple[TestCaseResult, ...] = ()
    token_rewards: tuple[float, ...] | None = None


VerifierKind = Literal["math", "code", "arithmetic", "reasoning_gym", "function"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerificationRequest:
    """One response to judge.

    kind:      which verifier ("function": a reward function of the user's, `function`).
    response:  the model's full response text (the verifier extracts the answer / code).
    reference: math/arithmetic: the reference answer; reasoning_gym: the task entry as JSON;
               function: the dataset row's reference answer, passed on as it is.
    problem:   code: link to the problem in the test-data repository (file://, gs://, or a
               local path), holding its tests, comparison mode and optional checker.
    language:  code: a name from the language table ("python", "cpp"); "" = take it from the
               response's code fence.
    function:  function: the reward function, "module:function" ("pkg.rewards:score") or
               "path/to/file.py:function" (rlax_tpu/verifiers/functions.py).
    prompt:    function: the prompt text, or with `chat` the chat messages as JSON text
               ([{"role": ..., "content": ...}, ...]).
    chat:      function: `prompt` holds chat messages (JSON), not text.
    metadata:  function: the dataset row's other fields as a JSON object ("" = {}).
    response_tokens: function: the response's token ids as the model generated them (the
               stop token included when it emitted one); a function may take them, and
               per-token rewards have one entry per token. () = not sent.
    request_id: idempotency key for the service; the controller derives it from
               (step, prompt id, sample index) so a retried request is not judged twice.
    """

    kind: VerifierKind
    response: str
    reference: str = ""
    problem: str = ""
    language: str = ""
    function: str = ""
    prompt: str = ""
    chat: bool = False
    metadata: str = ""
    response_tokens: tuple[int, ...] = ()
    request_id: str = ""


KINDS: tuple[str, ...] = typing.get_args(VerifierKind)


# -- errors: each maps to one gRPC status ----------------------------------------------------
class VerifierServiceError(Exception):
    """Base of the service's errors."""


class QueueFullError(VerifierServiceError):
    """The batch does not fit the bounded queue now; retry later (RESOURCE_EXHAUSTED)."""


class RequestIdReusedError(VerifierServiceError, ValueError):
    """A request id already used for a different request (INVALID_ARGUMENT)."""


class ServiceClosedError(VerifierServiceError):
    """The service is stopping (UNAVAILABLE)."""


STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestIdReusedError: grpc.StatusCode.INVALID_ARGUMENT,
    ServiceClosedError: grpc.StatusCode.UNAVAILABLE,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
}


def status_code(error: BaseException) -> grpc.StatusCode:
    return status_code_for(error, STATUS_CODES)


# -- message codecs (both ends) ------------------------------------------------------------
def request_to_proto(request: VerificationRequest) -> pb.VerificationRequestMessage:
    return pb.VerificationRequestMessage(
        request_id=request.request_id,
        kind=request.kind,
        response=request.response,
        reference=request.reference,
        problem=request.problem,
        language=request.language,
        function=request.function,
        prompt=request.prompt,
        chat=request.chat,
        metadata=request.metadata,
        response_tokens=request.response_tokens,
    )


def request_from_proto(message: pb.VerificationRequestMessage, index: int) -> VerificationRequest:
    if message.kind not in KINDS:
        raise ValueError(
            f"requests[{index}].kind is {message.kind!r}; expected one of {', '.join(KINDS)}"
        )
    if message.kind == "function" and not message.function:
        raise ValueError(
            f"requests[{index}] is of kind 'function' but names no reward function "
            "('module:function' or 'path/to/file.py:function')"
        )
    return VerificationRequest(
        kind=message.kind,
        response=message.response,
        reference=message.reference,
        problem=message.problem,
        language=message.language,
        function=message.function,
        prompt=message.prompt,
        chat=message.chat,
        metadata=message.metadata,
        response_tokens=tuple(message.response_tokens),
        request_id=message.request_id,
    )


def result_to_proto(
    result: VerificationResult, request_id: str = "", *, cached: bool = False
) -> pb.VerificationResultMessage:
    return pb.VerificationResultMessage(
        request_id=request_id,
        reward=result.reward,
        verdict=Verdict(result.verdict).value,
        reason=result.reason,
        tests=[
            pb.TestCaseResultMessage(
                name=t.name, verdict=Verdict(t.verdict).value, time_s=t.time_s, reason=t.reason
            )
            for t in result.tests
        ],
        cached=cached,
        token_rewards=(
            None if result.token_rewards is None else pb.TokenRewards(values=result.token_rewards)
        ),
    )


def result_from_proto(message: pb.VerificationResultMessage) -> VerificationResult:
    return VerificationResult(
        reward=message.reward,
        verdict=Verdict(message.verdict),
        reason=message.reason,
        tests=tuple(
            TestCaseResult(
                name=t.name, verdict=Verdict(t.verdict), time_s=t.time_s, reason=t.reason
            )
            for t in message.tests
        ),
        token_rewards=(
            tuple(message.token_rewards.values) if message.HasField("token_rewards") else None
        ),
    )


_MAPS = ("verdicts", "pool", "inputs", "sandbox")


def metrics_to_proto(metrics: Mapping[str, Any]) -> pb.VerifierMetrics:
    return pb.VerifierMetrics(
        **{k: v for k, v in metrics.items() if k not in _MAPS},
        verdicts=metrics["verdicts"],
        pool={k: int(v) for k, v in metrics["pool"].items()},
        inputs={k: int(v) for k, v in metrics.get("inputs", {}).items()},
        sandbox={k: str(v) for k, v in metrics.get("sandbox", {}).items()},
    )


def metrics_from_proto(message: pb.VerifierMetrics) -> dict[str, Any]:
    out: dict[str, Any] = {
        field.name: getattr(message, field.name)
        for field in message.DESCRIPTOR.fields
        if field.name not in _MAPS
    }
    for name in _MAPS:
        out[name] = dict(getattr(message, name))
    return out


# -- a request's fields (reward functions of the user's read them decoded) ---------------------
def encode_prompt(prompt: str, messages: Sequence[Mapping[str, Any]] = ()) -> tuple[str, bool]:
    """(prompt, chat) of a VerificationRequest: the messages as JSON text when there are
    any (chat), else the prompt text."""
    if messages:
        return json.dumps([dict(m) for m in messages], ensure_ascii=False), True
    return prompt, False


def encode_metadata(metadata: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str:
    """A VerificationRequest's metadata: the fields as a JSON object, keys sorted (so the
    same row always gives the same request)."""
    return json.dumps(dict(metadata), sort_keys=True, ensure_ascii=False)


def decode_arguments(prompt: str, chat: bool, metadata: str) -> tuple[str | list[Any], dict]:
    """(prompt, metadata) as the function receives them; ValueError naming what is wrong."""
    decoded_prompt = _json_of(prompt, list, "the chat prompt", "a list") if chat else prompt
    fields = _json_of(metadata, dict, "the metadata", "an object") if metadata else {}
    return decoded_prompt, fields


def _json_of(text: str, kind: type, what: str, expected: str) -> Any:
    """`text` parsed as JSON, which must be a `kind`; ValueError naming `what` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not JSON ({exc})") from None
    if not isinstance(value, kind):
        raise ValueError(f"{what} is a JSON {type(value).__name__}, not {expected}")
    return value


# -- client side --------------------------------------------------------------------------------
class VerifierCallError(RpcCallError):
    """A call to the verifier service failed; `code` is the gRPC status (RESOURCE_EXHAUSTED:
    the queue is full, retry later; INVALID_ARGUMENT: a bad request)."""


class VerifierClient(ComponentClient):
    """Calls one verifier service. Thread-safe: batches from several threads share the channel."""

    def __init__(self, address: str, *, auth_token: str, **kwargs) -> None:
        super().__init__(address, auth_token=auth_token, **kwargs)
        self._stub = pb_grpc.VerifierStub(self._channel)

    def verify(
        self,
        requests: Sequence[VerificationRequest],
        *,
        deadline_s: float | None = None,
        watch: Watch | None = None,
    ) -> list[VerificationResult]:
        """One result per request, in order. By `deadline_s` (default: the server's) the
        server answers VERIFIER_ERROR for requests not yet judged; retrying with the same
        request ids returns those that finished since without judging them again. With
        `watch` (rpc/liveness.py), a service that stops answering health checks fails the
        call with ComponentLostError (UNAVAILABLE) instead of holding it."""
        detailed = self.verify_detailed(requests, deadline_s=deadline_s, watch=watch)
        return [result for result, _ in detailed]

    def verify_detailed(
        self,
        requests: Sequence[VerificationRequest],
        *,
        deadline_s: float | None = None,
        watch: Watch | None = None,
    ) -> list[tuple[VerificationResult, bool]]:
        """As `verify`, with whether each result was recorded before the call (cached)."""
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        message = pb.VerifyRequest(
            requests=[request_to_proto(r) for r in requests], deadline_s=deadline_s or 0.0
        )
        size = message.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise VerifierCallError(
                f"Verify: the batch is {size / 2**20:.1f} MiB, over the "
                f"{MAX_MESSAGE_BYTES // 2**20} MiB gRPC message limit; send smaller batches",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        timeout = self.timeout_s if deadline_s is None else deadline_s + _CLIENT_MARGIN_S
        what = f"Verify({len(requests)} requests)"
        reply = self._call("Verify", message, what, timeout, watch=watch)
        return [(result_from_proto(m), m.cached) for m in reply.results]

    def metrics(self) -> dict[str, Any]:
        """The service's metrics (VerificationService.metrics)."""
        reply = self._call("GetMetrics", pb.MetricsRequest(), "GetMetrics", 30.0)
        return metrics_from_proto(reply)

    def status(self, timeout_s: float = 10.0) -> common_pb2.ComponentStatus:
        try:
            return get_status(self._channel, timeout_s=timeout_s)
        except grpc.RpcError as e:
            raise VerifierCallError.from_rpc(e, f"GetStatus on {self.address}") from None

    def status_details(self, timeout_s: float) -> dict[str, str]:
        """The status's details (a `Watch`'s health check)."""
        return dict(self.status(timeout_s).details)

    def _call(
        self, method: str, request: Any, what: str, timeout: float, watch: Watch | None = None
    ) -> Any:
        future = getattr(self._stub, method).future(request, timeout=timeout)
        if watch is not None:
            watch.start(future.cancel)
        try:
            return future.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            if watch is not None and not watch.accepts():
                raise watch.error() from None
            if isinstance(e, grpc.FutureCancelledError):
                raise
            raise VerifierCallError.from_rpc(e, f"{what} on {self.address}") from None
        finally:
            if watch is not None:
                watch.stop()
