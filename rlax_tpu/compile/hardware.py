"""What `rlax-tpu compile` knows about TPU chips, and the environment libtpu's compiler
needs on a host without TPUs. Imports no JAX: the CLI sets the environment first.

Per-chip figures are Google Cloud's published ones (cloud.google.com/tpu/docs/v4, v5e,
v5p, v6e; checked 2026-11): HBM capacity as JAX reports it (v5p: 95 GiB of the 96 GiB
physical, the rest reserved by the runtime), peak bf16 matrix FLOP/s, HBM bandwidth.
"""

from __future__ import annotations

import dataclasses
import os

GiB = 2**30
# A program fits when it needs at most this fraction of a chip's HBM: the runtime, the
# allocator's fragmentation and buffers outside the compiled program take the rest.
FIT_FRACTION = 0.9


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


def chip_of(topology: str) -> ChipSpec:
    """The chip of a MeshConfig.topology ("v5p:2x4x4" -> v5p)."""
    return CHIPS[topology.partition(":")[0]]


def prepare_environment() -> None:
    """Point JAX at libtpu's compiler without TPU hardware; call before JAX starts.

    JAX runs on the CPU (nothing is executed; on a TPU VM the chips stay free for a job);
    the TPU devices are abstract ones of the topology (rlax_tpu.compile.topology). No
    metadata-server query (there is no TPU VM to ask), no libtpu lockfile (another JAX
    process may hold libtpu), and no persistent compilation cache, so that compile times
    are measured, not read back.
    """
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["TPU_SKIP_MDS_QUERY"] = "1"
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
