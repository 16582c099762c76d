"""The verifiers' face (protos/rlax_tpu/v1/verifier.proto, DESIGN §7): what every verifier
takes and returns (a request; a verdict, a reward and a reason a human can read), the
programs the service runs for the policy's tools (`ExecutionRequest` -> `ExecutionResult`,
in the same sandbox), the service's errors and the gRPC status each maps to, the message
codecs both ends use, and the controller's client. The math and code verifiers, the task
adapters, the verifier service, the tools and the controller all speak these types; the
service carries them over gRPC unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

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


# -- programs run for the policy's tools (Execute) -----------------------------------------
# A program's wall clock is its time limit plus this, for the sandbox to start (bwrap, the
# namespace's init, the interpreter) without eating the program's own time.
EXECUTION_START_S = 1.0


class ExecutionVerdict(enum.StrEnum):
    """How one program run went. The values it shares with `Verdict` are the same strings."""

    OK = "ok"  # exited with code 0 within its limits
    RUNTIME_ERROR = "runtime_error"  # a non-zero exit code, or killed by a signal
    TIME_LIMIT = "time_limit"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"  # printed past its output cap: stopped there
    COMPILE_ERROR = "compile_error"  # a compiled language's build failed
    # Not run: no sandbox (and unsandboxed runs not allowed), a language the verifier does
    # not enable, the batch deadline passed; the reason says which.
    VERIFIER_ERROR = "verifier_error"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionRequest:
    """One program to run in the verifier's sandbox: a tool's call, not a judgement.

    code:        the program's source.
    language:    a row of the language table that `verifiers.code_languages` enables.
    stdin:       fed on its stdin.
    time_limit_s: CPU seconds, and the wall clock (plus EXECUTION_START_S, for the sandbox
                 to start); 0 = the verifier's maximum.
    memory_limit_bytes: address space; 0 = the verifier's maximum.
    output_limit_bytes: stdout cap (past it the program is stopped: OUTPUT_LIMIT); stderr
                 keeps its last this-many bytes (8 KiB at most); 0 = the verifier's maximum.
    request_id:  idempotency key, as for VerificationRequest (one namespace for both): a
                 retried id is answered from the service's cache, not run again.

    Limits above the verifier's maxima (`verifiers.execute_*`) are clamped to them.
    """

    code: str
    language: str = "python"
    stdin: str = ""
    time_limit_s: float = 0.0
    memory_limit_bytes: int = 0
    output_limit_bytes: int = 0
    request_id: str = ""

    def __post_init__(self) -> None:
        for name in ("time_limit_s", "memory_limit_bytes", "output_limit_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"{name} must be >= 0 (0 = the verifier's maximum), got {getattr(self, name)!r}"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExecutionResult:
    """What one program did. stdout is cut at the output cap and stderr keeps its last
    bytes; the *_truncated flags say when more was written. exit_code is None when the
    program was killed by a signal (a limit's, or its own) or did not run. reason says how
    it ended, for a human ("exit code 1: ZeroDivisionError: division by zero")."""

    verdict: ExecutionVerdict
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    exit_code: int | None = None
    wall_time_s: float = 0.0
    cpu_time_s: float = 0.0
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", ExecutionVerdict(self.verdict))  # "ok" -> OK


class ProgramExecutor(Protocol):
    """Runs programs in a verifier's sandbox: `VerifierClient` (one service), or the
    controller's `ServiceVerifier` (its replicas, a lost one's calls moved to the others)."""

    def execute(
        self, requests: Sequence[ExecutionRequest], *, deadline_s: float | None = None
    ) -> list[ExecutionResult]: ...


# -- errors: each maps to one gRPC status ----------------------------------------------------
class VerifierServiceError(Exception):
    """Base of the service's errors."""


class QueueFullError(VerifierServiceError):
    """The batch does not fit the bounded queue now; retry later (RESOURCE_EXHAUSTED)."""


class RequestIdReusedError(VerifierServiceError, ValueError):
    """A request id already used for a different request (INVALID_ARGUMENT)."""


class ServiceClosedError(VerifierServiceError):
    """The service is stopping (UNAVAILABLE)."""


class ExecutionUnavailableError(VerifierServiceError):
    """This service was built without a program runner: it judges, it runs no programs
    (UNIMPLEMENTED)."""


STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestIdReusedError: grpc.StatusCode.INVALID_ARGUMENT,
    ServiceClosedError: grpc.StatusCode.UNAVAILABLE,
    ExecutionUnavailableError: grpc.StatusCode.UNIMPLEMENTED,
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


def execution_request_to_proto(request: ExecutionRequest) -> pb.ExecutionRequestMessage:
    return pb.ExecutionRequestMessage(
        request_id=request.request_id,
        language=request.language,
        code=request.code,
        stdin=request.stdin,
        time_limit_s=request.time_limit_s,
        memory_limit_bytes=request.memory_limit_bytes,
        output_limit_bytes=request.output_limit_bytes,
    )


def execution_request_from_proto(
    message: pb.ExecutionRequestMessage, index: int
) -> ExecutionRequest:
    try:
        return ExecutionRequest(
            code=message.code,
            language=message.language or "python",
            stdin=message.stdin,
            time_limit_s=message.time_limit_s,
            memory_limit_bytes=message.memory_limit_bytes,
            output_limit_bytes=message.output_limit_bytes,
            request_id=message.request_id,
        )
    except ValueError as exc:
        raise ValueError(f"programs[{index}]: {exc}") from None


def execution_result_to_proto(
    result: ExecutionResult, request_id: str = "", *, cached: bool = False
) -> pb.ExecutionResultMessage:
    return pb.ExecutionResultMessage(
        request_id=request_id,
        verdict=ExecutionVerdict(result.verdict).value,
        stdout=result.stdout,
        stderr=result.stderr,
        stdout_truncated=result.stdout_truncated,
        stderr_truncated=result.stderr_truncated,
        exit_code=result.exit_code,
        wall_time_s=result.wall_time_s,
        cpu_time_s=result.cpu_time_s,
        reason=result.reason,
        cached=cached,
    )


def execution_result_from_proto(message: pb.ExecutionResultMessage) -> ExecutionResult:
    return ExecutionResult(
        verdict=ExecutionVerdict(message.verdict),
        stdout=message.stdout,
        stderr=message.stderr,
        stdout_truncated=message.stdout_truncated,
        stderr_truncated=message.stderr_truncated,
        exit_code=message.exit_code if message.HasField("exit_code") else None,
        wall_time_s=message.wall_time_s,
        cpu_time_s=message.cpu_time_s,
        reason=message.reason,
    )


_MAPS = ("verdicts", "pool", "inputs", "sandbox", "execution_verdicts")


def metrics_to_proto(metrics: Mapping[str, Any]) -> pb.VerifierMetrics:
    return pb.VerifierMetrics(
        **{k: v for k, v in metrics.items() if k not in _MAPS},
        verdicts=metrics["verdicts"],
        execution_verdicts=metrics.get("execution_verdicts", {}),
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
        self._check_size("Verify", message)
        timeout = self.timeout_s if deadline_s is None else deadline_s + _CLIENT_MARGIN_S
        what = f"Verify({len(requests)} requests)"
        reply = self._call("Verify", message, what, timeout, watch=watch)
        return [(result_from_proto(m), m.cached) for m in reply.results]

    def execute(
        self,
        requests: Sequence[ExecutionRequest],
        *,
        deadline_s: float | None = None,
        watch: Watch | None = None,
    ) -> list[ExecutionResult]:
        """Runs each program in the service's sandbox: one result per request, in order,
        with `verify`'s conventions: by `deadline_s` (default: the server's) programs not
        yet run are VERIFIER_ERROR, and a retry with the same request ids returns those
        that finished since without running them again; with `watch`, a service that stops
        answering health checks fails the call with ComponentLostError (UNAVAILABLE).
        UNIMPLEMENTED: the service runs no programs."""
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        message = pb.ExecuteRequest(
            programs=[execution_request_to_proto(r) for r in requests],
            deadline_s=deadline_s or 0.0,
        )
        self._check_size("Execute", message)
        timeout = self.timeout_s if deadline_s is None else deadline_s + _CLIENT_MARGIN_S
        what = f"Execute({len(requests)} programs)"
        reply = self._call("Execute", message, what, timeout, watch=watch)
        return [execution_result_from_proto(m) for m in reply.results]

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

    def _check_size(self, method: str, message: Any) -> None:
        size = message.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise VerifierCallError(
                f"{method}: the batch is {size / 2**20:.1f} MiB, over the "
                f"{MAX_MESSAGE_BYTES // 2**20} MiB gRPC message limit; send smaller batches",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )

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
