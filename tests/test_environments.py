"""Multi-turn environments and tools (JAX-free): a typed function made into a tool (its JSON
schema, its arguments checked, its failures as verdicts), the calculator against hostile
expressions and against Python's exact arithmetic, ToolEnvironment episodes, and the
registry with an environment and a tool of the user's in a file outside the package."""

from __future__ import annotations

import json
import math
import textwrap
import threading
import time
from typing import Literal, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_tpu.api.environments import (
    Action,
    Environment,
    EnvironmentRowError,
    EpisodeLimits,
    StepResult,
    Tool,
    ToolCall,
    ToolDefinitionError,
    ToolResult,
    ToolVerdict,
    tool,
)
from rlax_tpu.environments import (
    CalculatorError,
    EnvironmentSpecError,
    ToolEnvironment,
    calculator,
    evaluate,
    resolve_environment,
    resolve_tool,
)


# -- tools from functions ----------------------------------------------------------------------
def search(
    query: str,
    limit: int,
    scale: float = 1.0,
    exact: bool = False,
    tags: list[str] = (),  # type: ignore[assignment]
    matrix: Optional[list[list[int]]] = None,  # noqa: UP045 (the typing spelling is tested)
    mode: Literal["fast", "full"] = "fast",
    level: Literal[1, 2, 3] | None = None,
    *,
    note: str | None,
) -> str:
    """Searches the index for documents.

    A longer description that the schema leaves out.

    Args:
        query: What to look for.
        limit (int): How many results at most,
            counted after de-duplication.
        scale: A weight.
        mode: How hard to look.

    Returns:
        The results as text.
    """
    return f"{query}|{limit}|{scale}|{exact}|{list(tags)}|{matrix}|{mode}|{level}|{note}"


def test_a_functions_signature_and_docstring_make_its_json_schema():
    assert Tool.from_function(search).schema() == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Searches the index for documents.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for."},
                    "limit": {
                        "type": "integer",
                        "description": "How many results at most, counted after de-duplication.",
                    },
                    "scale": {"type": "number", "description": "A weight."},
                    "exact": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "matrix": {
                        "type": "array",
                        "items": {"type": "array", "items": {"type": "integer"}},
                        "nullable": True,
                    },
                    "mode": {
                        "type": "string",
                        "enum": ["fast", "full"],
                        "description": "How hard to look.",
                    },
                    "level": {"type": "integer", "enum": [1, 2, 3], "nullable": True},
                    "note": {"type": "string", "nullable": True},
                },
                "required": ["query", "limit"],
            },
        },
    }


def test_the_decorator_makes_a_tool_with_or_without_options():
    @tool
    def echo(text: str) -> str:
        """Echoes."""
        return text

    @tool(name="shout", timeout_s=2.0)
    def loud(text: str) -> str:
        return text.upper()

    assert (echo.name, echo.description, echo.timeout_s) == ("echo", "Echoes.", None)
    assert (loud.name, loud.description, loud.timeout_s) == ("shout", "", 2.0)
    assert loud.call({"text": "hi"}).content == "HI"


def _no_annotation(x, y: int) -> int:
    return y


def _union(x: int | str) -> str:
    return str(x)


def _dict(x: dict[str, int]) -> int:
    return 0


def _bare_list(x: list) -> int:
    return 0


def _star_args(*x: int) -> int:
    return 0


def _positional_only(x: int, /) -> int:
    return x


@pytest.mark.parametrize(
    "function, message",
    [
        (_no_annotation, "parameter 'x' has no type annotation"),
        (_union, "parameter 'x': int | str is a union of several types"),
        (_dict, "parameter 'x': the annotation dict[str, int] is not supported"),
        (_bare_list, "parameter 'x': the annotation list is not supported (give its items'"),
        (_star_args, "parameter 'x': a tool's parameters are passed by keyword"),
        (_positional_only, "parameter 'x': a tool's parameters are passed by keyword"),
    ],
)
def test_a_parameter_that_cannot_be_described_is_refused_by_name(function, message):
    with pytest.raises(ToolDefinitionError, match="int, float, str|name each one") as error:
        Tool.from_function(function)
    assert message in str(error.value)


def test_a_tool_name_the_chat_formats_cannot_carry_is_refused():
    with pytest.raises(ToolDefinitionError, match="pass name=... to name it"):
        Tool.from_function(lambda: 0)
    with pytest.raises(ToolDefinitionError, match="timeout_s must be > 0"):
        Tool.from_function(search, timeout_s=0)


# -- a tool's call -----------------------------------------------------------------------------
SEARCH = Tool.from_function(search)


@pytest.mark.parametrize(
    "arguments, error",
    [
        ({"limit": 3}, "missing required argument 'query' (a string)"),
        ({"query": "q"}, "missing required argument 'limit' (an integer)"),
        ({"query": "q", "limit": 3, "sort": "asc"}, "unexpected argument 'sort' (the arguments"),
        ({"query": "q", "limit": "3"}, "argument 'limit': expected an integer, got a string"),
        ({"query": "q", "limit": 2.5}, "argument 'limit': expected an integer, got a number"),
        ({"query": "q", "limit": True}, "argument 'limit': expected an integer, got a boolean"),
        ({"query": 7, "limit": 1}, "argument 'query': expected a string, got an integer"),
        ({"query": "q", "limit": 1, "scale": None}, "argument 'scale': expected a number, got n"),
        ({"query": "q", "limit": 1, "tags": "a"}, "argument 'tags': expected an array, got a s"),
        ({"query": "q", "limit": 1, "tags": ["a", 2]}, "argument 'tags'[1]: expected a string"),
        ({"query": "q", "limit": 1, "matrix": [[1], [2, "x"]]}, "argument 'matrix'[1][1]: expec"),
        ({"query": "q", "limit": 1, "mode": "slow"}, '\'mode\': expected one of "fast", "full"'),
        ({"query": "q", "limit": 1, "level": True}, "argument 'level': expected an integer"),
        (["q", 1], "arguments must be a JSON object, got an array"),
    ],
)
def test_arguments_that_do_not_match_the_schema_are_bad_arguments(arguments, error):
    result = SEARCH.call(arguments, timeout_s=5.0)
    assert result.verdict == ToolVerdict.BAD_ARGUMENTS
    assert error in result.error
    assert result.content == f"Error: {result.error}"


def test_arguments_that_match_reach_the_function_as_keywords():
    result = SEARCH.call({"query": "q", "limit": 2.0, "tags": ["a"], "level": None}, 5.0)
    assert result.verdict == ToolVerdict.OK
    # an integral number is an integer; an Optional left out without a default is None
    assert result.content == "q|2|1.0|False|['a']|None|fast|None|None"
    full = {"query": "q", "limit": 1, "scale": 2, "exact": True, "matrix": [[1, 2]]}
    full |= {"mode": "full", "level": 3, "note": "n"}
    assert SEARCH.call(full, 5.0).content == "q|1|2|True|[]|[[1, 2]]|full|3|n"


def test_an_exception_is_an_error_with_its_type_and_message():
    @tool
    def divide(a: int, b: int) -> float:
        return a / b

    result = divide.call({"a": 1, "b": 0}, 5.0)
    assert result == divide.call({"a": 1, "b": 0}, None)  # in this thread, the same outcome
    assert result.verdict == ToolVerdict.ERROR
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.content == "Error: ZeroDivisionError: division by zero"


def test_a_call_past_its_timeout_is_abandoned_as_a_timeout():
    release = threading.Event()

    @tool(timeout_s=0.2)
    def wait() -> str:
        release.wait(10.0)
        return "late"

    start = time.monotonic()
    try:
        result = wait.call({})
    finally:
        release.set()
    assert time.monotonic() - start < 2.0
    assert result.verdict == ToolVerdict.TIMEOUT
    assert result.error == "wait did not finish within 0.2 s"


def test_a_return_value_is_text_str_as_it_is_and_json_otherwise():
    @tool
    def give(kind: str) -> object:
        values = {"str": "plain", "dict": {"a": [1, 2.5, None]}, "int": 2**70, "set": {1}}
        return values[kind]

    assert give.call({"kind": "str"}, 5.0).content == "plain"
    assert give.call({"kind": "dict"}, 5.0).content == '{"a": [1, 2.5, null]}'
    assert give.call({"kind": "int"}, 5.0).content == str(2**70)
    result = give.call({"kind": "set"}, 5.0)
    assert result.verdict == ToolVerdict.ERROR
    assert "returned a set, which is not JSON" in result.error


def test_a_returned_tool_result_is_the_calls_result():
    """A tool that judges its own outcome (a sandboxed program's time limit) returns it."""

    @tool
    def judged(late: bool) -> object:
        if late:
            return ToolResult.failure(ToolVerdict.TIMEOUT, "stopped at its 1 s limit")
        return ToolResult(content="on time")

    assert judged.call({"late": False}, 5.0) == ToolResult(content="on time")
    late = judged.call({"late": True}, 5.0)
    assert (late.verdict, late.content) == (ToolVerdict.TIMEOUT, "Error: stopped at its 1 s limit")


# -- the calculator ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("-3 ** 2", -9),
        ("2 ** 100 + 1", 2**100 + 1),
        ("7 / 2", 3.5),
        ("6 / 3", 2),  # an exact division of integers stays an int ...
        ("10**30 / 10**10", 10**20),  # ... exactly, where the float would round
        ("-7 // 2", -4),
        ("-7 % 3", 2),
        ("2 ** -1", 0.5),
        ("1.5 * 4", 6.0),
        ("+(4)", 4),
    ],
)
def test_the_calculator_computes_arithmetic(expression, value):
    result = evaluate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    "expression, error",
    [
        ("__import__('os')", "a function call is not allowed"),
        ("x + 1", "the name 'x' is not allowed"),
        ("(1).real", "the attribute 'real' is not allowed"),
        ("2 ** 10 ** 10", "has more than 10000 bits"),
        ("10 ** 3000 * 10 ** 3000", "a result has more than 10000 bits"),
        ("9" * 10_000, "10000 characters long, over the limit of 1000"),
        ("-" * 500 + "1", "nested more than 100 levels deep"),
        ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression (too many nested"),
        ("1 / 0", "division by zero in 1 / 0"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "(-8) ** 0.5 is not a real number"),
        ("1e308 * 10", "too large for a floating-point number"),
        ("2.0 ** 5000", "too large for a floating-point number"),
        ("1e400", "too large for a floating-point number"),
        ("True + 1", "True is not a number"),
        ("'a' * 3", "'a' is not a number"),
        ("1j", "1j is not a number"),
        ("1 << 3", "the operator LShift is not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1; 2", "not an arithmetic expression"),
        ("", "not an arithmetic expression"),
    ],
)
def test_a_hostile_or_bad_expression_is_an_error_verdict_never_an_exception(expression, error):
    result = calculator.call({"expression": expression}, timeout_s=5.0)
    assert result.verdict == ToolVerdict.ERROR
    assert result.error.startswith("CalculatorError: ")
    assert error in result.error


def _integer_expressions():
    leaves = st.integers(min_value=-1000, max_value=1000).map(lambda n: (str(n), n))

    def combine(children):
        def join(pair, op):
            (left_text, left), (right_text, right) = pair
            value = {"+": left + right, "-": left - right, "*": left * right}[op]
            return f"({left_text} {op} {right_text})", value

        return st.builds(join, st.tuples(children, children), st.sampled_from("+-*"))

    return st.recursive(leaves, combine, max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(_integer_expressions())
def test_the_calculator_agrees_with_exact_integer_arithmetic(case):
    text, value = case
    assert evaluate(text) == value
    assert calculator.call({"expression": text}, None).content == str(value)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*/%(). e_jx*", max_size=40))
def test_the_calculator_answers_any_text_with_a_number_or_a_calculator_error(text):
    try:
        value = evaluate(text)
    except CalculatorError:
        return
    assert type(value) in (int, float) and math.isfinite(value)


# -- episodes --------------------------------------------------------------------------------------
LIMITS = EpisodeLimits(max_turns=4, max_total_tokens=1000, tool_timeout_s=5.0)


def _call(expression: str, call_id: str = "") -> ToolCall:
    return ToolCall("calculator", {"expression": expression}, call_id)


def test_limits_that_cannot_bound_an_episode_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1 .*got 0"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match="max_total_tokens must be an integer >= 1"):
        EpisodeLimits(max_total_tokens=-5)
    with pytest.raises(ValueError, match="tool_timeout_s must be > 0 seconds .*raise it"):
        EpisodeLimits(tool_timeout_s=0)


def test_the_row_gives_the_first_observation():
    environment = ToolEnvironment({"prompt": "What is 2+2?", "id": "r1"}, LIMITS)
    assert environment.reset() == ({"role": "user", "content": "What is 2+2?"},)
    chat = [{"role": "user", "content": "hi"}]
    with_system = ToolEnvironment({"messages": chat, "system_prompt": "Use tools."}, LIMITS)
    assert with_system.reset() == ({"role": "system", "content": "Use tools."}, *chat)
    own_system = [{"role": "system", "content": "Mine."}, *chat]
    kept = ToolEnvironment({"messages": own_system, "system_prompt": "Use tools."}, LIMITS)
    assert kept.reset() == tuple(own_system)
    assert [t.schema()["function"]["name"] for t in environment.tools] == ["calculator"]


@pytest.mark.parametrize(
    "row, error",
    [
        ({"id": "r"}, "the row has neither of 'prompt' and 'messages'"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "has both"),
        ({"messages": "hello"}, "'messages' must be a list of messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0] must be an object with a text"),
        ({"prompt": 3}, "'prompt' must be text"),
    ],
)
def test_a_row_without_a_usable_prompt_is_refused(row, error):
    with pytest.raises(EnvironmentRowError) as raised:
        ToolEnvironment(row, LIMITS)
    assert error in str(raised.value)


def test_an_episode_calls_a_tool_reads_its_result_and_ends_with_the_answer():
    environment = ToolEnvironment({"prompt": "What is 12*34+5?"}, LIMITS)
    environment.reset()
    first = environment.step(
        Action("<tool_call>...</tool_call>", (_call("12*34", "c1"), _call("408+5")))
    )
    assert first.observation == (
        {"role": "tool", "name": "calculator", "content": "408", "tool_call_id": "c1"},
        {"role": "tool", "name": "calculator", "content": "413"},
    )
    assert (first.reward, first.done) == (0.0, False)
    assert first.info["turn"] == 1 and first.info["tool_calls"] == 2
    assert first.info["verdicts"] == ["ok", "ok"]
    assert sum(first.info["tool_errors"].values()) == 0
    last = environment.step(Action("The answer is 413."))
    assert (last.observation, last.reward, last.done) == ((), 0.0, True)
    assert last.info["end"] == "answer" and last.info["turn"] == 2
    assert last.info["tool_calls"] == 2 and last.info["tool_seconds"] >= 0.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        environment.step(Action("again"))


def test_an_unknown_tool_and_a_parse_error_are_told_to_the_policy_and_the_episode_goes_on():
    environment = ToolEnvironment({"prompt": "p"}, LIMITS)
    environment.reset()
    step = environment.step(
        Action("...", (ToolCall("search", {"q": "x"}, "c9"),), parse_error="unclosed <tool_call>")
    )
    assert not step.done
    assert step.observation == (
        {
            "role": "tool",
            "name": "search",
            "content": "Error: there is no tool named 'search' (the tools: calculator)",
            "tool_call_id": "c9",
        },
        {
            "role": "tool",
            "content": "Error: the tool call could not be parsed: unclosed <tool_call>",
        },
    )
    assert step.info["verdicts"] == ["unknown_tool", "parse_error"]
    assert step.info["tool_errors"]["unknown_tool"] == 1
    assert step.info["tool_errors"]["parse_error"] == 1
    assert step.info["tool_calls"] == 1
    assert environment.step(Action("done")).info["end"] == "answer"


def test_the_last_turn_ends_the_episode_at_max_turns_without_running_its_calls():
    ran = []

    @tool
    def note(text: str) -> str:
        ran.append(text)
        return "noted"

    limits = EpisodeLimits(max_turns=2, max_total_tokens=1000, tool_timeout_s=5.0)
    environment = ToolEnvironment({"prompt": "p"}, limits, tools=(note,))
    environment.reset()
    assert not environment.step(Action("", (ToolCall("note", {"text": "a"}),))).done
    last = environment.step(Action("", (ToolCall("note", {"text": "b"}),)))
    assert (last.done, last.observation, last.info["end"]) == (True, (), "max_turns")
    assert ran == ["a"]


def test_a_restored_environment_goes_on_as_the_one_that_took_the_steps():
    limits = EpisodeLimits(max_turns=2, max_total_tokens=1000, tool_timeout_s=5.0)
    stepped = ToolEnvironment({"prompt": "p"}, limits)
    stepped.reset()
    stepped.step(Action("", (_call("1+1"), ToolCall("search", {}))))
    state = stepped.state()
    assert json.loads(json.dumps(state)) == state  # logged as JSON
    restored = ToolEnvironment({"prompt": "p"}, limits)
    restored.reset()
    restored.restore(state)
    # Both are on their last turn, with the same counters: the same step, the same answer.
    for environment in (stepped, restored):
        last = environment.step(Action("", (_call("2+2"),)))
        assert (last.done, last.info["end"], last.info["turn"]) == (True, "max_turns", 2)
        assert last.info["tool_errors"]["unknown_tool"] == 1 and last.info["tool_calls"] == 2


def test_spent_tokens_end_the_episode():
    environment = ToolEnvironment({"prompt": "p"}, LIMITS)
    environment.reset()
    assert not environment.step(Action("", (_call("1+1"),), tokens_used=999)).done
    last = environment.step(Action("", (_call("1+1"),), tokens_used=1000))
    assert last.done and last.info["end"] == "max_total_tokens"


def test_on_tool_error_end_stops_at_the_first_failed_call():
    environment = ToolEnvironment({"prompt": "p"}, LIMITS, on_tool_error="end")
    environment.reset()
    step = environment.step(Action("", (_call("1+1"), _call("1/0"), _call("2+2"))))
    assert step.done and step.info["end"] == "tool_error"
    assert [m["content"] for m in step.observation] == [
        "2",
        "Error: CalculatorError: division by zero in 1 / 0",
    ]
    assert step.info["tool_errors"]["error"] == 1 and step.info["tool_calls"] == 2
    parse = ToolEnvironment({"prompt": "p"}, LIMITS, on_tool_error="end")
    assert parse.step(Action("", parse_error="bad JSON")).info["end"] == "tool_error"


def test_a_tool_times_out_within_the_episodes_timeout_unless_it_has_its_own():
    release = threading.Event()

    def stall() -> str:
        release.wait(10.0)
        return "late"

    limits = EpisodeLimits(max_turns=4, max_total_tokens=1000, tool_timeout_s=0.2)
    tools = (Tool.from_function(stall), Tool.from_function(stall, name="patient", timeout_s=5.0))
    environment = ToolEnvironment({"prompt": "p"}, limits, tools=tools)
    try:
        step = environment.step(Action("", (ToolCall("stall", {}),)))
        assert step.info["verdicts"] == ["timeout"]
        assert step.info["tool_errors"]["timeout"] == 1 and step.info["tool_seconds"] < 2.0
        threading.Timer(0.5, release.set).start()
        assert environment.step(Action("", (ToolCall("patient", {}),))).info["verdicts"] == ["ok"]
    finally:
        release.set()


def test_tool_environment_options_are_checked_when_the_factory_is_made():
    with pytest.raises(ValueError, match="on_tool_error must be one of 'continue', 'end'"):
        ToolEnvironment.factory(on_tool_error="stop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolEnvironment.factory(tools=(calculator, calculator))
    with pytest.raises(TypeError, match="make a function one with Tool.from_function"):
        ToolEnvironment.factory(tools=(search,))  # type: ignore[arg-type]
    factory = ToolEnvironment.factory(tools=(SEARCH,), on_tool_error="end")
    environment = factory({"prompt": "p"}, LIMITS)
    assert [t.name for t in environment.tools] == ["search"]


def test_an_action_is_an_assistant_message():
    action = Action("Let me compute.", (_call("1+1", "c1"),))
    assert action.message() == {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "1+1"}},
                "id": "c1",
            }
        ],
    }
    assert Action("Final.").message() == {"role": "assistant", "content": "Final."}


# -- the registry --------------------------------------------------------------------------------
USER_MODULE = """
from rlax_tpu.api.environments import Environment, StepResult, tool


@tool
def reverse(text: str) -> str:
    '''Reverses text.

    Args:
        text: The text to reverse.
    '''
    return text[::-1]


def shout(text: str, times: int = 1) -> str:
    '''Shouts.'''
    return text.upper() * times


class Guess(Environment):
    '''Guess the row's number; each wrong guess is told higher or lower.'''

    def __init__(self, row, limits):
        self.secret = row["secret"]
        self.tools = (reverse,)

    def reset(self):
        return ({"role": "user", "content": "Guess my number."},)

    def step(self, action):
        guess = int(action.text)
        if guess == self.secret:
            return StepResult((), 1.0, True, {"end": "solved"})
        hint = "higher" if guess < self.secret else "lower"
        return StepResult(({"role": "user", "content": hint},), 0.0, False, {})


def not_an_environment(row, limits):
    return "nope"


def takes_nothing():
    return None


NUMBER = 3
"""


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    return path


def test_a_users_environment_and_tools_resolve_from_a_file(user_file):
    factory = resolve_environment(f"{user_file}:Guess")
    environment = factory({"secret": 7}, LIMITS)
    assert environment.reset() == ({"role": "user", "content": "Guess my number."},)
    assert environment.step(Action("5")).observation == ({"role": "user", "content": "higher"},)
    solved = environment.step(Action("7"))
    assert (solved.reward, solved.done, solved.info["end"]) == (1.0, True, "solved")
    assert environment.tools[0].call({"text": "abc"}).content == "cba"

    reverse = resolve_tool("my_env.py:reverse")  # relative to the working directory
    assert reverse.description == "Reverses text."
    shout = resolve_tool(f"{user_file}:shout")  # a plain function becomes a Tool
    assert shout.parameters["required"] == ["text"]
    assert shout.call({"text": "hi", "times": 2}, 5.0).content == "HIHI"


def test_a_users_module_on_the_path_resolves_by_name(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    assert resolve_tool("my_env:reverse").call({"text": "ab"}).content == "ba"
    assert isinstance(resolve_environment("my_env:Guess")({"secret": 1}, LIMITS).tools, tuple)


def test_the_builtins_resolve_by_name():
    assert resolve_tool("calculator") is calculator
    environment = resolve_environment("tools")({"prompt": "p"}, LIMITS)
    assert isinstance(environment, ToolEnvironment)
    assert [t.name for t in environment.tools] == ["calculator"]
    ending = resolve_environment("tools", tools=[SEARCH], on_tool_error="end")(
        {"prompt": "p"}, LIMITS
    )
    assert ending.step(Action("", (ToolCall("calculator", {}),))).info["end"] == "tool_error"


@pytest.mark.parametrize(
    "resolve, spec, error",
    [
        (resolve_tool, "abacus", "not a built-in tool (built-in: calculator, python)"),
        (resolve_environment, "gym", "'gym' is not a built-in environment (built-in: tools)"),
        (resolve_tool, "my_env.py:nothing", "'my_env.py' has no attribute 'nothing' (it has: "),
        (resolve_tool, "missing.py:f", "no file "),
        (resolve_tool, "no_such_package_xyz:f", "no module named 'no_such_package_xyz'"),
        (resolve_tool, "my_env.py:NUMBER", "int is not a function or a Tool"),
        (resolve_tool, "my_env.py:not_an_environment", "parameter 'row' has no type annotation"),
        (resolve_tool, "my_env.py:", "expected 'package.module:name'"),
        (resolve_environment, "my_env.py:takes_nothing", "cannot be called as factory(row, li"),
        (resolve_environment, "my_env.py:NUMBER", "int is not callable"),
    ],
)
def test_a_spec_that_does_not_resolve_names_itself_and_the_fix(user_file, resolve, spec, error):
    with pytest.raises(EnvironmentSpecError) as raised:
        resolve(spec)
    assert str(raised.value).startswith(("tool ", "environment "))
    assert spec in str(raised.value) and error in str(raised.value)


def test_a_users_factory_is_checked_to_make_environments(user_file):
    factory = resolve_environment("my_env.py:not_an_environment")
    with pytest.raises(EnvironmentSpecError, match="returned str, not an Environment"):
        factory({"prompt": "p"}, LIMITS)
    with pytest.raises(EnvironmentSpecError, match="configure the built-in 'tools' environment"):
        resolve_environment("my_env.py:Guess", on_tool_error="end")


def test_an_environment_without_restore_refuses_a_logged_state_it_cannot_use():
    class Stateless(Environment):
        def reset(self):
            return ({"role": "user", "content": "p"},)

        def step(self, action):
            return StepResult((), 0.0, True)

    environment = Stateless()
    assert environment.state() == {}
    environment.restore({})  # nothing to restore: fine
    with pytest.raises(NotImplementedError, match="override restore"):
        environment.restore({"turns": 2})
