"""Environments and tools by name, as a config names them: a built-in's name ("tools",
"calculator"), or the user's own as "package.module:name" (installed, or on PYTHONPATH) or
"path/to/file.py:name" (relative to the working directory), imported as reward functions are
(rlax_tpu/user_modules.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_tpu.api.environments import (
    Environment,
    EnvironmentFactory,
    EpisodeLimits,
    Tool,
    ToolDefinitionError,
)
from rlax_tpu.environments.calculator import calculator
from rlax_tpu.environments.tool_environment import ToolEnvironment
from rlax_tpu.user_modules import import_user_module

BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {"tools": ToolEnvironment}
# Tools that run in this process. A tool that runs code the policy wrote (a Python
# interpreter) runs in the verifier's sandbox, through the verifier service, and is listed
# here when it lands.
BUILTIN_TOOLS: dict[str, Tool] = {t.name: t for t in (calculator,)}


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


def resolve_tool(spec: str) -> Tool:
    """The tool `spec` names: a built-in's name ("calculator"), or the user's
    "module:name" / "path/to/file.py:name" naming a Tool (taken as it is) or a typed
    function (made one with Tool.from_function)."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    what = f"tool {spec!r}"
    if ":" not in spec:
        raise EnvironmentSpecError(
            f"{what} is not a built-in tool (built-in: {', '.join(BUILTIN_TOOLS)}); name "
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
