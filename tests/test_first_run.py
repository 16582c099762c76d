"""What a new user meets first with a Hugging Face checkpoint and a dataset of their own
(issue 20): the model config from the checkpoint, datasets in their own layout, prompts
rendered by the chat template, every EOS stopping generation, the SFT warm start on chat
rows, no silent truncation, and a run identity that lets a run be extended."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hf_fixtures import save_qwen_checkpoint

from rlax_tpu.cli import main as cli_main
from rlax_tpu.config import ConfigError, DatasetConfig, RunConfig, load_config
from rlax_tpu.config.checkpoint import resolve_checkpoint_model
from rlax_tpu.controller.warm_start import sft_rows
from rlax_tpu.data.datasets import (
    DatasetError,
    encode_prompt,
    load_dataset,
    load_eval_prompts,
    load_prompts,
    prompt_tokens,
    stop_tokens,
)
from rlax_tpu.data.tokenizer import Tokenizer
from rlax_tpu.run_dir import prepare_run_dir

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n"
        "#### 72",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes "
        "of babysitting. How much did she earn?",
        "answer": "Weng earns 12/60 = $0.2 per minute.\nShe earned 0.2 x 50 = $10.\n#### 10",
        "level": 2,
    },
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_qwen_checkpoint(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint) -> Tokenizer:
    return Tokenizer.load(checkpoint)


def _gsm8k(tmp_path, rows=GSM8K_ROWS, name="gsm8k.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config_file(tmp_path, body: str) -> str:
    path = tmp_path / "config.py"
    path.write_text(
        "from rlax_tpu.config import *\n\n\ndef get_config():\n    return " + body + "\n"
    )
    return str(path)


# -- the model config from the checkpoint ---------------------------------------------------------
def test_hf_checkpoint_alone_fills_the_architecture(tmp_path, checkpoint):
    path = _config_file(tmp_path, "RunConfig(model=ModelConfig(hf_checkpoint=CHECKPOINT))")
    path_text = open(path).read().replace("CHECKPOINT", repr(checkpoint))
    open(path, "w").write(path_text)
    config = load_config(path)
    hf = json.load(open(f"{checkpoint}/config.json"))
    assert config.model.architecture == "Qwen2ForCausalLM"
    assert config.model.vocab_size == hf["vocab_size"]
    assert config.model.intermediate_size == hf["intermediate_size"] == 96
    assert config.model.qkv_bias and config.model.tie_word_embeddings
    assert config.model.rope_theta == 1000.0  # transformers v5 keeps it in rope_parameters
    assert resolve_checkpoint_model(config) == config  # idempotent: a resume resolves again


def test_a_conflicting_architecture_field_is_named_with_both_values(checkpoint):
    config = RunConfig().override("model.hf_checkpoint", checkpoint)
    config = config.override("model.num_layers", "5").override("model.hidden_size", "128")
    assert resolve_checkpoint_model(config) == config  # spelled out: no storage call here
    with pytest.raises(ConfigError) as e:
        resolve_checkpoint_model(config, strict=True)  # a run's start checks it
    message = str(e.value)
    assert "model.num_layers=5 (the checkpoint has 2)" in message
    assert "model.hidden_size=128 (the checkpoint has 64)" in message


def test_overridable_fields_keep_the_configs_value(checkpoint):
    config = RunConfig().override("model.hf_checkpoint", checkpoint)
    config = config.override("model.max_position_embeddings", "512")
    resolved = resolve_checkpoint_model(config)
    assert resolved.model.max_position_embeddings == 512  # the checkpoint says 256
    assert resolved.model.hidden_size == 64


def test_a_wrong_checkpoint_path_is_one_line_not_a_traceback(tmp_path, capsys):
    path = _config_file(tmp_path, "RunConfig(model=ModelConfig(hf_checkpoint='/no/such/model'))")
    code = cli_main(["run", path, "--set", f"storage.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "model.hf_checkpoint" in err and "/no/such/model/config.json does not exist" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "config.sha256").exists()


# -- datasets in their own layout, rendered by the chat template -----------------------------------
def test_gsm8k_fields_map_and_the_rest_is_metadata(tmp_path):
    config = DatasetConfig(path=_gsm8k(tmp_path), prompt_field="question", answer_field="answer")
    records = load_dataset(config)
    assert records[0].prompt.startswith("Natalia sold clips")
    assert records[0].reference.endswith("#### 72")
    assert records[1].metadata == {"level": 2} and records[0].metadata == {}


def test_gsm8k_without_a_mapping_names_the_rows_fields_and_the_fix(tmp_path):
    with pytest.raises(DatasetError, match="fields are: answer, question.*prompt_field=question"):
        load_dataset(DatasetConfig(path=_gsm8k(tmp_path)))


def test_text_prompts_go_through_the_chat_template(tmp_path, tokenizer):
    config = DatasetConfig(path=_gsm8k(tmp_path), prompt_field="question")
    record = load_dataset(config)[0]
    text = tokenizer.decode(list(prompt_tokens(tokenizer, record)))
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert "<|im_start|>user\nNatalia sold clips" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = load_dataset(dataclasses.replace(config, apply_chat_template=False))[0]
    assert tokenizer.decode(list(prompt_tokens(tokenizer, plain))) == record.prompt


def test_system_prompt_and_template_kwargs_reach_the_template(tmp_path, tokenizer):
    config = DatasetConfig(
        path=_gsm8k(tmp_path),
        prompt_field="question",
        system_prompt="Put the final answer after ####.",
        chat_template_kwargs='{"enable_thinking": false}',
    )
    text = tokenizer.decode(list(prompt_tokens(tokenizer, load_dataset(config)[0])))
    assert text.startswith("<|im_start|>system\nPut the final answer after ####.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_kwargs_must_be_a_json_object():
    with pytest.raises(ConfigError, match="chat_template_kwargs"):
        DatasetConfig(path="x.jsonl", chat_template_kwargs="enable_thinking=false")


def test_every_eos_of_the_checkpoint_stops_generation(tokenizer):
    # generation_config.json names <|im_end|> and <|endoftext|>; the tokenizer only the first.
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    assert set(stop_tokens((), tokenizer)) == {tokenizer.eos_token_id, endoftext}
    assert stop_tokens((7,), tokenizer) == (7,)


# -- the SFT warm start on chat rows --------------------------------------------------------------
def test_sft_rows_of_chat_rows_train_on_the_answer_after_the_template(tmp_path, tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
        for r in GSM8K_ROWS
    ]
    records = load_dataset(DatasetConfig(path=_gsm8k(tmp_path, rows)))
    config = RunConfig().override("trainer.max_seq_len", "256")
    tokens, targets, mask = sft_rows(config, tokenizer, records)
    for i, record in enumerate(records):
        prompt = prompt_tokens(tokenizer, record)
        answer = tokenizer.encode(record.reference, add_special_tokens=False)
        assert list(tokens[i, : len(prompt)]) == list(prompt)
        trained = targets[i][mask[i] > 0]
        assert list(trained) == [*answer, tokenizer.eos_token_id]


def test_sft_rows_refuse_a_row_over_max_seq_len(tmp_path, tokenizer):
    records = load_dataset(DatasetConfig(path=_gsm8k(tmp_path), prompt_field="question"))
    config = RunConfig().override("inference.max_prompt_len", "16")
    config = config.override("inference.max_new_tokens", "16")
    config = config.override("trainer.max_seq_len", "40")  # no room for a whole row
    with pytest.raises(DatasetError, match="trainer.max_seq_len=40"):
        sft_rows(config, tokenizer, records)


# -- a worked solution as the SFT target (sft_field) ----------------------------------------------
SOLVED_ROWS = [
    {"prompt": "What is 2 + 3?", "answer": "5", "solution": "qzx = 5"},
    {"prompt": "What is 7 - 1?", "answer": "6", "solution": "abcdefghijklmnop = 6"},
]


@pytest.fixture(scope="module")
def char(tmp_path_factory) -> Tokenizer:
    from rlax_tpu.data.char_tokenizer import write_char_tokenizer

    directory = tmp_path_factory.mktemp("char")
    write_char_tokenizer(str(directory))
    return Tokenizer.load(str(directory))


def test_the_sft_field_is_the_warm_starts_target_and_the_reference_stays_the_answer(tmp_path, char):
    config = DatasetConfig(path=_gsm8k(tmp_path, SOLVED_ROWS), sft_field="solution")
    records = load_dataset(config)
    assert [(r.reference, r.sft_text) for r in records] == [
        ("5", "qzx = 5"),
        ("6", "abcdefghijklmnop = 6"),
    ]
    assert all(r.metadata == {} for r in records)  # the solution is no reward metadata
    tokens, targets, mask = sft_rows(RunConfig(), char, records)
    for i, row in enumerate(SOLVED_ROWS):
        assert list(targets[i][mask[i] > 0]) == [*char.encode(row["solution"]), char.eos_token_id]
    plain = load_dataset(DatasetConfig(path=config.path))  # without it: the reference
    assert [r.sft_text for r in plain] == ["5", "6"]
    assert [r.sft_target for r in plain] == ["", ""]


def test_a_row_without_its_sft_field_is_refused_but_the_held_out_set_needs_none(tmp_path, char):
    rows = [SOLVED_ROWS[0], {"prompt": "What is 1 + 1?", "answer": "2"}]
    with pytest.raises(DatasetError, match="row 1.*has no 'solution'"):
        load_dataset(DatasetConfig(path=_gsm8k(tmp_path, rows), sft_field="solution"))
    config = RunConfig(
        data=DatasetConfig(path=_gsm8k(tmp_path, SOLVED_ROWS), sft_field="solution")
    ).override("controller.eval_dataset", _gsm8k(tmp_path, rows[1:], "test.jsonl"))
    (record,) = load_eval_prompts(config, char)
    assert record.reference == "2" and record.sft_text == "2"


def test_the_datasets_scan_measures_the_sft_target_against_max_seq_len(tmp_path, char):
    config = RunConfig(
        data=DatasetConfig(path=_gsm8k(tmp_path, SOLVED_ROWS), sft_field="solution"),
        storage=RunConfig().storage.override("run_dir", str(tmp_path / "run")),
    ).apply_overrides(
        [
            "trainer.warm_start.steps=1",
            "inference.max_prompt_len=16",
            "inference.max_new_tokens=16",
            "trainer.max_seq_len=32",  # 15 + 7 + 1 fit; 15 + 20 + 1 do not
        ]
    )
    with pytest.raises(DatasetError, match=r"SFT target, EOS\): gsm8k:1 \(36\)"):
        load_prompts(config, char)
    records, _, _ = load_prompts(config.override("trainer.max_seq_len", "48"), char)
    assert len(records["gsm8k"]) == 2


# -- no silent truncation -------------------------------------------------------------------------
def test_prompt_plus_response_must_fit_the_trainers_sequence():
    with pytest.raises(ConfigError, match=r"trainer.max_seq_len: 96 cannot hold.*=192"):
        RunConfig().override("inference.max_new_tokens", "64").override("trainer.max_seq_len", "96")


def _scan_config(tmp_path, path: str, **controller) -> RunConfig:
    config = RunConfig(
        data=DatasetConfig(path=path, prompt_field="question"),
        storage=RunConfig().storage.override("run_dir", str(tmp_path / "run")),
    )
    for key, value in controller.items():
        config = config.override(f"controller.{key}", value)
    return config


def test_overlong_prompts_stop_the_start_with_the_rows_and_the_set(tmp_path, tokenizer):
    config = _scan_config(tmp_path, _gsm8k(tmp_path))  # max_prompt_len 128
    lengths = [len(prompt_tokens(tokenizer, r)) for r in load_dataset(config.data)]
    assert max(lengths) > 128  # the fixture's BPE is coarse: GSM8K rows are long
    with pytest.raises(DatasetError) as e:
        load_prompts(config, tokenizer)
    message = str(e.value)
    assert "gsm8k:0" in message and "inference.max_prompt_len=128" in message
    fix = [w.split("=", 1) for w in message.split("--set ")[1:] if "=" in w]
    sets = [f"{k}={v.split()[0].rstrip('.')}" for k, v in fix if k != "controller.overlong_prompts"]
    fitted = config.apply_overrides(sets)  # the --set it names makes the config valid...
    records, _, scans = load_prompts(fitted, tokenizer)  # ...and every prompt fit
    assert len(records["gsm8k"]) == 2 and scans["gsm8k"].dropped == 0


def test_overlong_prompts_dropped_on_request_and_counted(tmp_path, tokenizer):
    long = {"question": "How many clips? " * 100, "answer": "#### 1"}
    rows = [long, {"question": "What is 2 + 3?", "answer": "#### 5"}, long | {"id": "x"}]
    config = _scan_config(tmp_path, _gsm8k(tmp_path, rows), overlong_prompts="drop")
    records, _, scans = load_prompts(config, tokenizer)
    assert [r.prompt for r in records["gsm8k"]] == ["What is 2 + 3?"]
    assert scans["gsm8k"].dropped == 2
    assert [i for i, _ in scans["gsm8k"].overlong] == ["gsm8k:0", "x"]
    for record in records["gsm8k"]:  # what is left is sent whole
        encode_prompt(tokenizer, record, config.inference.max_prompt_len)


def test_eval_prompts_use_the_training_datasets_mapping(tmp_path, tokenizer):
    rows = [{"question": "What is 2 + 3?", "answer": "#### 5"}]
    config = _scan_config(tmp_path, _gsm8k(tmp_path, rows))
    config = config.override("controller.eval_dataset", _gsm8k(tmp_path, rows, "test.jsonl"))
    (record,) = load_eval_prompts(config, tokenizer)
    assert record.prompt == "What is 2 + 3?" and record.reference == "#### 5"


# -- a run's identity -----------------------------------------------------------------------------
def test_resumable_knobs_leave_the_identity_and_results_knobs_do_not():
    base = RunConfig()
    for key, value in [
        ("controller.num_steps", "99"),
        ("controller.eval_every", "5"),
        ("trainer.checkpoint_every", "2"),
        ("deploy.image", "rlax-tpu:v2"),
        ("inference.prefetch_weights", "false"),
    ]:
        assert base.override(key, value).digest() == base.digest(), key
    for key, value in [("seed", "1"), ("trainer.optimizer.learning_rate", "2e-6")]:
        assert base.override(key, value).digest() != base.digest(), key
    # num_steps is the decay horizon of a cosine schedule unless lr_decay_steps is set.
    cosine = base.override("trainer.optimizer.lr_schedule", "cosine")
    assert cosine.override("controller.num_steps", "99").digest() != cosine.digest()
    fixed = cosine.override("trainer.optimizer.lr_decay_steps", "50")
    assert fixed.override("controller.num_steps", "99").digest() == fixed.digest()


def test_run_dir_takes_an_extension_and_a_correction_before_progress(tmp_path):
    run_dir = str(tmp_path / "run")
    config = RunConfig().override("storage.run_dir", run_dir)
    prepare_run_dir(config, report=lambda _: None)
    # A failed start left only the dump: a corrected config takes the directory.
    corrected = config.override("trainer.optimizer.learning_rate", "3e-6")
    prepare_run_dir(corrected, report=lambda _: None)
    assert (
        json.load(open(f"{run_dir}/config.json"))["trainer"]["optimizer"]["learning_rate"] == 3e-6
    )
    (tmp_path / "run" / "snapshots").mkdir()
    (tmp_path / "run" / "snapshots" / "snapshot_000000000.json").write_text("{}")
    with pytest.raises(ConfigError, match="may change only controller.num_steps"):
        prepare_run_dir(config, report=lambda _: None)
    longer = corrected.override("controller.num_steps", "20")
    prepare_run_dir(longer, report=lambda _: None)  # an extension continues the run
    assert json.load(open(f"{run_dir}/config.json"))["controller"]["num_steps"] == 20


def test_sft_rows_shape_is_unchanged_for_plain_prompts(tmp_path):
    """The demo's character tokenizer has no template: its rows stay plain text."""
    from rlax_tpu.data.char_tokenizer import write_char_tokenizer

    write_char_tokenizer(str(tmp_path / "tok"))
    char = Tokenizer.load(str(tmp_path / "tok"))
    records = load_dataset(
        DatasetConfig(path=_gsm8k(tmp_path, [{"prompt": "1+2=", "answer": "3"}]))
    )
    tokens, _, mask = sft_rows(RunConfig(), char, records)
    assert list(tokens[0, :4]) == char.encode("1+2=") and np.sum(mask) == 2  # "3" and EOS


def test_math_problem_field_as_the_prompt_is_no_test_link(tmp_path):
    rows = [{"problem": "Find $x$ if $x+1=3$.", "solution": "So $x=\\boxed{2}$."}]
    config = DatasetConfig(
        path=_gsm8k(tmp_path, rows, "math.jsonl"), prompt_field="problem", answer_field="solution"
    )
    (record,) = load_dataset(config)
    assert record.prompt == rows[0]["problem"] and record.problem == ""
    assert record.reference == rows[0]["solution"] and record.metadata == {}


def test_a_spelled_out_architecture_needs_no_reachable_checkpoint(tmp_path, checkpoint):
    """Pod configs name gs:// checkpoints a laptop cannot read: compile and deploy still work
    from their spelled-out architecture; a run checks the weights are there."""
    config = RunConfig().override("model.hf_checkpoint", str(tmp_path / "elsewhere"))
    config = config.override("model.hidden_size", "128").override("model.num_layers", "3")
    assert resolve_checkpoint_model(config) == config
    with pytest.raises(ConfigError, match="elsewhere/config.json does not exist"):
        resolve_checkpoint_model(config, strict=True)
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text(open(f"{checkpoint}/config.json").read())
    config = RunConfig().override("model.hf_checkpoint", str(weightless))
    assert resolve_checkpoint_model(config).model.hidden_size == 64
    with pytest.raises(ConfigError, match="no weights"):
        resolve_checkpoint_model(config, strict=True)


def test_connect_takes_the_configs_verifier_address_after_flags_and_environment():
    from rlax_tpu.launch.remote import ADDRESS_ENV, ComponentAddresses

    given = dict(param_server=["ps:1"], trainer="tr:2", inference=["in:3"])
    fallback = {
        "verifier": RunConfig().override("verifiers.address", "v:4,w:5").verifiers.addresses()
    }
    assert ComponentAddresses.resolve(**given, environ={}, fallback=fallback).verifier == (
        "v:4",
        "w:5",
    )
    env = {ADDRESS_ENV["verifier"]: "e:6"}
    assert ComponentAddresses.resolve(**given, environ=env, fallback=fallback).verifier == ("e:6",)
    flagged = ComponentAddresses.resolve(**given, verifier=["f:7"], environ=env, fallback=fallback)
    assert flagged.verifier == ("f:7",)
