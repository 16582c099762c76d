"""tools/device_check.py without an accelerator: its dry run plans every part for a GPU and a
TPU host and checks the report's schema; a plan that cannot run (a bad --set, an unknown
platform or chip, a model too large for the chip) exits 2 with the reason; the platform and
chip come from what the host shows; a report's "Measured on" row matches the doc's table."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import device_check  # noqa: E402
from device_check import PART_ORDER, ReportSchemaError, check_report, main  # noqa: E402


def _dry_run(tmp_path: Path, *args: str) -> tuple[int, dict | None]:
    out = tmp_path / "plan.json"
    code = main(["--dry-run", "--json", str(out), *args])
    return code, json.loads(out.read_text()) if out.is_file() else None


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_the_dry_run_plans_every_part_and_writes_a_valid_report(tmp_path, capsys, platform):
    code, report = _dry_run(tmp_path, "--platform", platform)
    out = capsys.readouterr().out
    assert code == 0, out
    assert list(report["parts"]) == list(PART_ORDER)
    for name in PART_ORDER:
        assert f"  {name} " in out
    check_report(report)
    assert report["dry_run"] and report["target"]["platform"] == platform
    # The recipe's own hardware, and the pyproject extra its install names.
    chip, extra = {"gpu": ("h100", "cuda"), "tpu": ("v5e", "tpu")}[platform]
    assert report["target"]["chip"] == chip
    assert report["install"]["command"][-1].endswith(f"[{extra}]")
    assert report["install"]["requirements"][0].startswith("jax[")
    decode = report["parts"]["decode"]["plan"]
    assert decode["batch_sizes"] == [1, 16, 64, 256]
    assert decode["memory"]["estimate_bytes"] <= decode["memory"]["available_bytes"]
    gsm8k = report["parts"]["gsm8k"]
    assert "controller.num_steps=3" in gsm8k["plan"]["sets"]
    if platform == "tpu":  # one host's chips cannot hold the recipe's two processes
        assert gsm8k["status"] == "skipped" and "two slices" in gsm8k["error"]
    else:
        assert gsm8k["status"] == "planned"


def test_rlax_tpu_bench_device_runs_the_check(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-m", "rlax_tpu", "bench", "device", "--dry-run", "--platform", "gpu"]
        + ["--parts", "decode,gsm8k"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "  decode " in done.stdout and "  gsm8k " in done.stdout
    assert "  trainer " not in done.stdout
    assert "dry run: the plan is valid" in done.stdout


def test_a_bad_set_stops_the_plan_with_the_field(tmp_path, capsys):
    code, report = _dry_run(tmp_path, "--platform", "gpu", "--set", "trainer.no_such_knob=1")
    assert code == 2 and report is None
    err = capsys.readouterr().err
    assert "gsm8k" in err and "no_such_knob" in err


def test_an_unknown_platform_or_part_or_chip_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--dry-run", "--platform", "fpga"])
    assert exit_.value.code == 2
    assert main(["--dry-run", "--platform", "gpu", "--parts", "decode,warp"]) == 2
    assert "unknown part(s) warp" in capsys.readouterr().err
    assert main(["--dry-run", "--platform", "tpu", "--chip", "h100"]) == 2
    assert "unknown tpu chip 'h100'" in capsys.readouterr().err
    assert main(["--dry-run", "--platform", "cpu"]) == 2  # the 0.5B model needs an accelerator
    assert "--tiny" in capsys.readouterr().err


def test_a_model_too_large_for_the_chip_is_refused_until_the_fix_it_names(tmp_path, capsys):
    # An L4 (about 17 GiB a process may use) cannot hold the trainer's micro-batch of 8.
    code, _ = _dry_run(tmp_path, "--platform", "gpu", "--chip", "l4")
    assert code == 2
    assert "trainer: needs about" in capsys.readouterr().err
    code, report = _dry_run(
        tmp_path, "--platform", "gpu", "--chip", "l4", "--trainer-micro-batch", "1"
    )
    assert code == 0 and report["parts"]["trainer"]["plan"]["shape"]["micro"] == 1


def test_the_platform_and_chip_come_from_what_the_host_shows():
    gpu = device_check.detect_platform({}, gpus=[("NVIDIA H200", 143771)], tpu_files=[])
    assert gpu[0] == "gpu" and "NVIDIA H200" in gpu[1]
    tpu = device_check.detect_platform({"TPU_ACCELERATOR_TYPE": "v5litepod-4"}, gpus=[])
    assert tpu[0] == "tpu"
    assert device_check.detect_platform({}, gpus=[], tpu_files=["/dev/accel0"])[0] == "tpu"
    assert device_check.detect_platform({}, gpus=[], tpu_files=[])[0] == "cpu"
    names = {
        ("gpu", "NVIDIA H100 80GB HBM3"): "h100",
        ("gpu", "NVIDIA A100-SXM4-40GB"): "a100-40gb",
        ("gpu", "NVIDIA L40S"): None,  # not an L4
        ("tpu", "TPU v5 lite"): "v5e",
        ("tpu", "v5p-8"): "v5p",
        ("tpu", "TPU v6 lite"): "v6e",
    }
    for (platform, name), chip in names.items():
        assert device_check.chip_from_name(platform, name) == chip, name


def test_the_schema_refuses_a_failed_part_without_its_error(tmp_path):
    _, report = _dry_run(tmp_path, "--platform", "gpu", "--parts", "kernels")
    broken = copy.deepcopy(report)
    broken["parts"]["kernels"].update(status="failed", error=None)
    with pytest.raises(ReportSchemaError, match="without an error"):
        check_report(broken)
    broken["parts"]["kernels"].update(status="done", error="x")
    with pytest.raises(ReportSchemaError, match="status 'done'"):
        check_report(broken)


def test_a_report_row_fits_the_docs_measured_on_table(tmp_path):
    doc = (ROOT / "docs" / "gpu_tpu_recipes.md").read_text()
    assert device_check.MARKDOWN_HEADER in doc
    _, report = _dry_run(tmp_path, "--platform", "gpu")
    results = {
        "decode": {
            "batches": [{"batch": 1, "tokens_per_s": 812.5, "fraction_of_hbm_roofline": 0.31}]
        },
        "trainer": {"mfu": 0.284, "mfu_measured_matmul": 0.3},
        "kernels": {"max_abs_error": 0.0079},
        "weight_sync": {"publish_s": 0.91, "load_s": 0.42, "bytes": 988_065_664},
        "gsm8k": {"step_s": [61.2, 20.4], "steps_done": 2},
    }
    for name, result in results.items():
        report["parts"][name].update(status="ok", result=result, error=None, seconds=1.0)
    report["parts"]["gsm8k"].update(status="failed", error="stopped at the budget")
    check_report(report)
    row = device_check.markdown_row(report)
    assert row.count("|") == device_check.MARKDOWN_HEADER.count("|")
    assert "1: 812 (31%)" in row and "28.4%" in row and "61.2, 20.4 (2 of 3 steps)" in row
