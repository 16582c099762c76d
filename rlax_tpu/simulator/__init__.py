"""Scale planning without spending the hardware: a discrete-event simulator of a run
(`simulate`), LlamaRL's analytical step-time model (`analytical`), calibration from the
project's benchmark JSONs, from given hardware figures and from `rlax-tpu compile` reports
(`calibrate`), and the report (`report`). Pure Python: it imports no JAX. CLI:
`rlax-tpu simulate CONFIG`.

    workload, timing, sim, notes = calibrate(config, calibration)
    result = simulate(workload, timing, preemption=sim.preemption, seed=sim.seed)
"""

from rlax_tpu.simulator.calibration import Calibration, benchmark_kind, calibrate
from rlax_tpu.simulator.events import WARMUP_STEPS, SimResult, simulate, split_jobs
from rlax_tpu.simulator.model import (
    CalibrationError,
    Distribution,
    HardwareSpec,
    PreemptionConfig,
    SimulatorConfig,
    TimingModel,
    Workload,
    count_arrays,
    count_params,
    generation_s,
    lora_params,
    model_bytes,
)

__all__ = [
    "WARMUP_STEPS",
    "Calibration",
    "CalibrationError",
    "Distribution",
    "HardwareSpec",
    "PreemptionConfig",
    "SimResult",
    "SimulatorConfig",
    "TimingModel",
    "Workload",
    "benchmark_kind",
    "calibrate",
    "count_arrays",
    "count_params",
    "lora_params",
    "generation_s",
    "model_bytes",
    "simulate",
    "split_jobs",
]
