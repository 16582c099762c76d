"""Calibration from an end-to-end measurement: the costs no component benchmark sees (the
controller's own work per step, per-rollout streaming and the RPCs around a worker's load,
the train-step RPC around the trainer's step, a worker's first compile), fitted so that the
simulation of the measured run reproduces its figures (tools/bench_e2e.py's JSON per mode:
steps_per_s, wall_s, trainer_idle_fraction, worker_idle_fraction). Simulated figures are
means over `seeds` (lengths are drawn at random, and with them the mid-run compiles).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from rlax_tpu.config import RunConfig
from rlax_tpu.simulator.calibration import Calibration, calibrate
from rlax_tpu.simulator.events import SimResult, simulate

# (timing field, what it is fitted to, the simulated figure, the measured figure)
_TARGETS: tuple[tuple[str, Callable[[SimResult], float], Callable[[Mapping], float]], ...] = (
    (
        "rollout_overhead_s",
        lambda r: sum(r.worker_busy_s),
        lambda m: (1 - m["worker_idle_fraction"]) * m["wall_s"] * m.get("num_workers", 1),
    ),
    (
        "train_overhead_s",
        lambda r: r.trainer_busy_s,
        lambda m: (1 - m["trainer_idle_fraction"]) * m["wall_s"],
    ),
    ("controller_step_s", lambda r: r.warm_step_time_s, lambda m: 1 / m["steps_per_s"]),
    ("worker_compile_s", lambda r: r.wall_s, lambda m: m["wall_s"]),
)


def fit_to_measurement(
    config: RunConfig,
    calibration: Calibration,
    measured: Mapping[str, float],
    *,
    rounds: int = 3,
    iterations: int = 30,
    seeds: Sequence[int] = (0,),
) -> dict[str, float]:
    """Timing figures (rollout_overhead_s, train_overhead_s, controller_step_s,
    worker_compile_s) that make the simulation of `config` match `measured`; each is
    bisected in turn against the figure it moves most, for a few rounds. Add them to a
    Calibration with `add_settings({"timing": fitted})`."""
    base = calibrate(config, calibration)
    workload, timing = base[0], base[1]
    fitted = {
        "rollout_overhead_s": 0.0,
        "train_overhead_s": timing.train_overhead_s,
        "controller_step_s": 0.0,
        "worker_compile_s": 0.0,
    }

    def run(values: dict[str, float], simulated: Callable[[SimResult], float]) -> float:
        changed = dataclasses.replace(timing, **values)
        results = [simulated(simulate(workload, changed, seed=seed)) for seed in seeds]
        return sum(results) / len(results)

    for _ in range(rounds):
        for key, simulated, target in _TARGETS:
            goal = target(measured)
            lo, hi = 0.0, 1.0
            while run({**fitted, key: hi}, simulated) < goal and hi < 1e6:
                hi *= 4
            for _ in range(iterations):
                mid = (lo + hi) / 2
                if run({**fitted, key: mid}, simulated) < goal:
                    lo = mid
                else:
                    hi = mid
            fitted[key] = (lo + hi) / 2
    return fitted
