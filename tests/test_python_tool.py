"""The Python interpreter tool and the verifier service's Execute call under it: the core
(programs behind the judging queue, request ids, the cache's bound), the codecs, the limits'
clamping and the tool's results, then `rlax-tpu serve verifier` as a real process on loopback
running the tool's programs in its sandbox: output, a raise, a loop, hostile programs, the
output cap, the deadline, and a replica killed under a call."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
from processes import ProcessGroup

from rlax_tpu.api.environments import ToolResult, ToolVerdict
from rlax_tpu.api.verifier import (
    ExecutionRequest,
    ExecutionResult,
    ExecutionUnavailableError,
    ExecutionVerdict,
    RequestIdReusedError,
    VerificationRequest,
    VerificationResult,
    VerifierCallError,
    VerifierClient,
    execution_request_from_proto,
    execution_request_to_proto,
    execution_result_from_proto,
    execution_result_to_proto,
    metrics_from_proto,
    metrics_to_proto,
)
from rlax_tpu.config.run import VerifierConfig
from rlax_tpu.controller.scoring import ServiceVerifier
from rlax_tpu.environments import (
    EnvironmentSpecError,
    ToolContext,
    python_tool,
    resolve_tool,
)
from rlax_tpu.environments.python_tool import tool_result
from rlax_tpu.verifiers import service as service_module
from rlax_tpu.verifiers.execution import ProgramRunner
from rlax_tpu.verifiers.sandbox import RunLimits, Sandbox
from rlax_tpu.verifiers.service import VerificationService

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap",
)

TOKEN = "python-tool-test-token"
MAX_TIME_S = 2.0  # the served verifier's maxima (verifiers.execute_*)
MAX_MEMORY = 256 * 2**20
MAX_OUTPUT = 64 * 2**10
SLACK_S = 3.0  # a limited run's teardown and this loaded machine's scheduling


# -- the core, with scripted programs -------------------------------------------------------------
def echo(request: ExecutionRequest) -> ExecutionResult:
    """Runs nothing: prints the code back."""
    return ExecutionResult(verdict=ExecutionVerdict.OK, stdout=request.code, exit_code=0)


def judge(request: VerificationRequest) -> VerificationResult:
    return VerificationResult(reward=1.0, verdict="accepted", reason="scripted")


@pytest.fixture
def core():
    services = []

    def make(**kwargs):
        kwargs.setdefault("concurrency", 1)
        services.append(VerificationService(judge, **kwargs))
        return services[-1]

    yield make
    for service in services:
        service.close()


def test_programs_run_behind_the_judging_queue_and_are_counted_apart(core):
    service = core(execute=echo)
    outcomes = service.execute_batch([ExecutionRequest(code="a"), ExecutionRequest(code="b")])
    assert [o.result.stdout for o in outcomes] == ["a", "b"]
    service.verify_batch([VerificationRequest(kind="math", response="1")])
    metrics = service.metrics()
    assert (metrics["executed"], metrics["judged"]) == (2, 1)
    assert metrics["execution_verdicts"] == {"ok": 2} and metrics["verdicts"] == {"accepted": 1}
    assert metrics_from_proto(metrics_to_proto(metrics))["execution_verdicts"] == {"ok": 2}


def test_a_service_without_a_program_runner_refuses_programs(core):
    with pytest.raises(ExecutionUnavailableError, match="runs no programs"):
        core().execute_batch([ExecutionRequest(code="print(1)")])


def test_a_request_id_is_a_program_or_a_verification_never_both(core):
    service = core(execute=echo)
    first = service.execute_batch([ExecutionRequest(code="x", request_id="r")])
    again = service.execute_batch([ExecutionRequest(code="x", request_id="r")])
    assert (first[0].cached, again[0].cached) == (False, True)
    assert service.metrics()["executed"] == 1
    with pytest.raises(RequestIdReusedError):
        service.verify_batch([VerificationRequest(kind="math", response="x", request_id="r")])
    with pytest.raises(RequestIdReusedError):
        service.execute_batch([ExecutionRequest(code="y", request_id="r")])


def test_the_cache_keeps_programs_outputs_within_its_byte_bound(core, monkeypatch):
    monkeypatch.setattr(service_module, "RESULTS_CACHE_OUTPUT_BYTES", 25)
    service = core(execute=echo)
    for name in "abc":
        service.execute_batch([ExecutionRequest(code=name * 10, request_id=name)])
    # 30 bytes of output: the oldest went; the two newest are answered without running.
    for name in "bc":
        assert service.execute_batch([ExecutionRequest(code=name * 10, request_id=name)])[0].cached
    assert not service.execute_batch([ExecutionRequest(code="a" * 10, request_id="a")])[0].cached


def test_programs_and_results_survive_the_proto_round_trip():
    request = ExecutionRequest(
        code="print(input())",
        language="python",
        stdin="héllo\n",
        time_limit_s=1.5,
        memory_limit_bytes=2**20,
        output_limit_bytes=100,
        request_id="q",
    )
    assert execution_request_from_proto(execution_request_to_proto(request), 0) == request
    for result in (
        ExecutionResult(verdict="ok", stdout="x\n", exit_code=0, wall_time_s=0.1),
        ExecutionResult(verdict="time_limit", stderr="e", stderr_truncated=True, reason="r"),
    ):
        assert execution_result_from_proto(execution_result_to_proto(result)) == result
    bad = execution_request_to_proto(request)
    bad.time_limit_s = -1
    with pytest.raises(ValueError, match=r"programs\[2\]: time_limit_s must be >= 0"):
        execution_request_from_proto(bad, 2)


def test_a_requests_limits_are_clamped_to_the_verifiers_maxima():
    config = VerifierConfig(
        execute_time_limit_s=2.0,
        execute_memory_limit_bytes=MAX_MEMORY,
        execute_output_limit_bytes=MAX_OUTPUT,
    )
    runner = ProgramRunner(config, sandbox=Sandbox(), base_limits=RunLimits(max_processes=8))
    most = runner.limits(ExecutionRequest(code=""))  # 0: the maxima
    assert (most.cpu_time_s, most.wall_s, most.memory_bytes, most.output_bytes) == (
        2.0,
        3.0,
        MAX_MEMORY,
        MAX_OUTPUT,
    )
    greedy = ExecutionRequest(
        code="", time_limit_s=60, memory_limit_bytes=2**40, output_limit_bytes=2**30
    )
    assert runner.limits(greedy) == most
    modest = runner.limits(ExecutionRequest(code="", time_limit_s=0.5, output_limit_bytes=10))
    assert (modest.cpu_time_s, modest.wall_s, modest.output_bytes) == (0.5, 1.5, 10)
    assert modest.max_processes == 8


# -- what the policy reads -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "result, verdict, content",
    [
        (ExecutionResult(verdict="ok", stdout="42\n"), ToolVerdict.OK, "42\n"),
        (ExecutionResult(verdict="ok"), ToolVerdict.OK, "(the program printed nothing"),
        (
            ExecutionResult(verdict="ok", stdout="1", stderr="Warning: w\n"),
            ToolVerdict.OK,
            "1\nWarning: w\n",
        ),
        (
            ExecutionResult(verdict="memory_limit", reason="memory limit exceeded (limit 8 MiB)"),
            ToolVerdict.ERROR,
            "Error: the program ran out of memory (memory limit exceeded (limit 8 MiB))",
        ),
        (
            ExecutionResult(verdict="verifier_error", reason="no sandbox"),
            ToolVerdict.ERROR,
            "Error: the program could not be run: no sandbox",
        ),
    ],
)
def test_a_runs_result_becomes_what_the_policy_reads(result, verdict, content):
    read = tool_result(result)
    assert read.verdict == verdict and read.content.startswith(content)


def test_python_needs_a_verifier_to_resolve():
    for context in (None, ToolContext()):
        with pytest.raises(EnvironmentSpecError, match="no verifier was given: resolve it with"):
            resolve_tool("python", context)


# -- `rlax-tpu serve verifier` as a real process -----------------------------------------------
def start(group: ProcessGroup, cache: Path):
    process = group.start_verifier(
        token=TOKEN,
        test_data_cache=str(cache),
        overrides=[
            f"verifiers.execute_time_limit_s={MAX_TIME_S}",
            f"verifiers.execute_memory_limit_bytes={MAX_MEMORY}",
            f"verifiers.execute_output_limit_bytes={MAX_OUTPUT}",
        ],
        args=["--num-workers=2"],
    )
    return process, VerifierClient(process.address, auth_token=TOKEN)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(process, client) of one verifier service."""
    group = ProcessGroup()
    process, client = start(group, tmp_path_factory.mktemp("test-data-cache"))
    yield process, client
    client.close()
    group.stop_all()


@pytest.fixture
def python(served):
    """The python tool on the served verifier, 1 s per call."""
    return python_tool(served[1], time_limit_s=1.0)


def run(served, code: str, **limits) -> ExecutionResult:
    [result] = served[1].execute([ExecutionRequest(code=code, **limits)], deadline_s=30)
    return result


def still_serving(served) -> None:
    assert run(served, "print('ok')").stdout == "ok\n"


def test_the_tool_returns_what_the_program_prints(served):
    tool = resolve_tool("python", ToolContext(verifier=served[1]))
    assert tool.name == "python" and tool.description.startswith(
        "Run Python 3 code and return what it prints."
    )
    assert tool.schema()["function"]["parameters"]["required"] == ["code"]
    result = tool.call({"code": "import math\nprint(math.comb(10, 3), 2**64)"})
    assert result == ToolResult(content=f"120 {2**64}\n")
    assert tool.call({"code": 7}).verdict == ToolVerdict.BAD_ARGUMENTS


def test_a_program_that_raises_is_an_error_with_the_tracebacks_last_lines(python):
    code = "def parse(text):\n    return int(text)\nprint('before')\nparse('x1')\n"
    result = python.call({"code": code})
    assert result.verdict == ToolVerdict.ERROR
    assert result.content.startswith("before\nError: ")
    assert result.error.endswith("ValueError: invalid literal for int() with base 10: 'x1'")
    assert "line 2, in parse" in result.error


def test_a_program_that_loops_forever_is_a_timeout_within_its_limit(python):
    start_s = time.monotonic()
    result = python.call({"code": "print('spinning', flush=True)\nwhile True:\n    pass\n"})
    elapsed = time.monotonic() - start_s
    assert result.verdict == ToolVerdict.TIMEOUT, result
    assert result.content.startswith("spinning\nError: the program was stopped: time limit")
    assert elapsed < 1.0 + 1.0 + SLACK_S, elapsed


def test_output_past_the_cap_is_cut_and_says_so(served):
    tool = python_tool(served[1], output_limit_bytes=1000)
    result = tool.call({"code": "print('x' * 5000)\nprint('never')"})
    assert result.verdict == ToolVerdict.ERROR
    assert result.content.startswith("x" * 1000 + "\nError: the output was cut")
    assert "more than 1000 bytes" in result.error and "never" not in result.content
    direct = run(
        served,
        "import sys\nsys.stderr.write('e' * 3000)\nprint('y' * 3000)",
        output_limit_bytes=2000,
    )
    assert direct.verdict == ExecutionVerdict.OUTPUT_LIMIT
    assert (len(direct.stdout), direct.stdout_truncated) == (2000, True)
    assert (direct.stderr, direct.stderr_truncated) == ("e" * 2000, True)


def test_limits_past_the_verifiers_maxima_are_clamped(served):
    big = "chunks = [bytearray(64 << 20) for _ in range(8)]\nprint('allocated')"
    result = run(served, big, memory_limit_bytes=8 * 2**30)  # asks for 8 GiB; 256 MiB it is
    assert result.verdict == ExecutionVerdict.MEMORY_LIMIT, result
    assert "limit 256 MiB" in result.reason
    still_serving(served)


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


def test_hostile_programs_get_verdicts_and_the_verifier_keeps_serving(served, listener, tmp_path):
    port = listener.getsockname()[1]
    outside = [tmp_path / "pwned", Path("/etc/pwned_by_tool"), Path("/usr/pwned_by_tool")]
    writes = (
        f"for path in {[str(p) for p in outside] + ['/box/pwned', '/tmp/mine']!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    network = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(0.5)\n"
        f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
        "except OSError as e:\n    print('blocked')\n"
    )
    fork_bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    cases = [
        ("print(open('/etc/shadow').read())", ExecutionVerdict.RUNTIME_ERROR, ""),
        (writes, ExecutionVerdict.OK, "wrote /tmp/mine\n"),
        (network, ExecutionVerdict.OK, "blocked\n"),
        (fork_bomb, ExecutionVerdict.TIME_LIMIT, ""),
    ]
    for code, verdict, stdout in cases:
        start_s = time.monotonic()
        result = run(served, code, time_limit_s=1.0)
        assert (result.verdict, result.stdout) == (verdict, stdout), result
        assert time.monotonic() - start_s < 1.0 + 1.0 + SLACK_S
        still_serving(served)
    assert "FileNotFoundError" in run(served, cases[0][0]).stderr  # /etc/shadow is not there
    assert [p for p in outside if p.exists()] == []
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the host


def test_the_deadline_answers_verifier_error_and_a_retry_picks_up_the_result(served):
    client = served[1]
    slow = ExecutionRequest(code="import time\ntime.sleep(1)\nprint('late')", request_id="late")
    [first] = client.execute([slow], deadline_s=0.3)
    assert first.verdict == ExecutionVerdict.VERIFIER_ERROR and "deadline" in first.reason
    before = client.metrics()
    [again] = client.execute([slow], deadline_s=30)  # joins the run, or finds its result
    assert again.stdout == "late\n"
    after = client.metrics()
    assert after["joined"] + after["cache_hits"] == before["joined"] + before["cache_hits"] + 1
    with pytest.raises(VerifierCallError, match="already used") as error:
        client.execute([dataclasses.replace(slow, code="print('other')")])
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_call_moves_to_another_replica_when_its_verifier_is_killed(served, tmp_path):
    """Two replicas behind the controller's ServiceVerifier: the first call goes to the
    first, which is SIGKILLed while running the program; the call finishes on the other."""
    group = ProcessGroup()
    try:
        doomed, doomed_client = start(group, tmp_path)
        replicas = ServiceVerifier([doomed_client, served[1]], wait_s=10.0)
        tool = python_tool(replicas, time_limit_s=MAX_TIME_S)
        results = []
        code = "import time\ntime.sleep(1.0)\nprint('done')"
        call = threading.Thread(target=lambda: results.append(tool.call({"code": code})))
        before = served[1].metrics()["executed"]
        call.start()
        deadline = time.monotonic() + 10
        while doomed_client.metrics()["running"] == 0:
            assert time.monotonic() < deadline, "the call never reached the first replica"
            time.sleep(0.02)
        doomed.kill()
        call.join(20)
        assert results == [ToolResult(content="done\n")]
        assert served[1].metrics()["executed"] == before + 1
        still_serving(served)
        doomed_client.close()
    finally:
        group.stop_all()


def test_a_tools_program_never_runs_unsandboxed_even_where_judging_may():
    """verifiers.allow_unsandboxed lets code be judged with rlimits only; a tool's program
    is not run that way: its output would go back to the policy from a process that can
    read the verifier's environment and files."""
    config = VerifierConfig(allow_unsandboxed=True, code_languages=("python",))
    sandbox = Sandbox(bwrap="/nonexistent/bwrap", allow_unsandboxed=True)
    assert sandbox.check().startswith("UNSANDBOXED")  # judging would run
    result = ProgramRunner(config, sandbox=sandbox).execute(
        ExecutionRequest(code="import os; print(os.environ)")
    )
    assert result.verdict == ExecutionVerdict.VERIFIER_ERROR and not result.stdout
    assert "refusing to run a tool's program without the sandbox" in result.reason
