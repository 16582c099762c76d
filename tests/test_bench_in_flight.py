"""tools/bench_in_flight.py: its arithmetic on synthetic controller output, its config, and
(slow: a few minutes on 2 cores) the --quick smoke run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_in_flight  # noqa: E402


def rows_and_summary(step_s: float, eval_s: float, tokens: int, steps: int = 10):
    """metrics.jsonl rows of `steps` steps of `step_s` each (a quarter of it generating
    `tokens` tokens), an evaluation of `eval_s` at steps 0, 5 and 10, and the summary."""
    rows, t = [{"step": 0, "eval_accuracy": 0.5, "elapsed_s": 0.0}], eval_s
    finished = {0: eval_s}
    for s in range(1, steps + 1):
        t += step_s
        rows.append(
            {
                "step": s,
                "elapsed_s": t,
                "reward_mean": 0.5,
                "response_tokens": tokens,
                "time/worker_generate_s": step_s / 4,
                "rollout/partial_fraction": 0.25 if s > 1 else 0.0,
                "rollout/version_span": 1 if s > 1 else 0,
            }
        )
        if s % 5 == 0:
            t += eval_s
            finished[s] = t
    summary = {
        "start_step": 0,
        "end_step": steps,
        "wall_s": t,
        "evals": {"0": 0.5, "5": 0.7, "10": 0.8},
        "eval_elapsed_s": {str(k): v for k, v in finished.items()},
        "staleness_mean": 2.0,
        "trainer_idle_fraction": 0.4,
        "worker_idle_fraction": 0.3,
        "continued": 12,
    }
    return rows, summary


def test_throughput_is_over_the_warm_steps_with_evaluations_out():
    rows, summary = rows_and_summary(step_s=0.5, eval_s=3.0, tokens=640)
    figures = bench_in_flight.figures(summary, rows, batch_size=64)
    assert figures["steps_per_s"] == pytest.approx(2.0)
    # 640 tokens a step: 1280 a second of run, 5120 a second of generation.
    assert figures["tokens_per_s"] == pytest.approx(1280.0)
    assert figures["generation_tokens_per_s"] == pytest.approx(5120.0)
    assert figures["response_tokens_mean"] == pytest.approx(10.0)
    assert figures["partial_fraction"] == pytest.approx(0.225)
    assert (figures["version_span_max"], figures["continued"]) == (1, 12)
    assert (figures["initial_accuracy"], figures["final_accuracy"]) == (0.5, 0.8)


def test_mfu_is_a_warm_steps_model_flops_at_its_rate_over_the_peak():
    from rlax_tpu.simulator.model import decode_flops_per_token

    train, heldout = Path("/data/train.jsonl"), Path("/data/heldout.jsonl")
    config = bench_in_flight.bench_config(True, Path("/w"), train, heldout, None, [])
    rows, summary = rows_and_summary(step_s=0.5, eval_s=3.0, tokens=640)
    for r in rows[1:]:  # 2457.6 tokens a warm update; the first two compile a fifth
        compile_s = 0.06 if r["step"] <= 2 else 0.0
        r.update({"train/tokens_per_s": 8192.0, "train/time/step_s": 0.36})
        r.update({"train/time/compile_s": compile_s, "train/mfu": 0.02})
    figures = bench_in_flight.figures(summary, rows, 64, config, peak_flops=1e11)
    # 640 tokens a step at a context of the expected prompt (max_prompt_len 48 / 2) and
    # half the 10-token mean response.
    generation = 640 * decode_flops_per_token(config.model, 24 + 5)
    per_step = 6 * bench_in_flight.num_params(config) * 8192 * 0.36 + generation
    assert figures["model_flops_per_step"] == pytest.approx(per_step)
    assert figures["model_flops_per_s"] == pytest.approx(2.0 * per_step)
    assert figures["mfu"] == pytest.approx(figures["model_flops_per_s"] / 1e11)
    assert 0 < figures["mfu"] < 1 and figures["trainer_mfu"] == pytest.approx(0.02)
    assert bench_in_flight.figures(summary, rows, 64)["mfu"] is None  # no config: none


def test_time_to_accuracy_is_the_first_rl_evaluation_at_the_target():
    rows, summary = rows_and_summary(step_s=0.5, eval_s=3.0, tokens=640)
    figures = bench_in_flight.figures(summary, rows, batch_size=64)
    # Step 5's evaluation ends at 3 + 5 × 0.5 + 3 seconds.
    assert bench_in_flight.time_to_accuracy(figures, 0.7) == (pytest.approx(8.5), 5)
    # The warm start's own evaluation does not count: a target it meets is met at step 5.
    assert bench_in_flight.time_to_accuracy(figures, 0.4)[1] == 5
    assert bench_in_flight.time_to_accuracy(figures, 0.9) == (None, None)
    assert bench_in_flight.time_to_accuracy(figures, None) == (None, None)


def run(round_, seed, mode, *, tok, steps, acc, to_acc):
    figures = {
        "tokens_per_s": tok,
        "generation_tokens_per_s": 2 * tok,
        "steps_per_s": steps,
        "final_accuracy": acc,
        "time_to_accuracy_s": to_acc,
        "version_span_max": 1,
    }
    figures.update({k: 0.0 for k in bench_in_flight.MEDIAN_FIGURES if k not in figures})
    return {"round": round_, "seed": seed, "mode": mode, "figures": figures}


def test_speedups_are_per_round_and_seed_ratios_to_off():
    runs = [
        run(1, 0, "off", tok=100, steps=1.0, acc=0.7, to_acc=40.0),
        run(1, 0, "resume", tok=150, steps=1.5, acc=0.72, to_acc=20.0),
        run(1, 0, "keep", tok=120, steps=1.2, acc=0.68, to_acc=None),
        run(2, 0, "off", tok=200, steps=2.0, acc=0.7, to_acc=30.0),
        run(2, 0, "resume", tok=220, steps=2.2, acc=0.72, to_acc=30.0),
        run(2, 0, "keep", tok=300, steps=3.0, acc=0.68, to_acc=15.0),
    ]
    s = bench_in_flight.speedups(runs)
    assert s["resume"]["throughput"] == {"median": pytest.approx(1.3), "min": 1.1, "max": 1.5}
    assert s["resume"]["time_to_accuracy"]["median"] == pytest.approx(1.5)
    # A run that missed its target has no ratio: keep's is round 2's alone.
    assert s["keep"]["time_to_accuracy"] == {"median": 2.0, "min": 2.0, "max": 2.0}
    summary = bench_in_flight.summarise(runs, "keep")
    assert summary["target_reached"] == 1 and summary["runs"] == 2
    assert set(bench_in_flight.MEDIAN_FIGURES) >= {"mfu", "model_flops_per_s", "peak_flops"}
    for r, mfu in zip(runs, (0.012345, 0.0167, 0.0) * 2, strict=True):
        r["figures"]["mfu"] = mfu
    assert bench_in_flight.summarise(runs, "off")["mfu"] == 0.012345  # not rounded
    assert summary["time_to_accuracy_s"] is None  # half missed: the median is a miss


def test_accuracy_deltas_are_per_seed_and_their_mean():
    runs = [
        run(1, seed, mode, tok=1, steps=1, acc=acc, to_acc=1)
        for seed, accs in ((0, (0.70, 0.74, 0.66)), (1, (0.60, 0.60, 0.64)))
        for mode, acc in zip(bench_in_flight.MODES, accs, strict=True)
    ]
    deltas = bench_in_flight.accuracy_deltas(runs, [0, 1])
    assert deltas["resume"]["per_seed"] == {"0": pytest.approx(0.04), "1": 0.0}
    assert deltas["resume"]["mean"] == pytest.approx(0.02)
    assert deltas["keep"]["mean"] == pytest.approx(0.0)


def test_length_distribution_fits_the_lognormal_shape():
    lengths = [8, 2, 64, 4, 8, 16, 8, 32]  # 2^k: ln length is k·ln 2
    d = bench_in_flight.length_distribution(lengths, max_new_tokens=64)
    assert (d["count"], d["median"], d["p90"], d["max"], d["mean"]) == (8, 8, 64, 64, 17.75)
    assert d["at_max_new_tokens"] == pytest.approx(1 / 8, abs=1e-3)
    # k = 1 2 3 3 3 4 5 6: standard deviation sqrt(109/8 - (27/8)^2) = 1.495, times ln 2.
    assert d["sigma_log"] == pytest.approx(1.036, abs=1e-3)
    assert bench_in_flight.length_distribution([], 64) is None


def test_the_config_is_the_demos_model_on_the_task_with_n_4():
    train, heldout = Path("/data/train.jsonl"), Path("/data/heldout.jsonl")
    config = bench_in_flight.bench_config(False, Path("/w"), train, heldout, None, [])
    (dataset,) = config.controller.datasets
    assert (dataset.path, dataset.sft_field) == (str(train), "solution")
    assert config.controller.eval_dataset == str(heldout)
    assert (config.staleness.reload_every, config.staleness.max_staleness) == (1, 4)
    assert config.inference.max_new_tokens == 64 and config.inference.in_flight_update == "off"
    assert bench_in_flight._tick_tokens(config) == 16  # 64 / (J + 1), J = 3
    assert config.model.hidden_size == 128  # the demo's
    assert config.compilation_cache == "/w/compile_cache"  # shared by the runs, not in the repo
    quick = bench_in_flight.bench_config(True, Path("/w"), train, heldout, 4, [])
    assert quick.controller.num_steps == 4 and quick.inference.max_new_tokens == 32
    keep = bench_in_flight.mode_config(config, "keep", 2, Path("/runs/x"))
    assert (keep.inference.in_flight_update, keep.seed) == ("keep", 2)


def test_bad_arguments_are_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        bench_in_flight.main(["--steps", "2", "--work-dir", "/nonexistent/x"])
    assert "warm-up" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_in_flight.main(["--calibration", "/nonexistent.json"])
    assert "no such file" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    """The --quick smoke run: an SFT warm start, off, resume and keep, the report. About
    2 minutes on 2 cores, so not in the default run. In its own process: the tool runs the
    warm start in-process on the config's 2 CPU devices, not the 8 this session forces."""
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(ROOT / "tools" / "bench_in_flight.py"), "--quick"]
    command += ["--rounds", "1", "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["runs"]] == list(bench_in_flight.MODES)
    assert report["modes"]["off"]["partial_fraction"] == 0.0
    for mode in bench_in_flight.IN_FLIGHT:
        assert report["modes"][mode]["partial_fraction"] > 0  # responses crossed ticks
        assert report["speedup_in_flight_vs_off"][mode]["throughput"]["median"] > 0
        assert set(report["simulator"][mode]) >= {"steps_per_s", "generation_tokens_per_s"}
    assert report["response_lengths"]["warm_start_policy"]["count"] > 0
    assert "in flight vs off" in done.stdout
