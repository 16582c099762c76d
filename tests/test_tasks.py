"""Task adapters: the arithmetic generator and scorer, JSONL, and the reasoning-gym adapter."""

from __future__ import annotations

import json
import math
import random
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_tpu.api.verifier import Verdict
from rlax_tpu.verifiers.tasks import (
    THINKING_FILLER,
    ReasoningGymMissing,
    arithmetic_problems,
    arithmetic_space,
    arithmetic_split_of,
    extract_tagged_answer,
    read_jsonl,
    reasoning_gym_problems,
    score_arithmetic,
    score_reasoning_gym,
    thinking_length,
    with_thinking,
    write_jsonl,
)

_PROMPT = re.compile(r"What is (\d+) ([-+*/]) (\d+)\? Answer with just the number\.")
_OPS = st.lists(st.sampled_from(["+", "-", "*", "/"]), min_size=1, max_size=4, unique=True)


def _solve(prompt: str) -> int:
    a, op, b = _PROMPT.fullmatch(prompt).groups()
    a, b = int(a), int(b)
    if op == "/":
        assert a % b == 0
        return a // b
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_arithmetic_record_format():
    problems = arithmetic_problems(0, 3)
    assert [p["id"] for p in problems] == ["arith-0-0", "arith-0-1", "arith-0-2"]
    for p in problems:
        assert set(p) == {"id", "prompt", "answer"}
        assert _PROMPT.fullmatch(p["prompt"]) and p["answer"] == str(_solve(p["prompt"]))


def test_arithmetic_problems_are_pinned():
    # Golden values: a change to the generator changes every dataset built from a seed.
    assert arithmetic_problems(7, 3, ops=("+", "-", "*", "/")) == [
        {
            "id": "arith-7-0",
            "prompt": "What is 1156 / 34? Answer with just the number.",
            "answer": "34",
        },
        {
            "id": "arith-7-1",
            "prompt": "What is 12 + 20? Answer with just the number.",
            "answer": "32",
        },
        {
            "id": "arith-7-2",
            "prompt": "What is 17 * 15? Answer with just the number.",
            "answer": "255",
        },
    ]


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    count=st.integers(0, 30),
    max_operand=st.integers(1, 1000),
    ops=_OPS,
)
def test_arithmetic_generator_is_deterministic_and_correct(seed, count, max_operand, ops):
    problems = arithmetic_problems(seed, count, max_operand=max_operand, ops=ops)
    assert problems == arithmetic_problems(seed, count, max_operand=max_operand, ops=ops)
    assert len(problems) == count and len({p["id"] for p in problems}) == count
    for p in problems:
        a, op, b = _PROMPT.fullmatch(p["prompt"]).groups()
        assert op in ops
        answer = int(p["answer"])
        assert answer == _solve(p["prompt"]) and answer >= 0
        if op != "/":
            assert int(a) <= max_operand and int(b) <= max_operand
        else:
            assert 1 <= int(b) <= max_operand and answer <= max_operand


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32), ops=_OPS)
def test_correct_answer_scores_one_and_its_successor_zero(seed, ops):
    (problem,) = arithmetic_problems(seed, 1, ops=ops)
    answer = int(problem["answer"])
    right = score_arithmetic(f"{problem['prompt']} It is {answer}.", problem["answer"])
    wrong = score_arithmetic(f"It is {answer + 1}", problem["answer"])
    assert (right.reward, right.verdict) == (1.0, Verdict.ACCEPTED)
    assert (wrong.reward, wrong.verdict) == (0.0, Verdict.WRONG_ANSWER)


def test_different_seeds_give_different_problems():
    assert arithmetic_problems(1, 20) != arithmetic_problems(2, 20)


def test_bad_generator_arguments_are_rejected():
    with pytest.raises(ValueError, match="ops"):
        arithmetic_problems(0, 1, ops=("%",))
    with pytest.raises(ValueError, match="max_operand"):
        arithmetic_problems(0, 1, max_operand=0)


@pytest.mark.parametrize(
    "response, verdict",
    [
        ("42", Verdict.ACCEPTED),
        ("17 + 25 = 42.", Verdict.ACCEPTED),
        ("42.0", Verdict.ACCEPTED),
        ("The answer is 42, not 41", Verdict.WRONG_ANSWER),  # the last number counts
        ("42.5", Verdict.WRONG_ANSWER),
        ("-42", Verdict.WRONG_ANSWER),
        ("forty-two", Verdict.NO_ANSWER),
    ],
)
def test_arithmetic_scorer_reads_the_last_number(response, verdict):
    assert score_arithmetic(response, "42").verdict == verdict


def test_arithmetic_scorer_reads_negative_numbers():
    assert score_arithmetic("17 - 25 = -8", "-8").verdict == Verdict.ACCEPTED


def test_arithmetic_scorer_rejects_a_non_integer_reference():
    assert score_arithmetic("1", "one").verdict == Verdict.VERIFIER_ERROR


def test_jsonl_round_trip(tmp_path):
    problems = arithmetic_problems(3, 5)
    path = tmp_path / "data" / "arith.jsonl"
    write_jsonl(path, problems)
    assert read_jsonl(path) == problems
    assert len(path.read_text().splitlines()) == 5
    assert [p.name for p in path.parent.iterdir()] == ["arith.jsonl"]  # no temp file left


def test_tagged_answer_is_the_last_tag():
    assert extract_tagged_answer("<answer>1</answer> no, <answer> 2 </answer>") == "2"
    assert extract_tagged_answer("no tags") is None


def test_missing_reasoning_gym_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails
    entry = {"question": "q", "answer": "1", "metadata": {"source_dataset": "leg_counting"}}
    with pytest.raises(ReasoningGymMissing, match=r"pip install 'rlax_tpu\[tasks\]'"):
        score_reasoning_gym("<answer>1</answer>", json.dumps(entry))
    with pytest.raises(ReasoningGymMissing, match="rlax_tpu"):
        reasoning_gym_problems("leg_counting", 0, 1)


def test_bad_reasoning_gym_reference_is_a_verifier_error():
    assert score_reasoning_gym("1", "not json").verdict == Verdict.VERIFIER_ERROR
    assert score_reasoning_gym("1", '{"answer": 1}').verdict == Verdict.VERIFIER_ERROR


@pytest.mark.parametrize("name", ["basic_arithmetic", "leg_counting"])
def test_reasoning_gym_tasks_score_with_their_own_scorer(name):
    pytest.importorskip("reasoning_gym")
    problems = reasoning_gym_problems(name, 5, 3)
    assert problems == reasoning_gym_problems(name, 5, 3)
    for p in problems:
        assert "<answer></answer>" in p["prompt"]
        entry = json.loads(p["answer"])
        right = score_reasoning_gym(f"thinking...<answer>{entry['answer']}</answer>", p["answer"])
        assert (right.reward, right.verdict) == (1.0, Verdict.ACCEPTED), right.reason
        wrong = score_reasoning_gym("<answer>not it</answer>", p["answer"])
        assert (wrong.reward, wrong.verdict) == (0.0, Verdict.WRONG_ANSWER), wrong.reason
        assert name in wrong.reason


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    count=st.integers(0, 300),
    max_operand=st.integers(1, 40),
    ops=_OPS,
)
def test_train_and_test_sides_never_share_a_problem(seed, count, max_operand, ops):
    space = arithmetic_space(max_operand, ops)
    test_side = [p for p in space if arithmetic_split_of(*p[:3]) == "test"]
    train = arithmetic_problems(seed, count, max_operand=max_operand, ops=ops, split="train")
    test = arithmetic_problems(
        seed, min(count, len(test_side)), max_operand=max_operand, ops=ops, split="test"
    )
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    assert len({p["prompt"] for p in test}) == len(test)  # distinct by construction
    for p in train + test:
        assert p["answer"] == str(_solve(p["prompt"]))
    assert all(p["id"].startswith(f"arith-train-{seed}-") for p in train)


def test_the_split_is_a_property_of_the_problem_not_of_the_seed():
    # About one problem in eight is a test problem, the same ones for every seed.
    space = arithmetic_space(99, ("+", "-"))
    test_side = {p for p in space if arithmetic_split_of(*p[:3]) == "test"}
    assert 0.11 < len(test_side) / len(space) < 0.14
    for seed in (0, 1, 2):
        drawn = arithmetic_problems(seed, len(test_side), max_operand=99, split="test")
        assert {p["prompt"] for p in drawn} == {
            f"What is {a} {op} {b}? Answer with just the number." for a, op, b, _ in test_side
        }


def test_asking_for_more_test_problems_than_there_are_names_the_fix():
    with pytest.raises(ValueError, match=r"holds 76 distinct problems.*max_operand"):
        arithmetic_problems(0, 77, max_operand=20, split="test")
    with pytest.raises(ValueError, match="split 'dev'"):
        arithmetic_problems(0, 1, split="dev")


# -- worked solutions of heavy-tailed length (with_thinking) --------------------------------------
def _thinking(rows, **kwargs):
    return with_thinking(rows, 0, **{"median": 8, "sigma": 1.4, "max_filler": 57, **kwargs})


def test_worked_solutions_are_filler_then_the_answer_the_scorer_reads():
    rows = _thinking(arithmetic_problems(0, 200, max_operand=99, split="train"))
    for row in rows:
        filler, answer = row["solution"].split(" = ")
        assert answer == row["answer"] and filler and set(filler) <= set(THINKING_FILLER)
        assert score_arithmetic(row["solution"], row["answer"]).verdict == Verdict.ACCEPTED
        assert {k: row[k] for k in ("id", "prompt", "answer")} == {
            k: v for k, v in row.items() if k != "solution"
        }


def test_filler_lengths_are_heavy_tailed_and_capped():
    """A lognormal of median 8 and σ 1.4 truncated at 57 (the benchmark's): the fit of log
    length stays above 1 (truncation and rounding up trim it), p90 is several medians, and
    nothing passes the cap."""
    rng = random.Random(0)
    lengths = sorted(thinking_length(rng, 8, 1.4, 57) for _ in range(4000))
    logs = [math.log(n) for n in lengths]
    mean = sum(logs) / len(logs)
    sigma = (sum((x - mean) ** 2 for x in logs) / len(logs)) ** 0.5
    assert 7 <= lengths[len(lengths) // 2] <= 9
    assert lengths[int(0.9 * len(lengths))] >= 3.5 * lengths[len(lengths) // 2]
    assert sigma >= 1.0 and lengths[-1] == 57
    with pytest.raises(ValueError, match="max_filler >= median"):
        thinking_length(rng, 8, 1.0, 4)


def test_worked_solutions_are_a_function_of_seed_and_id_and_keep_the_split():
    train = arithmetic_problems(0, 300, max_operand=99, split="train")
    test = arithmetic_problems(0, 300, max_operand=99, split="test")
    assert _thinking(train) == _thinking(list(reversed(train)))[::-1]
    assert _thinking(train) != with_thinking(train, 1, median=8, sigma=1.4, max_filler=57)
    solved = {r["prompt"] for r in _thinking(train)}
    assert solved == {r["prompt"] for r in train} and not solved & {r["prompt"] for r in test}
