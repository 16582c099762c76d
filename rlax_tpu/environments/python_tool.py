"""The Python interpreter tool ("python"): the policy's code runs in the verifier's sandbox,
through the verifier service's Execute call, never in this process. So a call gets what a
test run gets (bubblewrap as an unprivileged uid, rlimits, its own cgroup, no network), runs
on the verifier replicas, and survives a lost one as judging does when `client` is the
controller's `ServiceVerifier` (the call moves to another replica).

The policy reads what the program printed; a failure is a ToolResult with its verdict: a
runtime error is "error" with the traceback's last lines, the time limit is "timeout".
"""

from __future__ import annotations

import dataclasses
import uuid

from rlax_tpu.api.environments import Tool, ToolResult, ToolVerdict
from rlax_tpu.api.verifier import (
    EXECUTION_START_S,
    ExecutionRequest,
    ExecutionResult,
    ExecutionVerdict,
    ProgramExecutor,
)

DEFAULT_TIME_LIMIT_S = 5.0
DEFAULT_OUTPUT_LIMIT_BYTES = 8 * 2**10
# How long a call may wait for the verifier service (its queue, the transport, a replica
# lost and the call moved) on top of the program's own wall clock.
DEFAULT_QUEUE_WAIT_S = 10.0
# The tool's own timeout (Tool.call's thread) is this much past the service's deadline, so
# that the service's answer, not the thread's, says how a slow call ended.
_CALL_MARGIN_S = 5.0
_TRACEBACK_LINES = 6
_NO_OUTPUT = "(the program printed nothing; print() the values you want to see)"


def python_tool(
    client: ProgramExecutor,
    *,
    name: str = "python",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    memory_limit_bytes: int = 0,
    output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES,
    queue_wait_s: float = DEFAULT_QUEUE_WAIT_S,
) -> Tool:
    """The "python" tool: `python(code)` runs `code` as a Python 3 program through `client`
    (a VerifierClient, or the controller's ServiceVerifier over the run's verifier
    replicas) and returns what it printed.

    time_limit_s:       the program's CPU seconds (and wall clock, plus the sandbox's start).
    memory_limit_bytes: its address space; 0 = the verifier's maximum.
    output_limit_bytes: its stdout cap (past it the program is stopped and the output
                        returned cut, saying so); stderr keeps its last this-many bytes.
    queue_wait_s:       how long a call may wait for the verifier besides the run itself.

    The verifier clamps every limit to its own maxima (verifiers.execute_*)."""
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 seconds, got {time_limit_s!r}")
    if queue_wait_s < 0:
        raise ValueError(f"queue_wait_s must be >= 0 seconds, got {queue_wait_s!r}")
    deadline_s = time_limit_s + EXECUTION_START_S + queue_wait_s

    def python(code: str) -> ToolResult:
        """Run Python 3 code and return what it prints.

        Args:
            code: A complete Python 3 program; print() every value you want to see.
        """
        request = ExecutionRequest(
            code=code,
            language="python",
            time_limit_s=time_limit_s,
            memory_limit_bytes=memory_limit_bytes,
            output_limit_bytes=output_limit_bytes,
            # Fixed for this call: a retry of it (a lost connection) is answered from the
            # service's cache or joins the run, never runs the program twice there.
            request_id=f"tool:{name}:{uuid.uuid4().hex}",
        )
        [result] = client.execute([request], deadline_s=deadline_s)
        return tool_result(result)

    tool = Tool.from_function(python, name=name, timeout_s=deadline_s + _CALL_MARGIN_S)
    description = (
        "Run Python 3 code and return what it prints. Each call is a fresh process with no "
        "network (nothing persists between calls; files may be written under /tmp only); "
        f"it is stopped after {time_limit_s:g} s."
    )
    return dataclasses.replace(tool, description=description)


def tool_result(result: ExecutionResult) -> ToolResult:
    """What the policy reads of a program's run: its stdout (then its stderr, if any) when it
    exited 0; else what it printed, then "Error: " and what went wrong, with the verdict
    "timeout" for the time limit and "error" for the rest (a runtime error's error is the
    traceback's last lines)."""
    if result.verdict == ExecutionVerdict.OK:
        content = result.stdout
        if result.stderr:
            content = _joined(content, result.stderr)
        return ToolResult(content=content or _NO_OUTPUT)
    if result.verdict == ExecutionVerdict.TIME_LIMIT:
        return _failure(result, ToolVerdict.TIMEOUT, f"the program was stopped: {result.reason}")
    if result.verdict == ExecutionVerdict.OUTPUT_LIMIT:
        error = (
            f"the output was cut: the program printed too much and was stopped ({result.reason})"
        )
    elif result.verdict in (ExecutionVerdict.RUNTIME_ERROR, ExecutionVerdict.COMPILE_ERROR):
        error = _traceback_tail(result.stderr) or result.reason
    elif result.verdict == ExecutionVerdict.MEMORY_LIMIT:
        error = f"the program ran out of memory ({result.reason})"
    else:  # VERIFIER_ERROR: nothing ran
        error = f"the program could not be run: {result.reason}"
    return _failure(result, ToolVerdict.ERROR, error)


def _failure(result: ExecutionResult, verdict: ToolVerdict, error: str) -> ToolResult:
    return ToolResult(
        content=_joined(result.stdout, f"Error: {error}"), verdict=verdict, error=error
    )


def _joined(first: str, second: str) -> str:
    if not first:
        return second
    return first + ("" if first.endswith("\n") else "\n") + second


def _traceback_tail(stderr: str) -> str:
    """The last lines of a traceback (where the error is named), without blank lines."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return "\n".join(lines[-_TRACEBACK_LINES:])


__all__ = ["python_tool", "tool_result"]
