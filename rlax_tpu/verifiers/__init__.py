"""Verifiers (DESIGN §7): rewards from math equivalence, sandboxed code execution, task
scorers and reward functions of the user's; a test-data repository for code problems; a
gRPC verifier service with a pool of worker processes, which also runs the programs of the
policy's tools in the sandbox (ProgramRunner). Others use what is named here."""

from rlax_tpu.api.verifier import (
    TestCaseResult,
    Verdict,
    VerificationRequest,
    VerificationResult,
)
from rlax_tpu.verifiers.execution import ProgramRunner
from rlax_tpu.verifiers.functions import (
    RewardFunctionError,
    check_reward_functions,
    configured_reward_functions,
    load_reward_function,
)
from rlax_tpu.verifiers.local import LocalVerifier
from rlax_tpu.verifiers.pool import TaskTimeout, WorkerCrashed, WorkerPool

__all__ = [
    "LocalVerifier",
    "ProgramRunner",
    "RewardFunctionError",
    "TaskTimeout",
    "TestCaseResult",
    "Verdict",
    "VerificationRequest",
    "VerificationResult",
    "WorkerCrashed",
    "WorkerPool",
    "check_reward_functions",
    "configured_reward_functions",
    "load_reward_function",
]
