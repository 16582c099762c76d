"""The rlax-tpu command line: help, config show, overrides, the foundation run job, sft, eval
and bench."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.cli import main
from rlax_tpu.config import ConfigRenamedWarning, RunConfig, field_descriptions, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.py")


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("run", "resume", "serve", "sft", "eval", "config", "bench"):
        assert f"    {command} " in out or f"    {command}\n" in out, command


def test_config_show_prints_the_resolved_config_with_overrides(capsys):
    assert (
        main(
            [
                "config",
                "show",
                TINY,
                "--set",
                "trainer.optimizer.learning_rate=3e-5",
                "--set",
                "staleness=one_step_off_policy",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "trainer.optimizer.learning_rate = 3e-05\n" in out
    assert "staleness.max_staleness = 1\n" in out
    expected = load_config(
        TINY, ["trainer.optimizer.learning_rate=3e-5", "staleness=one_step_off_policy"]
    )
    assert f"digest: {expected.digest()}" in out
    assert "paradigm: one_step_off_policy" in out


def test_config_show_prints_the_algorithm_that_runs_and_hides_what_is_unset(capsys):
    config = load_config(TINY)
    assert config.trainer.algorithm.advantage == ""  # left to the preset
    assert main(["config", "show", TINY]) == 0
    shown = capsys.readouterr().out
    resolved = config.trainer.algorithm.resolved()
    assert f'trainer.algorithm.advantage = "{resolved.advantage}"\n' in shown
    assert "= null\n" not in shown and '= ""\n' not in shown
    assert "unset fields (null or empty) hidden: --all" in shown
    assert main(["config", "show", TINY, "--all"]) == 0
    everything = capsys.readouterr().out
    assert "data = null\n" in everything and "data = null" not in shown
    assert f"digest: {config.digest()}" in shown and f"digest: {config.digest()}" in everything


def test_config_show_help_fields_prints_every_field_with_its_description(capsys):
    assert main(["config", "show", "--help-fields"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = field_descriptions(RunConfig)
    assert len(lines) == len(rows)
    for line, (path, _, default, text) in zip(lines, rows, strict=True):
        assert line.startswith(f"{path} (") and f"= {default}: {text}" in line
    assert any(line.startswith("controller.replay.global_cap (int) = 4096: ") for line in lines)


def test_an_old_field_path_in_a_set_warns_the_cli_user_with_the_new_one(capsys):
    with pytest.warns(ConfigRenamedWarning, match="is now controller.replay.global_cap"):
        assert main(["config", "show", TINY, "--set", "controller.replay_global_cap=64"]) == 0
    assert "controller.replay.global_cap = 64\n" in capsys.readouterr().out


def test_config_show_json_round_trips(capsys):
    assert main(["config", "show", TINY, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == load_config(TINY).to_dict()


def test_bad_override_exits_2_naming_the_field(capsys):
    assert main(["config", "show", TINY, "--set", "staleness.reload_every=0"]) == 2
    err = capsys.readouterr().err
    assert "staleness.reload_every" in err and "η must be >= 1" in err


# -- sft and eval, in this process ------------------------------------------------------------
# The test process has 8 virtual CPU devices (conftest.py): the demo config is laid out over
# them and shrunk.
SMALL = (
    "cpu_devices=8",
    "trainer.mesh.data=-1",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=1",
    "model.head_dim=16",
    "controller.eval_size=8",
    "verifiers.num_workers=1",
)


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def test_sft_writes_a_hugging_face_model_that_eval_picks_up(tmp_path, capsys):
    from rlax_tpu.models import load_hf_model

    run_dir = tmp_path / "run"
    overrides = (*SMALL, "trainer.warm_start.steps=3", f"storage.run_dir={run_dir}")
    assert main(["sft", TINY, *_sets(*overrides)]) == 0
    out = capsys.readouterr().out
    model_dir = run_dir / "sft_model"
    assert f"SFT model: {model_dir}\n" in out
    assert "sft step 3/3: loss" in out
    sft_line = next(line for line in out.splitlines() if line.startswith("held-out greedy"))
    assert "/8 prompts, 8 distinct problems, of" in sft_line

    # A Hugging Face checkpoint of the config's architecture, as `rlax-tpu run` starts from.
    config = load_config(TINY, list(overrides))
    model = load_hf_model(str(model_dir))
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
        assert getattr(model.config, field) == getattr(config.model, field), field
    # The run directory now belongs to this config, as with `rlax-tpu run`.
    assert (run_dir / "config.sha256").read_text().strip() == config.digest()

    # With no trainer checkpoint yet, eval's newest model is the SFT export.
    assert main(["eval", TINY, *_sets(*overrides)]) == 0
    out = capsys.readouterr().out
    assert f"model: Hugging Face model {model_dir}\n" in out
    assert sft_line in out.splitlines()


def test_sft_with_no_steps_says_what_to_set(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["sft", TINY, *_sets("trainer.warm_start.steps=0", f"storage.run_dir={run_dir}")]
    assert main(args) == 2
    assert "--set trainer.warm_start.steps=" in capsys.readouterr().err
    assert not run_dir.exists()


# Problems whose answer is 7 and problems whose answer is not.
# Problems of the test side of the arithmetic task (tasks.arithmetic_split_of): held out from
# the tiny config's training data by construction.
HELD_OUT = [("3 + 4", "7"), ("1 + 6", "7"), ("1 + 2", "3"), ("5 + 3", "8")]


def _held_out_file(path: Path) -> str:
    rows = [
        {"prompt": f"What is {q}? Answer with just the number.", "answer": a} for q, a in HELD_OUT
    ]
    path.write_text("".join(json.dumps({**r, "verifier": "arithmetic"}) + "\n" for r in rows))
    return str(path)


def _always_seven(config, out_dir: Path) -> str:
    """A Hugging Face model that answers "7" to every prompt: every position's residual
    stream is the same vector e (attention and MLP outputs zeroed), and only the "7" column
    of the LM head is non-zero (e itself)."""
    from model_helpers import model_params

    from rlax_tpu.data.char_tokenizer import write_char_tokenizer
    from rlax_tpu.data.tokenizer import Tokenizer
    from rlax_tpu.models.hf import save_hf

    write_char_tokenizer(str(out_dir / "tokenizer"))
    (seven,) = Tokenizer.load(str(out_dir / "tokenizer")).encode("7", add_special_tokens=False)
    params = model_params(config, seed=0)
    e = params["embed"][0].copy()
    params["embed"][:] = e
    for layer in params["layers"].values():
        layer["attn"]["wo"][:] = 0.0
        layer["mlp"]["w_down"][:] = 0.0
    params["lm_head"][:] = 0.0
    params["lm_head"][:, seven] = e
    save_hf(params, config.model, str(out_dir / "seven"))
    return str(out_dir / "seven")


def test_eval_scores_a_models_greedy_answers_with_the_verifiers(tmp_path, capsys):
    overrides = (
        *SMALL,
        f"storage.run_dir={tmp_path / 'run'}",
        f"controller.eval_dataset={_held_out_file(tmp_path / 'held_out.jsonl')}",
        "inference.max_new_tokens=1",
    )
    seven = _always_seven(load_config(TINY, list(overrides)), tmp_path)
    out_json = tmp_path / "eval.json"
    args = ["eval", TINY, *_sets(*overrides), "--model", seven, "--json", str(out_json)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out greedy accuracy: 0.500 (2/4 prompts, 4 distinct problems, of" in out
    # 2 of 4: the Wilson interval (0.5 ± 1.96·√(1/16 + 1.96²/64)) / (1 + 1.96²/4).
    assert "95 % interval 0.150–0.850)" in out
    result = json.loads(out_json.read_text())
    assert result["accuracy"] == 0.5
    assert result["accuracy_interval95"] == pytest.approx([0.1500, 0.8500], abs=5e-4)
    assert result["num_problems"] == len(HELD_OUT)
    assert [p["response"] for p in result["problems"]] == ["7"] * 4
    assert [p["reward"] for p in result["problems"]] == [1.0, 1.0, 0.0, 0.0]
    assert [p["verdict"] for p in result["problems"]][-1] == "wrong_answer"


def test_eval_defaults_to_the_newest_trainer_checkpoint(tmp_path, capsys):
    from model_helpers import model_params

    from rlax_tpu.models.hf import save_hf
    from rlax_tpu.trainer import Trainer

    run_dir = tmp_path / "run"
    overrides = (
        *SMALL,
        f"storage.run_dir={run_dir}",
        f"controller.eval_dataset={_held_out_file(tmp_path / 'held_out.jsonl')}",
        "inference.max_new_tokens=1",
    )
    config = load_config(TINY, list(overrides))
    # The run's SFT export is a random model; its trainer's checkpoint answers "7".
    save_hf(model_params(config, seed=1), config.model, str(run_dir / "sft_model"))
    seven = _always_seven(config, tmp_path)
    model = dataclasses.replace(config.model, hf_checkpoint=seven)
    rl_only = config.override("trainer.warm_start.steps", 0)  # checkpoint 0 at once
    trainer = Trainer(dataclasses.replace(rl_only, model=model))
    trainer.initialize()
    trainer.save(wait=True)
    trainer.close()

    newest_json, sft_json = tmp_path / "newest.json", tmp_path / "sft.json"
    assert main(["eval", TINY, *_sets(*overrides), "--json", str(newest_json)]) == 0
    assert f"model: trainer checkpoint of step 0 ({run_dir / 'checkpoints'})" in (
        capsys.readouterr().out
    )
    newest = json.loads(newest_json.read_text())
    assert [p["response"] for p in newest["problems"]] == ["7"] * 4
    assert newest["accuracy"] == 0.5

    sft_model = str(run_dir / "sft_model")
    assert (
        main(["eval", TINY, *_sets(*overrides), "--model", sft_model, "--json", str(sft_json)]) == 0
    )
    other = json.loads(sft_json.read_text())
    assert [p["response"] for p in other["problems"]] != ["7"] * 4


def test_eval_without_a_model_or_held_out_set_says_what_to_give(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["eval", TINY, *_sets(f"storage.run_dir={run_dir}")]) == 2
    err = capsys.readouterr().err
    assert "holds no model yet" in err and "--model DIR" in err
    args = ["eval", TINY, *_sets(f"storage.run_dir={run_dir}", "controller.eval_dataset=")]
    assert main([*args, "--model", str(tmp_path / "any")]) == 2
    assert "set controller.eval_dataset" in capsys.readouterr().err


# -- bench ---------------------------------------------------------------------------------------
def test_bench_lists_the_benchmarks(capsys):
    from rlax_tpu.cli.bench import BENCHMARKS

    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    for name in BENCHMARKS:
        assert (ROOT / "tools" / f"bench_{name}.py").is_file(), name
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert "(missing)" not in line and len(line.split()) > 2, line


def test_bench_passes_its_arguments_to_the_script(capfd):
    assert main(["bench", "trainer", "--help"]) == 0
    out = capfd.readouterr().out
    assert "usage: bench_trainer.py" in out and "--quick" in out
    # The script's own argument parser sees what follows the name, unchanged.
    assert main(["bench", "trainer", "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capfd.readouterr().err


def test_bench_with_an_unknown_name_exits_2(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "trainer" in err


def test_bench_outside_a_source_checkout_says_where_the_benchmarks_are(monkeypatch, capsys):
    from rlax_tpu.cli import bench

    monkeypatch.setattr(bench, "tools_dir", lambda: None)
    assert main(["bench", "trainer"]) == 2
    assert "ship with the source repository" in capsys.readouterr().err


# The smoke job on a 3-D trainer mesh of 8 virtual devices (the demo itself uses 2).
MESH_OVERRIDES = ("cpu_devices=8", "trainer.mesh.fsdp=2", "trainer.mesh.tensor=2")
MESH_3D = [arg for o in MESH_OVERRIDES for arg in ("--set", o)]


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "rlax_tpu", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_run_job_dumps_config_and_checks_trainer_against_inference(tmp_path):
    run_dir = tmp_path / "run"
    result = _run_cli("run", "--smoke", TINY, *MESH_3D, "--set", f"storage.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert "foundation job: OK" in result.stdout
    config = load_config(TINY, [*MESH_OVERRIDES, f"storage.run_dir={run_dir}"])
    assert load_config(str(run_dir / "config.json")) == config
    assert (run_dir / "config.sha256").read_text().strip() == config.digest()
    assert (run_dir / "config.txt").read_text() == config.to_text()
    metrics = json.loads((run_dir / "foundation_job.json").read_text())
    assert metrics["trainer_mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert metrics["train_vs_inference_logprob_max_abs_diff"] < 1e-4

    # Once a run has made progress there (a snapshot), another config is refused.
    (run_dir / "snapshots").mkdir()
    (run_dir / "snapshots" / "snapshot_000000000.json").write_text("{}")
    other = _run_cli(
        "run", "--smoke", TINY, "--set", f"storage.run_dir={run_dir}", "--set", "seed=1"
    )
    assert other.returncode == 2
    assert "holds a run with config digest" in other.stderr


def test_run_job_writes_its_run_dir_to_gcs(gcs_bucket):
    from rlax_tpu import storage

    run_dir = f"{gcs_bucket}/runs/tiny"
    result = _run_cli("run", "--smoke", TINY, *MESH_3D, "--set", f"storage.run_dir={run_dir}")
    assert result.returncode == 0, result.stderr
    config = load_config(TINY, [*MESH_OVERRIDES, f"storage.run_dir={run_dir}"])
    assert storage.read_text(f"{run_dir}/config.sha256").strip() == config.digest()
    assert json.loads(storage.read_text(f"{run_dir}/config.json")) == config.to_dict()
    assert "train_nll" in json.loads(storage.read_text(f"{run_dir}/foundation_job.json"))


def test_run_job_on_a_hugging_face_checkpoint(tmp_path):
    from hf_fixtures import make_hf_model

    from rlax_tpu.models import load_hf_config

    checkpoint = tmp_path / "qwen3"
    make_hf_model("Qwen3ForCausalLM").save_pretrained(checkpoint)
    base = load_config(TINY, [*MESH_OVERRIDES, f"storage.run_dir={tmp_path / 'run'}"])
    config = dataclasses.replace(base, model=load_hf_config(str(checkpoint)))
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config.to_dict()))

    result = _run_cli("run", "--smoke", str(config_file))
    assert result.returncode == 0, result.stderr
    assert "foundation job: OK" in result.stdout

    # A config that disagrees with the checkpoint is refused, naming the field.
    wrong = _run_cli(
        "run",
        "--smoke",
        str(config_file),
        "--set",
        "model.intermediate_size=64",
        "--set",
        f"storage.run_dir={tmp_path / 'run2'}",
    )
    assert wrong.returncode == 2
    assert "model.intermediate_size=64 (the checkpoint has 96)" in wrong.stderr
