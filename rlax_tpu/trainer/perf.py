"""Throughput figures of the trainer: a measured matmul peak of the mesh, the MFU
estimate (model FLOPs per second / that peak), and the seconds spent compiling (so that a
step's throughput leaves its compile out).

The peak is measured, not looked up, so the estimate means the same thing on a CPU
with virtual devices, a GPU or a TPU slice: a large matmul sharded over every device
of the mesh, in the model's compute dtype.
"""

from __future__ import annotations

import functools
import threading
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


def devices_peak_flops(dtype: str = "float32") -> float:
    """`matmul_peak_flops` over a mesh of every device of this process (cached): the peak a
    benchmark holds the work of all its devices against."""
    return matmul_peak_flops(Mesh(jax.devices(), ("all",)), dtype)


def mfu(model_flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: (model_flops / seconds) / peak_flops."""
    return model_flops / max(seconds, 1e-12) / peak_flops


def mfu_figures(
    model_flops: float | None, seconds: float | None, peak_flops: float | None
) -> dict[str, float | None]:
    """A timed piece of work against the peak: `model_flops` (its analytic FLOPs),
    `model_flops_per_s` (achieved: those over `seconds`, its time), `peak_flops` (the
    measured peak it is held against) and `mfu` (achieved / peak); a figure whose inputs
    are missing is None."""
    rate = None if model_flops is None or not seconds else model_flops / seconds
    return {
        "model_flops": model_flops,
        "model_flops_per_s": rate,
        "peak_flops": peak_flops,
        "mfu": None if rate is None or not peak_flops else mfu(model_flops, seconds, peak_flops),
    }


# JAX's own events (jax.monitoring) of compiling a program: tracing it, lowering it to MLIR,
# and the backend compile (a compilation-cache read included).
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_compile_lock = threading.Lock()
_compile_s = 0.0
_listening = False


def compile_seconds() -> float:
    """Seconds this process has spent compiling since its first call (which starts the
    count); the difference over a step is that step's compile time."""
    global _listening
    with _compile_lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
        return _compile_s


def _on_duration(event: str, duration: float, **_) -> None:
    global _compile_s
    if event in COMPILE_EVENTS:
        with _compile_lock:
            _compile_s += duration
