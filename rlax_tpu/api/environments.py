"""Multi-turn environments and their tools (JAX-free, the contract package): what an episode's
environment takes from the policy and gives back. The types every side shares are here; the
chat formats that turn a policy's text into `ToolCall`s live in rlax_tpu/data/tool_format.py,
the built-in environments, tools and their registry in rlax_tpu/environments/.

An episode: the controller makes one `Environment` per episode from a dataset row (an
`EnvironmentFactory`), renders `reset()`'s messages with the tools' `schema()`s as the prompt,
and for every policy turn hands the decoded turn to `step` as an `Action`; the `StepResult`'s
observation (tool results, a user's follow-up) is appended to the conversation, until `done`.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import inspect
import json
import re
import reprlib
import threading
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

# A chat message as chat templates take it: {"role": ..., "content": ..., and for an
# assistant turn with calls "tool_calls": [...], for a tool's result "name" / "tool_call_id"}.
Message = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the policy made: the tool's name and its arguments (a JSON object), and the
    call's id where the format gives one ("" otherwise)."""

    name: str
    arguments: Mapping[str, Any]
    id: str = ""

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry (OpenAI's shape, which chat
        templates read)."""
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": dict(self.arguments)},
        }
        if self.id:
            call["id"] = self.id
        return call


@dataclasses.dataclass(frozen=True)
class Action:
    """The policy's turn, decoded by the controller.

    text:        the turn's text, without the end-of-turn token.
    tool_calls:  the calls the chat format found in it, in order.
    parse_error: set when the text tried to call a tool but the call could not be parsed
                 (what was wrong, for the policy to read); calls parsed beside it are kept.
    tokens_used: the episode's tokens so far as the controller counts them (the prompt,
                 every turn and observation, this turn included); 0 = not counted.
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    parse_error: str = ""
    tokens_used: int = 0

    def message(self) -> dict[str, Any]:
        """The turn as an assistant message (for an episode's record of its conversation)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.message() for call in self.tool_calls]
        return message


class ToolVerdict(enum.StrEnum):
    """How one tool call went."""

    OK = "ok"
    ERROR = "error"  # the tool raised
    TIMEOUT = "timeout"  # it ran past its timeout and was abandoned
    BAD_ARGUMENTS = "bad_arguments"  # missing, extra or mistyped against the tool's schema
    UNKNOWN_TOOL = "unknown_tool"  # the episode has no tool of that name
    PARSE_ERROR = "parse_error"  # the policy's call could not be parsed (Action.parse_error)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """A tool call's outcome: `content` is what the policy reads (the tool's output, or
    "Error: " and what went wrong); `error` says what went wrong ("" when the verdict is ok)."""

    content: str
    verdict: ToolVerdict = ToolVerdict.OK
    error: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", ToolVerdict(self.verdict))  # "ok" -> OK

    @classmethod
    def failure(cls, verdict: ToolVerdict, error: str) -> ToolResult:
        return cls(content=f"Error: {error}", verdict=verdict, error=error)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the environment gives back for one policy turn.

    observation: the messages to append to the conversation (tool results, a user's
                 follow-up); when `done`, what the conversation ends with (often nothing):
                 no policy turn follows it.
    reward:      the environment's reward for the turn (the run's verifier may score the
                 final answer on top of it).
    done:        the episode is over.
    info:        JSON-able facts for the episode's record and metrics; the last step's
                 holds "end", how the episode ended (EpisodeEnd, or an environment's own).
    """

    observation: tuple[Message, ...]
    reward: float
    done: bool
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# How an episode ended (info["end"] of its last step): the policy gave its final answer (a
# turn without tool calls), used its turns or its tokens, or a tool failed under
# on_tool_error="end". An environment of the user's may name its own ends.
EpisodeEnd = Literal["answer", "max_turns", "max_total_tokens", "tool_error"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """An episode's bounds. A limit reached ends the episode with a verdict in the last
    step's info["end"], never an exception.

    max_turns:        the policy's turns per episode, the final answer's included.
    max_total_tokens: the episode's response tokens (turns and observations, the prompt not
                      counted) at most: no turn generates past it.
    tool_timeout_s:   how long one tool call may run (a tool's own timeout_s wins).
    """

    max_turns: int = 8
    max_total_tokens: int = 8192
    tool_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_turns, int) and self.max_turns >= 1):
            raise ValueError(
                f"max_turns must be an integer >= 1 (the policy's turns per episode, the final "
                f"answer's included; 1 = no tool calls), got {self.max_turns!r}"
            )
        if not (isinstance(self.max_total_tokens, int) and self.max_total_tokens >= 1):
            raise ValueError(
                f"max_total_tokens must be an integer >= 1 (the episode's turns and "
                f"observations together), got {self.max_total_tokens!r}"
            )
        if not (isinstance(self.tool_timeout_s, int | float) and self.tool_timeout_s > 0):
            raise ValueError(
                f"tool_timeout_s must be > 0 seconds (raise it for slow tools, or give a tool "
                f"its own timeout_s), got {self.tool_timeout_s!r}"
            )


class Environment(abc.ABC):
    """One episode's environment, made by an `EnvironmentFactory` from a dataset row and the
    run's `EpisodeLimits`; the row is given at creation, so `reset()` takes no arguments.

    The caller (the controller) guarantees: `reset()` is called once, first; `step` is called
    once per policy turn, in order, with that turn's `Action`, and never after a step that
    returned done. An environment keeps its episode's state (turns taken, counters) and is
    not reused for another episode. Limits reached are verdicts in info["end"], not errors;
    an exception from `step` is a bug of the environment's, and fails the episode.

    `tools`: the tools the policy may call; the controller gives their `schema()`s to the
    chat template (`tools=`), so the policy sees them in its prompt.
    """

    tools: tuple[Tool, ...] = ()

    @abc.abstractmethod
    def reset(self) -> tuple[Message, ...]:
        """The first observation: the prompt's messages."""

    @abc.abstractmethod
    def step(self, action: Action) -> StepResult:
        """The environment's answer to the policy's turn `action`."""

    def state(self) -> Mapping[str, Any]:
        """The episode's state after the last step, JSON-able: what `restore` needs to go on
        from there. The controller logs it with each step's observation, and a resumed run
        restores it instead of stepping again: a tool call is never run twice. Default {}:
        an environment whose steps read nothing but their action (override both methods
        when a step depends on earlier ones: turns taken, a game's board)."""
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Go on from `state` (a `state()` of an environment made from the same row), after
        `reset()`, as if the steps that led there had been taken. Default: nothing to
        restore (the default `state()` is {})."""
        if state:
            raise NotImplementedError(
                f"{type(self).__name__} logged a state but does not restore it: override "
                "restore() with state()"
            )


# Makes one episode's environment: (dataset row, limits) -> Environment.
EnvironmentFactory = Callable[[Mapping[str, Any], EpisodeLimits], Environment]


class EnvironmentRowError(ValueError):
    """A dataset row an environment cannot start an episode from (a field it needs missing
    or malformed); the message names the field and what the row should hold."""


class ToolDefinitionError(ValueError):
    """A function that cannot be made into a tool (a parameter without a supported type
    annotation, *args, a bad name); the message names the function, the parameter and the
    fix."""


# The annotations a tool's parameter may have, as errors list them.
SUPPORTED_ANNOTATIONS = "int, float, str, bool, list[X], Literal[...], Optional[X] / X | None"
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}
# OpenAI's rule for function names, which the chat formats rely on.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SECTION = re.compile(r"(Args|Arguments|Returns|Yields|Raises|Examples?|Notes?):\s*")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tool:
    """A function the policy may call.

    name:        what the policy calls it by.
    description: what it does, for the policy (the docstring's summary).
    parameters:  its arguments as a JSON schema object ({"type": "object", "properties":
                 ..., "required": [...]}); `call` checks arguments against it.
    function:    called with the arguments as keywords; returns a str (given to the policy
                 as it is), a JSON-able value (given as json.dumps of it), or a ToolResult
                 (taken as it is: a tool that judges its own outcome, such as a program
                 stopped at its time limit, TIMEOUT).
    timeout_s:   how long a call may run, None = the episode's tool_timeout_s.

    `Tool.from_function` (or `@tool`) builds one from a typed, documented function.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Callable[..., Any]
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ToolDefinitionError(
                f"tool name {self.name!r} must be 1 to 64 letters, digits, '_' or '-' "
                "(pass name=... to name it)"
            )
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ToolDefinitionError(
                f"tool {self.name!r}: timeout_s must be > 0 seconds or None (the episode's "
                f"tool_timeout_s), got {self.timeout_s!r}"
            )
        if self.parameters.get("type") != "object":
            raise ToolDefinitionError(
                f"tool {self.name!r}: parameters must be a JSON schema of type 'object', got "
                f"{dict(self.parameters)!r:.200}"
            )

    @classmethod
    def from_function(
        cls,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        timeout_s: float | None = None,
    ) -> Tool:
        """`function` as a tool: its name (or `name`), its docstring's summary, and a JSON
        schema of its parameters from their type hints (SUPPORTED_ANNOTATIONS; a parameter
        with a default, or Optional, is not required) with each one's description from the
        docstring's Google-style "Args:" section. An Optional parameter without a default
        is None when a call leaves it out. ToolDefinitionError names the parameter that
        cannot be described."""
        name = name or getattr(function, "__name__", "")
        what = f"tool {name!r} ({getattr(function, '__qualname__', function)!r})"
        doc = inspect.getdoc(function) or ""
        parameters = _parameters_schema(function, _argument_descriptions(doc), what)
        unset = {
            parameter.name: None
            for parameter in inspect.signature(function).parameters.values()
            if parameter.default is parameter.empty
            and parameter.name not in parameters.get("required", ())
        }
        return cls(
            name=name,
            description=_summary(doc),
            parameters=parameters,
            function=functools.partial(function, **unset) if unset else function,
            timeout_s=timeout_s,
        )

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool dict Hugging Face chat templates take in `tools=`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": _plain(self.parameters),
            },
        }

    def call(self, arguments: Mapping[str, Any], timeout_s: float | None = None) -> ToolResult:
        """Runs the tool on `arguments`; never raises for what the tool or its arguments do.

        Arguments that do not match `parameters` -> bad_arguments (naming the argument and
        what was expected). The function runs in a thread for at most `timeout_s` (default:
        the tool's own; with neither, it runs in this thread, unbounded): past it the call
        is abandoned (the thread finishes in the background, its result dropped) ->
        timeout. An exception -> error, with its type and message. A returned ToolResult is
        the call's result. A return value that is none of a str, a ToolResult or JSON-able
        -> error."""
        try:
            kwargs = _checked_object(arguments, self.parameters, "arguments")
        except _BadArgument as exc:
            return ToolResult.failure(
                ToolVerdict.BAD_ARGUMENTS, f"bad arguments for {self.name}: {exc}"
            )
        limit = self.timeout_s if timeout_s is None else timeout_s
        outcome = _run(self.function, kwargs, limit, self.name)
        if outcome is None:
            return ToolResult.failure(
                ToolVerdict.TIMEOUT, f"{self.name} did not finish within {limit:g} s"
            )
        value, raised = outcome
        if raised is not None:
            return ToolResult.failure(ToolVerdict.ERROR, _describe_exception(raised))
        if isinstance(value, str):
            return ToolResult(content=value)
        if isinstance(value, ToolResult):
            return value
        try:
            return ToolResult(content=json.dumps(value, ensure_ascii=False))
        except (TypeError, ValueError):
            return ToolResult.failure(
                ToolVerdict.ERROR,
                f"{self.name} returned {_article(type(value).__name__)} "
                f"{type(value).__name__}, which is not JSON (a tool returns a str or a JSON "
                "value: numbers, strings, lists, dicts)",
            )


def tool(
    function: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Decorator: `@tool` or `@tool(name=..., timeout_s=...)` makes the function a `Tool`
    (Tool.from_function)."""
    if function is None:
        return lambda f: Tool.from_function(f, name=name, timeout_s=timeout_s)
    return Tool.from_function(function, name=name, timeout_s=timeout_s)


# -- the schema of a function's parameters ---------------------------------------------------
def _summary(doc: str) -> str:
    """The docstring's first paragraph, on one line."""
    lines = []
    for line in doc.splitlines():
        if not line.strip() or _SECTION.fullmatch(line.strip()):
            break
        lines.append(line.strip())
    return " ".join(lines)


def _argument_descriptions(doc: str) -> dict[str, str]:
    """{argument: description} of a Google-style "Args:" section: `name: text` or
    `name (type): text` entries, a deeper-indented line continuing the entry above it."""
    descriptions: dict[str, str] = {}
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:")]
    if not starts:
        return descriptions
    entry_indent = None
    current = None
    for line in lines[starts[0] + 1 :]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # the next section
            break
        entry = re.fullmatch(r"\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line.strip())
        if entry and (entry_indent is None or indent <= entry_indent):
            entry_indent = indent
            current = entry.group(1)
            descriptions[current] = entry.group(2).strip()
        elif current is not None:
            descriptions[current] = f"{descriptions[current]} {line.strip()}".strip()
    return descriptions


def _parameters_schema(
    function: Callable[..., Any], descriptions: Mapping[str, str], what: str
) -> dict[str, Any]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"{what}: its signature cannot be read ({exc})") from None
    try:
        hints = typing.get_type_hints(function)
    except Exception as exc:
        raise ToolDefinitionError(
            f"{what}: its type hints cannot be resolved ({_describe_exception(exc)}); import "
            "the types they name in the function's module"
        ) from None
    properties: dict[str, Any] = {}
    required = []
    for parameter in signature.parameters.values():
        where = f"{what}, parameter {parameter.name!r}"
        if parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise ToolDefinitionError(
                f"{where}: a tool's parameters are passed by keyword, so *args, **kwargs and "
                "positional-only parameters cannot be tool parameters; name each one"
            )
        if parameter.name not in hints:
            raise ToolDefinitionError(
                f"{where} has no type annotation; annotate it with one of {SUPPORTED_ANNOTATIONS}"
            )
        annotation = hints[parameter.name]
        optional = False
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            others = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(others) != 1:
                raise ToolDefinitionError(
                    f"{where}: {_show(annotation)} is a union of several types; a tool's "
                    f"parameter has one type ({SUPPORTED_ANNOTATIONS})"
                )
            annotation, optional = others[0], True
        schema = _schema_of(annotation, where)
        if optional:
            schema["nullable"] = True
        if parameter.name in descriptions:
            schema["description"] = descriptions[parameter.name]
        properties[parameter.name] = schema
        if parameter.default is parameter.empty and not optional:
            required.append(parameter.name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return parameters


def _schema_of(annotation: Any, where: str) -> dict[str, Any]:
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and len(args) == 1:
        return {"type": "array", "items": _schema_of(args[0], where)}
    if origin is Literal and all(type(value) in _JSON_TYPES for value in args):
        kinds = {_JSON_TYPES[type(value)] for value in args}
        schema: dict[str, Any] = {"type": kinds.pop()} if len(kinds) == 1 else {}
        schema["enum"] = list(args)
        return schema
    hint = " (give its items' type: list[str])" if annotation is list or origin is list else ""
    raise ToolDefinitionError(
        f"{where}: the annotation {_show(annotation)} is not supported{hint}; use one of "
        f"{SUPPORTED_ANNOTATIONS}"
    )


def _show(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else repr(annotation)


def _plain(value: Any) -> Any:
    """A schema as plain dicts and lists (a chat template may json-dump it)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


# -- checking arguments against a schema -------------------------------------------------------
class _BadArgument(Exception):
    pass


def _checked_object(value: Any, schema: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The arguments as keywords, checked against an object schema (properties, required,
    additionalProperties: extra arguments are refused unless it is true)."""
    if not isinstance(value, Mapping):
        raise _BadArgument(f"{where} must be a JSON object, got {_describe_value(value)}")
    properties = schema.get("properties", {})
    unexpected = [key for key in value if key not in properties]
    if unexpected and schema.get("additionalProperties") is not True:
        takes = ", ".join(properties) if properties else "none"
        raise _BadArgument(
            f"unexpected argument {unexpected[0]!r} (the arguments it takes: {takes})"
        )
    for key in schema.get("required", ()):
        if key not in value:
            expected = properties.get(key, {}).get("type", "a value")
            raise _BadArgument(f"missing required argument {key!r} ({_expected(expected)})")
    out = {}
    for key, item in value.items():
        if key in properties:
            out[key] = _checked(item, properties[key], f"argument {key!r}")
        else:
            out[key] = item
    return out


def _checked(value: Any, schema: Mapping[str, Any], where: str) -> Any:
    """`value` checked against `schema` (type, nullable, enum, items, object properties), an
    integral number for an integer as an int; _BadArgument names `where` and what it
    expected. Keywords it does not know are not checked."""
    if value is None and schema.get("nullable"):
        return None
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    if kinds:
        for candidate in kinds:
            matched, converted = _typed(value, candidate)
            if matched:
                value = converted
                break
        else:
            raise _BadArgument(
                f"{where}: expected {' or '.join(_expected(k) for k in kinds)}, got "
                f"{_describe_value(value)}"
            )
    if "enum" in schema and not any(_same(value, option) for option in schema["enum"]):
        options = ", ".join(json.dumps(option) for option in schema["enum"])
        raise _BadArgument(f"{where}: expected one of {options}, got {_describe_value(value)}")
    if isinstance(value, list) and "items" in schema:
        return [_checked(item, schema["items"], f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, Mapping) and "properties" in schema:
        return _checked_object(value, schema, where)
    return value


def _typed(value: Any, kind: str) -> tuple[bool, Any]:
    """(whether `value` is a JSON `kind`, the value as passed on)."""
    if kind == "integer":
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool), value
    if kind == "array":
        return isinstance(value, list | tuple), list(value) if isinstance(value, tuple) else value
    python_types = {"string": str, "boolean": bool, "object": Mapping, "null": type(None)}
    if kind in python_types:
        return isinstance(value, python_types[kind]), value
    return True, value  # a type this checker does not know: not judged


def _same(value: Any, option: Any) -> bool:
    # 1 == True in Python, not in JSON
    return value == option and isinstance(value, bool) == isinstance(option, bool)


def _expected(kind: str) -> str:
    names = {"integer": "an integer", "number": "a number", "string": "a string"}
    names |= {"boolean": "a boolean", "array": "an array", "object": "an object"}
    return names.get(kind, kind)


def _describe_value(value: Any) -> str:
    kinds = [(bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string")]
    kinds += [(list | tuple, "an array"), (Mapping, "an object")]
    if value is None:
        return "null"
    name = next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)
    return f"{name} ({reprlib.repr(value)})"


# -- running a function with a timeout ---------------------------------------------------------
def _run(
    function: Callable[..., Any], kwargs: Mapping[str, Any], timeout_s: float | None, name: str
) -> tuple[Any, BaseException | None] | None:
    """(return value, exception raised) of function(**kwargs), or None when it ran past
    `timeout_s`. A thread cannot be stopped: a timed-out call keeps running in a daemon
    thread (which does not hold the process open) and its result is dropped, so a tool that
    can run without bound belongs in a sandbox, not here."""
    if timeout_s is None:
        return _outcome(function, kwargs)
    outcomes: list[tuple[Any, BaseException | None]] = []
    thread = threading.Thread(
        target=lambda: outcomes.append(_outcome(function, kwargs)),
        name=f"tool-{name}",
        daemon=True,
    )
    thread.start()
    thread.join(timeout_s)
    return outcomes[0] if outcomes else None


def _outcome(
    function: Callable[..., Any], kwargs: Mapping[str, Any]
) -> tuple[Any, BaseException | None]:
    try:
        return function(**kwargs), None
    except BaseException as exc:  # a tool's SystemExit is its failure, not the process's
        if isinstance(exc, KeyboardInterrupt):
            raise
        return None, exc


def _describe_exception(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"
