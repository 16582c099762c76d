"""Verifiers (DESIGN §7): rewards from math equivalence, sandboxed code execution and task
scorers; a test-data repository for code problems; a gRPC verifier service with a pool of
worker processes. Others use what is named here."""

from rlax_tpu.verifiers.local import LocalVerifier
from rlax_tpu.verifiers.pool import TaskTimeout, WorkerCrashed, WorkerPool
from rlax_tpu.verifiers.types import (
    TestCaseResult,
    Verdict,
    VerificationRequest,
    VerificationResult,
)

__all__ = [
    "LocalVerifier",
    "TaskTimeout",
    "TestCaseResult",
    "Verdict",
    "VerificationRequest",
    "VerificationResult",
    "WorkerCrashed",
    "WorkerPool",
]
