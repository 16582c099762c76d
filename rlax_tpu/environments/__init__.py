"""Multi-turn environments and tools (JAX-free): the built-in environment ("tools": tool calls
ending in a final answer), the built-in tools (the calculator), and the registry that
resolves a config's names for them, built-in or the user's. The contract they implement
(`Environment`, `Tool`, `Action`, `StepResult`, ...) is rlax_tpu/api/environments.py.
"""

from rlax_tpu.environments.calculator import CalculatorError, calculator, evaluate
from rlax_tpu.environments.registry import (
    BUILTIN_ENVIRONMENTS,
    BUILTIN_TOOLS,
    EnvironmentSpecError,
    resolve_environment,
    resolve_tool,
)
from rlax_tpu.environments.tool_environment import ON_TOOL_ERROR, OnToolError, ToolEnvironment

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "BUILTIN_TOOLS",
    "ON_TOOL_ERROR",
    "CalculatorError",
    "EnvironmentSpecError",
    "OnToolError",
    "ToolEnvironment",
    "calculator",
    "evaluate",
    "resolve_environment",
    "resolve_tool",
]
