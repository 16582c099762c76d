"""Multi-turn environments and tools (JAX-free): the built-in environment ("tools": tool calls
ending in a final answer), the built-in tools (the calculator; the Python interpreter, whose
programs run in the verifier's sandbox), and the registry that resolves a config's names for
them, built-in or the user's. The contract they implement (`Environment`, `Tool`, `Action`,
`StepResult`, ...) is rlax_tpu/api/environments.py.
"""

from rlax_tpu.environments.calculator import CalculatorError, calculator, evaluate
from rlax_tpu.environments.python_tool import python_tool
from rlax_tpu.environments.registry import (
    BUILTIN_ENVIRONMENTS,
    BUILTIN_TOOLS,
    SANDBOXED_TOOLS,
    EnvironmentSpecError,
    ToolContext,
    resolve_environment,
    resolve_tool,
)
from rlax_tpu.environments.tool_environment import ON_TOOL_ERROR, OnToolError, ToolEnvironment

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "BUILTIN_TOOLS",
    "ON_TOOL_ERROR",
    "SANDBOXED_TOOLS",
    "CalculatorError",
    "EnvironmentSpecError",
    "OnToolError",
    "ToolContext",
    "ToolEnvironment",
    "calculator",
    "evaluate",
    "python_tool",
    "resolve_environment",
    "resolve_tool",
]
