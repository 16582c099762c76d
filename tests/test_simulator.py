"""The scale-planning simulator (rlax_tpu.simulator): the schedule's invariants as
properties, calibration, preemptions, the CLI, and the paper reproductions (RLAX's
stale-16 -> stale-32 step time, LlamaRL's Table 3 speedups) with stated tolerances."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlax_tpu.cli import main as cli_main
from rlax_tpu.config import ModelConfig, load_config
from rlax_tpu.simulator import (
    Calibration,
    Distribution,
    PreemptionConfig,
    TimingModel,
    Workload,
    analytical,
    benchmark_kind,
    calibrate,
    count_arrays,
    count_params,
    generation_s,
    simulate,
    split_jobs,
)
from rlax_tpu.simulator import workloads as bench_workload
from rlax_tpu.simulator.fit import fit_to_measurement
from rlax_tpu.simulator.model import CalibrationError, train_s, train_tokens

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.py")
QWEN = str(ROOT / "configs" / "qwen2_5_32b_tpu_v5p_256.py")
RLAX_YAML = ROOT / "configs" / "simulator" / "rlax_qwq32b_v5p.yaml"
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tiny_workload(
    eta: int,
    n: int,
    *,
    steps: int = 12,
    workers: int = 2,
    schedule: str = "deterministic",
    response: Distribution | None = None,
) -> Workload:
    config = load_config(
        TINY,
        [
            f"staleness.max_staleness={n}",
            f"staleness.reload_every={eta}",
            f"staleness.schedule={schedule}",
            f"controller.num_steps={steps}",
            f"inference.num_workers={workers}",
            "controller.eval_dataset=",
        ],
    )
    calibration = Calibration()
    if response is not None:
        calibration.add_settings({"response_tokens": response.to_dict()})
    return calibrate(config, calibration)[0]


GEN_BOUND = TimingModel(train_fixed_s=0.01, train_s_per_token=0.0, decode_step_s=0.05)
TRAIN_BOUND = TimingModel(train_fixed_s=2.0, train_s_per_token=0.0, decode_step_s=0.001)

staleness_knobs = st.integers(1, 4).flatmap(
    lambda eta: st.tuples(st.just(eta), st.integers(eta - 1, eta + 5))
)


# -- the schedule's invariants ------------------------------------------------------------------
@FAST
@given(
    knobs=staleness_knobs,
    workers=st.integers(1, 3),
    schedule=st.sampled_from(["deterministic", "freshest"]),
    timing=st.sampled_from([GEN_BOUND, TRAIN_BOUND, TimingModel()]),
)
def test_simulated_staleness_never_exceeds_n(knobs, workers, schedule, timing):
    eta, n = knobs
    result = simulate(tiny_workload(eta, n, workers=workers, schedule=schedule), timing)
    assert result.steps == 12
    assert 0 <= min(result.staleness_histogram()) and result.staleness_max <= n
    assert sum(result.staleness_histogram().values()) == 12 * 64


@pytest.mark.parametrize("timing", [GEN_BOUND, TRAIN_BOUND])
def test_on_policy_never_overlaps_generation_and_training(timing):
    result = simulate(tiny_workload(1, 0, workers=3), timing)
    train = [(a, b) for who, what, a, b in result.timeline if what.startswith("train")]
    work = [(a, b) for who, what, a, b in result.timeline if what.startswith(("gen", "load"))]
    assert train and work
    for t0, t1 in train:
        assert all(b <= t0 + 1e-9 or a >= t1 - 1e-9 for a, b in work)
    assert result.staleness_max == 0


@FAST
@given(eta=st.integers(1, 4), extra=st.integers(1, 6), workers=st.integers(1, 3))
def test_raising_n_never_lowers_generation_bound_throughput(eta, extra, workers):
    heavy = Distribution(kind="lognormal", median=2, sigma=1.0)
    low = simulate(
        tiny_workload(eta, eta - 1 if eta > 1 else 0, workers=workers, response=heavy), GEN_BOUND
    )
    high = simulate(tiny_workload(eta, eta - 1 + extra, workers=workers, response=heavy), GEN_BOUND)
    assert high.steps / high.wall_s >= low.steps / low.wall_s * (1 - 1e-9)


def test_overlap_beats_lockstep_when_both_sides_cost():
    timing = TimingModel(train_fixed_s=0.5, train_s_per_token=0.0, decode_step_s=0.05)
    on = simulate(tiny_workload(1, 0), timing)
    one = simulate(tiny_workload(1, 1), timing)
    assert one.warm_step_time_s < 0.8 * on.warm_step_time_s
    assert one.trainer_idle_fraction < on.trainer_idle_fraction


def test_jobs_are_whole_groups_one_per_worker():
    assert split_jobs(64, 3, 8) == [24, 24, 16]
    assert split_jobs(64, 1, 8) == [64]
    assert split_jobs(16, 4, 8) == [8, 8]  # fewer jobs than workers: groups are not split
    assert split_jobs(40, 3, 8) == [16, 16, 8]


def test_a_heavy_tail_leaves_stragglers():
    workload = tiny_workload(1, 0)
    timing = TimingModel(decode_step_s=0.01, decode_call_s=0.0, decode_steps_per_call=1)
    even = generation_s(timing, workload, [44] * 64, [64] * 64)
    tail = generation_s(timing, workload, [44] * 64, [32] * 63 + [2048])
    assert sum([32] * 63 + [2048]) == pytest.approx(sum([64] * 64), rel=0.05)
    assert tail > 5 * even  # the same tokens, one long response: its slot sets the time


def test_batched_prefill_pays_one_call_per_round_of_rows():
    """The engine admits waiting prompts into free slots in rounds and prefills them
    prefill_batch_size rows per call (padded rows compute too)."""
    timing = TimingModel(
        prefill_call_s=0.01, prefill_s_per_token=0.0, decode_call_s=0.0, decode_step_s=0.0
    )
    timing = dataclasses.replace(timing, job_overhead_s=0.0, rollout_overhead_s=0.0)
    one = dataclasses.replace(tiny_workload(1, 0), decode_slots=32, prefill_rows=1)
    eight = dataclasses.replace(one, prefill_rows=8)
    prompts, responses = [44] * 64, [3] * 64
    assert generation_s(timing, one, prompts, responses) == pytest.approx(64 * 0.01)
    # Two rounds of 32 admitted prompts: 4 calls of 8 rows each.
    assert generation_s(timing, eight, prompts, responses) == pytest.approx(8 * 0.01)
    # A call costs its padded rows: 3 prompts in one round of 8 rows pay for 8.
    per_token = dataclasses.replace(timing, prefill_call_s=0.0, prefill_s_per_token=1e-4)
    bucket = eight.bucket(44)
    assert generation_s(per_token, eight, [44] * 3, [3] * 3) == pytest.approx(8 * bucket * 1e-4)


# -- shared prompt pages and packed batches (issue 42) ------------------------------------------
PREFILL_ONLY = TimingModel(
    prefill_call_s=0.0,
    prefill_s_per_token=1e-4,
    decode_call_s=0.0,
    decode_step_s=0.0,
    job_overhead_s=0.0,
)


def long_prompt_groups(samples_per_prompt: int, *, share: bool = True) -> Workload:
    """The tiny workload with 500-token prompts (one 512-token bucket), 8 prefill rows, 64
    decode slots and 64 samples per batch, `samples_per_prompt` of each prompt."""
    return dataclasses.replace(
        tiny_workload(1, 0, steps=4, response=Distribution(kind="fixed", median=16)),
        prompts_per_batch=64 // samples_per_prompt,
        samples_per_prompt=samples_per_prompt,
        prompt_tokens=Distribution(kind="fixed", median=500),
        prefill_buckets=(512,),
        prefill_rows=8,
        decode_slots=64,
        share_prompt_pages=share,
    )


def test_the_samples_of_a_prompt_admitted_together_take_one_prefill_row():
    """With share_prompt_pages a round prefills each group's prompt once: 8 groups of 8 in
    one round of 64 slots are one call of 8 rows, not 8 calls."""
    prompts, responses = [500] * 64, [16] * 64
    groups = [i // 8 for i in range(64)]
    call = 8 * 512 * 1e-4  # 8 rows of the 512-token bucket
    shared = generation_s(PREFILL_ONLY, long_prompt_groups(8), prompts, responses, groups=groups)
    unshared = long_prompt_groups(8, share=False)
    assert shared == pytest.approx(call)
    assert generation_s(PREFILL_ONLY, unshared, prompts, responses, groups=groups) == (
        pytest.approx(8 * call)
    )
    # Without groups (K = 1: every prompt its own) sharing changes nothing.
    alone = generation_s(PREFILL_ONLY, long_prompt_groups(1), prompts, responses, groups=range(64))
    assert (
        alone == generation_s(PREFILL_ONLY, unshared, prompts, responses) == pytest.approx(8 * call)
    )
    # 16 slots: four rounds of two groups each, one call per round (two unshared).
    few = dataclasses.replace(long_prompt_groups(8), decode_slots=16)
    assert generation_s(PREFILL_ONLY, few, prompts, responses, groups=groups) == (
        pytest.approx(4 * call)
    )


def test_sharing_prompt_pages_shortens_the_simulated_generation_of_groups():
    def busy(workload: Workload) -> float:
        return sum(simulate(workload, PREFILL_ONLY).worker_busy_s)

    # Two workers, a job of 4 groups each: one prefill call per job instead of 4.
    assert busy(long_prompt_groups(8)) < busy(long_prompt_groups(8, share=False)) / 3
    assert busy(long_prompt_groups(1)) == busy(long_prompt_groups(1, share=False))


def packed_workload(tokens_per_row: int) -> Workload:
    """Mini-batches of 8, micro-batches of 2 rows, sequences of at most 256 tokens."""
    return dataclasses.replace(
        tiny_workload(1, 0, steps=4),
        max_seq_len=256,
        mini_batch_size=8,
        micro_batch_size=2,
        tokens_per_row=tokens_per_row,
    )


def test_a_packed_step_trains_only_its_used_packed_micro_batches():
    timing = TimingModel(train_fixed_s=0.5, train_s_per_token=1e-4)
    # Mini-batch 1: seven 30-token sequences and one of 250; mini-batch 2: eight of 250.
    prompts = [10] * 16
    responses = [20] * 7 + [240] + [240] * 8
    padded, packed = packed_workload(0), packed_workload(256)
    # Padded: 16 rows of the batch's padded length (256); no change without packing.
    assert train_tokens(padded, prompts, responses) == 16 * 256
    assert train_s(timing, padded, prompts, responses) == pytest.approx(0.5 + 16 * 256 * 1e-4)
    # Packed: first fit puts the 30s in one row and the 250 in a second (one micro-batch
    # of 2 rows); the 250s take a row each (4 micro-batches): 5 micro-batches of 2 × 256.
    assert train_tokens(packed, prompts, responses) == 5 * 2 * 256
    assert train_s(timing, packed, prompts, responses) == pytest.approx(0.5 + 2560 * 1e-4)


def test_shared_prompts_count_a_groups_prompt_once_in_the_simulated_step():
    """Groups of 4 sharing a 100-token prompt: 99 of its tokens once per unit, each
    sample's from the prompt's last token on."""
    workload = dataclasses.replace(packed_workload(256), samples_per_prompt=4)
    shared = dataclasses.replace(workload, share_prefixes=True)
    prompts, responses = [100] * 16, [20] * 7 + [150] + [20] * 8
    # Unshared: the 120-token sequences two to a row, the 250 alone: 5 rows, then 4 rows:
    # 3 + 2 micro-batches of 2 rows.
    assert train_tokens(workload, prompts, responses) == 5 * 2 * 256
    # Shared: a group of four 120s is one unit of 99 + 4 × 21 = 183 tokens, a row; the group
    # with the 250 splits into 99 + 3 × 21 = 162 and the 250 alone: 3 rows, then 2 rows.
    assert train_tokens(shared, prompts, responses) == 3 * 2 * 256


def test_packing_shortens_the_simulated_train_step_of_heavy_tailed_lengths():
    timing = TimingModel(train_fixed_s=0.0, train_s_per_token=1e-3, decode_step_s=0.0)
    tail = Distribution(kind="lognormal", median=16, sigma=1.5, maximum=240)

    def busy(tokens_per_row: int) -> float:
        workload = dataclasses.replace(packed_workload(tokens_per_row), response_tokens=tail)
        return simulate(workload, timing).trainer_busy_s

    assert busy(256) < busy(0) / 2


def test_a_new_padded_length_compiles_the_train_step_again():
    timing = TimingModel(trainer_compile_s=5.0)
    short = tiny_workload(1, 0, steps=12, response=Distribution(kind="fixed", median=3))
    short = dataclasses.replace(
        short, prompt_tokens=Distribution(kind="fixed", median=61), max_seq_len=128
    )
    # 61 + 3 pads to 64 in every batch: one compile; 61 + 4 pads to 80 in some: two.
    mixed = dataclasses.replace(
        short, response_tokens=Distribution(kind="empirical", values=(3.0,) * 199 + (4.0,))
    )
    once, twice = simulate(short, timing), simulate(mixed, timing)
    no_compile = simulate(short, dataclasses.replace(timing, trainer_compile_s=0.0))
    assert once.trainer_busy_s - no_compile.trainer_busy_s == pytest.approx(5.0, abs=0.5)
    assert 4.5 < twice.trainer_busy_s - once.trainer_busy_s < 7.0  # a second compile


def test_count_arrays_matches_the_benchmarks_tiny_model():
    assert count_arrays(ModelConfig()) == 21  # tools/bench_trainer.py service "arrays"


def test_small_trees_and_the_trainer_service_calibrate_fixed_costs(tmp_path):
    ps = {
        "bytes": 1e8,
        "publish_bytes_per_s": 1e8,
        "pull_bytes_per_s": 1e9,
        "first_pull_bytes_per_s": 5e8,
        "small": [
            {"arrays": 8, "bytes": 0, "publish_s": 0.015, "first_pull_s": 0.005, "pull_s": 0.002},
            {"arrays": 32, "bytes": 0, "publish_s": 0.039, "first_pull_s": 0.017, "pull_s": 0.005},
        ],
    }
    trainer = {
        "step_s": 0.05,
        "mfu": 0.1,
        "configs": {"tiny": {"params": 1e5, "tokens_per_step": 512, "step_s": 0.03}},
        "service": {
            "params": 1e5,
            "arrays": 21,
            "bytes": 0,
            "rows": 64,
            "seq": 48,
            "step_s": 0.06,
            "publish_s": 0.035,
            "overhead_s": 0.002,
            "checkpoint_s": 0.05,
            "compile_s": 4.0,
            "recompile_s": 4.2,
        },
    }
    calibration = Calibration()
    for name, data in (("ps", ps), ("trainer", trainer)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        calibration.add_file(path)
    _, timing, _, _ = calibrate(load_config(TINY), calibration)
    assert timing.publish_s_per_array == pytest.approx(0.001)
    assert timing.pull_s_per_array == pytest.approx(0.0005)
    assert timing.pull_fixed_s == pytest.approx(0.001)
    # The trainer's own publish of 21 arrays sets the per-version cost: 35 - 21 ms.
    assert timing.publish_fixed_s == pytest.approx(0.014)
    assert timing.trainer_compile_s == pytest.approx(4.1)
    assert timing.checkpoint_s == 0.05 and timing.train_overhead_s == 0.002


def test_the_simulator_imports_no_jax():
    code = (
        "import sys, rlax_tpu.simulator, rlax_tpu.simulator.compiled, rlax_tpu.cli.simulate; "
        "assert 'jax' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# -- preemptions -----------------------------------------------------------------------------------
def test_preempted_run_finishes_every_step_and_loses_time():
    workload = tiny_workload(2, 3, steps=24)
    clean = simulate(workload, TimingModel())
    hard = simulate(
        workload, TimingModel(), preemption=PreemptionConfig(per_hour=1800, restart_s=0.2), seed=3
    )
    assert hard.preemptions and hard.steps == 24 and sorted(hard.consumed) == list(range(24))
    assert hard.wall_s > clean.wall_s and hard.lost_s > 0
    assert hard.staleness_max <= 3


def test_a_preemption_notice_saves_the_steps_since_the_checkpoint():
    config_workload = dataclasses.replace(tiny_workload(1, 1, steps=40), checkpoint_every=20)
    preemption = PreemptionConfig(per_hour=200, restart_s=0.5)
    hard = simulate(config_workload, TimingModel(), preemption=preemption, seed=1)
    notice = simulate(
        config_workload,
        TimingModel(),
        preemption=dataclasses.replace(preemption, notice=True),
        seed=1,
    )
    assert hard.preemptions == notice.preemptions  # the same preemption times
    assert notice.lost_s < hard.lost_s


def test_without_the_rollout_log_a_restart_discards_generated_rollouts():
    workload = tiny_workload(1, 4, steps=30)
    preemption = PreemptionConfig(per_hour=1800, restart_s=0.2, reuse_rollout_log=False)
    result = simulate(workload, GEN_BOUND, preemption=preemption, seed=2)
    assert result.preemptions and result.rollouts_discarded > 0


# -- calibration -----------------------------------------------------------------------------------
def test_count_params_matches_the_trainer_benchmarks_tiny_model():
    assert count_params(ModelConfig()) == 106_816  # tools/bench_trainer.py "tiny"


def test_benchmark_jsons_are_recognised_and_fitted(tmp_path):
    trainer = {
        "step_s": 1.0,
        "mfu": 0.2,
        "configs": {
            "a": {"params": 1e5, "tokens_per_step": 512, "step_s": 0.05},
            "b": {"params": 5e6, "tokens_per_step": 2048, "step_s": 3.05},
        },
    }
    inference = _inference_bench()
    ps = {"bytes": 1e8, "publish_bytes_per_s": 1e8, "pull_bytes_per_s": 1e9}
    paths = []
    for name, data in (("trainer", trainer), ("inference", inference), ("param_server", ps)):
        assert benchmark_kind(data) == name
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    calibration = Calibration()
    for path in paths:
        calibration.add_file(path)
    workload, timing, _, notes = calibrate(load_config(TINY), calibration)
    # 3 s per 6·(5e6·2048 − 1e5·512) FLOPs; the small one's 0.05 s leaves 0.035 s fixed.
    assert timing.train_fixed_s == pytest.approx(0.0349, abs=1e-3)
    assert timing.publish_bytes_per_s == 1e8 and timing.pull_bytes_per_s == 1e9
    assert timing.decode_step_s > 0 and len(notes) == 3


def _inference_bench(**extra) -> dict:
    """A bench_inference JSON with the keys calibration reads, plus `extra`: a run of the
    benchmark's workload (rlax_tpu.simulator.workloads) of 64 requests."""
    return {
        "tokens_per_s": 1000.0,
        "slot_utilization": 0.9,
        "useful_tokens": sum(bench_workload.lengths(64)[1]),
        "decode_slots": 8,
        "decode_steps_per_call": 4,
        "requests": 64,
        "model_flops_per_token": 7e6,
        **extra,
    }


def _calibrated_timing(tmp_path, *runs: dict) -> TimingModel:
    calibration = Calibration()
    for i, data in enumerate(runs):
        path = tmp_path / f"inference{i}.json"
        path.write_text(json.dumps(data))
        calibration.add_file(path)
    return calibrate(load_config(TINY), calibration)[1]


def _worker_loads(served: bool) -> dict:
    loads = {
        "tiny": {"arrays": 21, "bytes": 0, "load_s": 0.018, "swap_s": 0.002},
        "bench": {"arrays": 39, "bytes": 0, "load_s": 0.021, "swap_s": 0.003},
    }
    if served:  # the served load adds 25 ms per version and 0.05 ms per array
        for r in loads.values():
            r["served_load_s"] = r["load_s"] + 0.025 + r["arrays"] * 5e-5
    return loads


def test_an_inference_benchmark_of_another_workload_is_refused(tmp_path):
    """Calibration reads a run's prefill work off the benchmark's workload definition; a run
    measured on other lengths cannot be read that way, and says so."""
    timing = _calibrated_timing(tmp_path, _inference_bench())
    assert timing.decode_step_s > 0
    other = _inference_bench(useful_tokens=_inference_bench()["useful_tokens"] + 1)
    with pytest.raises(CalibrationError, match="measured with another workload"):
        _calibrated_timing(tmp_path, other)


def test_the_benchmark_draws_the_shared_workload():
    """tools/bench_inference.py's requests have exactly the shared workload's lengths."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        bench = importlib.import_module("bench_inference")
    finally:
        sys.path.remove(str(ROOT / "tools"))
    workload = bench.make_workload(64)
    prompts, outputs = bench_workload.lengths(64)
    assert [len(p) for p in workload.prompts] == prompts
    assert workload.output_lens == outputs
    assert bench.MODEL == bench_workload.MODEL and bench.INFERENCE == bench_workload.INFERENCE


def test_the_served_workers_load_sets_the_pull_latency(tmp_path):
    in_process = _calibrated_timing(tmp_path, _inference_bench(worker_load=_worker_loads(False)))
    served = _calibrated_timing(tmp_path, _inference_bench(worker_load=_worker_loads(True)))
    assert served.pull_fixed_s == pytest.approx(in_process.pull_fixed_s + 0.025)
    assert served.pull_s_per_array == pytest.approx(in_process.pull_s_per_array + 5e-5)
    assert served.swap_fixed_s == in_process.swap_fixed_s  # the swap stays in-process


def test_the_served_generate_overhead_is_the_job_overhead(tmp_path):
    def generate(overhead_s: float) -> dict:
        return {
            "requests": 64,
            "served_ms": 60.0 + 1e3 * overhead_s,
            "in_process_ms": 60.0,
            "overhead_s": overhead_s,
        }

    without = _calibrated_timing(tmp_path, _inference_bench())
    assert without.job_overhead_s == TimingModel().job_overhead_s  # nothing measured it
    runs = [_inference_bench(served_generate=generate(s)) for s in (0.010, 0.014)]
    assert _calibrated_timing(tmp_path, *runs).job_overhead_s == pytest.approx(0.012)
    # Noise can make the served call look faster than the engine: never a negative cost.
    timing = _calibrated_timing(tmp_path, _inference_bench(served_generate=generate(-0.001)))
    assert timing.job_overhead_s == 0.0


def test_settings_files_and_overrides_apply_in_order(tmp_path):
    path = tmp_path / "tpu.yaml"
    path.write_text(
        "preemption:\n  restart_s: 1\ntiming:\n  verify_p50_s: 2.0\n  verify_p95_s: 3.0\n"
        "hardware:\n  peak_flops_per_chip: 4.59e14\n  hbm_bytes_per_s_per_chip: 2.765e12\n"
        "  trainer_chips: 128\n  chips_per_worker: 8\n"
    )
    calibration = Calibration()
    calibration.add_file(path)
    calibration.add_overrides(["timing.verify_p95_s=5.0", "preemption.per_hour=0.5"])
    _, timing, sim, notes = calibrate(load_config(QWEN), calibration)
    assert timing.verify_p50_s == 2.0 and timing.verify_p95_s == 5.0
    assert sim.preemption.per_hour == 0.5 and sim.preemption.restart_s == 1
    assert any("tpu" in n or "hardware" in n for n in notes)
    assert 0.001 < timing.decode_step_s < 1.0  # a 32B model on 8 v5p chips: milliseconds


def test_fit_to_a_measurement_recovers_the_costs_components_miss():
    config = load_config(TINY, ["controller.num_steps=12", "controller.eval_every=4"])
    truth = {"rollout_overhead_s": 0.004, "controller_step_s": 0.2, "worker_compile_s": 3.0}
    calibration = Calibration()
    calibration.add_settings({"timing": truth})
    workload, timing, _, _ = calibrate(config, calibration)
    measured_run = simulate(workload, timing)
    measured = {
        "steps_per_s": 1 / measured_run.warm_step_time_s,
        "wall_s": measured_run.wall_s,
        "trainer_idle_fraction": measured_run.trainer_idle_fraction,
        "worker_idle_fraction": measured_run.worker_idle_fraction,
    }
    fitted = fit_to_measurement(config, Calibration(), measured, rounds=2, iterations=20)
    again = Calibration()
    again.add_settings({"timing": fitted})
    workload, timing, _, _ = calibrate(config, again)
    result = simulate(workload, timing)
    assert result.wall_s == pytest.approx(measured["wall_s"], rel=0.05)
    assert 1 / result.warm_step_time_s == pytest.approx(measured["steps_per_s"], rel=0.1)


def test_validation_tool_compares_prediction_with_a_synthetic_e2e(tmp_path):
    """tools/validate_simulator.py on a synthetic bench_e2e JSON (keys as bench_e2e writes)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import validate_simulator as tool

    mode = {
        "steps": 40,
        "steps_per_s": 0.8,
        "wall_s": 80.0,
        "trainer_idle_fraction": 0.5,
        "worker_idle_fraction": 0.5,
        "staleness_mean": 0.0,
        "steps_to_target": 20,
        "time_to_target_s": 40.0,
    }
    e2e = {
        "quick": True,
        "num_workers": 1,
        "cpu_count": 2,
        "speedup_off_vs_on": 1.2,
        "on_policy": mode,
        "one_step": dict(mode, staleness_mean=1.0),
        "off_policy": dict(mode, staleness_mean=3.5, time_to_target_s=33.3),
    }
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(e2e))
    prediction = tool.predict(e2e, [])
    assert prediction["on_policy"]["staleness_mean"] == 0
    assert prediction["off_policy"]["staleness_mean"] == pytest.approx(3.75)
    # The same steps to target; on a shared 2-core host overlap buys little.
    assert 0.5 < prediction["speedup_off_vs_on"] < 2
    rows = tool.table(e2e, {"components": prediction})
    speedup = next(r for r in rows if r["figure"] == "speedup_off_vs_on")
    assert speedup["components_error"] == pytest.approx(prediction["speedup_off_vs_on"] / 1.2 - 1)


# -- the analytical model --------------------------------------------------------------------------
@FAST
@given(
    a_t=st.floats(0.01, 10),
    c_t=st.floats(1e-4, 1),
    a_g=st.floats(0.01, 10),
    c_g=st.floats(1e-4, 1),
    weights=st.floats(1e9, 2e11),
    act=st.floats(1e6, 1e9),
    kv=st.floats(1e6, 1e9),
    devices=st.sampled_from([64, 256, 1024]),
)
def test_asynchronous_optimum_is_never_slower_than_synchronous(
    a_t, c_t, a_g, c_g, weights, act, kv, devices
):
    problem = analytical.StepTimeProblem(
        devices=devices,
        batch=2048,
        memory_bytes=80e9,
        weight_bytes=weights,
        activation_bytes=act,
        kv_bytes=kv,
        eta_train=lambda b: a_t / b + c_t,
        eta_gen=lambda b: a_g / b + c_g,
    )
    sync = analytical.synchronous_optimum(problem)
    asyn = analytical.asynchronous_optimum(problem)
    assert asyn.step_s <= sync.step_s * (1 + 1e-12)
    assert 0 < asyn.theta < 1
    assert asyn.theta == pytest.approx(asyn.trainer_s / (asyn.trainer_s + asyn.generator_s))
    # Balanced (Eq. 16): both sides take the same time at θ**.
    assert analytical.asynchronous_step_s(
        problem, asyn.theta, asyn.m_train, asyn.m_gen, asyn.b_train, asyn.b_gen
    ) == pytest.approx(asyn.step_s)
    assert analytical.disaggregated_synchronous_step_s(problem) >= asyn.step_s


def test_digest_toy_check_speedup():
    """digest-llamarl.md §3 toy: η_t = 0.2/b + 0.01, η_g = 2/b + 0.005, 70B-like, 256 GPUs."""
    problem = analytical.StepTimeProblem(
        devices=256,
        batch=2048,
        memory_bytes=80e9,
        weight_bytes=140e9,
        activation_bytes=2e9,
        kv_bytes=1.3e9,
        eta_train=lambda b: 0.2 / b + 0.01,
        eta_gen=lambda b: 2 / b + 0.005,
    )
    sync = analytical.synchronous_optimum(problem, discrete=True)
    asyn = analytical.asynchronous_optimum(problem, discrete=True)
    assert sync.step_s / asyn.step_s > 1.3
    assert analytical.disaggregated_synchronous_step_s(problem) > asyn.step_s


# -- paper reproductions ---------------------------------------------------------------------------
def test_llamarl_table3_speedups_direction_and_rough_size():
    """From an H100 roofline with straggler-aware decoding (docs/simulator.md lists the
    assumptions). Tolerance: every LlamaRL row faster than its baseline; 6 of the 7 rows
    within a factor of 2 of the paper's speedup (the 70B fp8 row, whose concurrency column
    the digest flags as inconsistent, is not reproduced); the 405B gain the largest."""
    rows = [r for r in analytical.reproduce_table3() if r["system"] == "llamarl"]
    assert all(r["speedup"] > 1.0 for r in rows)
    close = [r for r in rows if 0.5 <= r["speedup"] / r["paper_speedup"] <= 2.0]
    assert len(close) >= 6
    best = {m: max(r["speedup"] for r in rows if r["model"] == m) for m in ("8B", "70B", "405B")}
    assert best["405B"] > 3 * max(best["8B"], best["70B"])
    assert all(r["speedup"] > 1 for r in rows if r["model"] == "405B" and r["m_gen"] <= 16)


def rlax_run(n: int):
    config = load_config(
        QWEN,
        [
            f"staleness.max_staleness={n}",
            "staleness.reload_every=16",
            "model.param_dtype=bfloat16",
            "inference.num_workers=32",
            "inference.max_decode_slots=32",
            "controller.num_steps=96",
            # The timings were fitted to the paper's step times with padded training rows.
            "trainer.tokens_per_row=0",
        ],
    )
    calibration = Calibration()
    calibration.add_file(RLAX_YAML)
    workload, timing, sim, _ = calibrate(config, calibration)
    return simulate(workload, timing, seed=sim.seed)


def test_rlax_stale_16_to_stale_32_step_time():
    """RLAX §7.2: η = 16; N = 16 took 75 s a step, N = 32 45 s (1.67x). With the timings of
    configs/simulator/rlax_qwq32b_v5p.yaml the simulator must give the same direction and a
    ratio within 25% of the paper's, and step times within 25% of 75 s and 45 s (warm)."""
    s16, s32 = rlax_run(16), rlax_run(32)
    ratio = s16.warm_step_time_s / s32.warm_step_time_s
    assert 1.67 * 0.75 <= ratio <= 1.67 * 1.25
    assert s16.warm_step_time_s == pytest.approx(75, rel=0.25)
    assert s32.warm_step_time_s == pytest.approx(45, rel=0.25)
    assert s32.trainer_idle_fraction < s16.trainer_idle_fraction
    assert s16.staleness_max <= 16 and s32.staleness_max <= 32


# -- the CLI ---------------------------------------------------------------------------------------
def test_cli_simulate_prints_and_writes(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = cli_main(
        [
            "simulate",
            TINY,
            "--set",
            "controller.num_steps=10",
            "--set",
            "staleness=one_step_off_policy",
            "--set",
            "timing.host_cores=2",
            "--json",
            str(out),
            "--target-steps",
            "5",
            "--analytical",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "trainer idle" in text and "LlamaRL" in text
    figures = json.loads(out.read_text())
    assert figures["steps"] == 10 and figures["run"]["max_staleness"] == 1
    assert figures["time_to_target_steps_s"] < figures["wall_s"]
    assert math.isfinite(figures["analytical"]["speedup"])


def test_cli_plot_without_matplotlib_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = cli_main(
        ["simulate", TINY, "--set", "controller.num_steps=4", "--plot", str(tmp_path / "x.png")]
    )
    assert rc == 1
    assert "rlax_tpu[plots]" in capsys.readouterr().err


def test_cli_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    assert cli_main(["simulate", TINY, "--set", "controller.num_steps=4", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_train_step_pays_a_publish_only_for_the_versions_the_trainer_publishes():
    """The trainer publishes version s + 1 only at multiples of η or for the run's last
    (StalenessPolicy.publishes); a simulated step pays the publish on those steps alone."""
    slow_publish = TimingModel(
        train_fixed_s=0.01, train_s_per_token=0.0, decode_step_s=0.001, publish_fixed_s=5.0
    )
    busy = {}
    for eta in (1, 4):
        workload = tiny_workload(eta, eta - 1, steps=12)
        busy[eta] = simulate(workload, slow_publish).trainer_busy_s
        published = workload.policy.published(1, 12, 12)
        assert len(published) == (12 if eta == 1 else 3)  # versions 4, 8, 12
    # 12 publishes of 5 s against 3: the rest of a step costs the same in both.
    assert busy[1] - busy[4] == pytest.approx(9 * 5.0, rel=0.02)
