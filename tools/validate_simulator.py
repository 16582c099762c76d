#!/usr/bin/env python3
"""Predict tools/bench_e2e.py's figures with the simulator and compare them with a measurement.

    python tools/validate_simulator.py --e2e E2E.json --calibration BENCH.json [...] [--json OUT]

The e2e run's own config is rebuilt (configs/tiny_cpu.py with bench_e2e's QUICK or FULL
overrides, as its JSON says) for each mode (on-policy, one-step, off-policy) and simulated
with a timing model calibrated only from the component benchmarks given (bench_inference,
bench_trainer, bench_param_server, bench_verifier JSONs) plus what the task and the machine
fix without measuring the run: the demo's prompt and answer lengths (from the prompt
template and the operand range) and the machine's cores shared by every component.
Compiles, the controller's own per-step work and the cost of oversubscribing the cores are
not measured by any component benchmark; they are left at zero ("components only"), and
then, as a second prediction, fitted to the on-policy mode alone and used to predict the
two other modes ("+ on-policy fit"). Prints prediction against measurement and the error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from rlax_tpu.config import RunConfig, StalenessConfig, load_config  # noqa: E402
from rlax_tpu.simulator import (  # noqa: E402
    Calibration,
    SimResult,
    calibrate,
    simulate,
)
from rlax_tpu.simulator.fit import fit_to_measurement  # noqa: E402

MODES = {"on_policy": (1, 0), "one_step": (1, 1), "off_policy": (1, 4)}  # as bench_e2e
FIGURES = (
    "steps_per_s",
    "trainer_idle_fraction",
    "worker_idle_fraction",
    "staleness_mean",
    "wall_s",
)
# The demo task, from its definition (rlax_tpu/launch/job.py: arithmetic_problems with
# operands in [0, 99], "+" and "-"; the character tokenizer: one token per character, no
# BOS): prompts "What is A op B? Answer with just the number." of 43-47 tokens; a response
# is the answer's digits and the end-of-sequence token. A policy sampled at temperature 1
# does not always stop there: LENGTH_TAIL of responses are assumed to run to
# max_new_tokens (an assumption, not a measurement: see docs/simulator.md).
LENGTH_TAIL = 0.01
SEEDS = range(8)


def demo_settings(max_new_tokens: int, length_tail: float = LENGTH_TAIL) -> dict:
    from rlax_tpu.launch.job import ARITHMETIC_MAX_OPERAND, ARITHMETIC_OPS
    from rlax_tpu.verifiers.tasks import arithmetic_problems

    problems = arithmetic_problems(
        0, 1000, max_operand=ARITHMETIC_MAX_OPERAND, ops=ARITHMETIC_OPS, split="train"
    )
    prompts = [float(len(p["prompt"])) for p in problems]
    answers = [float(len(p["answer"]) + 1) for p in problems]
    tail = round(len(answers) * length_tail / (1 - length_tail))
    answers += [float(max_new_tokens)] * tail
    return {
        "prompt_tokens": {"kind": "empirical", "values": prompts},
        "response_tokens": {"kind": "empirical", "values": answers},
    }


def e2e_config(e2e: dict, mode: str) -> RunConfig:
    """The config bench_e2e ran `mode` with."""
    import bench_e2e  # tools/bench_e2e.py: its override lists (imports no JAX)

    overrides = bench_e2e.QUICK if e2e.get("quick") else bench_e2e.FULL
    config = load_config(str(ROOT / "configs" / "tiny_cpu.py"), list(overrides))
    config = config.apply_overrides([f"inference.num_workers={e2e['num_workers']}"])
    eta, n = MODES[mode]
    return dataclasses.replace(config, staleness=StalenessConfig(reload_every=eta, max_staleness=n))


def machine_settings(e2e: dict) -> dict:
    """Every component of the demo runs on this machine: its cores are shared. The trainer
    and each worker run XLA on cpu_devices (2) virtual devices, i.e. all cores. A publish or
    a pull keeps two processes busy (the trainer or the worker, and the parameter server):
    two cores too."""
    cores = float(e2e.get("cpu_count") or 2)
    return {
        "timing": {
            "host_cores": cores,
            "trainer_cores": cores,
            "worker_cores": cores,
            "io_cores": min(2.0, cores),
        }
    }


def figures(result: SimResult, e2e_mode: dict) -> dict:
    steps_to_target = e2e_mode.get("steps_to_target")
    return {
        "steps_per_s": 1 / result.warm_step_time_s,
        "trainer_idle_fraction": result.trainer_idle_fraction,
        "worker_idle_fraction": result.worker_idle_fraction,
        "staleness_mean": result.staleness_mean,
        "wall_s": result.wall_s,
        # Learning is not simulated: the measured step at which the target was reached.
        "time_to_target_s": (
            result.time_to_eval(steps_to_target) if steps_to_target is not None else None
        ),
    }


def predict(
    e2e: dict,
    calibration_files: list[str],
    fitted: dict | None = None,
    length_tail: float = LENGTH_TAIL,
) -> dict:
    out = {}
    for mode in MODES:
        calibration = _calibration(calibration_files, e2e, length_tail)
        if fitted:
            calibration.add_settings({"timing": fitted})
        workload, timing, sim, _ = calibrate(e2e_config(e2e, mode), calibration)
        # Lengths are drawn at random, and whether (and when) a batch first reaches a longer
        # padded length, i.e. compiles mid-run, differs from draw to draw: the prediction is
        # the mean over SEEDS simulated runs.
        runs = [figures(simulate(workload, timing, seed=seed), e2e[mode]) for seed in SEEDS]
        out[mode] = {key: _mean([r[key] for r in runs]) for key in runs[0]}
    on, off = out["on_policy"]["time_to_target_s"], out["off_policy"]["time_to_target_s"]
    out["speedup_off_vs_on"] = on / off if on and off else None
    return out


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def fit_on_policy(
    e2e: dict, calibration_files: list[str], length_tail: float = LENGTH_TAIL
) -> dict:
    """What no component benchmark measures, fitted to the on-policy mode alone
    (rlax_tpu.simulator.fit): per-rollout streaming and the RPCs around a worker's load, the
    train-step RPC around the trainer's step, the controller's per-step work, the worker's
    first compile."""
    measured = {**e2e["on_policy"], "num_workers": e2e["num_workers"]}
    return fit_to_measurement(
        e2e_config(e2e, "on_policy"),
        _calibration(calibration_files, e2e, length_tail),
        measured,
        rounds=2,
        iterations=16,
        seeds=SEEDS,
    )


def error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return predicted / measured - 1


def table(e2e: dict, predictions: dict[str, dict]) -> list[dict]:
    rows = []
    for mode in MODES:
        for key in (*FIGURES, "time_to_target_s"):
            measured = e2e[mode].get(key)
            row = {"mode": mode, "figure": key, "measured": measured}
            for name, prediction in predictions.items():
                row[name] = prediction[mode][key]
                row[f"{name}_error"] = error(prediction[mode][key], measured)
            rows.append(row)
    row = {"mode": "-", "figure": "speedup_off_vs_on", "measured": e2e.get("speedup_off_vs_on")}
    for name, prediction in predictions.items():
        row[name] = prediction["speedup_off_vs_on"]
        row[f"{name}_error"] = error(prediction["speedup_off_vs_on"], row["measured"])
    rows.append(row)
    return rows


def show(value: float | None, pct: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isinf(value)):
        return "n/a"
    return f"{value:+.0%}" if pct else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--e2e", required=True, help="tools/bench_e2e.py --json output")
    parser.add_argument(
        "--calibration",
        action="append",
        default=[],
        metavar="FILE",
        help="component benchmark JSON (bench_inference/trainer/param_server/verifier); repeat",
    )
    parser.add_argument("--json", help="write the comparison here")
    parser.add_argument(
        "--length-tail",
        type=float,
        default=LENGTH_TAIL,
        help="fraction of responses assumed to run to max_new_tokens (default %(default)s)",
    )
    args = parser.parse_args(argv)
    e2e = json.loads(Path(args.e2e).read_text())
    not_run = [mode for mode in MODES if e2e.get(mode) is None]
    if not_run:
        parser.error(
            f"{args.e2e} has no figures for {not_run} (bench_e2e --modes left them out): "
            "validation compares every mode; run bench_e2e with all of them"
        )
    for path in args.calibration:
        data = json.loads(Path(path).read_text())
        from rlax_tpu.simulator.calibration import benchmark_kind

        if benchmark_kind(data) == "e2e":
            parser.error(f"{path} is an end-to-end result: predictions use components only")
    components = predict(e2e, args.calibration, length_tail=args.length_tail)
    fitted = fit_on_policy(e2e, args.calibration, args.length_tail)
    with_fit = predict(e2e, args.calibration, fitted, args.length_tail)
    predictions = {"components": components, "fit_on_policy": with_fit}
    rows = table(e2e, predictions)
    calibrated = calibrate(
        e2e_config(e2e, "on_policy"), _calibration(args.calibration, e2e, args.length_tail)
    )
    timing = calibrated[1]
    print(
        f"e2e: {args.e2e} ({e2e.get('device')}, {e2e.get('steps')} steps, quick={e2e.get('quick')})"
    )
    print("calibration: " + ", ".join(args.calibration))
    for note in calibrated[3]:
        print(f"  {note}")
    print(f"responses assumed to run to max_new_tokens: {args.length_tail:.1%}")
    print(f"fitted to on-policy only: {json.dumps({k: round(v, 4) for k, v in fitted.items()})}")
    print(
        f"{'mode':<11}{'figure':<24}{'measured':>10}{'components':>12}{'err':>7}"
        f"{'+on-policy fit':>16}{'err':>7}"
    )
    for row in rows:
        print(
            f"{row['mode']:<11}{row['figure']:<24}{show(row['measured']):>10}"
            f"{show(row['components']):>12}{show(row['components_error'], True):>7}"
            f"{show(row['fit_on_policy']):>16}{show(row['fit_on_policy_error'], True):>7}"
        )
    if args.json:
        report = {
            "e2e": args.e2e,
            "calibration": args.calibration,
            "timing": timing.to_dict(),
            "fitted_on_policy": fitted,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


def _calibration(files: list[str], e2e: dict, length_tail: float = LENGTH_TAIL) -> Calibration:
    calibration = Calibration()
    for path in files:
        calibration.add_file(path)
    max_new_tokens = e2e_config(e2e, "on_policy").inference.max_new_tokens
    calibration.add_settings(demo_settings(max_new_tokens, length_tail))
    calibration.add_settings(machine_settings(e2e))
    return calibration


if __name__ == "__main__":
    sys.exit(main())
