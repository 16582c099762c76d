"""Programming problems on disk: the directory format the code verifier reads.

A problem is a directory with problem.json and its tests. A "stdio" problem (the default)
has tests/<name>.in and tests/<name>.ans and an optional checker program; a "function"
problem has tests/<name>.py, trusted assert-style Python that calls the candidate's
functions through the function-call harness (HumanEval, MBPP). The test-data repository
uploads and fetches these directories; `compile_checker` builds the checker once so it is
stored compiled (docs/verifiers.md).
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import math
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeVar

from rlax_tpu.verifiers.languages import LANGUAGES, Language
from rlax_tpu.verifiers.sandbox import Sandbox

_T = TypeVar("_T")

PROBLEM_FILE = "problem.json"
TESTS_DIR = "tests"
CHECKER_BINARY = "checker.bin"

ProblemKind = Literal["stdio", "function"]
PROBLEM_KINDS: tuple[str, ...] = ("stdio", "function")
SETUP_FILE = "setup.py"  # the default name of a function problem's setup code

CompareMode = Literal["exact", "whitespace", "float"]
COMPARE_MODES: tuple[str, ...] = ("exact", "whitespace", "float")
DEFAULT_FLOAT_TOLERANCE = 1e-6

# Test and file names are plain names: no separators, no "..", nothing hidden.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class ProblemFormatError(ValueError):
    """A problem directory does not follow the format; the message names the file and field."""


class CheckerCompileError(RuntimeError):
    """The checker of a problem did not compile; the message holds the compiler's output."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checker:
    """A checker program: `source` is a file name in the problem directory."""

    language: str
    source: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class TestCase:
    """One test: its input (fed on stdin) and reference answer files."""

    __test__ = False  # not a pytest test class

    name: str
    input_path: Path
    answer_path: Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class FunctionTest:
    """One test of a function problem: trusted Python (asserts calling the entry points)."""

    __test__ = False  # not a pytest test class

    name: str
    code_path: Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    """A loaded problem directory. Limits left None take the verifier config's values.

    A stdio problem has `tests` (and compare / checker); a function problem has
    `entry_points`, an optional `setup_path` and `function_tests`, and no `tests`."""

    directory: Path
    name: str
    kind: ProblemKind = "stdio"
    compare: CompareMode = "whitespace"
    float_tolerance: float = DEFAULT_FLOAT_TOLERANCE
    checker: Checker | None = None
    time_limit_s: float | None = None
    memory_limit_bytes: int | None = None
    tests: tuple[TestCase, ...] = ()
    entry_points: tuple[str, ...] = ()
    setup_path: Path | None = None
    function_tests: tuple[FunctionTest, ...] = ()

    @property
    def test_names(self) -> tuple[str, ...]:
        """The names of the tests, whichever kind, in order."""
        tests = self.function_tests if self.kind == "function" else self.tests
        return tuple(t.name for t in tests)

    @property
    def checker_binary(self) -> Path | None:
        """Where the compiled checker is (or will be) stored; None without a checker."""
        return None if self.checker is None else self.directory / CHECKER_BINARY


def _fail(directory: Path, field: str, detail: str) -> ProblemFormatError:
    where = f"{directory / PROBLEM_FILE}: {field}" if field else str(directory)
    return ProblemFormatError(f"{where}: {detail}")


def load_problem(directory: str | os.PathLike[str]) -> Problem:
    """Read and validate a problem directory; raises `ProblemFormatError` naming what is wrong."""
    directory = Path(directory)
    spec_path = directory / PROBLEM_FILE
    try:
        spec = json.loads(spec_path.read_text())
    except FileNotFoundError:
        raise ProblemFormatError(f"{spec_path}: missing (not a problem directory)") from None
    except (OSError, ValueError) as e:
        raise ProblemFormatError(f"{spec_path}: not readable JSON: {e}") from None
    if not isinstance(spec, dict):
        raise _fail(directory, "", f"{PROBLEM_FILE} must hold a JSON object")
    known = {
        "name",
        "kind",
        "compare",
        "float_tolerance",
        "checker",
        "time_limit_s",
        "memory_limit_bytes",
        "entry_points",
        "setup",
        "tests",
    }
    for key in spec:
        if key not in known:
            raise _fail(directory, key, f"unknown field; known: {', '.join(sorted(known))}")

    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(directory, "name", "must be a non-empty string")

    kind = spec.get("kind", "stdio")
    if kind not in PROBLEM_KINDS:
        raise _fail(directory, "kind", f"must be one of {PROBLEM_KINDS}, got {kind!r}")
    only_for = (
        {"compare": "stdio", "float_tolerance": "stdio", "checker": "stdio"}
        if kind == "function"
        else {"entry_points": "function", "setup": "function"}
    )
    for key, other in only_for.items():
        if spec.get(key) is not None:
            raise _fail(directory, key, f"only {other} problems have it; this one is {kind!r}")

    time_limit = spec.get("time_limit_s")
    if time_limit is not None and (
        isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or time_limit <= 0
    ):
        raise _fail(directory, "time_limit_s", f"must be a number > 0, got {time_limit!r}")
    memory_limit = spec.get("memory_limit_bytes")
    if memory_limit is not None and (
        isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit <= 0
    ):
        raise _fail(
            directory, "memory_limit_bytes", f"must be an integer > 0, got {memory_limit!r}"
        )

    names = spec.get("tests")
    if not isinstance(names, list) or not names:
        raise _fail(directory, "tests", "must be a non-empty list of test names")
    seen = set()
    for test in names:
        if not isinstance(test, str) or not _NAME.match(test):
            raise _fail(directory, "tests", f"test names must be plain names, got {test!r}")
        if test in seen:
            raise _fail(directory, "tests", f"test {test!r} is listed twice")
        seen.add(test)

    common = {
        "directory": directory,
        "name": name,
        "time_limit_s": None if time_limit is None else float(time_limit),
        "memory_limit_bytes": memory_limit,
    }
    if kind == "function":
        return _load_function_problem(directory, spec, names, common)

    compare = spec.get("compare", "whitespace")
    if compare not in COMPARE_MODES:
        raise _fail(directory, "compare", f"must be one of {COMPARE_MODES}, got {compare!r}")

    tolerance = spec.get("float_tolerance", DEFAULT_FLOAT_TOLERANCE)
    if tolerance is None:
        tolerance = DEFAULT_FLOAT_TOLERANCE
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not math.isfinite(tolerance)
        or tolerance < 0
    ):
        raise _fail(directory, "float_tolerance", f"must be a number >= 0, got {tolerance!r}")

    checker = None
    raw_checker = spec.get("checker")
    if raw_checker is not None:
        if not isinstance(raw_checker, dict):
            raise _fail(directory, "checker", "must be null or {language, source}")
        language, source = raw_checker.get("language"), raw_checker.get("source")
        if language not in LANGUAGES:
            raise _fail(
                directory,
                "checker.language",
                f"must be one of {tuple(LANGUAGES)}, got {language!r}",
            )
        if not isinstance(source, str) or not _NAME.match(source) or source == CHECKER_BINARY:
            raise _fail(directory, "checker.source", f"must be a plain file name, got {source!r}")
        if not (directory / source).is_file():
            raise _fail(directory, "checker.source", f"{directory / source} does not exist")
        checker = Checker(language=language, source=source)

    tests = []
    for test in names:
        case = TestCase(
            name=test,
            input_path=directory / TESTS_DIR / f"{test}.in",
            answer_path=directory / TESTS_DIR / f"{test}.ans",
        )
        for path in (case.input_path, case.answer_path):
            if not path.is_file():
                raise _fail(directory, "tests", f"test {test!r}: {path} does not exist")
        tests.append(case)

    return Problem(
        **common,
        compare=compare,
        float_tolerance=float(tolerance),
        checker=checker,
        tests=tuple(tests),
    )


def _check_python(directory: Path, field: str, path: Path, what: str) -> None:
    """Raise naming `field` unless `path` is readable UTF-8 Python that compiles."""
    try:
        compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
    except FileNotFoundError:
        raise _fail(directory, field, f"{what}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(directory, field, f"{what}: {path} is not readable UTF-8: {e}") from None
    except (SyntaxError, ValueError) as e:
        line = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        detail = e.msg if isinstance(e, SyntaxError) else str(e)
        raise _fail(
            directory, field, f"{what}: {path} is not valid Python: {detail}{line}"
        ) from None


def _load_function_problem(directory: Path, spec: dict, names: list[str], common: dict) -> Problem:
    entry_points = spec.get("entry_points")
    if not isinstance(entry_points, list) or not entry_points:
        raise _fail(directory, "entry_points", "must be a non-empty list of function names")
    for entry in entry_points:
        if not isinstance(entry, str) or not entry.isidentifier() or keyword.iskeyword(entry):
            raise _fail(directory, "entry_points", f"must be Python identifiers, got {entry!r}")
    if len(set(entry_points)) != len(entry_points):
        raise _fail(directory, "entry_points", f"lists a name twice: {entry_points}")

    setup_path = None
    setup = spec.get("setup")
    if setup is not None:
        if not isinstance(setup, str) or not _NAME.match(setup) or setup == PROBLEM_FILE:
            raise _fail(directory, "setup", f"must be null or a plain file name, got {setup!r}")
        setup_path = directory / setup
        _check_python(directory, "setup", setup_path, "setup")

    tests = []
    for test in names:
        case = FunctionTest(name=test, code_path=directory / TESTS_DIR / f"{test}.py")
        _check_python(directory, "tests", case.code_path, f"test {test!r}")
        tests.append(case)
    return Problem(
        **common,
        kind="function",
        entry_points=tuple(entry_points),
        setup_path=setup_path,
        function_tests=tuple(tests),
    )


def _named(tests: Sequence[_T] | Mapping[str, _T]) -> list[tuple[str, _T]]:
    """(name, test) pairs: a mapping's items, or a sequence named 01, 02, ... in order."""
    if isinstance(tests, Mapping):
        return list(tests.items())
    width = max(2, len(str(len(tests))))
    return [(f"{i + 1:0{width}d}", test) for i, test in enumerate(tests)]


def _write_spec(
    directory: Path,
    spec: dict,
    named: Sequence[tuple[str, object]],
    time_limit_s: float | None,
    memory_limit_bytes: int | None,
) -> Path:
    """Finish `spec` with the limits given and the tests' names; write problem.json."""
    if time_limit_s is not None:
        spec["time_limit_s"] = time_limit_s
    if memory_limit_bytes is not None:
        spec["memory_limit_bytes"] = memory_limit_bytes
    spec["tests"] = [test for test, _ in named]
    (directory / PROBLEM_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    return directory


def write_problem(
    directory: str | os.PathLike[str],
    *,
    name: str,
    tests: Sequence[tuple[str, str]] | Mapping[str, tuple[str, str]],
    compare: CompareMode = "whitespace",
    float_tolerance: float | None = None,
    checker_source: str | None = None,
    checker_language: str | None = None,
    checker_file: str | None = None,
    time_limit_s: float | None = None,
    memory_limit_bytes: int | None = None,
) -> Path:
    """Write a problem directory (created if needed) and return it.

    tests: (input, answer) pairs named 01, 02, ... in order, or a mapping name -> pair.
    checker_source: the checker's text; `checker_language` is then required and the file is
    named `checker_file` (default checker.cpp / checker.py). Call `compile_checker` after.
    """
    directory = Path(directory)
    named = _named(tests)
    (directory / TESTS_DIR).mkdir(parents=True, exist_ok=True)
    for test, (given, answer) in named:
        if not _NAME.match(test):
            raise ValueError(f"test name {test!r} is not a plain name")
        (directory / TESTS_DIR / f"{test}.in").write_text(given)
        (directory / TESTS_DIR / f"{test}.ans").write_text(answer)
    spec: dict = {"name": name, "compare": compare}
    if float_tolerance is not None:
        spec["float_tolerance"] = float_tolerance
    spec["checker"] = None
    if checker_source is not None:
        if checker_language not in LANGUAGES:
            raise ValueError(f"checker_language must be one of {tuple(LANGUAGES)}")
        source_name = (
            checker_file or f"checker{Path(LANGUAGES[checker_language].source_name).suffix}"
        )
        (directory / source_name).write_text(checker_source)
        spec["checker"] = {"language": checker_language, "source": source_name}
    return _write_spec(directory, spec, named, time_limit_s, memory_limit_bytes)


def write_function_problem(
    directory: str | os.PathLike[str],
    *,
    name: str,
    entry_points: Sequence[str],
    tests: Sequence[str] | Mapping[str, str],
    setup: str | None = None,
    time_limit_s: float | None = None,
    memory_limit_bytes: int | None = None,
) -> Path:
    """Write a function problem directory (created if needed) and return it.

    entry_points: the function names the tests call (the candidate must define them).
    tests: test code (trusted Python, asserts calling the entry points) named 01, 02, ... in
    order, or a mapping name -> code. setup: Python run before each test, in the harness and
    before the candidate's program (HumanEval's prompt, MBPP's test_setup_code)."""
    directory = Path(directory)
    named = _named(tests)
    (directory / TESTS_DIR).mkdir(parents=True, exist_ok=True)
    for test, code in named:
        if not _NAME.match(test):
            raise ValueError(f"test name {test!r} is not a plain name")
        (directory / TESTS_DIR / f"{test}.py").write_text(code, encoding="utf-8")
    spec: dict = {"name": name, "kind": "function", "entry_points": list(entry_points)}
    if setup is not None:
        (directory / SETUP_FILE).write_text(setup, encoding="utf-8")
        spec["setup"] = SETUP_FILE
    return _write_spec(directory, spec, named, time_limit_s, memory_limit_bytes)


_compile_locks: dict[Path, threading.Lock] = {}
_compile_locks_guard = threading.Lock()


def _lock_for(directory: Path) -> threading.Lock:
    with _compile_locks_guard:
        return _compile_locks.setdefault(directory.resolve(), threading.Lock())


def compile_checker(
    directory: str | os.PathLike[str],
    languages: Mapping[str, Language] = LANGUAGES,
    sandbox: Sandbox | None = None,
    *,
    force: bool = False,
) -> Path | None:
    """Compile the problem's checker into <directory>/checker.bin; return its path.

    None when the problem has no checker. Compiles in the sandbox (checkers are trusted,
    compilers parse them anyway). For an interpreted checker the artifact is a copy of the
    source, after its syntax check. Skipped when checker.bin exists unless `force`.
    Raises `CheckerCompileError` on a compile failure, `SandboxUnavailable` without one."""
    problem = load_problem(directory)
    if problem.checker is None:
        return None
    target = problem.checker_binary
    assert target is not None
    language = languages.get(problem.checker.language)
    if language is None:
        raise CheckerCompileError(
            f"{problem.directory}: checker language {problem.checker.language!r} is not in "
            "the language table"
        )
    sandbox = sandbox or Sandbox()
    with _lock_for(problem.directory):
        if target.is_file() and not force:
            return target
        with sandbox.workdir(writable=True) as work:
            shutil.copyfile(problem.directory / problem.checker.source, work / language.source_name)
            os.chmod(work / language.source_name, 0o644)
            if language.compile is not None:
                outcome = sandbox.run(
                    language.compile_argv(),
                    workdir=work,
                    limits=language.compile_limits,
                    writable=True,
                )
                if not outcome.ok:
                    detail = outcome.stderr_tail.decode(errors="replace").strip()
                    raise CheckerCompileError(
                        f"{problem.directory}: checker {problem.checker.source} did not compile "
                        f"({outcome.describe()}):\n{detail[-2000:]}"
                    )
            built = work / language.binary_name
            if not built.is_file():
                raise CheckerCompileError(
                    f"{problem.directory}: compiling the checker produced no {language.binary_name}"
                )
            # Write-then-rename so a concurrent reader never sees half a binary.
            fd, tmp = tempfile.mkstemp(prefix=".checker-", dir=problem.directory)
            os.close(fd)
            try:
                shutil.copyfile(built, tmp)
                os.chmod(tmp, 0o755)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    return target


__all__ = [
    "CHECKER_BINARY",
    "COMPARE_MODES",
    "PROBLEM_KINDS",
    "Checker",
    "CheckerCompileError",
    "FunctionTest",
    "Problem",
    "ProblemFormatError",
    "TestCase",
    "compile_checker",
    "load_problem",
    "write_function_problem",
    "write_problem",
]
