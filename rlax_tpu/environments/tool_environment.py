"""The standard environment ("tools"): the policy calls tools over several turns, then gives
its final answer. The environment runs the calls and returns their results; it rewards
nothing itself (every step's reward is 0): the run's verifier scores the final answer's
text, as it scores a single-turn response.
"""

from __future__ import annotations

import functools
import time
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rlax_tpu.api.environments import (
    Action,
    Environment,
    EnvironmentFactory,
    EnvironmentRowError,
    EpisodeEnd,
    EpisodeLimits,
    Message,
    StepResult,
    Tool,
    ToolCall,
    ToolResult,
    ToolVerdict,
)
from rlax_tpu.environments.calculator import calculator

# What a failed tool call does: the policy reads the error and goes on, or the episode ends
# (info["end"] = "tool_error"). Every verdict but "ok" is a failure, parse errors included.
OnToolError = Literal["continue", "end"]
ON_TOOL_ERROR: tuple[str, ...] = typing.get_args(OnToolError)
DEFAULT_TOOLS: tuple[Tool, ...] = (calculator,)


class ToolEnvironment(Environment):
    """An episode of tool calls ending in a final answer.

    The row (a PromptRecord's JSON, rlax_tpu/data/datasets.py, is one) holds exactly one of
    "prompt" (text: one user message) and "messages" (a chat: [{"role", "content"}, ...]),
    and may hold "system_prompt" (text: a system message put first, unless the messages
    bring their own). Its other fields are not read. `reset()` returns those messages.

    Each step, with the policy's turn:
    * no tool calls and no parse error: the final answer; done, info["end"] = "answer";
    * the episode's tokens spent (tokens_used >= max_total_tokens), or this the last turn
      (turn max_turns): done, "max_total_tokens" or "max_turns", the calls not run (no turn
      is left to read their results);
    * otherwise each call runs, in order (a name the episode has no tool for: unknown_tool),
      and the observation is one tool message per call ({"role": "tool", "name", "content"},
      with "tool_call_id" when the call had an id), then one for a parse error if any;
      with on_tool_error="end" the first failure ends the episode ("tool_error": calls
      after it are not run, the observation holds the results so far).

    info, every step: "turn" (the policy's turns so far), and the episode's counters so
    far: "tool_calls" (calls made, unknown tools included), "tool_errors" ({verdict: count}
    for every verdict but ok, a parse error counting once), "tool_seconds" (time spent in
    calls); "verdicts": this turn's, in observation order; "end" when done.
    """

    def __init__(
        self,
        row: Mapping[str, Any],
        limits: EpisodeLimits,
        *,
        tools: Sequence[Tool] = DEFAULT_TOOLS,
        on_tool_error: OnToolError = "continue",
    ) -> None:
        self.tools = _checked_tools(tools)
        self._by_name = {t.name: t for t in self.tools}
        self._on_tool_error = _checked_on_tool_error(on_tool_error)
        self._limits = limits
        self._prompt = _prompt_messages(row)
        self._turns = 0
        self._done = False
        self._tool_calls = 0
        self._tool_errors = {verdict.value: 0 for verdict in ToolVerdict if verdict != "ok"}
        self._tool_seconds = 0.0

    @classmethod
    def factory(
        cls, *, tools: Sequence[Tool] = DEFAULT_TOOLS, on_tool_error: OnToolError = "continue"
    ) -> EnvironmentFactory:
        """An EnvironmentFactory of this environment with these tools and on_tool_error
        (checked now, not at the first episode)."""
        tools = _checked_tools(tools)
        _checked_on_tool_error(on_tool_error)
        return functools.partial(cls, tools=tools, on_tool_error=on_tool_error)

    def reset(self) -> tuple[Message, ...]:
        return tuple(dict(message) for message in self._prompt)

    def step(self, action: Action) -> StepResult:
        if self._done:
            raise RuntimeError(
                "step() was called after the episode ended; the caller steps an environment "
                "once per policy turn until a step returns done"
            )
        self._turns += 1
        if not action.tool_calls and not action.parse_error:
            return self._end("answer")
        if action.tokens_used >= self._limits.max_total_tokens:
            return self._end("max_total_tokens")
        if self._turns >= self._limits.max_turns:
            return self._end("max_turns")
        observation: list[Message] = []
        verdicts: list[str] = []
        stop = self._on_tool_error == "end"
        for call in action.tool_calls:
            result = self._call(call)
            observation.append(_tool_message(result, call.name, call.id))
            verdicts.append(result.verdict.value)
            if stop and result.verdict != ToolVerdict.OK:
                return self._end("tool_error", observation, verdicts)
        if action.parse_error:
            result = ToolResult.failure(
                ToolVerdict.PARSE_ERROR, f"the tool call could not be parsed: {action.parse_error}"
            )
            self._tool_errors[result.verdict.value] += 1
            observation.append(_tool_message(result))
            verdicts.append(result.verdict.value)
            if stop:
                return self._end("tool_error", observation, verdicts)
        return StepResult(tuple(observation), 0.0, False, self._info(verdicts))

    def state(self) -> dict[str, Any]:
        return {
            "turns": self._turns,
            "done": self._done,
            "tool_calls": self._tool_calls,
            "tool_errors": dict(self._tool_errors),
            "tool_seconds": self._tool_seconds,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self._turns, self._done = int(state["turns"]), bool(state["done"])
        self._tool_calls = int(state["tool_calls"])
        self._tool_errors.update({k: int(v) for k, v in state["tool_errors"].items()})
        self._tool_seconds = float(state["tool_seconds"])

    def _call(self, call: ToolCall) -> ToolResult:
        self._tool_calls += 1
        start = time.monotonic()
        tool = self._by_name.get(call.name)
        if tool is None:
            result = ToolResult.failure(
                ToolVerdict.UNKNOWN_TOOL,
                f"there is no tool named {call.name!r} (the tools: "
                f"{', '.join(self._by_name) or 'none'})",
            )
        else:
            result = tool.call(call.arguments, tool.timeout_s or self._limits.tool_timeout_s)
        self._tool_seconds += time.monotonic() - start
        if result.verdict != ToolVerdict.OK:
            self._tool_errors[result.verdict.value] += 1
        return result

    def _end(
        self, end: EpisodeEnd, observation: Sequence[Message] = (), verdicts: Sequence[str] = ()
    ) -> StepResult:
        self._done = True
        return StepResult(tuple(observation), 0.0, True, {**self._info(verdicts), "end": end})

    def _info(self, verdicts: Sequence[str]) -> dict[str, Any]:
        return {
            "turn": self._turns,
            "tool_calls": self._tool_calls,
            "tool_errors": dict(self._tool_errors),
            "tool_seconds": self._tool_seconds,
            "verdicts": list(verdicts),
        }


def _tool_message(result: ToolResult, name: str = "", call_id: str = "") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "tool"}
    if name:
        message["name"] = name
    message["content"] = result.content
    if call_id:
        message["tool_call_id"] = call_id
    return message


def _prompt_messages(row: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    prompt, messages = row.get("prompt"), row.get("messages")
    if bool(prompt) == bool(messages):
        which = "both" if prompt else "neither"
        raise EnvironmentRowError(
            f"the row has {which} of 'prompt' and 'messages'; give exactly one (the prompt's "
            "text, or its chat messages [{'role': ..., 'content': ...}, ...])"
        )
    if prompt:
        if not isinstance(prompt, str):
            raise EnvironmentRowError(f"the row's 'prompt' must be text, got {prompt!r:.80}")
        chat = [{"role": "user", "content": prompt}]
    else:
        if isinstance(messages, str) or not isinstance(messages, Sequence):
            raise EnvironmentRowError(
                f"the row's 'messages' must be a list of messages, got {messages!r:.80}"
            )
        chat = []
        for i, message in enumerate(messages):
            if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)):
                raise EnvironmentRowError(
                    f"the row's messages[{i}] must be an object with a text 'role', got "
                    f"{message!r:.80}"
                )
            chat.append(dict(message))
    system = row.get("system_prompt") or ""
    if not isinstance(system, str):
        raise EnvironmentRowError(f"the row's 'system_prompt' must be text, got {system!r:.80}")
    if system and chat[0]["role"] != "system":
        chat.insert(0, {"role": "system", "content": system})
    return tuple(chat)


def _checked_tools(tools: Sequence[Tool]) -> tuple[Tool, ...]:
    tools = tuple(tools)
    for t in tools:
        if not isinstance(t, Tool):
            raise TypeError(
                f"tools must be Tool objects (make a function one with Tool.from_function or "
                f"@tool), got {t!r:.80}"
            )
    names = [t.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"two tools are named {repeated[0]!r}; the policy calls tools by name, so give "
            "each its own (Tool.from_function(fn, name=...))"
        )
    return tools


def _checked_on_tool_error(on_tool_error: str) -> str:
    if on_tool_error not in ON_TOOL_ERROR:
        raise ValueError(
            f"on_tool_error must be one of {', '.join(map(repr, ON_TOOL_ERROR))} (go on after "
            f"a failed tool call, or end the episode), got {on_tool_error!r}"
        )
    return on_tool_error
