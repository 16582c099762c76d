"""rlax_tpu.data.tokenizer against transformers' PreTrainedTokenizerFast on the same files.

A tiny byte-level BPE is trained in the test (deterministic), wrapped in transformers with a
Llama-3-style template (BOS from the post-processor, whitespace shaped by trim_blocks and
lstrip_blocks) or a Qwen-style one (no BOS, tools rendered with tojson), saved with
save_pretrained, and loaded by both sides: token ids and rendered prompts must be identical.
"""

from __future__ import annotations

import json

import pytest
import transformers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rlax_tpu import storage
from rlax_tpu.data.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from verifiable rewards trains the policy on math and code.",
    "What is 12 + 30? The answer is 42.",
    "def add(a, b):\n    return a + b\n",
    "Café naïve résumé — unicode survives byte-level BPE.",
    "You are a helpful assistant. Think step by step.",
] * 4

LLAMA_TEMPLATE = """{{ bos_token }}{% for message in messages %}
    {% if message['role'] == 'system' and not loop.first %}
        {{ raise_exception('The system message must come first') }}
    {% endif %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}
{{ message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{% endif %}"""

QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.' }}
{%- endif %}
{%- if tools %}
    {{- '\\n<tools>' }}
    {%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}
    {{- '\\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

STYLES = {
    "llama3": dict(
        specials=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        template=LLAMA_TEMPLATE,
        jinja_file=True,
    ),
    "qwen": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        template=QWEN_TEMPLATE,
        jinja_file=False,  # the template stays inside tokenizer_config.json
    ),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [
        {"role": "system", "content": "  Think step by step.  "},
        {"role": "user", "content": "Add 2 and 3.\n"},
        {"role": "assistant", "content": "The answer is 5."},
        {"role": "user", "content": "Café? <|im_end|> déjà vu"},
    ],
]
TEXTS = [
    "The quick brown fox",
    "  leading spaces and trailing  ",
    "unicode: naïve — 数学",
    "text with <|eot_id|> and <|im_end|> inside",
    "",
]


def _train_backend(specials: list[str], bos: str | None) -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, backend.token_to_id(bos))],
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


@pytest.fixture(scope="module", params=list(STYLES))
def saved(request, tmp_path_factory):
    """(style name, transformers tokenizer loaded back from disk, directory)."""
    style = STYLES[request.param]
    backend = _train_backend(style["specials"], style["bos"])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=style["bos"],
        eos_token=style["eos"],
        pad_token=style["pad"],
        chat_template=style["template"],
    )
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, save_jinja_files=style["jinja_file"])
    assert (path / "chat_template.jinja").exists() == style["jinja_file"]
    reference = transformers.AutoTokenizer.from_pretrained(path)
    return request.param, reference, str(path)


@pytest.fixture(scope="module")
def ours(saved):
    return Tokenizer.load(saved[2])


def test_training_is_deterministic():
    specials = STYLES["qwen"]["specials"]
    a = _train_backend(specials, None).to_str()
    assert a == _train_backend(specials, None).to_str()


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(saved, ours, add_special_tokens):
    _, reference, _ = saved
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected


def test_bos_is_added_only_by_llama_style(saved, ours):
    style, _, _ = saved
    ids = ours.encode("hello", add_special_tokens=True)
    assert (ids[0] == ours.bos_token_id) == (style == "llama3")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(saved, ours, skip_special_tokens):
    _, reference, _ = saved
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=True)
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_special_token_ids_match_transformers(saved, ours):
    _, reference, _ = saved
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_id == reference.eos_token_id
    assert ours.pad_token_id == reference.pad_token_id
    assert ours.eos_token_ids == (reference.eos_token_id,)
    assert ours.vocab_size == len(reference)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(saved, ours, conversation, add_generation_prompt):
    _, reference, _ = saved
    messages = CONVERSATIONS[conversation]
    expected = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == (
        expected
    )
    expected_ids = reference.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids


def test_template_kwargs_reach_the_template(saved, ours):
    style, reference, _ = saved
    tools = [{"name": "calc", "description": "Évalue <expr> & rend le résultat"}]
    messages = CONVERSATIONS[0]
    expected = reference.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert ours.apply_chat_template(messages, tools=tools) == expected
    if style == "qwen":  # its template renders tools, with JSON (not HTML-escaped) text
        assert '"Évalue <expr> & rend le résultat"' in expected


def test_raise_exception_in_template_is_a_chat_template_error():
    style = STYLES["llama3"]
    backend = _train_backend(style["specials"], style["bos"])
    tokenizer = Tokenizer(backend, {"bos_token": style["bos"]}, chat_template=LLAMA_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatTemplateError, match="system message must come first"):
        tokenizer.apply_chat_template(messages)


def test_generation_config_adds_stop_tokens(saved, tmp_path):
    _, _, path = saved
    storage.copy_tree(path, str(tmp_path))
    base = Tokenizer.load(path)
    extra = base.token_to_id(STYLES["llama3"]["specials"][1]) or 0
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [base.eos_token_id, extra]})
    )
    assert Tokenizer.load(str(tmp_path)).eos_token_ids == tuple(
        dict.fromkeys([base.eos_token_id, extra])
    )


def test_loads_from_gcs(saved, ours, gcs_bucket):
    _, _, path = saved
    remote = storage.join(gcs_bucket, "tokenizer")
    storage.copy_tree(path, remote)
    from_gcs = Tokenizer.load(remote)
    messages = CONVERSATIONS[1]
    assert from_gcs.chat_template == ours.chat_template
    assert from_gcs.encode_chat(messages) == ours.encode_chat(messages)


def test_missing_tokenizer_json_is_reported(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.load(str(tmp_path))


def test_missing_chat_template_is_reported(saved, tmp_path):
    _, _, path = saved
    (tmp_path / "tokenizer.json").write_text(
        storage.read_text(storage.join(path, "tokenizer.json"))
    )
    tokenizer = Tokenizer.load(str(tmp_path))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])
