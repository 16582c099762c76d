"""Math verifier: answer extraction, normalisation, numeric and symbolic equivalence, and the
time limit that protects the caller from sympy."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlax_tpu.verifiers.math import (
    compare_answers,
    extract_answer,
    normalize_answer,
    reference_answer,
    verify_math,
    verify_math_in_pool,
)
from rlax_tpu.verifiers.pool import WorkerPool
from rlax_tpu.verifiers.types import Verdict

# --- extraction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, method, text",
    [
        (r"so $\boxed{42}$.", "boxed", "42"),
        (r"\boxed{\frac{1}{\sqrt{2}}} done", "boxed", r"\frac{1}{\sqrt{2}}"),
        (r"first \boxed{1}, then \boxed{ \{1, 2\} }", "boxed", r"\{1, 2\}"),
        (r"\boxed{\text{(B)}}", "boxed", r"\text{(B)}"),
        (r"answer: \boxed 7 ok", "boxed", "7"),
        (r"\fbox{x+1}", "boxed", "x+1"),
        ("Natalia sold 48 clips.\n#### 72", "hash", "72"),
        ("#### 1,000\n", "hash", "1,000"),
        ("So the answer is 12.", "the_answer_is", "12"),
        ("The final answer is $\\frac{3}{4}$. Done", "the_answer_is", r"\frac{3}{4}"),
        ("Thus the answer is: **-3.5**.\nMore text 9", "the_answer_is", "-3.5"),
        ("Final Answer: x = 5", "the_answer_is", "x = 5"),
        ("Answer: 17", "the_answer_is", "17"),
        ("17 + 25 = 42", "last_number", "42"),
        ("it costs $1,250.50 in total.", "last_number", "1,250.50"),
        ("from 5-3 we get -2 then", "last_number", "-2"),
        ("half is 3/4 of it", "last_number", "3/4"),
    ],
)
def test_extraction_finds_the_final_answer(response, method, text):
    found = extract_answer(response)
    assert found is not None
    assert (found.method, found.text) == (method, text)


def test_extraction_follows_the_configured_order():
    response = r"The answer is 3. Indeed \boxed{4}. #### 5 and 6"
    assert extract_answer(response).text == "4"
    assert extract_answer(response, ("hash", "boxed")).text == "5 and 6"
    assert extract_answer(response, ("the_answer_is",)).text == "3"
    assert extract_answer(response, ("last_number",)).text == "6"


def test_unbalanced_boxed_falls_back_to_an_earlier_box():
    assert extract_answer(r"\boxed{1} and then \boxed{2").text == "1"


def test_no_answer_when_no_method_finds_one():
    assert extract_answer("I am not sure.") is None
    assert extract_answer(r"\boxed{} nothing", ("boxed",)) is None


def test_unknown_extraction_method_is_rejected_with_the_valid_names():
    with pytest.raises(ValueError, match="last_number"):
        extract_answer("1", ("boxed", "guess"))


@pytest.mark.parametrize(
    "reference, answer",
    [
        ("42", "42"),
        ("She has 3 + 4 = 7 left.\n#### 7", "7"),
        (r"So the sum is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    ],
)
def test_reference_may_be_a_whole_solution(reference, answer):
    assert reference_answer(reference) == answer


# --- normalisation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, normal",
    [
        ("1,000", "1000"),
        ("-12,345.5", "-12345.5"),
        ("5 cm", "5"),
        ("5 square feet", "5"),
        (r"\$5", "5"),
        ("$5$", "5"),
        ("5 dollars", "5"),
        ("1,000 dollars", "1000"),
        (r"30^\circ", "30"),
        (r"30^{\circ}", "30"),
        ("30°", "30"),
        ("30 degrees", "30"),
        (r"50\%", "50%"),
        ("50 percent", "50%"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac12", r"\frac12"),
        (r"\left( 1, 2 \right)", "( 1, 2 )"),
        (r"\text{(C)}", "C"),
        (r"\textbf{yes}", "yes"),
        ("x = 5", "5"),
        ("42.", "42"),
        (r"3\,000", "3 000"),
        ("2 x", "2 x"),  # a one-letter word is a variable, not a unit
        ("2 pi", "2 pi"),  # a known constant is not a unit
        ("(1,234)", "(1,234)"),  # a tuple, not a thousands separator
    ],
)
def test_normalisation(raw, normal):
    assert normalize_answer(raw) == normal


# --- equivalence --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "candidate, reference",
    [
        ("0.5", r"\frac{1}{2}"),
        (r"\dfrac{1}{2}", "1/2"),
        (r"\frac12", "0.5"),
        ("1,000", "1000"),
        ("1000.0", "1,000"),
        ("5 cm", "5"),
        ("$5", "5 dollars"),
        (r"90^\circ", "90"),
        ("50%", "50"),  # a percentage reads as its number...
        ("50%", "0.5"),  # ...and as a fraction of one
        ("0.5", r"50\%"),
        ("x^2+2x+1", "(x+1)^2"),
        (r"\frac{x^2-1}{x-1}", "x+1"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        (r"\frac{\sqrt{3}}{2}", r"\sin(\pi/3)"),
        (r"\sqrt[3]{27}", "3"),
        (r"\log_2 8", "3"),
        ("0.333333", r"\frac{1}{3}"),  # within the relative tolerance (1e-6)
        (r"2\frac{1}{4}", "9/4"),  # a mixed number
        ("3+4i", "4i+3"),
        (r"e^{i\pi}", "-1"),
        (r"\binom{5}{2}", "10"),
        ("y = 2x + 1", "y = 1 + 2x"),
        ("x^2 + y^2 = 1", "1 = y^2 + x^2"),
        ("(1, 2)", r"\left(1,2\right)"),
        ("3, -2", "-2, 3"),  # a bare list (roots) is unordered
        (r"\{3, 1\}", r"\{1, 3\}"),
        (r"[0, \infty)", r"[0,\infty)"),
        (r"\text{(B)}", "B"),
        ("Yes", "yes"),
        (r"\pi/2", r"\frac{\pi}{2}"),
        (r"\alpha + 1", r"1+\alpha"),
    ],
)
def test_equivalent_answers_are_accepted(candidate, reference):
    equal, how = compare_answers(candidate, reference)
    assert equal, how


@pytest.mark.parametrize(
    "candidate, reference",
    [
        ("0.5", "1/3"),
        ("0.33", r"\frac{1}{3}"),  # outside the relative tolerance
        ("10001", "10000"),  # integers compare exactly
        ("50", "0.5"),  # only a "%" sign gives the fraction-of-one reading
        ("x^2+2x+2", "(x+1)^2"),
        (r"\sqrt{x^2}", "x"),  # not equal for negative x
        ("(2, 1)", "(1, 2)"),  # a tuple is ordered
        ("[1, 2)", "(1, 2)"),  # interval ends differ
        ("1, 2", "1, 2, 3"),
        ("y = 2x", "y = 2x + 1"),
        ("A", "B"),
        (r"2^{10^{10}}", "2"),  # refused before sympy tries to build it
        ("__import__('os').getpid()", "1"),  # never reaches eval
        ("", "1"),
    ],
)
def test_different_answers_are_rejected(candidate, reference):
    equal, how = compare_answers(candidate, reference)
    assert not equal, how


# --- verify_math --------------------------------------------------------------------------


def test_correct_boxed_answer_is_accepted_and_the_reason_says_how():
    result = verify_math(r"We get $\boxed{\frac{1}{2}}$.", "0.5")
    assert (result.reward, result.verdict) == (1.0, Verdict.ACCEPTED)
    assert r"\frac{1}{2}" in result.reason and "boxed" in result.reason
    assert "numerically equal" in result.reason


def test_gsm8k_response_against_gsm8k_solution():
    reference = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert verify_math("48 + 24 = 72\n#### 72", reference).verdict == Verdict.ACCEPTED
    assert verify_math("48 + 24 = 73\n#### 73", reference).verdict == Verdict.WRONG_ANSWER


def test_wrong_answer_scores_zero():
    result = verify_math("The answer is 41.", "42")
    assert (result.reward, result.verdict) == (0.0, Verdict.WRONG_ANSWER)
    assert "'41'" in result.reason and "the_answer_is" in result.reason


def test_response_without_an_answer_is_no_answer():
    result = verify_math("I do not know.", "42")
    assert (result.reward, result.verdict) == (0.0, Verdict.NO_ANSWER)


def test_extraction_methods_can_be_restricted():
    response = "The answer is 7 but maybe 8"
    assert verify_math(response, "8").verdict == Verdict.WRONG_ANSWER
    assert verify_math(response, "8", ("last_number",)).verdict == Verdict.ACCEPTED
    assert verify_math(response, "8", ("boxed",)).verdict == Verdict.NO_ANSWER


def test_empty_reference_is_a_verifier_error():
    assert verify_math(r"\boxed{1}", "  ").verdict == Verdict.VERIFIER_ERROR


@given(
    st.integers(-(10**12), 10**12),
    st.sampled_from(["\\boxed{{{}}}", "#### {}", "The answer is {}.", "so we get {}"]),
)
def test_any_integer_answer_is_accepted_and_its_successor_rejected(value, template):
    reference = f"{value:,}" if value % 2 else str(value)  # with and without separators
    assert verify_math(template.format(value), reference).reward == 1.0
    assert verify_math(template.format(value + 1), reference).reward == 0.0


# --- time limit in the pool ---------------------------------------------------------------

# Equal polynomials written so sympy must expand a degree-120 polynomial in four variables:
# minutes of work. The cheap random-point test cannot tell them apart, so simplify runs.
_HOSTILE = r"\boxed{((x+y)(x-y)+(z+w)(z-w))^{60}}"
_HOSTILE_REFERENCE = "(x^2-y^2+z^2-w^2)^{60}"


@pytest.fixture(scope="module")
def math_pool():
    with WorkerPool(1, name="math-test", preload=("sympy", "rlax_tpu.verifiers.math")) as pool:
        yield pool


def test_hostile_input_hits_the_time_limit_and_the_pool_keeps_serving(math_pool):
    ok = verify_math_in_pool(math_pool, r"\boxed{x^2+2x+1}", "(x+1)^2", timeout_s=30)
    assert ok.verdict == Verdict.ACCEPTED  # also: the worker is started and warm
    start = time.monotonic()
    result = verify_math_in_pool(math_pool, _HOSTILE, _HOSTILE_REFERENCE, timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert (result.reward, result.verdict) == (0.0, Verdict.TIME_LIMIT)
    assert "ran past 1s" in result.reason and "(x+y)(x-y)" in result.reason
    assert elapsed < 3.0
    assert math_pool.stats()["timeouts"] == 1
    again = verify_math_in_pool(math_pool, "#### 72", "72", timeout_s=30)
    assert again.verdict == Verdict.ACCEPTED


def test_pool_result_matches_the_direct_check(math_pool):
    for response, reference in [(r"\boxed{0.5}", r"\frac12"), ("so 3", "4"), ("none", "1")]:
        direct = verify_math(response, reference)
        assert verify_math_in_pool(math_pool, response, reference, timeout_s=30) == direct
