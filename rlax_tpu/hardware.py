"""What `rlax-tpu compile` knows about TPU chips and GPUs, and the environment the compilers
need on a host without them. Imports no JAX: the CLI sets the environment first.

Per-chip figures are Google Cloud's published ones (cloud.google.com/tpu/docs/v4, v5e,
v5p, v6e; checked 2026-11): HBM capacity as JAX reports it (v5p: 95 GiB of the 96 GiB
physical, the rest reserved by the runtime), peak bf16 matrix FLOP/s, HBM bandwidth.
GPUs (SXM parts where there are several): memory as nvidia-smi reports it (memory.total in
MiB, the total XLA_PYTHON_CLIENT_MEM_FRACTION is a fraction of; public figures, not read on
a GPU by this project), dense bf16 tensor-core FLOP/s and HBM bandwidth from NVIDIA's data
sheets.
"""

from __future__ import annotations

import dataclasses
import os

GiB = 2**30
# A program fits when it needs at most this fraction of a chip's HBM: the runtime, the
# allocator's fragmentation and buffers outside the compiled program take the rest.
FIT_FRACTION = 0.9
# The fraction of a compiled program's roofline a run is assumed to reach, by kind of
# program: a statement to plan with, not a measurement (the simulator's
# `compiled_*_efficiency` defaults are these; calibrate them from a run's own timings).
STATED_EFFICIENCY = {"train": 0.4, "prefill": 0.5, "decode": 0.6}


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    name: str  # libtpu's generation name, as in MeshConfig.topology ("v5p")
    hbm_bytes: int  # per chip
    peak_flops_per_s: float  # bf16, per chip
    hbm_bytes_per_s: float  # per chip
    source: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("v4", 32 * GiB, 275e12, 1200e9, "https://cloud.google.com/tpu/docs/v4"),
    "v5e": ChipSpec("v5e", 16 * GiB, 197e12, 819e9, "https://cloud.google.com/tpu/docs/v5e"),
    "v5p": ChipSpec("v5p", 95 * GiB, 459e12, 2765e9, "https://cloud.google.com/tpu/docs/v5p"),
    "v6e": ChipSpec("v6e", 32 * GiB, 918e12, 1638e9, "https://cloud.google.com/tpu/docs/v6e"),
}


MiB = 2**20
GPUS: dict[str, ChipSpec] = {
    "a100-40gb": ChipSpec(
        "a100-40gb", 40960 * MiB, 312e12, 1555e9, "https://www.nvidia.com/en-us/data-center/a100/"
    ),
    "a100-80gb": ChipSpec(
        "a100-80gb", 81920 * MiB, 312e12, 2039e9, "https://www.nvidia.com/en-us/data-center/a100/"
    ),
    "h100": ChipSpec(
        "h100", 81559 * MiB, 989e12, 3350e9, "https://www.nvidia.com/en-us/data-center/h100/"
    ),
    "h200": ChipSpec(
        "h200", 143771 * MiB, 989e12, 4800e9, "https://www.nvidia.com/en-us/data-center/h200/"
    ),
    "l4": ChipSpec(
        "l4", 23034 * MiB, 121e12, 300e9, "https://www.nvidia.com/en-us/data-center/l4/"
    ),
}


def chip_of(topology: str) -> ChipSpec:
    """The chip of a MeshConfig.topology ("v5p:2x4x4" -> v5p)."""
    return CHIPS[topology.partition(":")[0]]


def parse_gpu(gpu: str) -> tuple[str, int]:
    """A TrainerConfig / InferenceConfig `gpu` ("h100", "a100-80gb:2") -> (model, count)."""
    model, _, count = gpu.partition(":")
    return model, int(count or 1)


def compile_target(config, component: str) -> str:
    """What `component`'s programs are compiled for: its GPUs ("h100:1") when
    `<component>.gpu` is set, else its TPU topology ("v5p:2x4x4"; "" when unknown).
    `config` is a RunConfig (not imported: this module stays free of the config's imports
    for the CLI's sake)."""
    gpu = getattr(config, component).gpu
    if gpu:
        model, count = parse_gpu(gpu)
        return f"{model}:{count}"
    return config.tpu_topology(component)


def prepare_environment(*, cpu_devices: int = 0, on_gpu: bool = False) -> None:
    """Point JAX at libtpu's compiler without TPU hardware; call before JAX starts.

    JAX runs on the CPU (nothing is executed; on a TPU VM the chips stay free for a job);
    the TPU devices are abstract ones of the topology (rlax_tpu.compile.topology). No
    metadata-server query (there is no TPU VM to ask), no libtpu lockfile (another JAX
    process may hold libtpu), and no persistent compilation cache, so that compile times
    are measured, not read back.

    GPU programs are compiled for `cpu_devices` CPU devices (the XLA:CPU estimate), or with
    `on_gpu` by this machine's GPUs (XLA:GPU; JAX then takes no GPU memory up front, so a
    run on the same GPUs is not disturbed).
    """
    if on_gpu:
        os.environ["JAX_PLATFORMS"] = "cuda,cpu"
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    if cpu_devices > 1 and flag not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={cpu_devices}".strip()
    os.environ["TPU_SKIP_MDS_QUERY"] = "1"
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"


def host_cpu() -> str:
    """This host's CPU model and core count, as benchmarks name the host of their figures
    (XLA:CPU rounds differently on different CPUs)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"
