"""Rewards that carry their verdicts (DESIGN §8): every rollout is judged by the verifiers,
and one they could not judge is never trained as a wrong answer.

A result with verdict VERIFIER_ERROR (a verifier exception, a missing sandbox, a missed batch
deadline) or a failed call (service unavailable, queue full) is sent again, up to
`controller.verify.retries` times with a doubling backoff; the service is idempotent by
request id and keeps no error in its cache, so a retry judges again and a success returns
the verdict the first try would have. A sample still unjudged after that is `unjudged`: the
controller drops its group (assembly.select_groups), and when more than
`controller.verify.max_unjudged_fraction` of a round is unjudged it stops the run, naming the
verifiers' reasons — a broken sandbox must not train a model on zeros. Which samples end
unjudged depends only on which requests the verifier fails, never on timing.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc

from rlax_tpu.api.records import Judgement, RolloutRecord
from rlax_tpu.api.verifier import (
    ExecutionRequest,
    ExecutionResult,
    Verdict,
    VerificationRequest,
    VerificationResult,
    encode_metadata,
    encode_prompt,
)
from rlax_tpu.controller.errors import ControllerError, UnjudgedError
from rlax_tpu.data.datasets import PromptRecord, decode_response
from rlax_tpu.rpc.client import (
    ComponentUnreachableError,
    RpcCallError,
    is_unreachable,
    retry_unreachable,
)
from rlax_tpu.rpc.liveness import Watch

_log = logging.getLogger(__name__)

# A call failing with one of these is the caller's bug or a setup error: retrying cannot help.
_FATAL_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
}
# Requests per Verify call: well under a service's queue (a batch over it is refused whole).
CHUNK = 256


class Verifier(Protocol):
    def verify_many(self, requests: Sequence[VerificationRequest]) -> list[VerificationResult]: ...


class ServiceVerifier:
    """Scores through one or more verifier services: chunk i of a call to service i mod n, the
    services in parallel. A retried request goes wherever its new chunk goes (the result
    does not depend on who judges it).

    Replicas are elastic: a chunk whose service does not answer (UNAVAILABLE) goes to the
    next one; with none answering, the call waits up to `wait_s` for one to come back
    (restarted), then raises ComponentUnreachableError; at once when `stop` is set (the
    run is stopping). `report(line)` hears of it.

    Liveness (rpc/liveness.py): with `liveness_s` > 0 each Verify call is watched by health
    checks, and a service that stops answering them (frozen, hung) counts as not answering;
    `deadline_s` is each call's batch deadline (the service answers VERIFIER_ERROR, retried,
    for what it has not judged by then; the call is given up 30 s later).

    `execute` runs the programs of the policy's tools on the same services, elastic the
    same way (it is a `ProgramExecutor`: the tools' verifier, registry.ToolContext)."""

    def __init__(
        self,
        clients: list[Any],
        *,
        wait_s: float = 300.0,
        report: Callable[[str], None] | None = None,
        stop: threading.Event | None = None,
        liveness_s: float = 0.0,
        deadline_s: float | None = None,
    ) -> None:
        self.clients = clients
        self.wait_s = wait_s
        self.report = report or _log.warning
        self.stop = stop
        self.liveness_s, self.deadline_s = liveness_s, deadline_s
        self._next_service = itertools.count()  # where each execute call starts

    def _options(self, client: Any, deadline_s: float | None) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if deadline_s is not None:
            options["deadline_s"] = deadline_s
        if self.liveness_s > 0:
            what = f"verifier service {getattr(client, 'address', '?')}"
            options["watch"] = Watch(what, client.status_details, liveness_s=self.liveness_s)
        return options

    def _call(self, client: Any, chunk: Sequence[VerificationRequest]) -> list[VerificationResult]:
        return client.verify(chunk, **self._options(client, self.deadline_s))

    def execute(
        self, requests: Sequence[ExecutionRequest], *, deadline_s: float | None = None
    ) -> list[ExecutionResult]:
        """Runs `requests` (programs of the policy's tools) in one Execute call, by
        `deadline_s` (default: the service's): calls take the services in turn; a call
        whose service does not answer goes to the next one, and with none answering it
        waits as `verify_many` does. A program the lost service was running runs again on
        the next one (its result does not depend on where it runs)."""
        start = next(self._next_service)
        return self._on_any(
            start, lambda client: client.execute(requests, **self._options(client, deadline_s))
        )

    def verify_many(self, requests: Sequence[VerificationRequest]) -> list[VerificationResult]:
        chunks = [requests[start : start + CHUNK] for start in range(0, len(requests), CHUNK)]
        if len(self.clients) == 1 or len(chunks) <= 1:
            return [r for i, chunk in enumerate(chunks) for r in self._verify(i, chunk)]
        with ThreadPoolExecutor(len(self.clients), thread_name_prefix="verify") as pool:
            results = pool.map(lambda i: self._verify(i, chunks[i]), range(len(chunks)))
            return [r for chunk in results for r in chunk]

    def _verify(self, i: int, chunk: Sequence[VerificationRequest]) -> list[VerificationResult]:
        """Chunk i on service i mod n, else the next one answering, waiting for one."""
        return self._on_any(i, lambda client: self._call(client, chunk))

    def _on_any(self, i: int, call: Callable[[Any], list[Any]]) -> list[Any]:
        """call(client) on service i mod n, else the next one answering, waiting for one."""
        n = len(self.clients)

        def on_any() -> list[Any]:
            for k in range(n - 1):
                try:
                    return call(self.clients[(i + k) % n])
                except RpcCallError as e:
                    if not is_unreachable(e):
                        raise
            return call(self.clients[(i + n - 1) % n])

        what = "the verifier service" if n == 1 else f"every one of the {n} verifier services"
        return retry_unreachable(
            on_any, wait_s=self.wait_s, what=what, on_retry=self.report, stop=self.stop
        )


UNSCORED = Judgement(0.0, "unscored")  # a dataset row with verifier "none"


def request_id(rollout: RolloutRecord, prefix: str = "") -> str:
    """The verifier's idempotency key of a rollout: (prompt id, sample index, version),
    after the run's `prefix` (`run_prefix`)."""
    return f"{prefix}{rollout.prompt_id}/s{rollout.sample_index}/v{rollout.version}"


def run_prefix(digest: str, run_dir: str) -> str:
    """A run's namespace in a verifier service's idempotency cache: runs sharing one service
    (verifiers.address) send the same prompt ids with other responses, which the service
    would refuse as a reused id; a resumed run keeps its namespace, so what it judged before
    is answered from the cache."""
    return hashlib.sha256(f"{digest}\n{run_dir}".encode()).hexdigest()[:12] + ":"


def verification_request(
    record: PromptRecord, response: str, request_id: str, response_tokens: Sequence[int] = ()
) -> VerificationRequest:
    """What the verifiers judge `response` to prompt `record` by.
    A reward function of the user's (verifier "function") also gets the prompt (text, or
    the chat messages), the row's metadata, the function's spec and the response's token
    ids as generated (`response_tokens`: what its per-token rewards are counted against)."""
    fields: dict[str, Any] = {}
    if record.verifier == "function":
        prompt, chat = encode_prompt(record.prompt, record.messages)
        fields = {
            "function": record.reward_function,
            "prompt": prompt,
            "chat": chat,
            "metadata": encode_metadata(record.metadata),
            "response_tokens": tuple(int(t) for t in response_tokens),
        }
    return VerificationRequest(
        kind=record.verifier,
        response=response,
        reference=record.reference,
        problem=record.problem,
        request_id=request_id,
        **fields,
    )


class Scorer:
    """Judges rollouts through `verifier` with bounded retries; counts into `counters` (the
    run's snapshotted accounting): verify_errors (error results received, retried or not),
    verify_retries (requests sent again), verify_unjudged (samples unjudged at the end)."""

    def __init__(
        self,
        verifier: Verifier,
        tokenizer: Any,
        stop_token_ids: Sequence[int],
        *,
        retries: int,
        backoff_s: float,
        max_unjudged_fraction: float,
        counters: MutableMapping[str, int],
        sleep: Callable[[float], None] = time.sleep,
        request_prefix: str = "",
    ) -> None:
        self.verifier = verifier
        self.request_prefix = request_prefix  # run_prefix: the run's request-id namespace
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.retries, self.backoff_s = retries, backoff_s
        self.max_unjudged_fraction = max_unjudged_fraction
        self.counters = counters
        for key in ("verify_errors", "verify_retries", "verify_unjudged"):
            counters.setdefault(key, 0)
        self._sleep = sleep

    def request(self, record: PromptRecord, rollout: RolloutRecord) -> VerificationRequest:
        """The verification request of `rollout` for prompt `record`. The text judged is
        the response's final turn (`RolloutRecord.final_turn`: a multi-turn episode's
        answer comes after its last observation; the whole response otherwise); a reward
        function's `response_tokens` are the whole response, which its per-token rewards
        are counted against."""
        response = decode_response(self.tokenizer, rollout.final_turn, self.stop_token_ids)
        key = request_id(rollout, self.request_prefix)
        return verification_request(record, response, key, rollout.tokens)

    def judge(
        self, items: Sequence[tuple[PromptRecord, RolloutRecord]], *, what: str
    ) -> list[Judgement]:
        """One Judgement per (prompt record, rollout) of `items`, in order; raises
        UnjudgedError when more than max_unjudged_fraction of them stay unjudged. `what`
        names them in messages ("batch 7", "evaluation of version 4")."""
        requests = [self.request(record, rollout) for record, rollout in items]
        out: list[Judgement | None] = [UNSCORED if q.kind == "none" else None for q in requests]
        pending = [i for i, q in enumerate(requests) if q.kind != "none"]
        reasons: dict[int, str] = {}
        for attempt in range(self.retries + 1):
            if attempt:
                self.counters["verify_retries"] += len(pending)
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            results = self._call([requests[i] for i in pending])
            failed = []
            for i, result in zip(pending, results, strict=True):
                if result.verdict == Verdict.VERIFIER_ERROR:
                    self.counters["verify_errors"] += 1
                    reasons[i] = result.reason
                    failed.append(i)
                else:
                    out[i] = Judgement(
                        float(result.reward),
                        str(result.verdict),
                        result.reason,
                        token_rewards=result.token_rewards,
                    )
            pending = failed
            if not pending:
                break
        for i in pending:
            out[i] = Judgement(None, str(Verdict.VERIFIER_ERROR), reasons[i])
        self.counters["verify_unjudged"] += len(pending)
        if pending:
            _log.warning(
                "%s: %d of %d samples unjudged after %d retries (first: %s)",
                what,
                len(pending),
                len(items),
                self.retries,
                reasons[pending[0]],
            )
        if items and len(pending) > self.max_unjudged_fraction * len(items):
            distinct = list(dict.fromkeys(reasons[i] for i in pending))[:3]
            raise UnjudgedError(
                f"{what}: {len(pending)} of {len(items)} samples are unjudged after "
                f"{self.retries} retries, over controller.verify.max_unjudged_fraction = "
                f"{self.max_unjudged_fraction}; the verifiers say: {' | '.join(distinct)}. "
                "Fix the verifier (e.g. its sandbox), then resume the run; nothing was "
                "trained on these samples"
            )
        # Each verdict keeps the text it was given (decoded once, for the request).
        return [j.with_response(q.response) for j, q in zip(out, requests, strict=True)]

    def _call(self, requests: list[VerificationRequest]) -> list[VerificationResult]:
        """The verifier's results; a failed call counts as an error result for each request
        (retried like one), unless it failed for a reason no retry can fix."""
        try:
            return self.verifier.verify_many(requests)
        except ComponentUnreachableError as e:  # waited for it: the run stops, to resume
            raise ControllerError(f"{e}; start it again, then `rlax-tpu resume`") from None
        except RpcCallError as e:
            if e.code in _FATAL_CODES:
                raise ControllerError(f"the verifier refused the requests: {e}") from None
            reason = f"verifier call failed: {e}"
        except Exception as e:  # noqa: BLE001 - any other failure of the call: retried
            reason = f"verifier call failed: {type(e).__name__}: {e}"
        error = VerificationResult(reward=0.0, verdict=Verdict.VERIFIER_ERROR, reason=reason)
        return [error] * len(requests)
