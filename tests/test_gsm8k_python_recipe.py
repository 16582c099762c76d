"""The GSM8K-with-Python recipe as a user tries it on a CPU: configs/qwen3_0_6b_gsm8k_python_gpu.py
with --trial, on a tiny random Qwen3 checkpoint carrying the real Qwen3 tokenizer and chat
template (`python tools/fetch_real_data.py`; the test skips without it) and GSM8K-format
rows. The run renders every prompt as an episode with the python tool's schema under Qwen3's
own template (its prefix check passes at start), runs episodes end to end with the
verifiers' sandbox behind the tool, and logs episode metrics and held-out accuracy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "qwen3_0_6b_gsm8k_python_gpu.py"
sys.path.insert(0, str(REPO / "tools"))

import fetch_real_data  # noqa: E402
from jobenv import user_env  # noqa: E402

ROWS = [
    {
        "question": f"Tom has {a} apples and buys {b} more. How many apples?",
        "answer": f"#### {a + b}",
    }
    for a, b in [(2, 3), (4, 1), (5, 5), (7, 2)]
]
TEST_ROWS = [
    {"question": f"Ann has {a} pears and eats {b}. How many pears?", "answer": f"#### {a - b}"}
    for a, b in [(9, 2), (7, 7)]
]


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory) -> Path:
    tokenizer = fetch_real_data.qwen3_tokenizer_dir()
    if not fetch_real_data.qwen3_tokenizer_present(tokenizer):
        pytest.skip(f"the real Qwen3 tokenizer is not here: `{fetch_real_data.FETCH_COMMAND}`")
    path = tmp_path_factory.mktemp("qwen3-tiny")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer) / name, path / name)
    return path


def test_the_gsm8k_python_recipe_runs_episodes_on_qwen3s_template(tmp_path, qwen3_checkpoint):
    data, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    test.write_text("".join(json.dumps(r) + "\n" for r in TEST_ROWS))
    run_dir = tmp_path / "run"
    sets = [
        f"model.hf_checkpoint={qwen3_checkpoint}",
        f"data.path={data}",
        f"controller.eval_dataset={test}",
        f"controller.eval_size={len(TEST_ROWS)}",
        f"storage.run_dir={run_dir}",
        "controller.num_steps=2",
        "inference.max_prompt_len=512",
        "inference.prefill_buckets=[512]",
    ]
    # One CPU device; XLA's default code generation: the real Qwen3 vocabulary (151k) makes
    # this run's time its head's matmuls, not its compiles (47 s with the quick one, 37 s).
    env = user_env(quick_codegen=False)
    done = subprocess.run(
        [sys.executable, "-m", "rlax_tpu", "run", str(RECIPE), "--trial"]
        + [x for s in sets for x in ("--set", s)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done: 2 steps" in done.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode/turns" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in rows if "eval_accuracy" in r] == [0, 2]
    # Each prompt is the episode's first observation under Qwen3's template: the system
    # prompt, the python tool's schema, the question, the generation prompt.
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3_checkpoint)
    logged = [
        json.loads(line)
        for f in sorted((run_dir / "rollouts").rglob("rollouts-*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    assert logged
    prompt = tokenizer.decode(logged[0]["prompt_tokens"])
    assert prompt.startswith("<|im_start|>system\nSolve the math problem.")
    assert '"name": "python"' in prompt and "<tools>" in prompt
    assert prompt.endswith("How many apples?<|im_end|>\n<|im_start|>assistant\n")
