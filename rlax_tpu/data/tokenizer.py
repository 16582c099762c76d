"""The tokenizer of a Hugging Face checkpoint, without transformers: tokenizer.json through the
`tokenizers` library, special tokens and the chat template from tokenizer_config.json (or
chat_template.jinja, which transformers v5 writes), read from a local directory or gs://.

Encoding, decoding and chat rendering match transformers' `PreTrainedTokenizerFast`
exactly: the chat template runs in the same sandboxed Jinja environment (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, a JSON `tojson`, `strftime_now`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors

from rlax_tpu import storage

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"

# The named special tokens transformers passes to every chat template.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Names a message's reasoning may come under; templates read `reasoning_content` or `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

Message = Mapping[str, Any]


class TokenizerError(ValueError):
    """A tokenizer directory is missing files or holds something this class cannot use."""


class ChatTemplateError(TokenizerError):
    """The chat template is missing, or it failed (e.g. its own `raise_exception`)."""


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt, for one model.

    Build with `Tokenizer.load(path)`; `path` is a directory (local or gs://) holding
    tokenizer.json and optionally tokenizer_config.json, chat_template.jinja and
    generation_config.json (whose eos_token_id adds stop tokens to `eos_token_ids`).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any] | None = None,
        *,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        config = dict(config or {})
        self._backend = backend
        # As transformers: padding and truncation are per call, and off by default.
        backend.no_truncation()
        backend.no_padding()
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_content(config.get(name))
            if token is not None:
                self.special_tokens[name] = token
        missing = [t for t in self.special_tokens.values() if backend.token_to_id(t) is None]
        if missing:  # transformers adds named special tokens the vocabulary lacks
            backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in missing])
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            self._set_post_processor(
                bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False))
            )
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"  # transformers skips the cleanup for BPE
        )
        if chat_template is None:
            chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # the older multi-template layout
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default")
        self.chat_template: str | None = chat_template
        self._compiled_template: jinja2.Template | None = None
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """The tokenizer stored in the directory `path` (local path, file:// or gs://)."""
        tokenizer_url = storage.join(path, TOKENIZER_FILE)
        if not storage.exists(tokenizer_url):
            raise TokenizerError(
                f"{tokenizer_url} does not exist; a tokenizer directory needs {TOKENIZER_FILE} "
                "(save one with transformers' tokenizer.save_pretrained)"
            )
        backend = tokenizers.Tokenizer.from_str(storage.read_text(tokenizer_url))
        config = _read_json(storage.join(path, TOKENIZER_CONFIG_FILE)) or {}
        template_url = storage.join(path, CHAT_TEMPLATE_FILE)
        chat_template = storage.read_text(template_url) if storage.exists(template_url) else None
        generation = _read_json(storage.join(path, GENERATION_CONFIG_FILE)) or {}
        extra_eos = generation.get("eos_token_id")
        if extra_eos is None:
            extra_eos = []
        elif isinstance(extra_eos, int):
            extra_eos = [extra_eos]
        return cls(backend, config, chat_template=chat_template, extra_eos_token_ids=extra_eos)

    # -- vocabulary ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    # -- text ---------------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens applies the tokenizer's template (e.g. BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        add_generation_prompt (default True here, since prompts are for generation) appends
        the assistant header. Extra keyword arguments reach the template (e.g. tools,
        enable_thinking). Keys whose value is None are dropped from messages, as transformers
        does.
        """
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        template = self._template()
        chat = [
            _alias_reasoning({k: _plain(v) for k, v in m.items() if v is not None})
            for m in messages
        ]
        kwargs = {
            "tools": None,
            "documents": None,
            **self.special_tokens,
            **{k: _plain(v) for k, v in template_kwargs.items()},
        }
        try:
            return template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of `apply_chat_template(...)`; the template writes its own special tokens,
        so none are added (as transformers' apply_chat_template(tokenize=True))."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    # -- internals ----------------------------------------------------------------------------
    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            if not self.chat_template:
                raise ChatTemplateError(
                    f"this tokenizer has no chat template (neither {CHAT_TEMPLATE_FILE} nor "
                    f"chat_template in {TOKENIZER_CONFIG_FILE})"
                )
            self._compiled_template = compile_chat_template(self.chat_template)
        return self._compiled_template

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """transformers' `update_post_processor`: BOS/EOS around every sequence as configured."""
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = (
            f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1"
            f"{(' ' + eos + ':1') if add_eos else ''}"
        )
        special = []
        if add_bos:
            special.append((bos, self._backend.token_to_id(bos)))
        if add_eos:
            special.append((eos, self._backend.token_to_id(eos)))
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )


# -- the chat template environment ------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers that some
    templates carry) and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes, got {name!r}"
            )


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in the environment transformers uses (untrusted code: the
    environment is sandboxed and immutable)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


# -- helpers ----------------------------------------------------------------------------------


def _read_json(url: str) -> dict[str, Any] | None:
    if not storage.exists(url):
        return None
    try:
        return json.loads(storage.read_text(url))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{url} is not valid JSON: {e}") from None


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """Template inputs rebuilt from plain JSON types (the sandbox cannot vet other objects'
    methods); anything else becomes an inert "<TypeName>" placeholder, as in transformers."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under every name templates read it by, as transformers does."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _clean_up_tokenization(text: str) -> str:
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )
