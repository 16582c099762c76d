"""The environment a test gives a process it starts as a user would (a job, a tool, a
component on its own device count): the test process's variables without its XLA_FLAGS
(8 virtual devices, the ops' threading), keeping only the suite's code-generation flags
(tests/conftest.py: FAST_CODEGEN, unless RLAX_TPU_TEST_CODEGEN=default)."""

from __future__ import annotations

import os

# Set by tests/conftest.py: the XLA flags every process of the suite compiles with.
CODEGEN_VARIABLE = "RLAX_TPU_TEST_XLA_CODEGEN"


def codegen_flags() -> str:
    return os.environ.get(CODEGEN_VARIABLE, "")


def user_env(*, quick_codegen: bool = True, **extra: str) -> dict[str, str]:
    """os.environ with XLA_FLAGS holding only the code-generation flags (none with
    `quick_codegen=False`: XLA's defaults, for a job whose running time outweighs its
    compiles), then `extra`."""
    env = dict(os.environ)
    flags = codegen_flags() if quick_codegen else ""
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def with_codegen(xla_flags: str) -> str:
    """`xla_flags` (a test's own, e.g. a device count) with the suite's code-generation flags."""
    return " ".join([*codegen_flags().split(), *xla_flags.split()])
