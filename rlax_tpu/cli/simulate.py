"""`rlax-tpu simulate CONFIG`: size a run before spending the hardware (rlax_tpu.simulator).

`--set` overrides the run config as for `run`; overrides of the simulator's own settings
start with `timing.`, `hardware.`, `preemption.`, `response_tokens`, `prompt_tokens`,
`evaluations` or `seed` (e.g. --set timing.ps_bytes_per_s=5e9). `--calibration` takes
benchmark JSONs of tools/bench_*.py, `rlax-tpu compile --json` reports (the compiled
programs' rooflines) and YAML/JSON settings files, applied in order. With
inference.in_flight_update on, the run is simulated with "off" too, and both are set side by
side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from rlax_tpu.config import RunConfig, load_config

_SIM_KEYS = ("timing", "hardware", "preemption", "response_tokens", "prompt_tokens")
_SIM_KEYS += ("evaluations", "seed")


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--calibration",
        action="append",
        default=[],
        metavar="FILE",
        help="a tools/bench_*.py --json output, an `rlax-tpu compile --json` report of this "
        "config, or a YAML/JSON of simulator settings (timing, hardware, preemption, "
        "response_tokens, ...); repeatable, in order",
    )
    parser.add_argument("--json", dest="json_out", metavar="OUT", help="write the figures here")
    parser.add_argument("--plot", metavar="OUT.png", help="timeline + staleness histogram PNG")
    parser.add_argument(
        "--target-steps", type=int, metavar="K", help="report the time to K steps (default all)"
    )
    parser.add_argument(
        "--analytical",
        action="store_true",
        help="also LlamaRL's step-time model (synchronous co-located vs asynchronous, θ**) "
        "for this run's model and hardware figures",
    )


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What `simulate_config` found: the figures `rlax-tpu simulate` prints and writes (with
    "in_flight" and "speedup_in_flight_vs_off" when the config's in-flight updates carry
    responses over ticks), the simulated run, its workload and simulator settings."""

    figures: dict[str, Any]
    result: Any  # simulator.SimResult
    workload: Any  # simulator.Workload
    sim: Any  # simulator.SimulatorConfig


def simulate_config(
    config: RunConfig, calibration: Any, *, target_steps: int | None = None
) -> Simulation:
    """`config` simulated under `calibration` (a simulator.Calibration); with
    inference.in_flight_update on (and N - η > 0), the same workload and timings are
    simulated with "off" too and set side by side (`report.in_flight_comparison`). Raises
    CalibrationError for calibration that cannot be read or belongs to something else."""
    from rlax_tpu.simulator import calibrate, simulate
    from rlax_tpu.simulator.report import in_flight_comparison, report

    workload, timing, sim, notes = calibrate(config, calibration)
    result = simulate(workload, timing, preemption=sim.preemption, seed=sim.seed)
    figures = report(workload, timing, result, target_steps=target_steps, notes=notes)
    if workload.in_flight is not None:
        off = simulate(
            dataclasses.replace(workload, in_flight=None),
            timing,
            preemption=sim.preemption,
            seed=sim.seed,
        )
        figures["in_flight"] = in_flight_comparison(report(workload, timing, off), figures)
        figures["speedup_in_flight_vs_off"] = figures["in_flight"]["speedup"]
    return Simulation(figures, result, workload, sim)


def main(args: argparse.Namespace) -> int:
    from rlax_tpu.simulator import Calibration, CalibrationError
    from rlax_tpu.simulator.report import (
        PlotUnavailableError,
        format_in_flight,
        format_table,
        plot,
    )

    is_sim = [o.split("=", 1)[0].split(".", 1)[0] in _SIM_KEYS for o in args.overrides]
    run_overrides = [o for o, sim in zip(args.overrides, is_sim, strict=True) if not sim]
    config = load_config(args.config, run_overrides)
    calibration = Calibration()
    try:  # a file that cannot be read, or a benchmark or compile report of something else
        for path in args.calibration:
            calibration.add_file(path)
        calibration.add_overrides(o for o, sim in zip(args.overrides, is_sim, strict=True) if sim)
        simulation = simulate_config(config, calibration, target_steps=args.target_steps)
    except CalibrationError as e:
        print(f"rlax-tpu simulate: calibration: {e}", file=sys.stderr)
        return 2
    figures, workload, sim = simulation.figures, simulation.workload, simulation.sim
    print(format_table(figures))
    if "in_flight" in figures:
        print(format_in_flight(figures["in_flight"]))
    elif config.inference.in_flight_update != "off":
        print(
            f"inference.in_flight_update={config.inference.in_flight_update} changes nothing "
            f"here: N - η = 0 (staleness.max_staleness={workload.policy.max_staleness}, "
            f"reload_every={workload.policy.reload_every}) leaves no tick to carry a response "
            "into"
        )
    if args.analytical:
        figures["analytical"] = _analytical(workload, sim)
        print(figures["analytical"].pop("text"))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(figures, f, indent=2, default=str)
            f.write("\n")
    if args.plot:
        try:
            plot(simulation.result, args.plot, title=f"{config.name}: simulated timeline")
        except PlotUnavailableError as e:
            print(f"rlax-tpu simulate: no plot: {e}", file=sys.stderr)
            return 1
        print(f"plot: {args.plot}")
    return 0


def _analytical(workload, sim) -> dict:
    """LlamaRL's model for this run: η(b) from the timing model's per-sample costs at batch
    b (one decode step shared by b sequences; training linear in tokens), M0 from
    hardware.memory_bytes_per_chip, G0 the chips of the hardware figures (trainer + workers)."""
    from rlax_tpu.simulator import analytical
    from rlax_tpu.simulator.model import count_params
    from rlax_tpu.simulator.report import format_analytical

    t = sim.timing
    model = workload.model
    resp = workload.response_tokens.mean()
    prompt = workload.prompt_tokens.mean()
    chips = max(
        1, sim.hardware.trainer_chips + sim.hardware.chips_per_worker * workload.num_workers
    )
    params = count_params(model)
    problem = analytical.StepTimeProblem(
        devices=chips,
        batch=workload.batch_size,
        memory_bytes=sim.hardware.memory_bytes_per_chip,
        weight_bytes=params * sim.hardware.serve_dtype_bytes,
        activation_bytes=(prompt + resp) * model.hidden_size * model.num_layers * 2 * 4,
        kv_bytes=(prompt + resp) * model.kv_bytes_per_token(sim.hardware.serve_dtype_bytes),
        # Per sample on one device (the paper's η·m is device-seconds per sample).
        eta_train=lambda b: t.train_fixed_s / b + (prompt + resp) * t.train_s_per_token,
        eta_gen=lambda b: resp * (t.decode_step_s + t.decode_call_s / t.decode_steps_per_call) / b,
    )
    sync = analytical.synchronous_optimum(problem)
    asyn = analytical.asynchronous_optimum(problem)
    disaggregated = analytical.disaggregated_synchronous_step_s(problem)
    return {
        "synchronous_step_s": sync.step_s,
        "asynchronous_step_s": asyn.step_s,
        "disaggregated_synchronous_step_s": disaggregated,
        "theta": asyn.theta,
        "speedup": sync.step_s / asyn.step_s,
        "text": format_analytical(sync, asyn, disaggregated),
    }
