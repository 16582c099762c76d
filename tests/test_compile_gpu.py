"""`rlax-tpu compile` for a config on GPUs (`trainer.gpu` / `inference.gpu`): with no GPU here,
the programs are compiled by XLA:CPU for as many CPU devices, an estimate labelled so,
checked against each process's share of the GPU (`gpu_memory_fraction`)."""

import json
from pathlib import Path

import pytest
from test_compile import TINY, _compile

from rlax_tpu.compile.hlo_cost import analyze
from rlax_tpu.config import ConfigError, InferenceConfig, MeshConfig, TrainerConfig, load_config
from rlax_tpu.hardware import GPUS, compile_target, parse_gpu
from rlax_tpu.simulator import Calibration, CalibrationError, calibrate

HLO = Path(__file__).resolve().parent / "hlo"

# The tiny compile config moved from its v5p host to 2 GPUs.
# Overrides revalidate one at a time: the mesh changes before the GPUs it must fill.
ON_GPUS = [
    "trainer.mesh.topology=",
    "trainer.mesh.fsdp=2",
    "trainer.mesh.tensor=1",
    "trainer.gpu=h100:2",
    "inference.mesh.topology=",
    "inference.gpu=h100:2",
]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def gpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "report.json"
    proc = _compile(TINY, *_sets(ON_GPUS), "--json", str(out))
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_a_gpu_config_is_compiled_by_xla_cpu_as_a_labelled_estimate(gpu_report):
    proc, report = gpu_report
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ESTIMATE: no GPU here" in proc.stdout
    assert "fits: every program within 90% of HBM (a GPU process: of its share)" in proc.stdout
    for component, fraction in (("trainer", 0.55), ("inference", 0.35)):
        target = report["components"][component]
        assert target["compiler"] == "XLA:CPU"
        assert (target["topology"], target["chip"], target["num_chips"]) == ("h100:2", "h100", 2)
        assert target["memory_fraction"] == fraction
        assert target["memory_bytes_per_chip"] == int(GPUS["h100"].hbm_bytes * fraction)
    assert report["components"]["trainer"]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 1}
    programs = {p["name"]: p for p in report["programs"]}
    assert set(programs) == {
        "init",
        "init_opt",
        "rl_step",
        "recompute",
        "prefill",
        "decode",
        "swap_out",
        "swap_in",
    }
    for p in programs.values():
        assert p["hbm_bytes"] == report["components"][p["component"]]["memory_bytes_per_chip"]
        assert 0 < p["memory"]["total"] <= 0.9 * p["hbm_bytes"]
    for name in ("rl_step", "recompute", "prefill", "decode"):
        assert programs[name]["flops"] > 0
    # XLA:CPU writes loop conditions as fusions: the trainer's scans (updates, micro-batches)
    # are counted by the trip counts XLA's loop analysis records.
    for name in ("rl_step", "recompute"):
        assert programs[name]["hlo"]["unknown_loops"] == 0, name


def test_a_program_over_its_gpu_share_is_refused_naming_the_fraction():
    # 0.001 of an H100 is 80 MiB per process: half the 64 MiB KV pool a GPU and the
    # temporaries (XLA:CPU copies the pool) exceed 90% of it.
    proc = _compile(
        TINY, *_sets([*ON_GPUS, "inference.gpu_memory_fraction=0.001"]), "--programs", "decode"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "does not fit its share of a h100 GPU" in proc.stderr
    assert "inference.gpu_memory_fraction=0.001" in proc.stderr


def test_an_unknown_gpu_is_refused_with_the_known_ones():
    proc = _compile(TINY, *_sets([*ON_GPUS, "trainer.gpu=rtx9:2"]), "--programs", "recompute")
    assert proc.returncode == 2
    assert "trainer.gpu" in proc.stderr and "unknown GPU 'rtx9'" in proc.stderr
    assert all(model in proc.stderr for model in GPUS)


def test_gpu_field_names_a_model_and_an_optional_count():
    assert parse_gpu("h100") == ("h100", 1) and parse_gpu("a100-80gb:8") == ("a100-80gb", 8)
    for bad in ("H100", "h100:0", "h100:x", ":2"):
        with pytest.raises(ConfigError, match="gpu"):
            TrainerConfig(gpu=bad)


def test_gpus_and_a_tpu_topology_are_exclusive():
    with pytest.raises(ConfigError, match="clear one"):
        InferenceConfig(gpu="h100", mesh=MeshConfig(tensor=-1, fsdp=1, topology="v5p:2x2x1"))


def test_the_mesh_must_fill_the_gpus():
    with pytest.raises(ConfigError, match="fill the GPUs"):
        TrainerConfig(gpu="h100:3", mesh=MeshConfig(data=1, fsdp=2, tensor=1))


def test_compile_target_is_the_gpus_else_the_tpu_slice():
    config = load_config(TINY, ON_GPUS)
    assert compile_target(config, "trainer") == "h100:2"
    assert compile_target(load_config(TINY), "trainer") == "v5p:2x2x1"


def test_the_simulator_refuses_to_time_an_xla_cpu_estimate(gpu_report):
    _, report = gpu_report
    calibration = Calibration()
    calibration.compile_reports.append(("report.json", report))
    with pytest.raises(CalibrationError, match="XLA:CPU"):
        calibrate(load_config(TINY, ON_GPUS), calibration)


def test_hlo_walk_reads_xla_cpu_trip_counts():
    # A 7-step scan of a 64 × 64 matmul as XLA:CPU compiles it: the loop's condition is a
    # fusion, its trip count is in the while's backend config.
    cost = analyze((HLO / "scan_cpu.txt").read_text())
    assert cost.loops == [("while.5", 7)] and cost.unknown_loops == 0
    assert cost.flops == 7 * 2 * 64**3


def test_hlo_walk_counts_cublas_matmuls():
    # A [128, 256] × [256, 512] matmul as XLA:GPU writes it: a cuBLAS custom call.
    cost = analyze((HLO / "cublas_gemm.txt").read_text())
    assert cost.flops == 2 * 128 * 512 * 256
