"""Programs run for the policy's tools (the verifier service's Execute): one program and its
stdin, run once in the code verifier's sandbox under limits clamped to the verifier's maxima,
and reported as it ended (stdout, stderr, exit code, verdict), not judged.

`ProgramRunner` shares the code verifier's `Sandbox` (the same bwrap, uid, seccomp filter and
per-run cgroups) and its language table, so a tool's call is as contained as a test run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from rlax_tpu.api.verifier import (
    EXECUTION_START_S,
    ExecutionRequest,
    ExecutionResult,
    ExecutionVerdict,
)
from rlax_tpu.config.run import VerifierConfig
from rlax_tpu.verifiers.languages import LANGUAGES, Language
from rlax_tpu.verifiers.sandbox import RunLimits, RunOutcome, Sandbox, SandboxUnavailable

_REASON_CHARS = 200  # of stderr's last line, in a reason


class ProgramRunner:
    """Runs `ExecutionRequest`s in `sandbox` (the code verifier's).

    config:      `verifiers`: the languages enabled (`code_languages`) and the maxima of a
                 program's limits (`execute_time_limit_s`, `execute_memory_limit_bytes`,
                 `execute_output_limit_bytes`), which are also what a request asking for
                 none (0) gets.
    base_limits: the other limits of a run (processes, file size, open files, stack, /tmp,
                 CPU cores).
    """

    def __init__(
        self,
        config: VerifierConfig,
        *,
        sandbox: Sandbox,
        languages: Mapping[str, Language] = LANGUAGES,
        base_limits: RunLimits | None = None,
    ) -> None:
        self.config = config
        self.sandbox = sandbox
        self.languages = dict(languages)
        self.base_limits = base_limits or RunLimits()

    def limits(self, request: ExecutionRequest) -> RunLimits:
        """The run's limits: the request's, each clamped to the verifier's maximum (0 = the
        maximum)."""
        config = self.config
        time_s = _clamped(request.time_limit_s, config.execute_time_limit_s)
        return dataclasses.replace(
            self.base_limits,
            cpu_time_s=time_s,
            wall_time_s=time_s + EXECUTION_START_S,
            memory_bytes=_clamped(request.memory_limit_bytes, config.execute_memory_limit_bytes),
            output_bytes=_clamped(request.output_limit_bytes, config.execute_output_limit_bytes),
        )

    def execute(self, request: ExecutionRequest) -> ExecutionResult:
        """Runs the program once; never raises for what the program does. A compiled
        language is built first (COMPILE_ERROR when that fails). Python is not: its syntax
        errors are the run's own (RUNTIME_ERROR, the interpreter's message on stderr)."""
        lang = self.languages.get(request.language)
        enabled = tuple(self.config.code_languages)
        if lang is None or request.language not in enabled:
            return _not_run(
                f"language {request.language!r} is not enabled (verifiers.code_languages = "
                f"{list(enabled)})"
            )
        try:
            how = self.sandbox.check()
            if how.startswith("UNSANDBOXED"):
                # A tool's program hands its output back to the policy (and to the turn log):
                # without the sandbox it would run as the verifier's uid, able to read the
                # verifier's environment (its auth token) and the problems' tests.
                # verifiers.allow_unsandboxed is for judging code only.
                return _not_run(
                    f"refusing to run a tool's program without the sandbox ({how}): its output "
                    "goes back to the policy, so verifiers.allow_unsandboxed does not cover "
                    "it; install bubblewrap (apt-get install bubblewrap)"
                )
            result = self._run(request, lang, self.limits(request))
        except SandboxUnavailable as e:
            return _not_run(str(e))
        except OSError as e:  # the work directory cannot be made or written
            return _not_run(f"{type(e).__name__}: {e}")
        return result

    def _run(self, request: ExecutionRequest, lang: Language, limits: RunLimits) -> ExecutionResult:
        # Python's "compile" step is only a syntax check (the source is what runs): skipped.
        builds = lang.compile is not None and lang.binary_name != lang.source_name
        with self.sandbox.workdir(writable=builds) as work:
            path = work / lang.source_name
            path.write_text(request.code)
            os.chmod(path, 0o644)
            if builds:
                built = self.sandbox.run(
                    lang.compile_argv(), workdir=work, limits=lang.compile_limits, writable=True
                )
                if not built.ok or not (work / lang.binary_name).is_file():
                    stderr, truncated = _tail(built, limits.output_bytes)
                    return ExecutionResult(
                        verdict=ExecutionVerdict.COMPILE_ERROR,
                        stderr=stderr,
                        stderr_truncated=truncated,
                        exit_code=built.exit_code,
                        wall_time_s=built.wall_time_s,
                        cpu_time_s=built.cpu_time_s,
                        reason=f"compile error ({built.describe()}){_last_line(built)}",
                    )
            outcome = self.sandbox.run(
                lang.run_argv(), workdir=work, limits=limits, stdin=request.stdin.encode()
            )
        return _result(outcome, limits)


def _result(outcome: RunOutcome, limits: RunLimits) -> ExecutionResult:
    stderr, stderr_truncated = _tail(outcome, limits.output_bytes)
    if outcome.output_limit_exceeded:
        verdict = ExecutionVerdict.OUTPUT_LIMIT
        reason = (
            f"output limit exceeded: more than {limits.output_bytes} bytes on stdout, stopped there"
        )
    elif outcome.time_limit_exceeded:
        verdict = ExecutionVerdict.TIME_LIMIT
        reason = (
            f"time limit exceeded ({outcome.cpu_time_s:.2f}s CPU, {outcome.wall_time_s:.2f}s "
            f"wall; limit {limits.cpu_time_s:g}s)"
        )
    elif outcome.memory_limit_exceeded:
        verdict = ExecutionVerdict.MEMORY_LIMIT
        reason = f"memory limit exceeded (limit {limits.memory_bytes // 2**20} MiB)"
    elif outcome.exit_code == 0:
        verdict, reason = ExecutionVerdict.OK, "exit code 0"
    else:
        verdict = ExecutionVerdict.RUNTIME_ERROR
        reason = f"{outcome.describe()}{_last_line(outcome)}"
    return ExecutionResult(
        verdict=verdict,
        stdout=_text(outcome.stdout),
        stderr=stderr,
        stdout_truncated=outcome.output_limit_exceeded,
        stderr_truncated=stderr_truncated,
        exit_code=outcome.exit_code,
        wall_time_s=outcome.wall_time_s,
        cpu_time_s=outcome.cpu_time_s,
        reason=reason,
    )


def _clamped(asked: float, most: float) -> float:
    return most if asked <= 0 else min(asked, most)


def _tail(outcome: RunOutcome, cap: int) -> tuple[str, bool]:
    """stderr's last `cap` bytes (of the sandbox's tail), and whether more was written."""
    kept = outcome.stderr_tail[-cap:]
    return _text(kept), outcome.stderr_bytes > len(kept)


def _text(data: bytes) -> str:
    # A cut may split a character, and a program may print any bytes: replaced, not refused.
    return data.decode("utf-8", errors="replace")


def _last_line(outcome: RunOutcome) -> str:
    """ ": " and stderr's last non-blank line (shortened), or ""."""
    lines = [line for line in _text(outcome.stderr_tail).splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[-1].strip()
    return ": " + (line if len(line) <= _REASON_CHARS else line[:_REASON_CHARS] + "…")


def _not_run(reason: str) -> ExecutionResult:
    return ExecutionResult(verdict=ExecutionVerdict.VERIFIER_ERROR, reason=reason)


__all__ = ["ProgramRunner"]
