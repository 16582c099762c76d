"""Held out means held out (issue 36): the demo's evaluation problems are never training
problems, for every shipped config and seed; every run, eval and prefilter measures the
overlap of its held-out set with its training data and stops over
controller.max_eval_overlap, naming the datasets and the knob."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rlax_tpu.cli import main
from rlax_tpu.config import load_config
from rlax_tpu.data.char_tokenizer import write_char_tokenizer
from rlax_tpu.data.datasets import (
    DatasetError,
    PromptRecord,
    check_eval_overlap,
    eval_overlap,
    load_dataset,
    normalised_problem,
)
from rlax_tpu.data.tokenizer import Tokenizer
from rlax_tpu.launch import job

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_WITH_BUILTIN_HELD_OUT = sorted(
    path
    for path in (ROOT / "configs").glob("*.py")
    if load_config(str(path)).controller.eval_dataset == job.BUILTIN_ARITHMETIC
)
TINY = str(ROOT / "configs" / "tiny_cpu.py")


def test_the_demo_configs_are_the_ones_checked():
    assert {p.name for p in SHIPPED_WITH_BUILTIN_HELD_OUT} >= {
        "tiny_cpu.py",
        "tiny_cpu_off_policy.py",
        "tiny_cpu_one_step_off_policy.py",
    }


@pytest.mark.parametrize("path", SHIPPED_WITH_BUILTIN_HELD_OUT, ids=lambda p: p.stem)
def test_the_demo_evaluates_only_problems_it_never_trains_on(path, tmp_path):
    for seed in range(5):
        config = load_config(str(path), [f"seed={seed}", f"storage.run_dir={tmp_path / str(seed)}"])
        effective = job.materialise(config)
        trained = {
            normalised_problem(r) for d in effective.controller.datasets for r in load_dataset(d)
        }
        eval_file = dataclasses.replace(
            effective.controller.datasets[0], path=effective.controller.eval_dataset
        )
        asked = [normalised_problem(r) for r in load_dataset(eval_file)]
        assert len(asked) >= config.controller.eval_size
        assert len(set(asked)) == len(asked), "a held-out problem is asked twice"
        # Exact matches are normalised matches too: none of either.
        assert not trained & set(asked), f"seed {seed}: held-out problems are training problems"


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("char")
    write_char_tokenizer(str(directory))
    return Tokenizer.load(str(directory))


def _record(i: int, prompt: str, dataset: str = "d") -> PromptRecord:
    return PromptRecord(dataset=dataset, id=f"{dataset}:{i}", prompt=prompt, verifier="none")


def test_overlap_counts_the_same_prompt_and_the_same_problem_written_otherwise(char_tokenizer):
    training = {"train": [_record(0, "What is 2 + 3?"), _record(1, "What is 4 + 4?")]}
    held_out = [
        _record(0, "What is 2 + 3?", "eval"),  # the same prompt
        _record(1, "what is 4  +  4?", "eval"),  # the same problem: case and spaces
        _record(2, "What is 4 + 5?", "eval"),  # digits are kept: another problem
        _record(3, "What is 2 + 3?", "eval"),  # asked twice
    ]
    overlap = eval_overlap("eval", held_out, training, char_tokenizer)
    assert (overlap.prompts, overlap.distinct, overlap.exact, overlap.normalised) == (4, 3, 2, 3)
    assert overlap.fraction == 0.75 and overlap.examples == ("eval:0", "eval:1", "eval:3")
    with pytest.raises(DatasetError) as info:
        check_eval_overlap(overlap, 0.5)
    message = str(info.value)
    assert "'eval' is not held out: 3 of its 4 prompts (75.0%)" in message
    assert "'train'" in message and "--set controller.max_eval_overlap=0.75" in message
    check_eval_overlap(overlap, 0.75)  # accepted at the knob


def test_chat_prompts_compare_by_their_messages(char_tokenizer):
    chat = PromptRecord(
        dataset="d",
        id="c",
        messages=({"role": "user", "content": "What is 2 + 3?"},),
        verifier="none",
    )
    overlap = eval_overlap("eval", [chat], {"train": [_record(0, "WHAT IS 2+3?")]}, char_tokenizer)
    assert overlap.normalised == 1


def _same_file_sets(tmp_path: Path) -> list[str]:
    """The tiny config evaluating on its own training file."""
    data = tmp_path / "train.jsonl"
    rows = [
        {"prompt": f"What is {a} + 1? Answer with just the number.", "answer": str(a + 1)}
        for a in range(8)
    ]
    data.write_text("".join(json.dumps({**r, "verifier": "arithmetic"}) + "\n" for r in rows))
    return [
        f'controller.datasets=[{{"path": "{data}", "verifier": "arithmetic"}}]',
        f"controller.eval_dataset={data}",
        "controller.eval_size=8",
        f"storage.run_dir={tmp_path / 'run'}",
    ]


def test_a_run_evaluating_on_its_training_file_is_stopped_before_it_starts(tmp_path, capsys):
    sets = [x for s in _same_file_sets(tmp_path) for x in ("--set", s)]
    assert main(["run", TINY, *sets]) == 1
    err = capsys.readouterr().err
    assert "is not held out: 8 of its 8 prompts (100.0%)" in err, err
    assert "--set controller.max_eval_overlap=1" in err
    # Nothing started, nothing of the run's identity written (only the built-in tokenizer).
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["tokenizer"]
    assert main(["eval", TINY, *sets, "--model", str(tmp_path / "none")]) == 2
    assert "is not held out" in capsys.readouterr().err


def test_with_the_knob_raised_the_inputs_are_accepted_and_the_overlap_recorded(tmp_path):
    config = load_config(TINY, [*_same_file_sets(tmp_path), "controller.max_eval_overlap=1"])
    _, _, _, (_, held_out, overlap), scans = job._inputs(config)
    assert len(held_out) == 8 and overlap.fraction == 1.0
    assert scans[job.HELD_OUT].to_json()["normalised"] == 8


def test_the_overlap_knob_is_a_fraction():
    config = load_config(TINY)
    with pytest.raises(ValueError, match="max_eval_overlap"):
        dataclasses.replace(config.controller, max_eval_overlap=1.5)
