"""tools/bench_e2e.py's arithmetic on synthetic controller output (the benchmark itself runs
the whole job several times per round, minutes, so it is not run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_e2e  # noqa: E402


def rows_and_summary(step_s: float, eval_s: float, steps: int = 10):
    """metrics.jsonl rows of `steps` steps of `step_s` each, an evaluation of `eval_s` at
    steps 0 and 5 (elapsed_s is taken before the step's evaluation), and the summary."""
    rows, t = [{"step": 0, "eval_accuracy": 0.5, "elapsed_s": 0.0}], eval_s
    finished = {0: eval_s}
    for s in range(1, steps + 1):
        t += step_s
        rows.append(
            {
                "step": s,
                "elapsed_s": t,
                "reward_mean": 0.1 * s,
                "time/controller_step_s": step_s,
                "time/worker_generate_s": step_s / 4 if s > 2 else 5.0,  # compiles at first
                "train/time/step_s": step_s / 2,
                # 4096 tokens an update (64 x 64), a tenth of the first steps' compiling.
                "train/time/compile_s": step_s / 20 if s <= 2 else 0.0,
                "train/tokens_per_s": 4096 / (step_s / 2 - (step_s / 20 if s <= 2 else 0.0)),
                "train/mfu": 0.01 * s,
                "response_tokens": 256,  # 4 a sample
            }
        )
        if s == 5:
            t += eval_s
            finished[5] = t
    summary = {
        "start_step": 0,
        "end_step": steps,
        "wall_s": t,
        "steps_per_s": steps / t,
        "evals": {"0": 0.5, "5": 0.8},
        "eval_elapsed_s": {str(k): v for k, v in finished.items()},
        "staleness_mean": 0.0,
        "trainer_idle_fraction": 0.4,
        "worker_idle_fraction": 0.6,
    }
    return rows, summary


def test_warm_rate_leaves_out_warm_up_steps_and_evaluations():
    rows, summary = rows_and_summary(step_s=0.25, eval_s=3.0)
    figures = bench_e2e.figures(summary, rows, target=0.7)
    assert figures["steps_per_s"] == pytest.approx(4.0)
    assert figures["eval_s"] == pytest.approx(6.0)
    assert figures["steps_to_target"] == 5
    # From the start of RL to the end of step 5's evaluation: 3 + 5 × 0.25 + 3 seconds.
    assert figures["time_to_target_s"] == pytest.approx(7.2, abs=0.06)
    assert (figures["initial_accuracy"], figures["final_accuracy"]) == (0.5, 0.8)


def test_step_parts_are_warm_medians_in_ms_and_absent_parts_are_left_out():
    rows, summary = rows_and_summary(step_s=0.2, eval_s=1.0)
    parts = bench_e2e.figures(summary, rows, target=0.9)["step_ms"]
    assert parts == {
        "controller_step": 200.0,
        "worker_generate": 50.0,
        "trainer_jitted_step": 100.0,
    }


def test_compute_is_generation_plus_update_and_overhead_the_rest_of_the_step():
    rows, summary = rows_and_summary(step_s=0.2, eval_s=1.0)
    figures = bench_e2e.figures(summary, rows, target=0.9)
    # 200 ms steps of 50 ms generation and a 100 ms update.
    assert figures["compute_ms"] == pytest.approx(150.0)
    assert figures["overhead_ms"] == pytest.approx(50.0)
    assert figures["step_vs_compute"] == pytest.approx(200 / 150, abs=1e-3)


def test_compute_is_unknown_when_a_part_was_not_measured():
    split = bench_e2e.compute_split({"controller_step": 200.0, "worker_generate": 50.0})
    assert split == {
        "compute_ms": None,
        "overhead_ms": None,
        "step_vs_compute": None,
        "publish_load_ms": None,
    }


def test_the_version_hand_off_is_the_trainers_publish_plus_the_workers_load():
    parts = {"controller_step": 200.0, "worker_generate": 50.0, "trainer_jitted_step": 100.0}
    split = bench_e2e.compute_split({**parts, "trainer_publish": 1.5, "worker_load": 2.0})
    assert split["publish_load_ms"] == pytest.approx(3.5)
    assert bench_e2e.compute_split(parts)["publish_load_ms"] is None


def test_without_a_target_or_evaluations_target_and_accuracy_figures_are_none():
    rows, summary = rows_and_summary(step_s=0.25, eval_s=0.0)
    summary = {**summary, "evals": {}, "eval_elapsed_s": {}}
    figures = bench_e2e.figures(summary, rows, target=None)
    assert figures["steps_per_s"] == pytest.approx(4.0)
    assert figures["time_to_target_s"] is None and figures["steps_to_target"] is None
    assert figures["final_accuracy"] is None and figures["initial_accuracy"] is None


def test_mfu_is_a_steps_model_flops_at_its_rate_over_the_peak():
    from rlax_tpu.simulator.model import decode_flops_per_token

    config = bench_e2e.bench_config("demo", True, 1, [])
    rows, summary = rows_and_summary(step_s=0.25, eval_s=3.0)
    figures = bench_e2e.figures(summary, rows, 0.7, config, peak_flops=1e11)
    # The update: 6·N a token of 4096; generation: 256 tokens at a context of the expected
    # prompt (half of max_prompt_len 60) and half the 4-token mean response.
    generation = 256 * decode_flops_per_token(config.model, 30 + 2)
    per_step = 6 * bench_e2e.num_params(config) * 4096 + generation
    assert figures["model_flops_per_step"] == pytest.approx(per_step)
    assert figures["model_flops_per_s"] == pytest.approx(per_step * figures["steps_per_s"])
    assert figures["peak_flops"] == 1e11
    assert figures["mfu"] == pytest.approx(figures["model_flops_per_s"] / 1e11)
    assert 0 < figures["mfu"] < 1
    # The trainer's own, over the warm steps 3-10: 0.03 ... 0.10.
    assert figures["trainer_mfu"] == pytest.approx(0.065)


def test_mfu_figures_are_none_without_the_config_or_the_trainers_figures():
    rows, summary = rows_and_summary(step_s=0.25, eval_s=3.0)
    assert all(bench_e2e.figures(summary, rows, 0.7)[k] is None for k in ("mfu", "peak_flops"))
    config = bench_e2e.bench_config("demo", True, 1, [])
    rows = [{k: v for k, v in r.items() if k != "train/tokens_per_s"} for r in rows]
    figures = bench_e2e.figures(summary, rows, 0.7, config, peak_flops=1e10)
    assert figures["model_flops_per_step"] is None and figures["mfu"] is None


def test_tunix_mfu_is_our_on_policy_steps_flops_at_its_rate():
    tunix = bench_e2e.tunix_mfu({"steps_per_s": 2.0}, {"model_flops_per_step": 1e9}, 1e10)
    assert tunix == {
        "model_flops_per_step": 1e9,
        "model_flops_per_s": pytest.approx(2e9),
        "peak_flops": 1e10,
        "mfu": pytest.approx(0.2),
    }
    assert (
        bench_e2e.tunix_mfu({"steps_per_s": None}, {"model_flops_per_step": 1e9}, 1e10)["mfu"]
        is None
    )
    assert bench_e2e.tunix_mfu({"steps_per_s": 2.0}, None, 1e10)["mfu"] is None


# -- over rounds ---------------------------------------------------------------------------------
def mode_round(steps_per_s, *, step=150.0, generate=40.0, update=85.0, to_target=10.0, acc=0.8):
    step_ms = {"controller_step": step, "worker_generate": generate, "trainer_jitted_step": update}
    return {
        "steps": 40,
        "steps_per_s": steps_per_s,
        "time_to_target_s": to_target,
        "time_to_target_excl_eval_s": None if to_target is None else to_target - 1,
        "steps_to_target": None if to_target is None else 10,
        "final_accuracy": acc,
        "step_ms": step_ms,
        **bench_e2e.compute_split(step_ms),
    }


def tunix_round(steps_per_s):
    return {"steps_per_s": steps_per_s, "status": "ok"}


def test_mfu_medians_over_rounds_keep_their_digits_and_the_table_shows_them(capsys):
    on = [mode_round(2.0), mode_round(2.0), mode_round(2.0)]
    for r, mfu in zip(on, (0.012345, 0.015125, 0.0169), strict=True):
        r.update(mfu=mfu, model_flops_per_step=1e9, model_flops_per_s=2e9, peak_flops=1e11)
    # Tunix at 1, 0.5 and 4 steps/s: 1, 0.5 and 4 GFLOP/s of our step's 1 GFLOP.
    tunix = [
        {**tunix_round(rate), **bench_e2e.tunix_mfu({"steps_per_s": rate}, r, 1e11)}
        for rate, r in zip((1.0, 0.5, 4.0), on, strict=True)
    ]
    demo = bench_e2e.size_report(
        bench_e2e.bench_config("demo", True, 1, []),
        None,
        {"on_policy": on},
        tunix,
        {"sft_s": 1.0, "reused": True},
    )
    assert demo["on_policy"]["mfu"] == 0.015125  # the median, not rounded to 4 places
    assert demo["on_policy"]["min_max"]["mfu"] == [0.012345, 0.0169]
    assert demo["on_policy"]["model_flops_per_s"] == pytest.approx(2e9)
    assert demo["tunix"]["mfu"] == pytest.approx(0.01)
    assert demo["tunix"]["min_max"]["mfu"] == [pytest.approx(0.005), pytest.approx(0.04)]
    report = bench_e2e.report_for({"demo": demo}, {"device": "2 x cpu", "num_rounds": 3})
    assert report["on_policy"]["mfu"] == 0.015125
    bench_e2e.print_table(report)
    out = capsys.readouterr().out
    assert "MFU" in out and "1.51% [1.23%–1.69%]" in out and "1.00% [0.50%–4.00%]" in out


def test_a_ratio_is_the_median_of_per_round_ratios_not_the_ratio_of_medians():
    on = [mode_round(1.0), mode_round(2.0), mode_round(3.0)]
    tunix = [tunix_round(2.0), tunix_round(1.0), tunix_round(6.0)]
    report = bench_e2e.size_report(
        bench_e2e.bench_config("20m", False, 1, []),
        None,
        {"on_policy": on},
        tunix,
        {"sft_s": 1.0, "reused": False},
    )
    # Per round 0.5, 2, 0.5: median 0.5 (the medians' ratio, 2 / 2, would say 1).
    assert [r["speedup_vs_tunix"] for r in report["rounds"]] == [0.5, 2.0, 0.5]
    assert report["speedup_vs_tunix"] == pytest.approx(0.5)
    assert report["min_max"]["speedup_vs_tunix"] == [0.5, 2.0]
    assert report["on_policy"]["steps_per_s"] == pytest.approx(2.0)
    assert report["on_policy"]["min_max"]["steps_per_s"] == [1.0, 3.0]
    assert report["tunix"]["steps_per_s"] == pytest.approx(2.0)
    # Off-policy did not run: its ratios are missing, not zero.
    assert report["off_policy"] is None and report["speedup_off_vs_tunix"] is None


def test_overhead_fraction_is_the_median_of_per_round_overhead_over_compute():
    on = [
        mode_round(1.0, step=150.0, generate=40.0, update=85.0),  # 25 / 125 = 0.2
        mode_round(1.0, step=200.0, generate=50.0, update=50.0),  # 100 / 100 = 1
        mode_round(1.0, step=110.0, generate=50.0, update=50.0),  # 10 / 100 = 0.1
    ]
    tunix = [tunix_round(None)] * 3
    report = bench_e2e.size_report(
        bench_e2e.bench_config("demo", True, 1, []),
        0.7,
        {"on_policy": on},
        tunix,
        {"sft_s": 1.0, "reused": True},
    )
    assert report["overhead_fraction_on_policy"] == pytest.approx(0.2)
    assert report["min_max"]["overhead_fraction_on_policy"] == [0.1, 1.0]
    assert report["on_policy"]["compute_ms"] == pytest.approx(100.0)
    assert report["on_policy"]["overhead_ms"] == pytest.approx(25.0)
    assert report["speedup_vs_tunix"] is None


def test_off_vs_on_compares_time_to_target_with_a_target_and_steps_per_s_without():
    modes = {
        "on_policy": mode_round(2.0, to_target=30.0),
        "off_policy": mode_round(3.0, to_target=10.0),
    }
    by_time = bench_e2e.round_ratios(modes, None, by_time_to_target=True)
    by_rate = bench_e2e.round_ratios(modes, None, by_time_to_target=False)
    assert by_time["speedup_off_vs_on"] == pytest.approx(3.0)
    assert by_rate["speedup_off_vs_on"] == pytest.approx(1.5)


def test_a_round_that_missed_the_target_counts_as_slowest_in_the_median_time():
    rounds = [mode_round(1.0, to_target=10.0), mode_round(1.0, to_target=None)]
    rounds.append(mode_round(1.0, to_target=20.0))
    summary = bench_e2e.summarise_mode(rounds)
    assert summary["time_to_target_s"] == pytest.approx(20.0)
    assert summary["target_reached_rounds"] == 2
    assert summary["min_max"]["time_to_target_s"] == [10.0, 20.0]
    missed = bench_e2e.summarise_mode([mode_round(1.0, to_target=None)] * 2 + rounds[:1])
    assert missed["time_to_target_s"] is None and missed["steps_to_target"] is None


def test_step_parts_are_medians_over_rounds():
    rounds = [mode_round(1.0, step=s) for s in (100.0, 300.0, 200.0)]
    summary = bench_e2e.summarise_mode(rounds)
    assert summary["step_ms"]["controller_step"] == pytest.approx(200.0)
    assert summary["step_ms_min_max"]["controller_step"] == [100.0, 300.0]
    assert len(summary["rounds"]) == 3


def test_the_demo_size_keeps_the_single_size_keys_at_the_top_level():
    on = [mode_round(2.0)]
    demo = bench_e2e.size_report(
        bench_e2e.bench_config("demo", True, 1, []),
        0.7,
        {name: on for name in bench_e2e.MODES},
        [tunix_round(4.0)],
        {"sft_s": 1.0, "reused": True},
    )
    report = bench_e2e.report_for({"demo": demo}, {"quick": True, "num_rounds": 1})
    from rlax_tpu.simulator.calibration import benchmark_kind

    assert benchmark_kind(report) == "e2e"
    assert report["on_policy"]["steps_per_s"] == pytest.approx(2.0)
    assert report["speedup_vs_tunix"] == pytest.approx(0.5)
    assert report["tunix_steps_per_s"] == pytest.approx(4.0)
    assert (report["quick"], report["num_workers"], report["steps"]) == (True, 1, 40)
    assert report["sizes"]["demo"] is demo


def test_the_20m_size_has_18_to_22_million_parameters():
    config = bench_e2e.bench_config("20m", False, 1, [])
    assert 18e6 <= bench_e2e.num_params(config) <= 22e6
    demo = bench_e2e.bench_config("demo", True, 1, [])
    assert config.model.vocab_size == demo.model.vocab_size  # the same tokenizer and task
    assert config.model.tokenizer == demo.model.tokenizer
    assert config.controller.num_steps == bench_e2e.WARMUP_STEPS + bench_e2e.MEASURED_STEPS_20M
    assert not config.controller.eval_dataset


def test_unknown_modes_are_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        bench_e2e.main(["--modes", "on_policy,sideways", "--work-dir", "/nonexistent/x"])
    assert "sideways" in capsys.readouterr().err


def test_unknown_sizes_are_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        bench_e2e.main(["--sizes", "demo,huge", "--work-dir", "/nonexistent/x"])
    assert "huge" in capsys.readouterr().err


def test_our_modes_do_tunix_s_work_no_diagnostic_recompute_and_no_checkpoint_mid_run():
    config = bench_e2e.bench_config("20m", quick=False, workers=1, extra=[])
    assert config.trainer.recompute_every and config.trainer.checkpoint_every <= 4  # the demo's
    same = bench_e2e.same_work(config)
    assert same.trainer.recompute_every == 0
    steps = range(1, same.controller.num_steps + 1)
    assert not [s for s in steps if s % same.trainer.checkpoint_every == 0]
    assert same.digest() == config.digest()  # the same weights
