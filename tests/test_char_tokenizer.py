"""Tests of the character-level demo tokenizer: layout, exact round trips, transformers parity."""

import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlax_tpu.data.char_tokenizer import PRINTABLE_ASCII, write_char_tokenizer
from rlax_tpu.data.tokenizer import Tokenizer

PROPERTY = settings(max_examples=60, deadline=None, derandomize=True)
printable_text = st.text(alphabet=PRINTABLE_ASCII, max_size=60)


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> str:
    return write_char_tokenizer(str(tmp_path_factory.mktemp("char_tokenizer")))


@pytest.fixture(scope="module")
def tokenizer(directory) -> Tokenizer:
    return Tokenizer.load(directory)


@pytest.fixture(scope="module")
def hf_tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def test_ids_are_specials_then_the_alphabet(tokenizer):
    assert tokenizer.vocab_size == 3 + len(PRINTABLE_ASCII) == 103
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.eos_token_ids == (2,)
    assert [tokenizer.id_to_token(i) for i in range(3, 103)] == list(PRINTABLE_ASCII)


def test_custom_alphabet_and_specials(tmp_path):
    tokenizer = Tokenizer.load(
        write_char_tokenizer(str(tmp_path), "0123456789+-= ", extra_special=("<p>", "<s>", "</s>"))
    )
    assert tokenizer.vocab_size == 3 + 14
    assert tokenizer.encode("12 + 30 = 42") == [4, 5, 16, 13, 16, 6, 3, 16, 15, 16, 7, 5]
    assert tokenizer.eos_token_id == 2 and tokenizer.id_to_token(2) == "</s>"


@PROPERTY
@given(printable_text)
def test_printable_text_round_trips_one_token_per_character(tokenizer, text):
    # A special token's text ("<eos>") is one id by design (the next test), not characters.
    assume(not any(tokenizer.id_to_token(i) in text for i in range(3)))
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)  # no BOS/EOS added, one token per character
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_and_can_be_skipped(tokenizer):
    ids = tokenizer.encode("<bos>a b<eos><pad>")
    a, space, b = (tokenizer.token_to_id(c) for c in "a b")
    assert ids == [1, a, space, b, 2, 0]
    assert tokenizer.decode(ids) == "<bos>a b<eos><pad>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a b"


def test_chat_template_renders_messages_as_lines(tokenizer):
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 17 + 25? Answer with just the number."},
    ]
    text = tokenizer.apply_chat_template(messages)
    assert text == "You add numbers.\nWhat is 17 + 25? Answer with just the number.\n"
    assert tokenizer.encode_chat(messages) == tokenizer.encode(text)


@PROPERTY
@given(printable_text)
def test_transformers_loads_it_and_encodes_identically(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert hf_tokenizer(text)["input_ids"] == ids
    assert hf_tokenizer.decode(ids) == text


def test_transformers_renders_the_same_chat_prompt(tokenizer, hf_tokenizer):
    messages = [{"role": "user", "content": "What is 3 - 1?"}]
    assert hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == tokenizer.apply_chat_template(messages)
    assert (hf_tokenizer.pad_token_id, hf_tokenizer.eos_token_id, len(hf_tokenizer)) == (0, 2, 103)


def test_characters_outside_the_alphabet_cannot_be_encoded(tmp_path, tokenizer):
    with pytest.raises(Exception, match="UNK"):
        tokenizer.encode("é")
    with_unk = Tokenizer.load(
        write_char_tokenizer(
            str(tmp_path), string.digits, extra_special=("<pad>", "<bos>", "<eos>", "<unk>")
        )
    )
    assert with_unk.encode("1é") == [5, 3]


@pytest.mark.parametrize(
    ("alphabet", "special", "message"),
    [
        ("", ("<pad>", "<bos>", "<eos>"), "must not be empty"),
        ("abca", ("<pad>", "<bos>", "<eos>"), "repeats the characters \\['a'\\]"),
        ("abc", ("<pad>", "<bos>"), "at least the pad, bos and eos"),
        ("abc", ("<pad>", "<pad>", "<eos>"), "distinct"),
        ("abc", ("a", "<bos>", "<eos>"), "also characters of the alphabet"),
    ],
)
def test_bad_alphabets_are_refused(tmp_path, alphabet, special, message):
    with pytest.raises(ValueError, match=message):
        write_char_tokenizer(str(tmp_path), alphabet, extra_special=special)


def test_written_to_and_loaded_from_gcs(gcs_bucket):
    directory = write_char_tokenizer(f"{gcs_bucket}/tokenizer", "ab")
    tokenizer = Tokenizer.load(directory)
    assert tokenizer.encode("ba") == [4, 3]
