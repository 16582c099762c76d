"""The rlax-tpu command line: help, config show, overrides, and the foundation run job."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.cli import main
from rlax_tpu.config import load_config

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
                "trainer.learning_rate=3e-5",
                "--set",
                "staleness=one_step_off_policy",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "trainer.learning_rate = 3e-05\n" in out
    assert "staleness.max_staleness = 1\n" in out
    expected = load_config(TINY, ["trainer.learning_rate=3e-5", "staleness=one_step_off_policy"])
    assert f"digest: {expected.digest()}" in out
    assert "paradigm: one_step_off_policy" in out


def test_config_show_json_round_trips(capsys):
    assert main(["config", "show", TINY, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == load_config(TINY).to_dict()


def test_bad_override_exits_2_naming_the_field(capsys):
    assert main(["config", "show", TINY, "--set", "staleness.reload_every=0"]) == 2
    err = capsys.readouterr().err
    assert "staleness.reload_every" in err and "η must be >= 1" in err


def test_commands_of_later_components_say_so(capsys):
    assert main(["sft", "configs/tiny_cpu.py"]) == 2
    assert "not available yet" in capsys.readouterr().err


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

    # The run directory now belongs to that config: another config is refused.
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
        "model.rope_theta=10.0",
        "--set",
        f"storage.run_dir={tmp_path / 'run2'}",
    )
    assert wrong.returncode == 2
    assert "model.rope_theta = 10.0 but the checkpoint has 1000.0" in wrong.stderr
