"""Abstract TPU devices of a topology, and meshes over them, on any host; the devices a GPU
program is compiled for.

libtpu describes a slice ("v5p:2x4x4") without the hardware; its devices take part in
meshes, shardings and compilation like real ones but hold no memory and run nothing.
XLA:GPU cannot compile without a GPU, so a GPU program is compiled for this machine's GPUs
when JAX has them, else for as many CPU devices: XLA:CPU's buffer assignment of the same
program at the same shapes and sharding, an estimate of the GPU's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Iterator

import jax
from jax.sharding import Mesh

from rlax_tpu.config import MeshConfig
from rlax_tpu.sharding import build_mesh


class TopologyError(RuntimeError):
    """libtpu cannot describe the topology (unknown shape, libtpu missing); says why."""


@contextlib.contextmanager
def _captured_stderr() -> Iterator[tempfile.TemporaryFile]:
    """Redirect file descriptor 2 (libtpu's C++ logging writes there) into a file: on a
    host without TPUs libtpu warns that it cannot find the TPU's accelerator type and worker
    hostnames, which the compile does not need."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@functools.cache
def abstract_devices(topology: str, num_slices: int = 1) -> tuple[jax.Device, ...]:
    """The devices of `num_slices` slices of `topology` ("v5p:2x2x1"): one per chip (v4 as
    megacore, as JAX runs it; the others have one TensorCore per JAX device already), slice
    by slice; with several slices each device has its `slice_index`, as on a multi-slice
    job, and the slices are joined over DCN."""
    from jax.experimental import topologies

    kwargs = {"chip_config_name": "megacore"} if topology.startswith("v4:") else {}
    if num_slices > 1:  # one slice: libtpu's single-slice description, as before
        kwargs["num_slices"] = num_slices
    with _captured_stderr() as captured:
        try:
            description = topologies.get_topology_desc(
                topology_name=topology, platform="tpu", **kwargs
            )
        except Exception as e:  # JaxRuntimeError, RuntimeError (no libtpu), ...
            captured.seek(0)
            log = captured.read().decode(errors="replace").strip()
            slices = f" × {num_slices} slices" if num_slices > 1 else ""
            raise TopologyError(
                f"libtpu cannot describe topology {topology!r}{slices}: {e}"
                + (f"\nlibtpu said:\n{log}" if log else "")
                + "\n(`pip install rlax_tpu[tpu]` installs libtpu; the chips along each "
                "axis must be a shape the generation offers, e.g. v5p:2x2x1, v5p:2x4x4, v5e:4x4)"
            ) from None
    return tuple(description.devices)


def topology_mesh(mesh_config: MeshConfig, topology: str) -> Mesh:
    """`mesh_config`'s mesh over the abstract devices of `mesh_config.num_slices` slices of
    `topology` (one slice's shape)."""
    return build_mesh(mesh_config, devices=abstract_devices(topology, mesh_config.num_slices))


def gpu_devices(count: int) -> tuple[tuple[jax.Device, ...], str]:
    """`count` devices to compile a GPU program for, and the compiler that will: this
    machine's GPUs when JAX has them ("XLA:GPU"), else CPU devices ("XLA:CPU", the
    estimate; `hardware.prepare_environment(cpu_devices=...)` makes enough of them)."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # no GPU backend (JAX_PLATFORMS=cpu, no CUDA plugin or no GPU)
        gpus = []
    devices, compiler = (gpus, "XLA:GPU") if gpus else (jax.devices("cpu"), "XLA:CPU")
    if len(devices) < count:
        raise TopologyError(
            f"{compiler} has {len(devices)} device(s) here, the config's GPUs are {count}"
            + (
                ""
                if gpus
                else " (rlax-tpu compile makes that many CPU devices when JAX has not started"
                " yet; set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
            )
        )
    return tuple(devices[:count]), compiler
