"""A graded reward for the arithmetic task, for the staleness sweep's online DPO variant.

Online DPO trains on the best and the worst of a prompt's samples; with the task's binary
reward (right or wrong) the two tie whenever every sample is right or every sample is wrong,
and a group of all-wrong answers teaches nothing. This reward keeps 1 for the exact answer
and gives a wrong number partial credit that falls with its distance from the answer, so
samples rank: 0.5 · max(0, 1 − |x − answer| / max(10, |answer|)), 0 without a number. A
sample is right (accuracy, `reward >= 1`) exactly when the binary reward says so.

Used as `DatasetConfig(verifier="function", reward_function="tools/graded_arithmetic.py:reward")`
(docs/verifiers.md, "Rewards of your own").
"""

from __future__ import annotations

import re
from typing import Any

_LAST_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\d])")


def reward(prompt: Any, response: str, reference: str, metadata: dict[str, Any]) -> dict:
    numbers = _LAST_NUMBER.findall(response)
    if not numbers:
        return {"reward": 0.0, "verdict": "no_answer", "reason": "no number in the response"}
    answer, expected = float(numbers[-1]), int(reference.strip())
    if answer == expected:
        return {"reward": 1.0, "verdict": "accepted", "reason": f"{numbers[-1]} == {expected}"}
    credit = 0.5 * max(0.0, 1.0 - abs(answer - expected) / max(10.0, abs(expected)))
    return {
        "reward": credit,
        "verdict": "wrong_answer",
        "reason": f"{numbers[-1]} != {expected} (partial credit {credit:.3f})",
    }
