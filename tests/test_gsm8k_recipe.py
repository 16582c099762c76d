"""The one-GPU recipe as a new user runs it, on the CPU (issue 20's "done when"): a clean
checkout given only a Qwen2-layout Hugging Face directory (a tiny random stand-in made by
transformers, with Qwen's tokenizer layout, chat template and generation config) and a
GSM8K-format JSONL runs GRPO from configs/qwen2_5_0_5b_gsm8k_gpu.py with --set
model.hf_checkpoint=DIR --set data.path=FILE as a CPU trial (`--trial`: the recipe's sizes
shrunk to what a CPU runs), extends the finished run by a step, exports it, and the export
loads in transformers with the same logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from hf_fixtures import save_qwen_checkpoint
from jobenv import user_env

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "qwen2_5_0_5b_gsm8k_gpu.py"

# GSM8K's own rows ({"question", "answer": "... #### N"}), short enough for the tiny stand-in.
ROWS = [
    {
        "question": f"Tom has {a} apples and buys {b} more. How many apples?",
        "answer": f"#### {a + b}",
    }
    for a, b in [(2, 3), (4, 1), (5, 5), (7, 2), (1, 8), (3, 3), (6, 0), (9, 1)]
]
TEST_ROWS = [
    {"question": f"Ann has {a} pears and eats {b}. How many pears?", "answer": f"#### {a - b}"}
    for a, b in [(9, 2), (7, 7)]
]


def _rlax(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = user_env()  # one CPU device, as a user
    return subprocess.run(
        [sys.executable, "-m", "rlax_tpu", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_gpu_recipe_trains_extends_and_exports_a_qwen2_checkpoint_on_gsm8k(tmp_path):
    checkpoint = save_qwen_checkpoint(tmp_path / "Qwen2-stand-in")
    data = tmp_path / "gsm8k_train.jsonl"
    # One row no prompt limit here holds: left out by the run's choice, and counted.
    overlong = {"question": "How many apples? " * 60, "answer": "#### 1"}
    data.write_text("".join(json.dumps(r) + "\n" for r in [*ROWS, overlong]))
    # The recipe evaluates on GSM8K's own test split: problems the run never trains on.
    test = tmp_path / "gsm8k_test.jsonl"
    test.write_text("".join(json.dumps(r) + "\n" for r in TEST_ROWS))
    run_dir = tmp_path / "run"
    sets = [
        f"model.hf_checkpoint={checkpoint}",
        f"data.path={data}",
        f"controller.eval_dataset={test}",
        f"controller.eval_size={len(TEST_ROWS)}",
        f"storage.run_dir={run_dir}",
        "controller.overlong_prompts=drop",
        "inference.max_prompt_len=128",  # the stand-in's context is 256 tokens
    ]
    args = ["run", str(RECIPE), "--trial", *[x for s in sets for x in ("--set", s)]]

    first = _rlax(*args, "--set", "controller.num_steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # The trial says what it shrank and leaves what --set chose.
    changed = trial_changes(first.stdout)
    assert "controller.prompts_per_batch: 32 -> 2" in changed
    assert "trainer.gpu: 'h100' -> ''" in changed
    assert any(line.startswith("inference.kv_cache_bytes: 2,048 MiB -> ") for line in changed)
    assert not any(line.startswith(("controller.num_steps", "storage.")) for line in changed)
    assert "dataset gsm8k_train: 9 prompts" in first.stdout
    assert "1 over the limits left out" in first.stdout
    assert "done: 2 steps" in first.stdout
    # The architecture came from the checkpoint's config.json, nothing from the recipe.
    dumped = json.loads((run_dir / "config.json").read_text())
    assert dumped["model"]["hidden_size"] == 64 and dumped["model"]["num_layers"] == 2
    # Every prompt was measured before the run, under Qwen's chat template and the recipe's
    # system prompt (far longer than a bare question), and none was over the limit.
    scan = json.loads((run_dir / "dataset_scan.json").read_text())
    assert scan["gsm8k_train"]["rows"] == 9 and scan["gsm8k_train"]["dropped"] == 1
    assert [row_id for row_id, _ in scan["gsm8k_train"]["overlong"]] == ["gsm8k_train:8"]
    held_out = scan["held_out"]
    assert (held_out["prompts"], held_out["normalised"], held_out["exact"]) == (2, 0, 0)
    bare = transformers.AutoTokenizer.from_pretrained(checkpoint)(ROWS[0]["question"])
    assert scan["gsm8k_train"]["median_prompt"] > len(bare["input_ids"]) + 20

    # A finished run extended by one step resumes from its final snapshot and trains it.
    more = _rlax(*args, "--set", "controller.num_steps=3")
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "done: 3 steps" in more.stdout
    assert json.loads((run_dir / "config.json").read_text())["controller"]["num_steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows if "reward_mean" in r}) == [1, 2, 3]
    assert {r["dataset/overlong_dropped"] for r in rows if "reward_mean" in r} == {1}
    # The same command again has nothing to do: it says so without starting a component.
    again = _rlax(*args, "--set", "controller.num_steps=3")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"already done, 3 steps in {run_dir}" in again.stdout
    assert "components ready" not in again.stdout and "done: 3 steps" in again.stdout

    out = tmp_path / "export"
    exported = _rlax("export", str(run_dir), str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": ROWS[0]["question"]}], add_generation_prompt=True
    )
    ids = prompt["input_ids"] if isinstance(prompt, dict | transformers.BatchEncoding) else prompt
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    source = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        before = source(torch.tensor([ids])).logits[0].numpy()
    assert np.isfinite(theirs).all()
    assert not np.allclose(theirs, before, atol=1e-6), "the export is the untrained model"
    ours = _rlax_logits(out, ids)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def trial_changes(stdout: str) -> list[str]:
    """The lines of `--trial`'s list of changes."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("trial of "))
    changes = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        changes.append(line.strip())
    return changes


def _rlax_logits(directory: Path, ids: list[int]) -> np.ndarray:
    """The exported checkpoint's logits under this package's model, in a subprocess (the
    test process keeps JAX unimported, like a user's transformers session)."""
    code = (
        "import json, sys, numpy as np, jax.numpy as jnp\n"
        "from rlax_tpu.models.hf import load_hf_model\n"
        "model = load_hf_model(sys.argv[1], param_dtype='float32', dtype='float32')\n"
        "ids = jnp.asarray([json.loads(sys.argv[2])], jnp.int32)\n"
        "out = model.forward_train(ids, ids, return_logits=True).logits\n"
        "np.save(sys.argv[3], np.asarray(out, np.float32)[0])\n"
    )
    out = directory.parent / "ours.npy"
    env = user_env()
    subprocess.run(
        [sys.executable, "-c", code, str(directory), json.dumps(ids), str(out)],
        check=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    return np.load(out)
