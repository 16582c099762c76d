"""The code verifier: compile a response's program once, run it on a problem's tests.

Each run is a sandboxed process (rlax_tpu.verifiers.sandbox). For a stdio problem it is
fed a test's input on stdin and its stdout is compared with the reference answer (exact,
whitespace or float tolerance) or judged by the problem's checker program. For a function
problem (HumanEval, MBPP) the run is the trusted function-call harness, which calls the
program's functions from the test's asserts and reports under a per-run token that the
program cannot forge. The reward is all-or-nothing or the passed fraction.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from rlax_tpu.api.verifier import TestCaseResult, Verdict, VerificationResult
from rlax_tpu.config.run import VerifierConfig
from rlax_tpu.verifiers import function_harness
from rlax_tpu.verifiers.languages import LANGUAGES, Language, extract_code, language_for_fence
from rlax_tpu.verifiers.problems import (
    CheckerCompileError,
    FunctionTest,
    Problem,
    ProblemFormatError,
    TestCase,
    compile_checker,
    load_problem,
)
from rlax_tpu.verifiers.sandbox import RunLimits, RunOutcome, Sandbox, SandboxUnavailable

_SHOW_CHARS = 40  # longest excerpt of an output shown in a reason
_COMPILE_ERROR_CHARS = 600

# Checker programs (testlib convention): argv[1..3] = input, contestant output, answer.
CHECKER_ACCEPTED = 0
CHECKER_WRONG_ANSWER = 1

# The function-call harness, as it is named in a run's work directory.
HARNESS_FILE = "function_harness.py"
_HARNESS_VERDICTS = {
    "accepted": Verdict.ACCEPTED,
    "wrong_answer": Verdict.WRONG_ANSWER,
    "runtime_error": Verdict.RUNTIME_ERROR,
    "time_limit": Verdict.TIME_LIMIT,
    "memory_limit": Verdict.MEMORY_LIMIT,
    # Failures found before the candidate's code ran: the problem or the harness is broken.
    "problem_error": Verdict.VERIFIER_ERROR,
    "harness_error": Verdict.VERIFIER_ERROR,
}
_HEX = re.compile(r"[0-9a-f]{32}")

_Test = TypeVar("_Test")


def _limit_hit(outcome: RunOutcome, limits: RunLimits) -> tuple[Verdict, str] | None:
    """The verdict and reason of a run stopped by one of its limits, else None."""
    if outcome.output_limit_exceeded:
        return Verdict.OUTPUT_LIMIT, f"output limit exceeded (over {limits.output_bytes} bytes)"
    if outcome.time_limit_exceeded:
        return (
            Verdict.TIME_LIMIT,
            f"time limit exceeded ({outcome.cpu_time_s:.2f}s CPU, "
            f"{outcome.wall_time_s:.2f}s wall; limit {limits.cpu_time_s:g}s)",
        )
    if outcome.memory_limit_exceeded:
        return (
            Verdict.MEMORY_LIMIT,
            f"memory limit exceeded (limit {limits.memory_bytes // 2**20} MiB)",
        )
    return None


# --- comparing outputs ------------------------------------------------------------------

_NUMBER = re.compile(rb"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _show(token: bytes | None) -> str:
    if token is None:
        return "end of output"
    text = token.decode(errors="replace")
    if len(text) > _SHOW_CHARS:
        text = text[:_SHOW_CHARS] + "…"
    return repr(text)


def _mismatch(where: str, expected: bytes | None, got: bytes | None) -> str:
    at = f" at {where}" if where else ""
    return f"wrong answer{at} (expected {_show(expected)}, got {_show(got)})"


def _floats_match(got: bytes, expected: bytes, tolerance: float) -> bool:
    if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(expected)):
        return got == expected
    a, b = float(got), float(expected)
    return abs(a - b) <= tolerance or abs(a - b) <= tolerance * abs(b)


def compare_output(
    output: bytes, answer: bytes, mode: str = "whitespace", float_tolerance: float = 1e-6
) -> tuple[bool, str]:
    """Whether `output` matches `answer`, and if not, a reason naming the first difference.

    exact:      the same text, apart from \\r\\n vs \\n and newlines at the very end.
    whitespace: the same sequence of whitespace-separated tokens.
    float:      tokens as in whitespace; where both are numbers they match within
                `float_tolerance`, absolute or relative to the answer.
    """
    if mode == "exact":
        got = output.replace(b"\r\n", b"\n").rstrip(b"\n")
        expected = answer.replace(b"\r\n", b"\n").rstrip(b"\n")
        if got == expected:
            return True, "accepted"
        got_lines, expected_lines = got.split(b"\n"), expected.split(b"\n")
        for i in range(max(len(got_lines), len(expected_lines))):
            g = got_lines[i] if i < len(got_lines) else None
            e = expected_lines[i] if i < len(expected_lines) else None
            if g != e:
                where = f"line {i + 1}" if max(len(got_lines), len(expected_lines)) > 1 else ""
                return False, _mismatch(where, e, g)
        return False, "wrong answer"  # unreachable: equal lines mean equal text
    if mode not in ("whitespace", "float"):
        raise ValueError(f"unknown compare mode {mode!r}")
    got_tokens, expected_tokens = output.split(), answer.split()
    for i in range(max(len(got_tokens), len(expected_tokens))):
        g = got_tokens[i] if i < len(got_tokens) else None
        e = expected_tokens[i] if i < len(expected_tokens) else None
        if g is not None and e is not None:
            same = _floats_match(g, e, float_tolerance) if mode == "float" else g == e
        else:
            same = False
        if not same:
            where = f"token {i + 1}" if max(len(got_tokens), len(expected_tokens)) > 1 else ""
            return False, _mismatch(where, e, g)
    return True, "accepted"


# --- the verifier -----------------------------------------------------------------------


def _last_line(data: bytes, limit: int = 120) -> str:
    lines = [line for line in data.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1].strip()
    return line if len(line) <= limit else line[:limit] + "…"


def _copy(src: Path, dst: Path, mode: int = 0o644) -> None:
    shutil.copyfile(src, dst)
    os.chmod(dst, mode)


class CodeVerifier:
    """Judges programs in model responses against problem directories.

    config:               the `verifiers` section (languages, limits, reward, allow_unsandboxed);
                          keyword overrides of its fields may be given as `**overrides`.
    sandbox:              runs every compiler, program and checker; default: a bwrap sandbox
                          honouring `config.allow_unsandboxed`.
    max_parallel_tests:   test cases of one request run concurrently up to this many.
    stop_on_first_failure: skip tests not yet started once one fails; default: on for the
                          "all_passed" reward (the reward is 0 anyway), off for
                          "fraction_passed".
    checker_time_limit_s, checker_memory_limit_bytes: limits of one checker run.
    base_limits:          limits of a test run other than time, memory and output (processes,
                          file size, open files, stack, tmp size, wall clock).
    """

    def __init__(
        self,
        config: VerifierConfig | None = None,
        *,
        sandbox: Sandbox | None = None,
        languages: Mapping[str, Language] = LANGUAGES,
        max_parallel_tests: int = 4,
        stop_on_first_failure: bool | None = None,
        checker_time_limit_s: float = 10.0,
        checker_memory_limit_bytes: int = 1 * 2**30,
        base_limits: RunLimits | None = None,
        **overrides: object,
    ) -> None:
        if config is None:
            config = VerifierConfig(**overrides)  # type: ignore[arg-type]
        elif overrides:
            config = dataclasses.replace(config, **overrides)  # type: ignore[arg-type]
        if max_parallel_tests < 1:
            raise ValueError(f"max_parallel_tests must be >= 1, got {max_parallel_tests}")
        self.config = config
        self.sandbox = sandbox or Sandbox(
            bwrap=config.sandbox_bwrap,
            allow_unsandboxed=config.allow_unsandboxed,
            cgroup=config.sandbox_cgroup,
        )
        self.languages = dict(languages)
        self.max_parallel_tests = max_parallel_tests
        self.stop_on_first_failure = (
            config.code_reward == "all_passed"
            if stop_on_first_failure is None
            else stop_on_first_failure
        )
        self.checker_limits = RunLimits(
            cpu_time_s=checker_time_limit_s,
            memory_bytes=checker_memory_limit_bytes,
            output_bytes=64 * 2**10,
        )
        self.base_limits = base_limits or RunLimits()

    # --- entry points ---------------------------------------------------------------------

    def verify(
        self, response: str, problem_dir: str | os.PathLike[str], *, language: str = ""
    ) -> VerificationResult:
        """Judge the program in `response` (its last fenced code block) on a problem directory.

        `language`: a name from the language table; "" = take it from the code fence."""
        enabled = tuple(self.config.code_languages)
        if language and language not in enabled:
            return _result(
                Verdict.VERIFIER_ERROR,
                f"language {language!r} is not enabled (verifiers.code_languages = "
                f"{list(enabled)})",
            )
        found = extract_code(response, language=language, enabled=enabled, table=self.languages)
        if found is None:
            return _result(Verdict.NO_ANSWER, "no fenced code block (```lang ... ```) found")
        source, tag = found
        if not language:
            if tag:
                language = language_for_fence(tag, enabled, self.languages) or ""
                if not language:
                    return _result(
                        Verdict.COMPILE_ERROR,
                        f"code block is tagged {tag!r}, not one of the enabled languages "
                        f"({', '.join(enabled)})",
                    )
            elif len(enabled) == 1:
                language = enabled[0]
            else:
                return _result(
                    Verdict.COMPILE_ERROR,
                    "code block has no language tag; tag it as one of: " + ", ".join(enabled),
                )
        try:
            problem = load_problem(problem_dir)
        except ProblemFormatError as e:
            return _result(Verdict.VERIFIER_ERROR, f"bad problem: {e}")
        return self.run_tests(source, language, problem)

    def run_tests(
        self, source: str, language: str, problem: Problem | str | os.PathLike[str]
    ) -> VerificationResult:
        """Compile `source` once and run it on every test of `problem`."""
        if not isinstance(problem, Problem):
            try:
                problem = load_problem(problem)
            except ProblemFormatError as e:
                return _result(Verdict.VERIFIER_ERROR, f"bad problem: {e}")
        lang = self.languages.get(language)
        if lang is None or language not in self.config.code_languages:
            return _result(
                Verdict.VERIFIER_ERROR,
                f"language {language!r} is not enabled (verifiers.code_languages = "
                f"{list(self.config.code_languages)})",
            )
        try:
            how = self.sandbox.check()
        except SandboxUnavailable as e:
            return _result(Verdict.VERIFIER_ERROR, str(e))
        note = f" [{how}]" if how.startswith("UNSANDBOXED") else ""
        try:
            result = self._judge(source, lang, problem)
        except SandboxUnavailable as e:
            return _result(Verdict.VERIFIER_ERROR, str(e))
        except OSError as e:  # test data unreadable, work directory not writable, ...
            return _result(Verdict.VERIFIER_ERROR, f"{type(e).__name__}: {e}")
        if note:
            result = dataclasses.replace(result, reason=result.reason + note)
        return result

    # --- steps ----------------------------------------------------------------------------

    def _limits(self, problem: Problem) -> RunLimits:
        return dataclasses.replace(
            self.base_limits,
            cpu_time_s=problem.time_limit_s or self.config.code_time_limit_s,
            memory_bytes=problem.memory_limit_bytes or self.config.code_memory_limit_bytes,
            output_bytes=self.config.code_output_limit_bytes,
        )

    def _judge(self, source: str, lang: Language, problem: Problem) -> VerificationResult:
        if problem.kind == "function":
            return self._judge_function(source, lang, problem)
        checker: Path | None = None
        if problem.checker is not None:
            try:
                checker = compile_checker(problem.directory, self.languages, self.sandbox)
            except CheckerCompileError as e:
                return _result(Verdict.CHECKER_FAILURE, f"checker did not compile: {e}")
            except OSError as e:
                return _result(
                    Verdict.VERIFIER_ERROR,
                    f"checker of {problem.directory} is not compiled and could not be: {e}",
                )
        with self.sandbox.workdir(writable=True) as work:
            path = work / lang.source_name
            path.write_text(source)
            os.chmod(path, 0o644)
            if lang.compile is not None:
                outcome = self.sandbox.run(
                    lang.compile_argv(), workdir=work, limits=lang.compile_limits, writable=True
                )
                if not outcome.ok:
                    return _result(Verdict.COMPILE_ERROR, _compile_error(outcome))
                if not (work / lang.binary_name).is_file():
                    return _result(
                        Verdict.COMPILE_ERROR, f"compile error: no {lang.binary_name} produced"
                    )
            limits = self._limits(problem)
            return self._run_all(
                problem.tests,
                lambda test: self._run_one(test, work, lang, problem, limits, checker),
            )

    def _run_all(
        self, tests: Sequence[_Test], run_one: Callable[[_Test], TestCaseResult]
    ) -> VerificationResult:
        results: list[TestCaseResult | None] = [None] * len(tests)
        lock = threading.Lock()
        state = {"next": 0, "stop": False}

        def worker() -> None:
            # Tests are taken in order, and after a failure (when stopping on one) no new test
            # starts; so every test before the first failure has run, whatever the timing.
            while True:
                with lock:
                    if state["stop"] or state["next"] >= len(tests):
                        return
                    index = state["next"]
                    state["next"] += 1
                result = run_one(tests[index])
                results[index] = result
                if result.verdict != Verdict.ACCEPTED and self.stop_on_first_failure:
                    with lock:
                        state["stop"] = True

        workers = min(self.max_parallel_tests, len(tests))
        with concurrent.futures.ThreadPoolExecutor(workers, "code-test") as pool:
            for future in [pool.submit(worker) for _ in range(workers)]:
                future.result()  # re-raises what a worker raised
        return self._aggregate(tuple(r for r in results if r is not None), len(tests))

    def _aggregate(self, results: tuple[TestCaseResult, ...], total: int) -> VerificationResult:
        passed = sum(r.verdict == Verdict.ACCEPTED for r in results)
        if passed == total:
            return VerificationResult(
                reward=1.0,
                verdict=Verdict.ACCEPTED,
                reason=f"all {total} tests passed",
                tests=results,
            )
        first = next(r for r in results if r.verdict != Verdict.ACCEPTED)
        reason = f"{passed}/{total} tests passed; first failure {first.name}: {first.reason}"
        if len(results) < total:
            reason += f"; {total - len(results)} not run after it"
        reward = passed / total if self.config.code_reward == "fraction_passed" else 0.0
        return VerificationResult(
            reward=reward, verdict=first.verdict, reason=reason, tests=results
        )

    def _run_one(
        self,
        test: TestCase,
        work: Path,
        lang: Language,
        problem: Problem,
        limits: RunLimits,
        checker: Path | None,
    ) -> TestCaseResult:
        outcome = self.sandbox.run(
            lang.run_argv(), workdir=work, limits=limits, stdin=test.input_path.read_bytes()
        )

        def done(verdict: Verdict, reason: str) -> TestCaseResult:
            return TestCaseResult(
                name=test.name, verdict=verdict, time_s=outcome.cpu_time_s, reason=reason
            )

        limit = _limit_hit(outcome, limits)
        if limit is not None:
            return done(*limit)
        if not outcome.ok:
            detail = outcome.describe()
            last = _last_line(outcome.stderr_tail)
            return done(
                Verdict.RUNTIME_ERROR, f"runtime error ({detail}{': ' + last if last else ''})"
            )
        if checker is not None:
            assert problem.checker is not None
            verdict, reason = self._check(test, outcome.stdout, problem, checker)
            return done(verdict, reason)
        ok, reason = compare_output(
            outcome.stdout, test.answer_path.read_bytes(), problem.compare, problem.float_tolerance
        )
        return done(Verdict.ACCEPTED if ok else Verdict.WRONG_ANSWER, reason)

    # --- function problems ----------------------------------------------------------------

    def _judge_function(self, source: str, lang: Language, problem: Problem) -> VerificationResult:
        """Syntax-check the program once, then run the harness once per test."""
        if lang.name != "python":
            return _result(
                Verdict.COMPILE_ERROR,
                f"problem {problem.name!r} tests Python functions "
                f"({', '.join(problem.entry_points)}); answer in a ```python block, "
                f"not {lang.name}",
            )
        # Read on the host and sent on the harness's stdin: the candidate never sees the
        # tests' expected values, only the arguments it is called with.
        setup = None
        if problem.setup_path is not None:
            setup = problem.setup_path.read_text(encoding="utf-8")
        codes = {t.name: t.code_path.read_text(encoding="utf-8") for t in problem.function_tests}
        sandboxed = self.sandbox.sandboxed
        candidate = function_harness.CANDIDATE_FILE
        with self.sandbox.workdir(writable=True) as work:
            (work / candidate).write_text(source)
            os.chmod(work / candidate, 0o644)
            if lang.compile is not None:
                outcome = self.sandbox.run(
                    lang.compile_argv(source=candidate, binary=candidate),
                    workdir=work,
                    limits=lang.compile_limits,
                    writable=True,
                )
                if not outcome.ok:
                    return _result(Verdict.COMPILE_ERROR, _compile_error(outcome))
            # Copied after the compile step, which is the last run with a writable /box.
            _copy(Path(function_harness.__file__), work / HARNESS_FILE)
            limits = self._limits(problem)

            def run_one(test: FunctionTest) -> TestCaseResult:
                spec = {
                    "test": test.name,
                    "entry_points": list(problem.entry_points),
                    "setup": setup,
                    "code": codes[test.name],
                    "sandboxed": sandboxed,
                }
                return self._run_function_test(test.name, spec, work, limits)

            return self._run_all(problem.function_tests, run_one)

    def _run_function_test(
        self, name: str, spec: dict, work: Path, limits: RunLimits
    ) -> TestCaseResult:
        token = secrets.token_hex(16)
        stdin = f"{token}\n{json.dumps(spec)}".encode()
        # The harness is the sandbox's PID 1: no other process there ever holds its stdin.
        outcome = self.sandbox.run(
            ["python3", "-I", "-B", HARNESS_FILE, name],
            workdir=work,
            limits=limits,
            stdin=stdin,
            as_pid_1=True,
        )

        def done(verdict: Verdict, reason: str) -> TestCaseResult:
            return TestCaseResult(
                name=name, verdict=verdict, time_s=outcome.cpu_time_s, reason=reason
            )

        limit = _limit_hit(outcome, limits)
        if limit is not None:
            return done(*limit)
        report = harness_report(outcome.stdout, token) if outcome.exit_code == 0 else None
        if report is None:
            last = _last_line(outcome.stderr_tail)
            return done(
                Verdict.RUNTIME_ERROR,
                f"runtime error: the harness reported nothing, the program ended the run "
                f"({outcome.describe()}{': ' + last if last else ''})",
            )
        verdict = _HARNESS_VERDICTS[report["verdict"]]
        reason = report["reason"]
        if outcome.oom_kills and verdict not in (Verdict.ACCEPTED, Verdict.VERIFIER_ERROR):
            # The kernel killed the candidate's process for the run's memory; the harness saw
            # only a SIGKILL.
            return done(
                Verdict.MEMORY_LIMIT,
                f"memory limit exceeded (limit {limits.memory_bytes // 2**20} MiB): {reason}",
            )
        if verdict == Verdict.VERIFIER_ERROR:
            reason = f"bad problem or harness: {reason}"
        elif verdict != Verdict.ACCEPTED:
            reason = f"{report['verdict'].replace('_', ' ')}: {reason}"
        return done(verdict, reason)

    def _check(
        self, test: TestCase, output: bytes, problem: Problem, checker: Path
    ) -> tuple[Verdict, str]:
        """Run the checker on (input, output, answer): 0 = accepted, 1 = wrong answer."""
        assert problem.checker is not None
        lang = self.languages[problem.checker.language]
        with self.sandbox.workdir() as box:
            _copy(checker, box / "checker.bin", 0o755)
            _copy(test.input_path, box / "input.txt")
            _copy(test.answer_path, box / "answer.txt")
            (box / "output.txt").write_bytes(output)
            os.chmod(box / "output.txt", 0o644)
            argv = lang.run_argv(
                binary="checker.bin", args=("input.txt", "output.txt", "answer.txt")
            )
            outcome = self.sandbox.run(argv, workdir=box, limits=self.checker_limits)
        message = _last_line(outcome.stderr_tail) or _last_line(outcome.stdout)
        suffix = f": {message}" if message else ""
        if (
            outcome.time_limit_exceeded
            or outcome.memory_limit_exceeded
            or outcome.output_limit_exceeded
            or outcome.signal is not None
        ):
            return Verdict.CHECKER_FAILURE, f"checker failure ({outcome.describe()}{suffix})"
        if outcome.exit_code == CHECKER_ACCEPTED:
            return Verdict.ACCEPTED, f"accepted by checker{suffix}"
        if outcome.exit_code == CHECKER_WRONG_ANSWER:
            return Verdict.WRONG_ANSWER, f"wrong answer (checker{suffix or ' said so'})"
        return Verdict.CHECKER_FAILURE, f"checker failure (exit code {outcome.exit_code}{suffix})"


def harness_report(stdout: bytes, token: str) -> dict | None:
    """The function-call harness's outcome in a run's stdout, or None without a valid one.

    Valid means: stdout is exactly two lines, "<token> <key>", written by the harness before
    the candidate's code ran, then "<token> <key> <outcome JSON>" with a known verdict. The
    key is made inside the sandbox by the harness and never leaves it but through stdout, so
    the candidate cannot know it, even if it could read the token. Nothing else writes to
    the run's stdout, so any other byte there is tampering (a forged line, or junk meant to
    hide the harness's own line) and fails the run."""
    lines = stdout.split(b"\n")
    if len(lines) != 3 or lines[2]:
        return None
    first = lines[0].decode("ascii", errors="replace").split(" ")
    if len(first) != 2 or first[0] != token or not _HEX.fullmatch(first[1]):
        return None
    prefix = f"{token} {first[1]} ".encode()
    if not lines[1].startswith(prefix):
        return None
    try:
        report = json.loads(lines[1][len(prefix) :])
    except ValueError:
        return None
    if (
        not isinstance(report, dict)
        or report.get("verdict") not in _HARNESS_VERDICTS
        or report.get("passed") is not (report.get("verdict") == "accepted")
        or not isinstance(report.get("reason"), str)
    ):
        return None
    return report


def _compile_error(outcome: RunOutcome) -> str:
    text = outcome.stderr_tail.decode(errors="replace").strip()
    if not outcome.ok and (outcome.time_limit_exceeded or outcome.memory_limit_exceeded):
        text = f"compiler {outcome.describe()}" + (f": {text}" if text else "")
    if len(text) > _COMPILE_ERROR_CHARS:
        text = text[:_COMPILE_ERROR_CHARS] + "…"
    return f"compile error: {text or outcome.describe()}"


def _result(verdict: Verdict, reason: str) -> VerificationResult:
    return VerificationResult(reward=0.0, verdict=verdict, reason=reason)


__all__ = ["CodeVerifier", "compare_output", "harness_report"]
