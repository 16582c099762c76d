"""`rlax-tpu compile`: prove a config fits its TPU topology before renting it.

Every jitted program the run executes on its accelerators (`programs.py`) is lowered on
abstract inputs and compiled by libtpu's real compiler for the abstract devices of the
trainer's and the inference workers' topologies (`MeshConfig.topology`, else the deploy
slices; `MeshConfig.num_slices` of them, joined over DCN), on any host: nothing is
allocated or run. Per program and per chip: memory by kind against the chip's HBM, FLOPs
and HBM bytes per call, the roofline time, compile time (`measure.py`). A component on GPUs
(`trainer.gpu` / `inference.gpu`) is compiled for this machine's GPUs, or without them by
XLA:CPU for as many CPU devices (an estimate, labelled so), and checked against its
process's share of a GPU (`gpu_memory_fraction`).
`compile_config` needs JAX set up by `hardware.prepare_environment()` first (the CLI,
`rlax_tpu/cli/compile.py`, does it).
"""

from rlax_tpu.compile.measure import ProgramReport
from rlax_tpu.compile.programs import PROGRAMS
from rlax_tpu.compile.report import CompileReport, ComponentTarget, compile_config, format_report
from rlax_tpu.compile.topology import TopologyError, abstract_devices

__all__ = [
    "CompileReport",
    "ComponentTarget",
    "PROGRAMS",
    "ProgramReport",
    "TopologyError",
    "abstract_devices",
    "compile_config",
    "format_report",
]
