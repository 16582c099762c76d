"""The simulator calibrated from an `rlax-tpu compile --json` report (rlax_tpu.simulator.compiled):
the step costs its rooflines give, where they sit among the other sources, and the refusal
of a report compiled for another config. The reports are written here by hand in the
schema of rlax_tpu.compile.report (CompileReport.to_json): no compiler runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlax_tpu.cli import main as cli_main
from rlax_tpu.config import RunConfig, load_config
from rlax_tpu.simulator import Calibration, TimingModel, benchmark_kind, calibrate
from rlax_tpu.simulator.model import CalibrationError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.py")
# The tiny config on one v5p host (4 chips) for both components: 8 × 8 rows of 64 tokens,
# prefill 64 rows of the 64-token bucket, 64 decode slots.
ON_V5P = (
    "trainer.mesh.data=-1",
    "trainer.mesh.topology=v5p:2x2x1",
    "inference.mesh.topology=v5p:2x2x1",
    "controller.eval_dataset=",
)


def tpu_config(*overrides: str) -> RunConfig:
    return load_config(TINY, [*ON_V5P, *overrides])


def _program(
    name: str, component: str, shape: str, dims: dict, calls: int, roofline_s: float
) -> dict:
    return {
        "name": name,
        "component": component,
        "shape": shape,
        "dims": dims,
        "calls": "once per train step",
        "calls_per_step": calls,
        "chip": "v5p",
        "memory": {"params": 1 << 20, "total": 1 << 24},
        "hbm_bytes": 95 * 2**30,
        "flops": roofline_s * 459e12,
        "bytes_accessed": 1e6,
        "roofline_s": roofline_s,
        "bound": "compute",
        "lower_s": 0.1,
        "compile_s": 1.0,
        "hlo": {"kernels_without_cost": 1 if name == "decode" else 0},
        "xla_cost_analysis": {},
        "error": "",
        "out_of_memory": False,
        "fits": True,
        "hbm_fraction": 0.01,
    }


def compile_report(config: RunConfig, recompute_calls: int = 2) -> dict:
    """What `rlax-tpu compile` writes for `config`: rooflines rl_step 0.2 s, recompute
    0.05 s per call, prefill 4 ms, decode 30 ms."""
    inf, rows = config.inference, config.controller.prompts_per_batch
    rows *= config.controller.samples_per_prompt
    seq, bucket = config.trainer.max_seq_len, inf.prefill_buckets[-1]
    train = {"rows": rows, "seq_len": seq}
    programs = [
        _program("rl_step", "trainer", f"{rows} × {seq} tokens", train, 1, 0.2),
        _program("recompute", "trainer", f"{rows} × {seq} tokens", train, recompute_calls, 0.05),
        _program(
            "prefill",
            "inference",
            f"{inf.prefill_rows} × {bucket} tokens",
            {"rows": inf.prefill_rows, "seq_len": bucket},
            1,
            0.004,
        ),
        _program(
            "decode",
            "inference",
            f"{inf.max_decode_slots} slots × 1 token(s)",
            {"slots": inf.max_decode_slots, "steps": 1},
            1,
            0.03,
        ),
    ]
    components = {
        component: {
            "topology": config.tpu_topology(component),
            "chip": "v5p",
            "num_chips": 4,
            "mesh": getattr(config, component).mesh.shape_for(4),
            "hbm_bytes_per_chip": 95 * 2**30,
            "peak_flops_per_s": 459e12,
            "hbm_bytes_per_s": 2765e9,
        }
        for component in ("trainer", "inference")
    }
    return {
        "config": config.name,
        "config_digest": config.digest(),
        "fit_fraction": 0.9,
        "fits": True,
        "problems": [],
        "components": components,
        "programs": programs,
        "train_step_roofline_s": 0.2 + 0.05 * recompute_calls,
        "chips": {},
    }


def _calibrate(tmp_path, config: RunConfig, report: dict, *files_or_sets):
    path = tmp_path / "compile.json"
    path.write_text(json.dumps(report))
    calibration = Calibration()
    calibration.add_file(path)
    for item in files_or_sets:
        if isinstance(item, dict):
            calibration.add_settings(item)
        else:
            calibration.add_overrides([item])
    _, timing, _, notes = calibrate(config, calibration)
    return timing, notes


def test_the_rooflines_give_the_train_prefill_and_decode_costs(tmp_path):
    config = tpu_config()
    report = compile_report(config)
    assert benchmark_kind(report) == "compile"
    timing, notes = _calibrate(tmp_path, config, report)
    # Train step 0.2 + 2 × 0.05 s for 64 rows × 64 tokens, at 40% of the roofline.
    assert timing.train_s_per_token == pytest.approx(0.3 / 0.4 / (64 * 64))
    assert timing.train_fixed_s == 0.0
    # A prefill call of 64 rows × the 64-token bucket at 50%; one decode call per token at 60%.
    assert timing.prefill_s_per_token == pytest.approx(0.004 / 0.5 / (64 * 64))
    assert timing.decode_step_s == pytest.approx(0.03 / 0.6)
    # Host costs per call are not in a compiled program: left to the other sources.
    assert timing.decode_call_s == TimingModel().decode_call_s
    text = "\n".join(notes)
    for figure in ("train_s_per_token", "prefill_s_per_token", "decode_step_s"):
        assert f"compile.json: {figure}" in text
    assert "hardware.compiled_train_efficiency" in text and "(this config)" in text
    assert "without a cost estimate" in text  # decode's paged-attention kernel


def test_a_packed_steps_roofline_is_per_packed_token(tmp_path):
    """Packed, the compiled step counts every packed micro-batch: rows × tokens_per_row."""
    config = tpu_config("trainer.tokens_per_row=128")
    timing, notes = _calibrate(tmp_path, config, compile_report(config))
    assert timing.train_s_per_token == pytest.approx(0.3 / 0.4 / (64 * 128))
    assert "64 × 128 packed tokens" in "\n".join(notes)


def test_the_roofline_efficiency_is_explicit_and_settings_still_win(tmp_path):
    config = tpu_config()
    timing, notes = _calibrate(
        tmp_path,
        config,
        compile_report(config),
        "hardware.compiled_train_efficiency=1.0",
        "timing.decode_step_s=0.5",
    )
    assert timing.train_s_per_token == pytest.approx(0.3 / (64 * 64))  # the bare lower bound
    assert timing.decode_step_s == 0.5
    assert "set explicitly: decode_step_s" in notes


def test_a_compile_report_replaces_the_hardware_roofline_but_not_its_call_costs(tmp_path):
    config = tpu_config()
    hardware = {
        "hardware": {
            "peak_flops_per_chip": 459e12,
            "hbm_bytes_per_s_per_chip": 2765e9,
            "trainer_chips": 4,
            "chips_per_worker": 4,
            "decode_call_s": 0.001,
        }
    }
    timing, notes = _calibrate(tmp_path, config, compile_report(config), hardware)
    assert timing.decode_step_s == pytest.approx(0.03 / 0.6)
    assert timing.decode_call_s == 0.001
    assert "replaces the earlier sources' decode_step_s" in "\n".join(notes)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["name=other_run"], "of config 'tiny_cpu', not 'other_run'"),
        (["controller.samples_per_prompt=16"], "rl_step was compiled for 64 × 64 rows × tokens"),
        (["inference.max_decode_slots=128"], "decode was compiled for 64 slots"),
        (["trainer.mesh.fsdp=2"], "the trainer mesh was {'data': 4, 'fsdp': 1, 'tensor': 1}"),
        (
            ["inference.mesh.topology=", "deploy.inference_tpu.topology=2x2x2"],
            "the inference was compiled for v5p:2x2x1, this config runs it on v5p:2x2x2",
        ),
    ],
)
def test_a_report_compiled_for_another_config_is_refused(tmp_path, overrides, message):
    report = compile_report(tpu_config())
    with pytest.raises(CalibrationError, match="rlax-tpu compile CONFIG") as e:
        _calibrate(tmp_path, tpu_config(*overrides), report)
    assert message in str(e.value)


def test_a_setting_the_programs_do_not_see_keeps_the_report(tmp_path):
    # A sweep over the worker count changes the digest, not a compiled program.
    report = compile_report(tpu_config())
    timing, notes = _calibrate(tmp_path, tpu_config("inference.num_workers=4"), report)
    assert timing.decode_step_s == pytest.approx(0.03 / 0.6)
    assert "not checked" in notes[0] and report["config_digest"][:12] in notes[0]


def test_a_program_that_did_not_compile_gives_no_figure(tmp_path):
    config = tpu_config()
    report = compile_report(config)
    decode = report["programs"][3]
    decode.update(error="RESOURCE_EXHAUSTED: out of HBM", roofline_s=0.0, fits=False)
    report.update(fits=False, problems=["inference decode does not fit a v5p chip"])
    timing, notes = _calibrate(tmp_path, config, report)
    assert timing.decode_step_s == TimingModel().decode_step_s
    assert timing.train_s_per_token == pytest.approx(0.3 / 0.4 / (64 * 64))
    text = "\n".join(notes)
    assert "no decode figure: decode did not compile" in text
    assert "does not fit" in text


def test_cli_simulate_takes_a_compile_report(tmp_path, capsys):
    report = tmp_path / "c.json"
    report.write_text(json.dumps(compile_report(tpu_config())))
    out = tmp_path / "sim.json"
    sets = [arg for o in ON_V5P for arg in ("--set", o)]
    rc = cli_main(
        ["simulate", TINY, *sets, "--set", "controller.num_steps=3"]
        + ["--calibration", str(report), "--json", str(out)]
    )
    assert rc == 0
    assert f"calibration: {report}: decode_step_s" in capsys.readouterr().out
    assert any(
        n.startswith(f"compile report {report}") for n in json.loads(out.read_text())["notes"]
    )


def test_cli_simulate_refuses_a_report_of_another_config(tmp_path, capsys):
    report = tmp_path / "c.json"
    report.write_text(json.dumps(compile_report(tpu_config())))
    sets = [arg for o in ON_V5P for arg in ("--set", o)]
    rc = cli_main(["simulate", TINY, *sets, "--set", "name=x", "--calibration", str(report)])
    assert rc == 2
    assert "this compile report is of config 'tiny_cpu', not 'x'" in capsys.readouterr().err
