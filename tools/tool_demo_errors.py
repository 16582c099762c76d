#!/usr/bin/env python3
"""Where the tool-use demo's episodes go wrong: per quarter of a run's steps, from its
rollout log (`rlax-tpu samples`), how many sampled episodes called the calculator, how
many of those copied the problem's operands into the call and the tool's result into the
answer, how many were rewarded, and how many answered without the tool (and how many of
those were right).

    python tools/tool_demo_errors.py RUN_DIR [--json OUT]

RUN_DIR is a run of configs/tiny_cpu_tools.py (prompts "What is A * B?"). docs/agents.md
quotes its figures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlax_tpu.cli.samples import read_samples  # noqa: E402
from rlax_tpu.controller.snapshots import RolloutLog  # noqa: E402

_PROBLEM = re.compile(r"What is (\d+) \* (\d+)\?")


def classify(sample: dict[str, Any], a: str, b: str) -> dict[str, bool]:
    """One sample of the problem `a * b`: whether it called the tool, copied the operands
    into the call, copied the tool's result into its answer, and was rewarded."""
    rewarded = (sample["reward"] or 0.0) > 0.0
    turns = sample.get("turns") or []
    if not turns:
        return {"called": False, "operands": False, "result": False, "rewarded": rewarded}
    call = turns[0]["text"] or ""
    observation = next((t for t in turns if t["role"] == "observation"), None)
    result = (observation or {}).get("messages", [{}])[0].get("content", "")
    answer = turns[-1]["text"] if turns[-1]["role"] == "policy" and len(turns) > 2 else None
    return {
        "called": True,
        "operands": f'"expression": "{a} * {b}"' in call,
        "result": bool(result) and answer is not None and answer.strip() == result.strip(),
        "rewarded": rewarded,
    }


def quarters(run_dir: str) -> list[dict[str, Any]]:
    """The counts per quarter of the run's batches."""
    batches = RolloutLog(run_dir).batches()
    n = len(batches)
    out = []
    for q in range(4):
        chosen = batches[q * n // 4 : (q + 1) * n // 4]
        counts = dict.fromkeys(("calls", "operands", "result", "rewarded_calls"), 0)
        counts.update(direct=0, direct_right=0)
        for batch in chosen:
            for prompt in read_samples(run_dir, step=batch)["prompts"]:
                a, b = _PROBLEM.match(prompt["record"]["prompt"]).groups()
                for sample in prompt["samples"]:
                    c = classify(sample, a, b)
                    if c["called"]:
                        counts["calls"] += 1
                        counts["operands"] += c["operands"]
                        counts["result"] += c["result"]
                        counts["rewarded_calls"] += c["rewarded"]
                    else:
                        counts["direct"] += 1
                        counts["direct_right"] += c["rewarded"]
        out.append({"batches": [chosen[0], chosen[-1]] if chosen else [], **counts})
    return out


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| batches | calls | operands copied | result copied | rewarded | answered without "
        "the tool (right) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["batches"]:
            continue
        calls = max(r["calls"], 1)
        lines.append(
            f"| {r['batches'][0]}–{r['batches'][1]} | {r['calls']} | "
            f"{r['operands'] / calls:.2f} | {r['result'] / calls:.2f} | "
            f"{r['rewarded_calls'] / calls:.2f} | {r['direct']} ({r['direct_right']}) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = quarters(args.run_dir)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
