"""LocalVerifier: dispatch by kind, the pool and its time limit, code delegation, batches."""

from __future__ import annotations

import json

import pytest

from rlax_tpu.api.verifier import Verdict, VerificationRequest, VerificationResult
from rlax_tpu.config import VerifierConfig
from rlax_tpu.verifiers.local import (
    POOL_PRELOAD,
    CodeVerifierMissing,
    LocalVerifier,
    pool_for,
    truncate_response,
)
from rlax_tpu.verifiers.pool import WorkerPool

_HOSTILE = r"\boxed{((x+y)(x-y)+(z+w)(z-w))^{60}}"
_HOSTILE_REFERENCE = "(x^2-y^2+z^2-w^2)^{60}"


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, name="local-test", preload=POOL_PRELOAD) as p:
        yield p


@pytest.fixture
def verifier(pool):
    return LocalVerifier(VerifierConfig(num_workers=2, math_timeout_s=20.0), pool)


class FakeCodeVerifier:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def verify(self, response: str, problem_dir: str, *, language: str = "") -> VerificationResult:
        self.calls.append((response, problem_dir, language))
        return VerificationResult(reward=1.0, verdict=Verdict.ACCEPTED, reason="all tests passed")


def test_math_request_is_judged_in_the_pool(verifier, pool):
    before = pool.stats()["tasks_done"]
    result = verifier.verify(
        VerificationRequest(kind="math", response=r"\boxed{\frac{1}{2}}", reference="0.5")
    )
    assert result.verdict == Verdict.ACCEPTED
    assert pool.stats()["tasks_done"] == before + 1


def test_math_uses_the_configured_extraction_methods(pool):
    config = VerifierConfig(math_answer_extraction=("hash",), math_timeout_s=20.0)
    local = LocalVerifier(config, pool)
    request = VerificationRequest(kind="math", response="so 72", reference="72")
    assert local.verify(request).verdict == Verdict.NO_ANSWER


def test_unknown_extraction_method_fails_at_construction(pool):
    with pytest.raises(ValueError, match="the_answer_is"):
        LocalVerifier(VerifierConfig(math_answer_extraction=("boxed", "guess")), pool)


def test_math_time_limit_comes_from_the_config(pool):
    local = LocalVerifier(VerifierConfig(math_timeout_s=1.0), pool)
    request = VerificationRequest(kind="math", response=_HOSTILE, reference=_HOSTILE_REFERENCE)
    result = local.verify(request)
    assert (result.reward, result.verdict) == (0.0, Verdict.TIME_LIMIT)
    assert "ran past 1s" in result.reason


def test_arithmetic_runs_inline(verifier, pool):
    before = pool.stats()["tasks_done"]
    request = VerificationRequest(kind="arithmetic", response="17 + 25 = 42", reference="42")
    assert verifier.verify(request).reward == 1.0
    assert pool.stats()["tasks_done"] == before


def test_code_request_goes_to_the_code_verifier_with_the_resolved_problem(pool):
    code = FakeCodeVerifier()
    local = LocalVerifier(
        VerifierConfig(),
        pool,
        code_verifier=code,
        problem_resolver=lambda link: f"/cache/{link.rsplit('/', 1)[-1]}",
    )
    request = VerificationRequest(
        kind="code", response="```python\nprint(1)\n```", problem="gs://b/p/a+b", language="python"
    )
    assert local.verify(request).verdict == Verdict.ACCEPTED
    assert code.calls == [("```python\nprint(1)\n```", "/cache/a+b", "python")]


def test_code_request_without_a_code_verifier_says_what_is_missing(verifier):
    with pytest.raises(CodeVerifierMissing, match="code_verifier="):
        verifier.verify(VerificationRequest(kind="code", response="x", problem="/p"))


def test_verify_many_keeps_the_order_of_mixed_kinds(pool):
    code = FakeCodeVerifier()
    local = LocalVerifier(VerifierConfig(math_timeout_s=20.0), pool, code_verifier=code)
    requests = [
        VerificationRequest(kind="math", response=r"\boxed{x^2+2x+1}", reference="(x+1)^2"),
        VerificationRequest(kind="arithmetic", response="41", reference="42"),
        VerificationRequest(kind="math", response="I give up", reference="3"),
        VerificationRequest(kind="code", response="code", problem="/problems/p1"),
        VerificationRequest(kind="math", response="#### 1,000", reference="1000"),
        VerificationRequest(kind="math", response="#### 999", reference="1000"),
    ]
    verdicts = [r.verdict for r in local.verify_many(requests)]
    assert verdicts == [
        Verdict.ACCEPTED,
        Verdict.WRONG_ANSWER,
        Verdict.NO_ANSWER,
        Verdict.ACCEPTED,
        Verdict.ACCEPTED,
        Verdict.WRONG_ANSWER,
    ]
    assert code.calls == [("code", "/problems/p1", "")]
    assert local.verify_many([]) == []


def test_verifier_without_a_pool_owns_and_closes_its_own():
    with LocalVerifier(VerifierConfig(num_workers=1, math_timeout_s=20.0)) as local:
        request = VerificationRequest(kind="math", response="#### 5", reference="5")
        assert local.verify(request).verdict == Verdict.ACCEPTED
        owned = local.pool
    assert owned.stats()["workers"] == 0


def test_reasoning_gym_request_is_scored_in_the_pool(verifier):
    pytest.importorskip("reasoning_gym")
    from rlax_tpu.verifiers.tasks import reasoning_gym_problems

    (problem,) = reasoning_gym_problems("leg_counting", 1, 1)
    answer = json.loads(problem["answer"])["answer"]
    right = VerificationRequest(
        kind="reasoning_gym", response=f"<answer>{answer}</answer>", reference=problem["answer"]
    )
    wrong = VerificationRequest(
        kind="reasoning_gym", response="<answer>-1</answer>", reference=problem["answer"]
    )
    assert [r.reward for r in verifier.verify_many([right, wrong])] == [1.0, 0.0]


def test_long_responses_are_cut_to_their_end_and_counted(pool):
    config = VerifierConfig(math_timeout_s=20.0, max_response_bytes=1000)
    local = LocalVerifier(config, pool)
    padding = "é" * 2000  # 4000 bytes of two-byte characters
    answer_at_the_end = VerificationRequest(
        kind="math", response=padding + r" so \boxed{5}", reference="5"
    )
    assert local.verify(answer_at_the_end).verdict == Verdict.ACCEPTED
    answer_at_the_start = VerificationRequest(
        kind="math", response=r"\boxed{5} " + padding, reference="5"
    )
    assert local.verify(answer_at_the_start).verdict == Verdict.NO_ANSWER
    short = VerificationRequest(kind="math", response=r"\boxed{5}", reference="5")
    assert local.verify(short).verdict == Verdict.ACCEPTED
    assert local.stats() == {"responses_truncated": 2}


def test_truncation_keeps_whole_characters_at_the_end():
    assert truncate_response("abc", 3) == ("abc", False)
    assert truncate_response("aé€😀", 7) == ("€😀", True)  # 1 + 2 + 3 + 4 bytes
    assert truncate_response("aé€😀", 6) == ("😀", True)  # never half a character
    assert truncate_response("x" * 10, 4) == ("xxxx", True)


def test_the_pool_for_a_config_caps_its_workers_memory():
    config = VerifierConfig(num_workers=1, math_memory_limit_bytes=768 * 2**20)
    with pool_for(config) as capped:
        assert capped.memory_bytes == 768 * 2**20
        limit = capped.run(address_space_limit, timeout_s=60)
    assert limit == 768 * 2**20


def address_space_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_AS)[0]
