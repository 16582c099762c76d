"""Throughput figures of the trainer: a measured matmul peak of the mesh and the MFU
estimate (model FLOPs per second / that peak).

The peak is measured, not looked up, so the estimate means the same thing on a CPU
with virtual devices, a GPU or a TPU slice: a large matmul sharded over every device
of the mesh, in the model's compute dtype.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@functools.cache
def _measure(devices: tuple, dtype_name: str, size: int, repeats: int) -> float:
    mesh = Mesh(list(devices), ("all",))
    n = len(devices)
    dtype = jnp.dtype(dtype_name)
    a = jax.device_put(
        jnp.ones((n * size, size), dtype), NamedSharding(mesh, PartitionSpec("all", None))
    )
    b = jax.device_put(jnp.ones((size, size), dtype), NamedSharding(mesh, PartitionSpec()))
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    matmul(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n * size**3 / best


def matmul_peak_flops(mesh: Mesh, dtype: str = "float32") -> float:
    """Measured FLOP/s of a [n·k, k] × [k, k] matmul over all devices of `mesh` (cached)."""
    devices = tuple(mesh.devices.flat)
    size = 512 if devices[0].platform == "cpu" else 4096
    return _measure(devices, dtype, size, 3 if devices[0].platform == "cpu" else 10)


def mfu(model_flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: (model_flops / seconds) / peak_flops."""
    return model_flops / max(seconds, 1e-12) / peak_flops
