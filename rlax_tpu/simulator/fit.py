"""Calibration from an end-to-end measurement: the costs no component benchmark sees (the
controller's own work per step, per-rollout streaming and logging, the train-step RPC
around the jitted step, compiles), fitted so that the simulation of the measured run
reproduces its figures (tools/bench_e2e.py's JSON per mode: steps_per_s, wall_s,
trainer_idle_fraction, worker_idle_fraction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from rlax_tpu.config import RunConfig
from rlax_tpu.simulator.events import SimResult, simulate
from rlax_tpu.simulator.model import Calibration, calibrate

# (timing field, what it is fitted to, the simulated figure, the measured figure)
_TARGETS: tuple[tuple[str, Callable[[SimResult], float], Callable[[Mapping], float]], ...] = (
    (
        "rollout_overhead_s",
        lambda r: sum(r.worker_busy_s),
        lambda m: (1 - m["worker_idle_fraction"]) * m["wall_s"] * m.get("num_workers", 1),
    ),
    (
        "train_fixed_s",
        lambda r: r.trainer_busy_s,
        lambda m: (1 - m["trainer_idle_fraction"]) * m["wall_s"],
    ),
    ("controller_step_s", lambda r: r.warm_step_time_s, lambda m: 1 / m["steps_per_s"]),
    ("trainer_compile_s", lambda r: r.wall_s, lambda m: m["wall_s"]),
)


def fit_to_measurement(
    config: RunConfig,
    calibration: Calibration,
    measured: Mapping[str, float],
    *,
    rounds: int = 3,
    iterations: int = 30,
) -> dict[str, float]:
    """Timing figures (rollout_overhead_s, train_fixed_s, controller_step_s,
    trainer_compile_s) that make the simulation of `config` match `measured`; each is
    bisected in turn against the figure it moves most, for a few rounds. Add them to a
    Calibration with `add_settings({"timing": fitted})`."""
    base = calibrate(config, calibration)
    workload, timing, sim = base[0], base[1], base[2]
    fitted = {
        "rollout_overhead_s": 0.0,
        "train_fixed_s": timing.train_fixed_s,
        "controller_step_s": 0.0,
        "trainer_compile_s": 0.0,
    }

    def run(values: dict[str, float]) -> SimResult:
        return simulate(workload, dataclasses.replace(timing, **values), seed=sim.seed)

    for _ in range(rounds):
        for key, simulated, target in _TARGETS:
            goal = target(measured)
            lo, hi = 0.0, 1.0
            while simulated(run({**fitted, key: hi})) < goal and hi < 1e6:
                hi *= 4
            for _ in range(iterations):
                mid = (lo + hi) / 2
                if simulated(run({**fitted, key: mid})) < goal:
                    lo = mid
                else:
                    hi = mid
            fitted[key] = (lo + hi) / 2
    return fitted
