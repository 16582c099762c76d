"""tools/bench_e2e.py's arithmetic on synthetic controller output (the benchmark itself runs
the whole job three times, minutes, so it is not run here)."""

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


def test_unknown_modes_are_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        bench_e2e.main(["--modes", "on_policy,sideways", "--work-dir", "/nonexistent/x"])
    assert "sideways" in capsys.readouterr().err
