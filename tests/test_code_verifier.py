"""The code verifier: code extraction, problem directories, comparison, checkers, verdicts."""

from __future__ import annotations

import json
import shutil

import pytest

from rlax_tpu.api.verifier import Verdict
from rlax_tpu.config.run import VerifierConfig
from rlax_tpu.verifiers.code import CodeVerifier, compare_output
from rlax_tpu.verifiers.languages import LANGUAGES, UnknownLanguage, extract_code, get_language
from rlax_tpu.verifiers.problems import (
    CHECKER_BINARY,
    CheckerCompileError,
    ProblemFormatError,
    compile_checker,
    load_problem,
    write_problem,
)
from rlax_tpu.verifiers.sandbox import RunLimits, Sandbox

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap",
)
needs_gpp = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ is not installed: apt-get install g++"
)

SUM_TESTS = [("1 2\n", "3\n"), ("5 6\n", "11\n"), ("10 -3\n", "7\n"), ("0 0\n", "0\n")]
SUM_PY = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_CPP = (
    "#include <iostream>\n"
    "int main() { long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }\n"
)


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n\n```{tag}\n{code}```\n"


# --- extraction ---------------------------------------------------------------------------


def test_last_fenced_block_wins():
    response = "```python\nprint(1)\n```\ntext\n```cpp\nint main() {}\n```\n"
    assert extract_code(response) == ("int main() {}\n", "cpp")


def test_requested_language_picks_its_last_block():
    response = "```python\nprint(1)\n```\n```cpp\nint main() {}\n```\nthe end"
    assert extract_code(response, language="python") == ("print(1)\n", "python")


def test_fence_aliases_map_to_languages():
    assert extract_code("```c++\nx\n```")[1] == "cpp"
    assert extract_code("```Python3\nx\n```")[1] == "python"
    assert extract_code("```\nx\n```") == ("x\n", "")
    assert extract_code("```java\nx\n```") == ("x\n", "java")


def test_windows_line_endings_are_understood():
    assert extract_code("```python\r\nprint(1)\r\n```\r\n") == ("print(1)\r\n", "python")


def test_no_closed_block_is_no_code():
    assert extract_code("print(1)") is None
    assert extract_code("```python\nprint(1)\n") is None


def test_unknown_language_names_the_enabled_ones():
    assert get_language("cpp") is LANGUAGES["cpp"]
    with pytest.raises(UnknownLanguage, match="enabled: python"):
        get_language("cpp", enabled=("python",))


# --- comparison ---------------------------------------------------------------------------


def test_exact_ignores_only_line_endings_and_final_newlines():
    assert compare_output(b"a b\r\nc\n\n", b"a b\nc", "exact")[0]
    ok, reason = compare_output(b"a  b\nc\n", b"a b\nc\n", "exact")
    assert not ok and reason == "wrong answer at line 1 (expected 'a b', got 'a  b')"


def test_whitespace_compares_tokens():
    assert compare_output(b"1   2\n\n3 ", b"1 2 3\n", "whitespace")[0]
    assert compare_output(b"6\n", b"5\n") == (False, "wrong answer (expected '5', got '6')")
    ok, reason = compare_output(b"1 2", b"1 2 3")
    assert reason == "wrong answer at token 3 (expected '3', got end of output)"


def test_float_tolerance_absolute_and_relative():
    assert compare_output(b"0.3333333", b"0.333333333", "float", 1e-6)[0]
    assert compare_output(b"1000000.5", b"1000000.0", "float", 1e-6)[0]  # relative
    assert not compare_output(b"0.334", b"0.333", "float", 1e-6)[0]
    assert compare_output(b"yes 1e-9", b"yes 0", "float", 1e-6)[0]
    assert not compare_output(b"no 0", b"yes 0", "float", 1e-6)[0]
    assert not compare_output(b"nan", b"1.0", "float", 1e-6)[0]


def test_long_outputs_are_truncated_in_reasons():
    _, reason = compare_output(b"x" * 500, b"y" * 500)
    assert len(reason) < 150 and "…" in reason


# --- problem directories ------------------------------------------------------------------


def test_written_problem_loads_back(tmp_path):
    write_problem(tmp_path, name="sum", tests=SUM_TESTS, compare="float", float_tolerance=1e-3)
    problem = load_problem(tmp_path)
    assert problem.name == "sum" and problem.compare == "float"
    assert problem.float_tolerance == 1e-3 and problem.checker is None
    assert [t.name for t in problem.tests] == ["01", "02", "03", "04"]
    assert problem.tests[1].input_path.read_text() == "5 6\n"


def test_missing_problem_file_is_named(tmp_path):
    with pytest.raises(ProblemFormatError, match="problem.json: missing"):
        load_problem(tmp_path)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"compare": "fuzzy"}, "compare"),
        ({"tests": []}, "tests"),
        ({"tests": ["../../etc/passwd"]}, "tests"),
        ({"tests": ["01", "01"]}, "tests"),
        ({"tests": ["01", "99"]}, "tests"),
        ({"time_limit_s": -1}, "time_limit_s"),
        ({"memory_limit_bytes": 1.5}, "memory_limit_bytes"),
        ({"checker": {"language": "cobol", "source": "c.cob"}}, "checker.language"),
        ({"checker": {"language": "cpp", "source": "/etc/passwd"}}, "checker.source"),
        ({"checker": {"language": "cpp", "source": "absent.cpp"}}, "checker.source"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_problem_fields_are_named(tmp_path, change, field):
    write_problem(tmp_path, name="p", tests=[("1\n", "1\n")])
    spec = json.loads((tmp_path / "problem.json").read_text())
    (tmp_path / "problem.json").write_text(json.dumps({**spec, **change}))
    with pytest.raises(ProblemFormatError, match=f"problem.json: {field}"):
        load_problem(tmp_path)


def test_named_tests_keep_their_names(tmp_path):
    write_problem(tmp_path, name="p", tests={"small": ("1\n", "1\n"), "big": ("2\n", "2\n")})
    assert [t.name for t in load_problem(tmp_path).tests] == ["small", "big"]


# --- verifying: shared fixtures -------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    return CodeVerifier(code_time_limit_s=1.0, code_memory_limit_bytes=256 * 2**20)


@pytest.fixture(scope="module")
def sum_problem(tmp_path_factory):
    return write_problem(tmp_path_factory.mktemp("sum"), name="sum", tests=SUM_TESTS)


DIVISOR_CHECKER_CPP = r"""
#include <cstdio>
#include <fstream>
// A proper divisor of n (not 1, not n) is accepted; many answers are right.
int main(int argc, char** argv) {
    std::ifstream in(argv[1]), out(argv[2]);
    long n, x;
    in >> n;
    if (!(out >> x)) { std::fprintf(stderr, "no number in the output\n"); return 1; }
    if (x > 1 && x < n && n % x == 0) return 0;
    std::fprintf(stderr, "%ld is not a proper divisor of %ld\n", x, n);
    return 1;
}
"""


@pytest.fixture(scope="module")
def divisor_problem(tmp_path_factory):
    if shutil.which("g++") is None or shutil.which("bwrap") is None:
        pytest.skip("needs g++ and bwrap")
    directory = write_problem(
        tmp_path_factory.mktemp("divisor"),
        name="divisor",
        tests=[("6\n", "2\n"), ("15\n", "3\n"), ("49\n", "7\n")],
        checker_source=DIVISOR_CHECKER_CPP,
        checker_language="cpp",
    )
    compile_checker(directory, sandbox=Sandbox())
    return directory


# --- verifying --------------------------------------------------------------------------


@needs_bwrap
def test_correct_python_is_accepted(verifier, sum_problem):
    result = verifier.verify(fenced(SUM_PY), sum_problem)
    assert result.verdict == Verdict.ACCEPTED and result.reward == 1.0
    assert [t.name for t in result.tests] == ["01", "02", "03", "04"]
    assert all(t.verdict == Verdict.ACCEPTED for t in result.tests)
    assert result.reason == "all 4 tests passed"


@needs_bwrap
@needs_gpp
def test_correct_cpp_is_accepted(verifier, sum_problem):
    result = verifier.verify(fenced(SUM_CPP, "cpp"), sum_problem)
    assert result.verdict == Verdict.ACCEPTED, result.reason


@needs_bwrap
@needs_gpp
def test_cpp_compile_error_carries_the_compiler_message(verifier, sum_problem):
    result = verifier.verify(fenced("int main( { return 0; }\n", "cpp"), sum_problem)
    assert result.verdict == Verdict.COMPILE_ERROR and result.reward == 0.0
    assert result.reason.startswith("compile error: main.cpp:1")
    assert result.tests == ()


@needs_bwrap
def test_python_syntax_error_is_a_compile_error(verifier, sum_problem):
    result = verifier.verify(fenced("print(\n"), sum_problem)
    assert result.verdict == Verdict.COMPILE_ERROR
    assert "SyntaxError" in result.reason


@needs_bwrap
def test_wrong_answer_reason_names_the_first_failure(sum_problem):
    # a + b on test 01, a * b after: right on 01 and on 04 (0 * 0 == 0 + 0).
    code = "a, b = map(int, input().split())\nprint(a + b if a == 1 else a * b)\n"
    verifier = CodeVerifier(code_reward="fraction_passed", code_time_limit_s=1.0)
    result = verifier.verify(fenced(code), sum_problem)
    assert result.verdict == Verdict.WRONG_ANSWER
    assert [t.verdict for t in result.tests] == [
        Verdict.ACCEPTED,
        Verdict.WRONG_ANSWER,
        Verdict.WRONG_ANSWER,
        Verdict.ACCEPTED,
    ]
    assert result.reward == 0.5
    assert result.reason == (
        "2/4 tests passed; first failure 02: wrong answer (expected '11', got '30')"
    )


@needs_bwrap
def test_all_passed_reward_is_zero_and_stops_after_a_failure(sum_problem):
    verifier = CodeVerifier(code_time_limit_s=1.0, max_parallel_tests=1)
    result = verifier.verify(fenced("print(0)\n"), sum_problem)
    assert result.verdict == Verdict.WRONG_ANSWER and result.reward == 0.0
    assert [t.name for t in result.tests] == ["01"]
    assert result.reason.endswith("; 3 not run after it")


@needs_bwrap
def test_runtime_error_shows_the_last_stderr_line(verifier, sum_problem):
    result = verifier.verify(fenced("print(1 // 0)\n"), sum_problem)
    assert result.verdict == Verdict.RUNTIME_ERROR
    assert "runtime error (exit code 1: ZeroDivisionError" in result.reason


@pytest.fixture(scope="module")
def one_test_problem(tmp_path_factory):
    return write_problem(tmp_path_factory.mktemp("one"), name="one", tests=[("1 2\n", "3\n")])


@needs_bwrap
def test_time_and_memory_limits_give_their_verdicts(verifier, one_test_problem):
    slow = verifier.verify(fenced("while True: pass\n"), one_test_problem)
    assert slow.verdict == Verdict.TIME_LIMIT
    assert "time limit exceeded" in slow.reason
    hog = verifier.verify(fenced("x = bytearray(1 << 30)\n"), one_test_problem)
    assert hog.verdict == Verdict.MEMORY_LIMIT


@needs_bwrap
def test_problem_time_limit_overrides_the_config(tmp_path):
    write_problem(tmp_path, name="t", tests=[("", "done\n")], time_limit_s=0.2)
    verifier = CodeVerifier(code_time_limit_s=5.0)
    code = (
        "import time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.5: pass\n"
        "print('done')\n"
    )
    result = verifier.verify(fenced(code), tmp_path)
    assert result.verdict == Verdict.TIME_LIMIT


@needs_bwrap
def test_output_limit_verdict(tmp_path):
    write_problem(tmp_path, name="t", tests=[("", "x\n")])
    verifier = CodeVerifier(code_output_limit_bytes=1000, code_time_limit_s=1.0)
    result = verifier.verify(fenced("print('x' * 5000)\n"), tmp_path)
    assert result.verdict == Verdict.OUTPUT_LIMIT


@needs_bwrap
def test_float_problem_accepts_within_tolerance(verifier, tmp_path):
    write_problem(tmp_path, name="third", tests=[("1\n", "0.333333333\n")], compare="float")
    assert verifier.verify(fenced("print(1/3)\n"), tmp_path).verdict == Verdict.ACCEPTED
    assert verifier.verify(fenced("print(0.33)\n"), tmp_path).verdict == Verdict.WRONG_ANSWER


@needs_bwrap
def test_exact_problem_rejects_extra_spaces(verifier, tmp_path):
    write_problem(tmp_path, name="e", tests=[("", "a b\n")], compare="exact")
    assert verifier.verify(fenced("print('a b')\n"), tmp_path).verdict == Verdict.ACCEPTED
    assert verifier.verify(fenced("print('a  b')\n"), tmp_path).verdict == Verdict.WRONG_ANSWER


def test_response_without_code_is_no_answer(verifier, sum_problem):
    result = verifier.verify("The answer is 3.", sum_problem)
    assert result.verdict == Verdict.NO_ANSWER and result.reward == 0.0


def test_unknown_fence_language_is_a_compile_error(verifier, sum_problem):
    result = verifier.verify(fenced("class A {}\n", "java"), sum_problem)
    assert result.verdict == Verdict.COMPILE_ERROR
    assert "'java'" in result.reason and "python, cpp" in result.reason


def test_untagged_block_needs_a_tag_when_several_languages_are_enabled(verifier, sum_problem):
    result = verifier.verify(fenced(SUM_PY, ""), sum_problem)
    assert result.verdict == Verdict.COMPILE_ERROR and "no language tag" in result.reason


@needs_bwrap
def test_untagged_block_uses_the_only_enabled_language(sum_problem):
    verifier = CodeVerifier(code_languages=("python",), code_time_limit_s=1.0)
    assert verifier.verify(fenced(SUM_PY, ""), sum_problem).verdict == Verdict.ACCEPTED


@needs_bwrap
def test_requested_language_overrides_the_fence(verifier, sum_problem):
    result = verifier.verify(fenced(SUM_PY, ""), sum_problem, language="python")
    assert result.verdict == Verdict.ACCEPTED


def test_disabled_requested_language_is_a_verifier_error(sum_problem):
    verifier = CodeVerifier(code_languages=("python",))
    result = verifier.verify(fenced(SUM_CPP, "cpp"), sum_problem, language="cpp")
    assert result.verdict == Verdict.VERIFIER_ERROR


def test_bad_problem_directory_is_a_verifier_error(verifier, tmp_path):
    result = verifier.verify(fenced(SUM_PY), tmp_path)
    assert result.verdict == Verdict.VERIFIER_ERROR and "problem.json" in result.reason


# --- sandbox refusal and the unsandboxed fallback ------------------------------------------


def test_without_sandbox_untrusted_code_is_refused(sum_problem):
    verifier = CodeVerifier(sandbox=Sandbox(bwrap="/nonexistent/bwrap"))
    result = verifier.verify(fenced(SUM_PY), sum_problem)
    assert result.verdict == Verdict.VERIFIER_ERROR and result.reward == 0.0
    assert "install bubblewrap" in result.reason.lower()
    assert "allow_unsandboxed=true" in result.reason


def test_allow_unsandboxed_runs_with_rlimits_and_says_so(sum_problem, one_test_problem):
    config = VerifierConfig(allow_unsandboxed=True, code_time_limit_s=1.0)
    verifier = CodeVerifier(
        config, sandbox=Sandbox(bwrap="/nonexistent/bwrap", allow_unsandboxed=True)
    )
    result = verifier.verify(fenced(SUM_PY), sum_problem)
    assert result.verdict == Verdict.ACCEPTED and result.reward == 1.0
    assert "UNSANDBOXED" in result.reason
    slow = verifier.verify(fenced("while True: pass\n"), one_test_problem)
    assert slow.verdict == Verdict.TIME_LIMIT


def test_config_allow_unsandboxed_reaches_the_default_sandbox():
    assert CodeVerifier(allow_unsandboxed=True).sandbox.allow_unsandboxed
    assert not CodeVerifier().sandbox.allow_unsandboxed


# --- checkers -----------------------------------------------------------------------------


@needs_bwrap
@needs_gpp
def test_compiled_checker_is_stored_in_the_problem(divisor_problem):
    binary = divisor_problem / CHECKER_BINARY
    assert binary.is_file() and binary.stat().st_mode & 0o111
    mtime = binary.stat().st_mtime_ns
    compile_checker(divisor_problem)  # already built: not again
    assert binary.stat().st_mtime_ns == mtime


@needs_bwrap
@needs_gpp
def test_checker_accepts_any_correct_answer(verifier, divisor_problem):
    # The reference answers are the smallest divisors; the largest are right too.
    code = "n = int(input())\nprint(max(d for d in range(2, n) if n % d == 0))\n"
    result = verifier.verify(fenced(code), divisor_problem)
    assert result.verdict == Verdict.ACCEPTED, result.reason


@needs_bwrap
@needs_gpp
def test_checker_rejection_carries_its_message(verifier, divisor_problem):
    result = verifier.verify(fenced("print(1)\n"), divisor_problem)
    assert result.verdict == Verdict.WRONG_ANSWER
    assert "first failure 01: wrong answer (checker: 1 is not a proper divisor of 6)" in (
        result.reason
    )


@needs_bwrap
def test_python_checker_and_checker_failure(verifier, tmp_path):
    checker = (
        "import sys\n"
        "out = open(sys.argv[2]).read().split()\n"
        "if out == ['crash']:\n"
        "    sys.exit(3)\n"
        "sys.exit(0 if out and out[0] in ('yes', 'YES') else 1)\n"
    )
    write_problem(
        tmp_path,
        name="yes",
        tests=[("", "yes\n")],
        checker_source=checker,
        checker_language="python",
    )
    compile_checker(tmp_path)
    assert verifier.verify(fenced("print('YES')\n"), tmp_path).verdict == Verdict.ACCEPTED
    assert verifier.verify(fenced("print('no')\n"), tmp_path).verdict == Verdict.WRONG_ANSWER
    broken = verifier.verify(fenced("print('crash')\n"), tmp_path)
    assert broken.verdict == Verdict.CHECKER_FAILURE
    assert "exit code 3" in broken.reason


@needs_bwrap
def test_uncompiled_checker_is_compiled_on_first_use(verifier, tmp_path):
    write_problem(
        tmp_path,
        name="yes",
        tests=[("", "yes\n")],
        checker_source="import sys\nsys.exit(0)\n",
        checker_language="python",
    )
    assert not (tmp_path / CHECKER_BINARY).exists()
    assert verifier.verify(fenced("print(1)\n"), tmp_path).verdict == Verdict.ACCEPTED
    assert (tmp_path / CHECKER_BINARY).is_file()


@needs_bwrap
def test_checker_that_does_not_compile(verifier, tmp_path):
    write_problem(
        tmp_path,
        name="bad",
        tests=[("", "1\n")],
        checker_source="def broken(:\n",
        checker_language="python",
    )
    with pytest.raises(CheckerCompileError, match="SyntaxError"):
        compile_checker(tmp_path)
    result = verifier.verify(fenced("print(1)\n"), tmp_path)
    assert result.verdict == Verdict.CHECKER_FAILURE and "did not compile" in result.reason


@needs_bwrap
def test_tests_run_in_parallel_keep_test_order(tmp_path):
    tests = {f"t{i:02d}": (f"{i}\n", f"{i * i}\n") for i in range(12)}
    write_problem(tmp_path, name="sq", tests=tests)
    verifier = CodeVerifier(code_time_limit_s=1.0, max_parallel_tests=4)
    result = verifier.verify(fenced("n = int(input())\nprint(n * n)\n"), tmp_path)
    assert result.verdict == Verdict.ACCEPTED
    assert [t.name for t in result.tests] == list(tests)


def test_run_limits_come_from_problem_then_config_then_base(tmp_path):
    verifier = CodeVerifier(
        code_time_limit_s=3.0,
        code_memory_limit_bytes=100 * 2**20,
        code_output_limit_bytes=777,
        base_limits=RunLimits(max_processes=3, wall_time_s=7.0),
    )
    write_problem(tmp_path, name="p", tests=[("", "")], memory_limit_bytes=50 * 2**20)
    limits = verifier._limits(load_problem(tmp_path))
    assert (limits.cpu_time_s, limits.memory_bytes, limits.output_bytes) == (3.0, 50 * 2**20, 777)
    assert (limits.max_processes, limits.wall_s) == (3, 7.0)
