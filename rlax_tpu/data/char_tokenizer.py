"""A character-level tokenizer for the tiny demo models: one token per character.

`write_char_tokenizer` saves a real Hugging Face tokenizer directory (tokenizer.json and
tokenizer_config.json with a plain-text chat template), so the demo loads it like any
checkpoint's tokenizer: with `rlax_tpu.data.tokenizer.Tokenizer` or transformers.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from rlax_tpu import storage
from rlax_tpu.data.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

# Digits, letters, punctuation and the whitespace " \t\n\r\x0b\x0c": 100 characters.
PRINTABLE_ASCII = string.printable
# Each message's content on its own line; the generation prompt adds nothing, so the model
# answers right after the last newline ("What is 17 + 25? ...\n" -> "42<eos>").
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{{ '\\n' }}{% endfor %}"

# The tool-use demo's tokenizer (model.tokenizer = "builtin:char_tools"): one more special
# token, the end of a turn; the call tags as single (not special) tokens, as Qwen's vocabulary
# has them; and a Hermes-style template: a turn's calls are
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> (as Qwen writes them, without its
# newlines), a turn ends with <|im_end|>, a tool's result is "\n=<result>\n", and the tools'
# names head the prompt. Prefix-preserving (TurnRenderer.check_prefix_preserving).
TOOLS_SPECIAL = ("<pad>", "<bos>", "<eos>", "<|im_end|>")
TOOLS_ADDED = ("<tool_call>", "</tool_call>")
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}{{ 'tools:' }}{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}"
    "{{ '\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- set f = c.function if c.function is defined else c %}"
    "{{ '<tool_call>' }}{{ {'name': f.name, 'arguments': f.arguments} | tojson }}"
    "{{ '</tool_call>' }}{%- endfor %}{{ '<|im_end|>' }}"
    "{%- elif m.role == 'tool' %}{{ '\\n=' + m.content + '\\n' }}"
    "{%- else %}{{ m.content + '\\n' }}{%- endif %}"
    "{%- endfor %}"
)


def char_tokenizer(
    alphabet: str = PRINTABLE_ASCII,
    *,
    extra_special: Sequence[str] = ("<pad>", "<bos>", "<eos>"),
    added: Sequence[str] = (),
) -> tokenizers.Tokenizer:
    """The `tokenizers` tokenizer: ids are the specials in order (pad=0, bos=1, eos=2), then
    the characters of `alphabet` in order, then the `added` tokens (multi-character tokens
    that are not special: decoding keeps them). Text outside the alphabet cannot be
    encoded."""
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(f"alphabet repeats the characters {repeated!r}")
    tokens = [*extra_special, *added]
    if len(set(tokens)) != len(tokens) or not all(tokens):
        raise ValueError(
            f"special and added tokens must be distinct and non-empty, got {extra_special!r}, "
            f"{added!r}"
        )
    clash = [t for t in tokens if t in alphabet and len(t) == 1]
    if clash:
        raise ValueError(f"tokens {clash!r} are also characters of the alphabet")
    vocab = {token: i for i, token in enumerate([*extra_special, *alphabet, *added])}
    # The unknown token is absent from the vocabulary on purpose: an unknown character is an
    # error rather than a silent placeholder the model was never trained on.
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    tokenizer.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in extra_special]
    )
    tokenizer.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in added])
    return tokenizer


def write_char_tokenizer(
    directory: str,
    alphabet: str = PRINTABLE_ASCII,
    *,
    extra_special: Sequence[str] = ("<pad>", "<bos>", "<eos>"),
    added: Sequence[str] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> str:
    """Save a character-level tokenizer to `directory` (local path or gs://) and return it.

    The first three of `extra_special` are the pad, bos and eos tokens (ids 0, 1, 2); no
    special tokens are added on encode, and the chat template (default) renders each
    message's content followed by a newline.
    """
    if len(extra_special) < 3:
        raise ValueError(
            f"extra_special needs at least the pad, bos and eos tokens, got {extra_special!r}"
        )
    tokenizer = char_tokenizer(alphabet, extra_special=extra_special, added=added)
    pad, bos, eos = extra_special[:3]
    decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in extra_special,
        }
        for token in (*extra_special, *added)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "pad_token": pad,
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # decoding must give back the exact text
        "model_max_length": 1_000_000,
        "chat_template": chat_template,
    }
    storage.makedirs(directory)
    storage.write_text(storage.join(directory, TOKENIZER_FILE), tokenizer.to_str(pretty=True))
    storage.write_text(
        storage.join(directory, TOKENIZER_CONFIG_FILE), json.dumps(config, indent=2) + "\n"
    )
    return directory


def write_char_tools_tokenizer(directory: str) -> str:
    """The tool-use demo's tokenizer (`builtin:char_tools`) saved to `directory`."""
    return write_char_tokenizer(
        directory, extra_special=TOOLS_SPECIAL, added=TOOLS_ADDED, chat_template=TOOLS_CHAT_TEMPLATE
    )
