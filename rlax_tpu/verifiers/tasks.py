"""Task adapters: datasets the controller can train on and the scorers that judge them.

The built-in arithmetic task ("What is 17 + 25?") feeds the demo RL run; reasoning-gym's
procedural tasks are an optional extra (`pip install 'rlax_tpu[tasks]'`) scored by their own
`score_answer`. Datasets are JSONL records with the fields id, prompt and answer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu.api.verifier import Verdict, VerificationResult

ARITHMETIC_OPS = ("+", "-", "*", "/")
_PROMPT = "What is {a} {op} {b}? Answer with just the number."
_SHOWN_CHARS = 120


# --- arithmetic ---------------------------------------------------------------------------


# The arithmetic task's two sides: one problem in _TEST_BUCKETS is a test problem, chosen by
# a hash of the problem itself ("17 + 5"), so no seed, size or count puts a test problem in
# training data: held out by construction.
ARITHMETIC_SPLITS = ("train", "test")
_TEST_BUCKETS = 8


def arithmetic_split_of(a: int, op: str, b: int) -> str:
    """ "test" or "train": the side of the problem `a op b` (as the prompt writes it)."""
    digest = hashlib.sha256(f"{a} {op} {b}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % _TEST_BUCKETS == 0 else "train"


def _check_arithmetic(ops: Sequence[str], max_operand: int, count: int, split: str | None) -> None:
    unknown = [op for op in ops if op not in ARITHMETIC_OPS]
    if unknown or not ops:
        raise ValueError(f"ops {list(ops)!r}: choose one or more of {ARITHMETIC_OPS!r}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if split is not None and split not in ARITHMETIC_SPLITS:
        raise ValueError(f"split {split!r}: choose one of {ARITHMETIC_SPLITS!r} (or None)")


def _draw_problem(rng: random.Random, ops: Sequence[str], max_operand: int) -> tuple:
    op = ops[rng.randrange(len(ops))]
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "+":
        return a, op, b, a + b
    if op == "-":
        return max(a, b), op, min(a, b), max(a, b) - min(a, b)
    if op == "*":
        return a, op, b, a * b
    b = max(b, 1)
    return a * b, op, b, a


def arithmetic_space(max_operand: int, ops: Sequence[str]) -> list[tuple[int, str, int, int]]:
    """Every distinct problem (a, op, b, answer) the generator can make, in a fixed order."""
    _check_arithmetic(ops, max_operand, 0, None)
    values = range(max_operand + 1)
    space = set()
    for op in ops:
        for a in values:
            for b in values:
                if op == "+":
                    space.add((a, op, b, a + b))
                elif op == "-" and a >= b:
                    space.add((a, op, b, a - b))
                elif op == "*":
                    space.add((a, op, b, a * b))
                elif op == "/" and b >= 1:
                    space.add((a * b, op, b, a))
    return sorted(space, key=lambda p: (ARITHMETIC_OPS.index(p[1]), p[0], p[2]))


def arithmetic_problems(
    seed: int,
    count: int,
    *,
    max_operand: int = 50,
    ops: Sequence[str] = ("+", "-"),
    split: str | None = None,
) -> list[dict[str, str]]:
    """`count` problems {"id", "prompt", "answer"}, the same for the same arguments.

    Operands are integers in [0, max_operand]; "-" puts the larger operand first so answers
    are never negative; "/" divides exactly (the dividend is divisor * quotient, divisor in
    [1, max_operand]); "*" multiplies two operands.

    split: None, any problem, drawn with repeats (id "arith-{seed}-{index}"); "train", drawn
    the same way from the training side only (`arithmetic_split_of`); "test", `count`
    distinct problems of the test side in an order the seed shuffles (ValueError when the
    space holds fewer). Ids of a split are "arith-{split}-{seed}-{index}".
    """
    _check_arithmetic(ops, max_operand, count, split)
    if split == "test":
        space = [
            p for p in arithmetic_space(max_operand, ops) if arithmetic_split_of(*p[:3]) == "test"
        ]
        if count > len(space):
            raise ValueError(
                f"the test side of the arithmetic task (operands 0-{max_operand}, ops "
                f"{list(ops)}) holds {len(space)} distinct problems, fewer than the {count} "
                "asked for: ask for fewer or make the space larger (max_operand, ops)"
            )
        random.Random(f"rlax_tpu.arithmetic:{seed}:test").shuffle(space)
        chosen = space[:count]
    else:
        rng = random.Random(f"rlax_tpu.arithmetic:{seed}")  # str seeds hash stably (not hash())
        chosen = []
        while len(chosen) < count:
            problem = _draw_problem(rng, ops, max_operand)
            if split is None or arithmetic_split_of(*problem[:3]) == split:
                chosen.append(problem)
    prefix = f"arith-{seed}" if split is None else f"arith-{split}-{seed}"
    return [
        {
            "id": f"{prefix}-{index}",
            "prompt": _PROMPT.format(a=a, op=op, b=b),
            "answer": str(answer),
        }
        for index, (a, op, b, answer) in enumerate(chosen)
    ]


# --- multiplication with a calculator (the tool-use demo) -----------------------------------
# Three-digit by two-digit products (81,000 problems, split as the arithmetic task is), which
# the demo's tiny model cannot work out in its head but can with the calculator tool.
MULTIPLICATION_FIRST = (100, 999)
MULTIPLICATION_SECOND = (10, 99)
_MULTIPLICATION_PROMPT = "What is {a} * {b}?"


def multiplication_problems(
    seed: int, count: int, *, split: str, tool_demonstrations: float = 0.0
) -> list[dict[str, Any]]:
    """`count` problems {"id", "prompt", "answer", "demonstration"} of one side of the
    multiplication task, the same for the same arguments: "train" drawn with repeats from
    the training side, "test" distinct problems of the test side (`arithmetic_split_of`
    decides, so no seed or size puts a test problem in training data).

    "demonstration" is the SFT warm start's target as a list of messages (a dataset's
    sft_field may name it): for a `tool_demonstrations` fraction of rows (drawn by the seed)
    a calculator call, its result and the answer; for the others the answer alone."""
    if split not in ARITHMETIC_SPLITS:
        raise ValueError(f"split {split!r}: choose one of {ARITHMETIC_SPLITS!r}")
    if not 0.0 <= tool_demonstrations <= 1.0:
        raise ValueError(f"tool_demonstrations must be in [0, 1], got {tool_demonstrations}")
    (a_lo, a_hi), (b_lo, b_hi) = MULTIPLICATION_FIRST, MULTIPLICATION_SECOND
    rng = random.Random(f"rlax_tpu.multiplication:{seed}:{split}")
    if split == "test":
        space = [
            (a, b)
            for a in range(a_lo, a_hi + 1)
            for b in range(b_lo, b_hi + 1)
            if arithmetic_split_of(a, "*", b) == "test"
        ]
        if count > len(space):
            raise ValueError(
                f"the multiplication task's test side holds {len(space)} problems, fewer than "
                f"the {count} asked for"
            )
        rng.shuffle(space)
        chosen = space[:count]
    else:
        chosen = []
        while len(chosen) < count:
            a, b = rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)
            if arithmetic_split_of(a, "*", b) == "train":
                chosen.append((a, b))
    shown = random.Random(f"rlax_tpu.multiplication:{seed}:{split}:demonstrations")
    rows = []
    for index, (a, b) in enumerate(chosen):
        answer = str(a * b)
        demonstration: list[dict[str, Any]] = []
        if shown.random() < tool_demonstrations:  # row by row: a prefix of a longer draw
            call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
            demonstration = [
                {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
                {"role": "tool", "name": "calculator", "content": answer},
            ]
        demonstration.append({"role": "assistant", "content": answer})
        rows.append(
            {
                "id": f"mul-{split}-{seed}-{index}",
                "prompt": _MULTIPLICATION_PROMPT.format(a=a, b=b),
                "answer": answer,
                "demonstration": demonstration,
            }
        )
    return rows


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


# --- arithmetic with a long-tailed worked solution ------------------------------------------
# The filler ("thinking") characters of `with_thinking`: 26 letters drawn uniformly, so no
# digit is read as the answer, and a greedy decoder, which takes one letter only when the
# model puts more than 1/27 of its mass on it, ends the filler early where sampling keeps
# the long tail.
THINKING_FILLER = "abcdefghijklmnopqrstuvwxyz"


def thinking_length(rng: random.Random, median: float, sigma: float, max_filler: int) -> int:
    """A filler length: ⌈median·e^(σ·z)⌉, z standard normal, drawn again while it exceeds
    `max_filler` (a lognormal truncated at the cap, so no length piles up on it)."""
    if median < 1 or sigma < 0 or max_filler < median:
        raise ValueError(
            f"need median >= 1, sigma >= 0 and max_filler >= median; got median={median}, "
            f"sigma={sigma}, max_filler={max_filler}"
        )
    while True:
        n = max(1, math.ceil(median * math.exp(sigma * rng.gauss(0.0, 1.0))))
        if n <= max_filler:
            return n


def with_thinking(
    rows: Iterable[dict[str, str]],
    seed: int,
    *,
    median: float,
    sigma: float,
    max_filler: int,
    field: str = "solution",
) -> list[dict[str, str]]:
    """`rows` of the arithmetic task (or any with an "answer"), each given a worked solution
    in `field`: n filler characters (THINKING_FILLER) then " = <answer>", n from
    `thinking_length`. A dataset with sft_field=`field` warm-starts a policy whose response
    lengths are heavy-tailed (lognormal, shape σ) while its reward stays the answer's (the
    arithmetic verifier reads the last number). Each row's solution depends only on (seed,
    its id)."""
    out = []
    for row in rows:
        rng = random.Random(f"rlax_tpu.thinking:{seed}:{row['id']}")
        n = thinking_length(rng, median, sigma, max_filler)
        filler = "".join(rng.choice(THINKING_FILLER) for _ in range(n))
        out.append({**row, field: f"{filler} = {row['answer']}"})
    return out


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
