"""`rlax-tpu prefilter` end to end: the run's components (launcher, parameter server, trainer,
inference worker, verifier service) score a tiny arithmetic dataset with a checkpoint.

The checkpoint is built, not trained: every layer is zero and every embedding row the same,
so the model answers every prompt from one fixed distribution over its first token
("1": 0.6, "2": 0.3, "3": 0.1). With one response token, prompts whose answer is 1, 2, 3 or
4 then have pass rates of about 0.6, 0.3, 0.1 and 0: some fall inside the band, some do not.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from jobenv import user_env
from tiny_job import tiny_job_config, write_config

from rlax_tpu.config import ControllerConfig, DatasetConfig, RunConfig
from rlax_tpu.launch.prefilter import Band, pass_rates

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = 8
BAND = (0.2, 0.9)
FIRST_TOKEN = {"1": 0.6, "2": 0.3, "3": 0.1}


def prefilter_config(run_dir: Path, data: Path) -> RunConfig:
    return tiny_job_config(
        "prefilter",
        run_dir,
        seed=5,
        inference={"max_decode_slots": 32, "max_new_tokens": 1},
        controller=ControllerConfig(
            datasets=(DatasetConfig(path=str(data), verifier="arithmetic"),),
        ),
    )


def fixed_distribution_checkpoint(config: RunConfig, path: Path) -> None:
    """An HF checkpoint whose next-token distribution is FIRST_TOKEN after any prompt."""
    import numpy as np
    from flax import nnx

    from rlax_tpu.data.char_tokenizer import write_char_tokenizer
    from rlax_tpu.data.tokenizer import Tokenizer
    from rlax_tpu.models import Transformer, save_hf
    from rlax_tpu.tree import flatten, unflatten_like

    write_char_tokenizer(str(path.parent / "tokenizer"))
    tokenizer = Tokenizer.load(str(path.parent / "tokenizer"))
    model = config.model
    params = nnx.to_pure_dict(nnx.state(Transformer(model, rngs=nnx.Rngs(0)), nnx.Param))
    leaves = {}
    for name, leaf in flatten(params).items():
        value = np.zeros(leaf.shape, np.float32)
        if name == "embed":
            value[:] = 1.0  # every token the same input: the final norm gives all-ones states
        elif name.startswith("final_norm"):
            value[:] = 1.0
        elif name == "lm_head":  # logits = Σ_d lm_head[d, v]
            value[:] = -20.0 / model.hidden_size
            for text, p in FIRST_TOKEN.items():
                (token,) = tokenizer.encode(text, add_special_tokens=False)
                value[:, token] = math.log(p) / model.hidden_size
        leaves[name] = value
    save_hf(unflatten_like(params, leaves), model, str(path))


def run_prefilter(workspace: Path, name: str) -> Path:
    out = workspace / name
    env = user_env(JAX_PLATFORMS="cpu")  # the components set their own device count
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlax_tpu",
            "prefilter",
            str(workspace / "config.json"),
            f"--dataset={workspace / 'sums.jsonl'}",
            f"--checkpoint={workspace / 'model'}",
            f"--samples={SAMPLES}",
            f"--min-pass={BAND[0]}",
            f"--max-pass={BAND[1]}",
            f"--out={out}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prefilter")
    rows = [
        {
            "id": f"sum-{i}",
            "prompt": f"What is {i % 4 + 1 + i} - {i}? Answer with just the number.",
            "answer": str(i % 4 + 1),
            "source": "test",  # an extra field: filtered rows keep it
        }
        for i in range(12)
    ]
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = prefilter_config(root / "unused_run_dir", root / "sums.jsonl")
    write_config(config, root / "config.json")
    fixed_distribution_checkpoint(config, root / "model")
    return root


@pytest.fixture(scope="module")
def outputs(workspace) -> tuple[Path, Path]:
    return run_prefilter(workspace, "first"), run_prefilter(workspace, "second")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_prompt_gets_a_pass_rate_of_k_samples(workspace, outputs):
    rates = read_jsonl(outputs[0] / "pass_rates.jsonl")
    dataset = read_jsonl(workspace / "sums.jsonl")
    assert [r["id"] for r in rates] == [r["id"] for r in dataset]
    for rate in rates:
        assert rate["k"] == SAMPLES
        assert 0.0 <= rate["pass_rate"] <= 1.0
        assert rate["pass_rate"] * SAMPLES == round(rate["pass_rate"] * SAMPLES)
    by_answer = {}
    for row, rate in zip(dataset, rates, strict=True):
        by_answer.setdefault(row["answer"], []).append(rate["pass_rate"])
    # The checkpoint's distribution shows through: "4" is never sampled, "1" most often.
    assert by_answer["4"] == [0.0] * 3
    assert min(by_answer["1"]) > max(by_answer["3"])


def test_the_filtered_dataset_is_exactly_the_rows_within_the_band(workspace, outputs):
    rates = read_jsonl(outputs[0] / "pass_rates.jsonl")
    dataset = read_jsonl(workspace / "sums.jsonl")
    expected = [
        row
        for row, rate in zip(dataset, rates, strict=True)
        if BAND[0] <= rate["pass_rate"] <= BAND[1]
    ]
    assert 0 < len(expected) < len(dataset)  # the band does separate the rows
    assert read_jsonl(outputs[0] / "filtered.jsonl") == expected
    summary = json.loads((outputs[0] / "summary.json").read_text())
    assert summary["kept"] == len(expected) and summary["samples"] == SAMPLES


def test_two_runs_with_the_same_seed_write_identical_outputs(outputs):
    for name in ("pass_rates.jsonl", "filtered.jsonl", "summary.json"):
        assert (outputs[0] / name).read_bytes() == (outputs[1] / name).read_bytes(), name


def test_an_out_of_range_band_is_refused():
    with pytest.raises(ValueError, match="band"):
        Band(0.9, 0.1)
    band = Band(0.25, 0.75)
    assert band.keeps(0.25) and band.keeps(0.75) and not band.keeps(0.8)
    assert not band.keeps(None)


def test_a_prompt_with_an_unjudged_sample_gets_no_pass_rate():
    """A sample the verifier could not judge is not a failure: its prompt has no pass rate
    (and so is never kept), where counting it as 0 would bias the rate down."""
    rewards = {("a", 0): 1.0, ("a", 1): 0.0, ("b", 0): 1.0, ("b", 1): None}
    rates = pass_rates(["a", "b"], rewards, samples=2)
    assert rates[0] == {"id": "a", "pass_rate": 0.5, "k": 2}
    assert rates[1]["pass_rate"] is None and rates[1]["k"] == 0
    assert rates[1]["error"] == "1 of 2 samples unjudged by the verifier"


def test_a_dataset_that_holds_the_held_out_problems_is_refused_before_anything_starts(
    workspace, tmp_path
):
    """Rows pre-filtered here are for training: held out means held out for them too."""
    from rlax_tpu.data.datasets import DatasetError
    from rlax_tpu.launch.prefilter import Band, prefilter

    config = prefilter_config(tmp_path / "unused", workspace / "sums.jsonl")
    config = config.override("controller.eval_dataset", str(workspace / "sums.jsonl"))
    with pytest.raises(DatasetError, match=r"is not held out: 12 of its 12 prompts"):
        prefilter(
            config,
            dataset=str(workspace / "sums.jsonl"),
            checkpoint=str(workspace / "model"),
            samples=2,
            band=Band(0.0, 1.0),
            out=str(tmp_path / "out"),
        )
    assert not (tmp_path / "out").exists()
