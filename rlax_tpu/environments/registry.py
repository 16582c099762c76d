"""Environments and tools by name, as a config names them: a built-in's name ("tools",
"calculator", "python"), or the user's own as "package.module:name" (installed, or on
PYTHONPATH) or "path/to/file.py:name" (relative to the working directory), imported as reward
functions are (rlax_tpu/user_modules.py). A tool that runs the policy's code ("python") is
made for the run's verifier, which the caller passes in a `ToolContext`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlax_tpu.api.environments import (
    Environment,
    EnvironmentFactory,
    EpisodeLimits,
    Tool,
    ToolDefinitionError,
)
from rlax_tpu.api.verifier import ProgramExecutor
from rlax_tpu.environments.calculator import calculator
from rlax_tpu.environments.python_tool import python_tool
from rlax_tpu.environments.tool_environment import ToolEnvironment
from rlax_tpu.user_modules import import_user_module

BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {"tools": ToolEnvironment}
# Tools that run in this process.
BUILTIN_TOOLS: dict[str, Tool] = {t.name: t for t in (calculator,)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolContext:
    """What the run gives the tools that need it.

    verifier: runs the programs of the tools that run the policy's code, in the verifier's
              sandbox: the controller's ServiceVerifier (its verifier replicas), or a
              VerifierClient of one service. None: such tools cannot be named.
    """

    verifier: ProgramExecutor | None = None


# Tools that run the policy's code: made per run, for its verifier (ToolContext.verifier).
SANDBOXED_TOOLS: dict[str, Callable[[ProgramExecutor], Tool]] = {"python": python_tool}


class EnvironmentSpecError(ValueError):
    """An environment or tool spec that cannot be used: malformed, not a built-in, its
    module does not import, no such attribute, or not a factory / a tool. The message names
    the spec and the fix."""


def resolve_environment(
    spec: str,
    *,
    tools: Sequence[Tool] | None = None,
    on_tool_error: str = "continue",
) -> EnvironmentFactory:
    """The factory `spec` names: "tools" (ToolEnvironment with `tools`, default the
    built-in tools, and `on_tool_error`), or the user's "module:factory" /
    "path/to/file.py:factory", a callable (row, limits) -> Environment (an Environment
    subclass taking (row, limits) is one), which picks its own tools. The returned
    factory checks that what it makes is an Environment."""
    if spec in BUILTIN_ENVIRONMENTS:
        try:
            return ToolEnvironment.factory(
                tools=BUILTIN_TOOLS.values() if tools is None else tools,
                on_tool_error=on_tool_error,  # type: ignore[arg-type]
            )
        except (TypeError, ValueError) as exc:
            raise EnvironmentSpecError(f"environment {spec!r}: {exc}") from None
    what = f"environment {spec!r}"
    if ":" not in spec:
        raise EnvironmentSpecError(
            f"{what} is not a built-in environment (built-in: "
            f"{', '.join(BUILTIN_ENVIRONMENTS)}); name your own as 'package.module:factory' "
            "or 'path/to/file.py:factory'"
        )
    if tools is not None or on_tool_error != "continue":
        raise EnvironmentSpecError(
            f"{what}: tools and on_tool_error configure the built-in 'tools' environment; "
            "an environment of your own picks its own tools (its `tools` attribute)"
        )
    factory = _attribute(spec, what)
    if not callable(factory):
        raise EnvironmentSpecError(
            f"{what}: {type(factory).__name__} is not callable; name a function "
            "(row, limits) -> Environment, or an Environment subclass"
        )
    try:
        inspect.signature(factory).bind(None, None)
    except TypeError as exc:
        raise EnvironmentSpecError(
            f"{what}: it cannot be called as factory(row, limits) ({exc}); define it as "
            "`def factory(row, limits) -> Environment`"
        ) from None
    except ValueError:  # some builtins have no signature: the first call will tell
        pass
    return _CheckedFactory(spec, factory)


def resolve_tool(spec: str, context: ToolContext | None = None) -> Tool:
    """The tool `spec` names: a built-in's name ("calculator"; "python", made for
    `context.verifier`), or the user's "module:name" / "path/to/file.py:name" naming a Tool
    (taken as it is) or a typed function (made one with Tool.from_function)."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    what = f"tool {spec!r}"
    if spec in SANDBOXED_TOOLS:
        verifier = context.verifier if context is not None else None
        if verifier is None:
            raise EnvironmentSpecError(
                f"{what} runs the policy's code in the verifier's sandbox, through the "
                "verifier service, and no verifier was given: resolve it with "
                "resolve_tool(spec, ToolContext(verifier=...)), the run's ServiceVerifier "
                "or a VerifierClient"
            )
        return SANDBOXED_TOOLS[spec](verifier)
    if ":" not in spec:
        built_in = ", ".join([*BUILTIN_TOOLS, *SANDBOXED_TOOLS])
        raise EnvironmentSpecError(
            f"{what} is not a built-in tool (built-in: {built_in}); name "
            "your own as 'package.module:function' or 'path/to/file.py:function'"
        )
    value = _attribute(spec, what)
    if isinstance(value, Tool):
        return value
    if not callable(value):
        raise EnvironmentSpecError(
            f"{what}: {type(value).__name__} is not a function or a Tool; name a typed "
            "function (or one decorated with @tool)"
        )
    try:
        return Tool.from_function(value)
    except ToolDefinitionError as exc:
        raise EnvironmentSpecError(f"{what}: {exc}") from None


def _attribute(spec: str, what: str) -> Any:
    module_name, _, name = spec.rpartition(":")
    if not (module_name and name.isidentifier()):
        raise EnvironmentSpecError(
            f"{what}: expected 'package.module:name' or 'path/to/file.py:name'"
        )
    module = import_user_module(module_name, what, EnvironmentSpecError)
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise EnvironmentSpecError(
            f"{what}: {module_name!r} has no attribute {name!r}"
            + (f" (it has: {', '.join(public[:10])})" if public else "")
        )
    return getattr(module, name)


class _CheckedFactory:
    """A user's factory, whose environments are checked to be Environments."""

    def __init__(self, spec: str, factory: EnvironmentFactory) -> None:
        self.spec = spec
        self.factory = factory

    def __call__(self, row: Mapping[str, Any], limits: EpisodeLimits) -> Environment:
        environment = self.factory(row, limits)
        if not isinstance(environment, Environment):
            raise EnvironmentSpecError(
                f"environment {self.spec!r}: the factory returned "
                f"{type(environment).__name__}, not an Environment (subclass "
                "rlax_tpu.api.environments.Environment)"
            )
        return environment
