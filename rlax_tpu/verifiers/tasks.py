"""Task adapters: datasets the controller can train on and the scorers that judge them.

The built-in arithmetic task ("What is 17 + 25?") feeds the demo RL run; reasoning-gym's
procedural tasks are an optional extra (`pip install 'rlax_tpu[tasks]'`) scored by their own
`score_answer`. Datasets are JSONL records with the fields id, prompt and answer.
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu.verifiers.types import Verdict, VerificationResult

ARITHMETIC_OPS = ("+", "-", "*", "/")
_PROMPT = "What is {a} {op} {b}? Answer with just the number."
_SHOWN_CHARS = 120


# --- arithmetic ---------------------------------------------------------------------------


def arithmetic_problems(
    seed: int,
    count: int,
    *,
    max_operand: int = 50,
    ops: Sequence[str] = ("+", "-"),
) -> list[dict[str, str]]:
    """`count` problems {"id", "prompt", "answer"}, the same for the same arguments.

    Operands are integers in [0, max_operand]; "-" puts the larger operand first so answers
    are never negative; "/" divides exactly (the dividend is divisor * quotient, divisor in
    [1, max_operand]); "*" multiplies two operands. The id is "arith-{seed}-{index}".
    """
    unknown = [op for op in ops if op not in ARITHMETIC_OPS]
    if unknown or not ops:
        raise ValueError(f"ops {list(ops)!r}: choose one or more of {ARITHMETIC_OPS!r}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = random.Random(f"rlax_tpu.arithmetic:{seed}")  # str seeds hash stably (not hash())
    problems = []
    for index in range(count):
        op = ops[rng.randrange(len(ops))]
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "+":
            answer = a + b
        elif op == "-":
            a, b = max(a, b), min(a, b)
            answer = a - b
        elif op == "*":
            answer = a * b
        else:
            b = max(b, 1)
            a, answer = a * b, a
        problems.append(
            {
                "id": f"arith-{seed}-{index}",
                "prompt": _PROMPT.format(a=a, op=op, b=b),
                "answer": str(answer),
            }
        )
    return problems


_LAST_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\d])")


def score_arithmetic(response: str, answer: str) -> VerificationResult:
    """ACCEPTED (1.0) iff the last number in `response` equals the integer `answer` exactly
    ("42", "42.0" and "-8" are read; "1,000" reads as 000: answers here are small)."""
    try:
        expected = int(answer.strip())
    except ValueError:
        return VerificationResult(
            reward=0.0,
            verdict=Verdict.VERIFIER_ERROR,
            reason=f"the reference {answer!r} is not an integer",
        )
    numbers = _LAST_NUMBER.findall(response)
    if not numbers:
        return VerificationResult(
            reward=0.0, verdict=Verdict.NO_ANSWER, reason="no number in the response"
        )
    last = numbers[-1]
    value = float(last) if "." in last else int(last)
    if value == expected:
        return VerificationResult(
            reward=1.0, verdict=Verdict.ACCEPTED, reason=f"last number {last} == {expected}"
        )
    return VerificationResult(
        reward=0.0, verdict=Verdict.WRONG_ANSWER, reason=f"last number {last} != {expected}"
    )


# --- JSONL --------------------------------------------------------------------------------


def write_jsonl(path: str | os.PathLike[str], records: Iterable[dict[str, Any]]) -> None:
    """Writes one JSON object per line, atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a local JSONL file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --- reasoning-gym ------------------------------------------------------------------------


class ReasoningGymMissing(ImportError):
    """reasoning-gym is not installed; the message names the fix."""


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ReasoningGymMissing(
            "reasoning-gym tasks need the optional dependency reasoning-gym: "
            "pip install 'rlax_tpu[tasks]'"
        ) from exc
    return reasoning_gym


def reasoning_gym_problems(name: str, seed: int, count: int) -> list[dict[str, str]]:
    """`count` problems of reasoning-gym's dataset `name` as {"id", "prompt", "answer"},
    where answer is the whole task entry as JSON (what `score_reasoning_gym` needs).

    The prompt is the entry's question followed by an instruction to put the final answer
    in <answer>...</answer> tags, which is where the scorer looks for it.
    """
    dataset = _reasoning_gym().create_dataset(name, size=count, seed=seed)
    return [
        {
            "id": f"rg-{name}-{seed}-{index}",
            "prompt": f"{entry['question']}\n\nGive your final answer in <answer></answer> tags.",
            "answer": json.dumps(entry, default=str),
        }
        for index, entry in enumerate(dataset)
    ]


def extract_tagged_answer(response: str) -> str | None:
    """The text inside the last <answer>...</answer> of `response`, stripped."""
    matches = re.findall(r"<answer>(.*?)</answer>", response, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def score_reasoning_gym(response: str, reference: str) -> VerificationResult:
    """Scores `response` with reasoning-gym's own `score_answer` for the task entry in
    `reference` (JSON with question, answer and metadata.source_dataset).

    The answer is the last <answer>...</answer> span, else the whole response stripped.
    reward = the score in [0, 1] (partial credit passes through); ACCEPTED when it is 1.
    """
    try:
        entry = json.loads(reference)
        dataset_name = entry["metadata"]["source_dataset"]
    except (ValueError, TypeError, KeyError) as exc:
        return VerificationResult(
            reward=0.0,
            verdict=Verdict.VERIFIER_ERROR,
            reason=f"the reference is not a reasoning-gym entry with metadata.source_dataset "
            f"({type(exc).__name__}: {exc})",
        )
    score_answer = _reasoning_gym().get_score_answer_fn(dataset_name)
    answer = extract_tagged_answer(response)
    if answer is None:
        answer = response.strip()
    if not answer:
        return VerificationResult(
            reward=0.0, verdict=Verdict.NO_ANSWER, reason="the response is empty"
        )
    try:
        score = min(max(float(score_answer(answer, entry)), 0.0), 1.0)
    except Exception as exc:  # a scorer bug must not take down a whole batch
        return VerificationResult(
            reward=0.0,
            verdict=Verdict.VERIFIER_ERROR,
            reason=f"{dataset_name}'s score_answer raised {type(exc).__name__}: {exc}",
        )
    shown = answer if len(answer) <= _SHOWN_CHARS else answer[: _SHOWN_CHARS - 3] + "..."
    reason = f"{dataset_name} scored {score:g} for answer {shown!r}"
    return VerificationResult(
        reward=score,
        verdict=Verdict.ACCEPTED if score >= 1.0 else Verdict.WRONG_ANSWER,
        reason=reason,
    )
