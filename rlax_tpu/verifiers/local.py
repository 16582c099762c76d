"""In-process verification: one `VerificationRequest` in, one `VerificationResult` out.

Dispatches by kind: math and reasoning-gym checks run in a `WorkerPool` under
`VerifierConfig.math_timeout_s` and `math_memory_limit_bytes`, a reward function of the
user's in the same pool under `reward_timeout_s`, arithmetic runs inline (it is a regex),
code goes to the `CodeVerifier` it was given. A response longer than
`max_response_bytes` is cut to its last that-many bytes first (counted). The controller
uses this when no verifier service is set.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rlax_tpu.api.verifier import (
    Verdict,
    VerificationRequest,
    VerificationResult,
    decode_arguments,
)
from rlax_tpu.config import VerifierConfig
from rlax_tpu.verifiers import functions
from rlax_tpu.verifiers.math import check_extraction_methods, verify_math_in_pool
from rlax_tpu.verifiers.pool import TaskOutOfMemory, TaskTimeout, WorkerCrashed, WorkerPool
from rlax_tpu.verifiers.tasks import score_arithmetic, score_reasoning_gym

# Modules the pool's workers import before taking tasks, so no task's time limit is spent
# importing sympy.
POOL_PRELOAD = ("sympy", "rlax_tpu.verifiers.math", "rlax_tpu.verifiers.tasks")


class CodeVerifierLike(Protocol):
    def verify(
        self, response: str, problem_dir: str, *, language: str = ""
    ) -> VerificationResult: ...


def truncate_response(response: str, max_bytes: int) -> tuple[str, bool]:
    """`response` cut to its last `max_bytes` UTF-8 bytes (whole characters), and whether it
    was cut. The end is kept: that is where the final answer and the last code block are."""
    if len(response) * 4 <= max_bytes:  # no character is wider than 4 bytes
        return response, False
    data = response.encode("utf-8", errors="surrogatepass")
    if len(data) <= max_bytes:
        return response, False
    return data[-max_bytes:].decode("utf-8", errors="ignore"), True


def pool_for(
    config: VerifierConfig,
    *,
    num_workers: int | None = None,
    max_tasks_per_worker: int = 100,
    reward_functions: Sequence[str] = (),
) -> WorkerPool:
    """The worker pool `config` asks for (`num_workers` overrides its size): workers with
    the checks' modules and the `reward_functions` (specs) preloaded and
    `math_memory_limit_bytes` of address space each. Other reward functions are imported
    by a worker on first use."""
    return WorkerPool(
        num_workers or config.num_workers,
        max_tasks_per_worker=max_tasks_per_worker,
        name="verifier",
        preload=POOL_PRELOAD,
        memory_bytes=config.math_memory_limit_bytes,
        initializer=functions.preload if reward_functions else None,
        initargs=(tuple(reward_functions),),
    )


class CodeVerifierMissing(RuntimeError):
    """A code request came to a LocalVerifier built without a code verifier."""


class LocalVerifier:
    """Judges requests in this process (and the pool's workers).

    pool: where math / reasoning-gym checks and reward functions run; None = a pool of
      `config.num_workers` workers owned (and closed) by this verifier.
    code_verifier: judges kind "code"; problem_resolver turns a request's `problem` link
      into a local directory for it (None = the link is already a local path).
    """

    def __init__(
        self,
        config: VerifierConfig,
        pool: WorkerPool | None = None,
        *,
        code_verifier: CodeVerifierLike | None = None,
        problem_resolver: Callable[[str], str] | None = None,
    ) -> None:
        self.config = config
        self._methods = check_extraction_methods(config.math_answer_extraction)
        self._owns_pool = pool is None
        self.pool = pool or pool_for(config)
        self.code_verifier = code_verifier
        self.problem_resolver = problem_resolver
        self._lock = threading.Lock()
        self._counts = {"responses_truncated": 0}

    def stats(self) -> dict[str, int]:
        """responses_truncated: responses cut to `max_response_bytes` before judging."""
        with self._lock:
            return dict(self._counts)

    def verify(self, request: VerificationRequest) -> VerificationResult:
        """The result for one request; never raises for a bad response, only for a request
        this verifier cannot judge (unknown kind, code without a code verifier)."""
        response, truncated = truncate_response(request.response, self.config.max_response_bytes)
        if truncated:
            with self._lock:
                self._counts["responses_truncated"] += 1
        if request.kind == "math":
            try:
                return verify_math_in_pool(
                    self.pool,
                    response,
                    request.reference,
                    timeout_s=self.config.math_timeout_s,
                    methods=self._methods,
                )
            except TaskOutOfMemory as exc:
                return _out_of_memory("the math check", exc)
        if request.kind == "arithmetic":
            return score_arithmetic(response, request.reference)
        if request.kind == "reasoning_gym":
            return self._in_pool(score_reasoning_gym, response, request.reference)
        if request.kind == "function":
            return self._reward_function(request, response)
        if request.kind == "code":
            if self.code_verifier is None:
                raise CodeVerifierMissing(
                    "a code request needs LocalVerifier(..., code_verifier=CodeVerifier(...)); "
                    "this verifier was built without one"
                )
            problem_dir = (
                self.problem_resolver(request.problem) if self.problem_resolver else request.problem
            )
            return self.code_verifier.verify(response, problem_dir, language=request.language)
        raise ValueError(
            f"unknown verifier kind {request.kind!r}; "
            "expected 'math', 'arithmetic', 'reasoning_gym', 'code' or 'function'"
        )

    def _reward_function(self, request: VerificationRequest, response: str) -> VerificationResult:
        """The request's reward function (functions.judge) in the pool."""
        spec = request.function
        if not spec:
            return VerificationResult(
                reward=0.0,
                verdict=Verdict.VERIFIER_ERROR,
                reason="a 'function' request names no reward function ('module:function')",
            )
        try:
            prompt, metadata = decode_arguments(request.prompt, request.chat, request.metadata)
        except ValueError as exc:
            return VerificationResult(
                reward=0.0,
                verdict=Verdict.VERIFIER_ERROR,
                reason=f"reward function {spec!r} not called: {exc}",
            )
        return self._in_pool(
            functions.judge,
            spec,
            prompt,
            response,
            request.reference,
            metadata,
            request.response_tokens or None,  # () = not sent
            timeout_s=self.config.reward_timeout_s,
            what=f"reward function {spec!r}",
        )

    def _in_pool(
        self,
        fn: Callable[..., VerificationResult],
        *args: Any,
        timeout_s: float | None = None,
        what: str = "",
    ) -> VerificationResult:
        """fn(*args) in the pool under `timeout_s` (default `math_timeout_s`); `what` names
        it in reasons (default fn's name)."""
        timeout_s = self.config.math_timeout_s if timeout_s is None else timeout_s
        what = what or fn.__name__
        try:
            return self.pool.run(fn, *args, timeout_s=timeout_s)
        except TaskTimeout:
            return VerificationResult(
                reward=0.0,
                verdict=Verdict.TIME_LIMIT,
                reason=f"{what} ran past {timeout_s:g}s",
            )
        except TaskOutOfMemory as exc:
            return _out_of_memory(what, exc)
        except WorkerCrashed as exc:
            return VerificationResult(
                reward=0.0,
                verdict=Verdict.VERIFIER_ERROR,
                reason=f"the worker process running {what} died: {exc}",
            )

    def verify_many(self, requests: Sequence[VerificationRequest]) -> list[VerificationResult]:
        """`verify` of each request, in order; up to as many at once as the pool has workers
        (code requests too: the code verifier does its own limiting)."""
        if len(requests) <= 1:
            return [self.verify(r) for r in requests]
        threads = min(len(requests), max(self.pool.num_workers, 1))
        with concurrent.futures.ThreadPoolExecutor(threads, "verify") as executor:
            return list(executor.map(self.verify, requests))

    def close(self) -> None:
        """Closes the pool if this verifier created it."""
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> LocalVerifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _out_of_memory(what: str, exc: TaskOutOfMemory) -> VerificationResult:
    return VerificationResult(
        reward=0.0,
        verdict=Verdict.MEMORY_LIMIT,
        reason=f"{what} ran out of memory on this response ({exc})",
    )
