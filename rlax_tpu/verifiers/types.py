"""What every verifier takes and returns (DESIGN §7).

A verifier turns one model response into a reward plus a reason a human can read. The
math and code verifiers, the task adapters, the verifier service and the controller all
speak these types; the service carries them over gRPC unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal


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
