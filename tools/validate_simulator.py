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
# The demo task, from its definition (rlax_tpu/verifiers/tasks.py, configs/tiny_cpu.py):
# "What is A op B? Answer with just the number." with operands <= 20 is 42-44 characters
# (one token each); an answer is one or two digits and the end-of-sequence token.
DEMO_SETTINGS = {
    "prompt_tokens": {"kind": "fixed", "median": 44},
    "response_tokens": {"kind": "empirical", "values": [2, 3, 3]},
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
    and each worker run XLA on cpu_devices (2) virtual devices, i.e. all cores."""
    cores = float(e2e.get("cpu_count") or 2)
    return {"timing": {"host_cores": cores, "trainer_cores": cores, "worker_cores": cores}}


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


def predict(e2e: dict, calibration_files: list[str], fitted: dict | None = None) -> dict:
    out = {}
    for mode in MODES:
        calibration = _calibration(calibration_files, e2e)
        if fitted:
            calibration.add_settings({"timing": fitted})
        workload, timing, sim, _ = calibrate(e2e_config(e2e, mode), calibration)
        result = simulate(workload, timing, seed=sim.seed)
        out[mode] = figures(result, e2e[mode])
    on, off = out["on_policy"]["time_to_target_s"], out["off_policy"]["time_to_target_s"]
    out["speedup_off_vs_on"] = on / off if on and off else None
    return out


def fit_on_policy(e2e: dict, calibration_files: list[str]) -> dict:
    """What no component benchmark measures, fitted to the on-policy mode alone
    (rlax_tpu.simulator.fit): per-rollout streaming and logging, the train-step RPC around
    the jitted step, the controller's per-step work, the first step's compile."""
    measured = {**e2e["on_policy"], "num_workers": e2e["num_workers"]}
    return fit_to_measurement(
        e2e_config(e2e, "on_policy"), _calibration(calibration_files, e2e), measured
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
    args = parser.parse_args(argv)
    e2e = json.loads(Path(args.e2e).read_text())
    for path in args.calibration:
        data = json.loads(Path(path).read_text())
        from rlax_tpu.simulator.model import benchmark_kind

        if benchmark_kind(data) == "e2e":
            parser.error(f"{path} is an end-to-end result: predictions use components only")
    components = predict(e2e, args.calibration)
    fitted = fit_on_policy(e2e, args.calibration)
    with_fit = predict(e2e, args.calibration, fitted)
    predictions = {"components": components, "fit_on_policy": with_fit}
    rows = table(e2e, predictions)
    timing = calibrate(e2e_config(e2e, "on_policy"), _calibration(args.calibration, e2e))[1]
    print(
        f"e2e: {args.e2e} ({e2e.get('device')}, {e2e.get('steps')} steps, quick={e2e.get('quick')})"
    )
    print("calibration: " + ", ".join(args.calibration))
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


def _calibration(files: list[str], e2e: dict) -> Calibration:
    calibration = Calibration()
    for path in files:
        calibration.add_file(path)
    calibration.add_settings(DEMO_SETTINGS)
    calibration.add_settings(machine_settings(e2e))
    return calibration


if __name__ == "__main__":
    sys.exit(main())
