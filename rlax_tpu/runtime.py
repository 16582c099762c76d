"""Process start-up: how JAX is brought up for a run.

Some JAX settings (the number of virtual CPU devices) only take effect before JAX
initialises its backends, so the CLI calls `configure_jax` after reading the config
and before anything touches a device. A multi-host trainer joins its job right after that:
`serve trainer` and `serve inference` call `rlax_tpu.distributed.initialize_from_environment`.
"""

from __future__ import annotations

import logging
import os
import sys

from rlax_tpu.config import RunConfig

_log = logging.getLogger(__name__)
_FLAG = "--xla_force_host_platform_device_count"
# With several virtual CPU devices, XLA:CPU runs each device's part of a program on a thread
# of its Eigen pool, the same pool its ops split their own work into. A device part that
# waits in a collective's rendezvous holds its thread, and one that waits for its op's split
# work holds its thread too; when every thread of the pool waits on one of the two, the
# partners never arrive and XLA aborts the process after 40 s (seen in CI: the smoke job on
# 8 devices, 4 device parts in an all-reduce, their 4 partners never started). Single-threaded
# ops per device cannot wait on split work; the devices still run in parallel.
CPU_DEVICES_FLAGS = ("--xla_cpu_multi_thread_eigen=false",)


def jax_environment(config: RunConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables JAX must start with for `config` (from `environ`, default os.environ,
    with the config's additions): XLA_FLAGS with `config.xla_flags` and the CPU device count
    (unless the caller set one), LIBTPU_INIT_ARGS with `config.libtpu_flags`. The run's
    processes (`configure_jax`) and `rlax-tpu compile` both start JAX under these, so what
    is compiled ahead is compiled as the run compiles it."""
    environ = dict(os.environ if environ is None else environ)
    out = {}
    xla = _joined(environ.get("XLA_FLAGS", ""), config.xla_flags)
    if config.cpu_devices > 0 and _FLAG not in xla:
        xla = f"{xla} {_FLAG}={config.cpu_devices}".strip()
    xla = cpu_devices_flags(xla)
    if xla:
        out["XLA_FLAGS"] = xla
    libtpu = _joined(environ.get("LIBTPU_INIT_ARGS", ""), config.libtpu_flags)
    if libtpu:
        out["LIBTPU_INIT_ARGS"] = libtpu
    if "JAX_PLATFORMS" not in environ and _targets_cpu(config) and not _accelerator_present():
        # A config for no TPU slice or GPU, on a host with neither: the CPU alone. JAX would
        # otherwise start an installed TPU plugin (jax[tpu]), which prints pages of warnings
        # on a host without a TPU.
        out["JAX_PLATFORMS"] = "cpu"
    cache = compilation_cache_dir(config)
    if cache and "JAX_COMPILATION_CACHE_DIR" not in environ:
        out["JAX_COMPILATION_CACHE_DIR"] = cache
        # Every program, not only those that compile for over a second (JAX's default): a
        # restart of the CPU demo recompiles dozens of small ones.
        out.setdefault(
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"),
        )
    return out


def _targets_cpu(config: RunConfig) -> bool:
    """Whether `config` names no accelerator: no mesh topology, no GPU."""
    t, i = config.trainer, config.inference
    return not (t.mesh.topology or i.mesh.topology or t.gpu or i.gpu)


def _accelerator_present() -> bool:
    """Whether this host has a TPU chip or a GPU that JAX could use (what JAX itself looks
    for: Google's PCI devices, NVIDIA and AMD device nodes); True when that cannot be told."""
    try:
        from jax._src import hardware_utils
    except ImportError:  # pragma: no cover - layout of a future JAX
        return True
    try:
        return bool(
            hardware_utils.num_available_tpu_chips_and_device_id()[0]
            or hardware_utils.has_visible_nvidia_gpu()
            or hardware_utils.num_available_amd_gpus(stop_at=1)
        )
    except Exception:  # noqa: BLE001 - unreadable /sys or /dev: let JAX decide
        return True


def compilation_cache_dir(config: RunConfig) -> str:
    """Where the run's processes keep compiled programs (config.compilation_cache resolved);
    "" when off."""
    setting = config.compilation_cache
    if setting == "off":
        return ""
    if setting != "auto":
        return setting
    run_dir = config.storage.run_dir
    if "://" not in run_dir or run_dir.startswith("file://"):
        return os.path.join(os.path.abspath(run_dir.removeprefix("file://")), "compile_cache")
    return os.path.join(os.path.expanduser("~"), ".cache", "rlax_tpu", "compile_cache")


def cpu_devices_flags(xla_flags: str) -> str:
    """`xla_flags` with CPU_DEVICES_FLAGS added (unless already set, either way) when they
    ask for more than one virtual CPU device."""
    counts = [f.split("=", 1)[1] for f in xla_flags.split() if f.startswith(f"{_FLAG}=")]
    if not counts or not counts[-1].isdigit() or int(counts[-1]) <= 1:  # XLA names a bad count
        return xla_flags
    names = {f.split("=", 1)[0] for f in xla_flags.split()}
    extra = [f for f in CPU_DEVICES_FLAGS if f.split("=", 1)[0] not in names]
    return " ".join([*xla_flags.split(), *extra])


def _joined(present: str, wanted: str) -> str:
    """`present` with each flag of `wanted` it lacks appended (a child process inherits its
    parent's variables: the flags are not repeated)."""
    flags = present.split()
    return " ".join(flags + [f for f in wanted.split() if f not in flags])


def configure_jax(config: RunConfig) -> None:
    """Start JAX as `jax_environment` says: the config's compiler flags, and
    `config.cpu_devices` virtual devices on the CPU platform (if > 0)."""
    wanted = jax_environment(config)
    if all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    if "jax" in sys.modules and _backends_started():
        _log.warning(
            "JAX is already initialised; cpu_devices=%d and the config's compiler flags "
            "cannot take effect in this process",
            config.cpu_devices,
        )
        return
    os.environ.update(wanted)
    if "jax" in sys.modules and "JAX_PLATFORMS" in wanted:
        # JAX read its environment when it was imported: the platform goes through its config.
        import jax

        jax.config.update("jax_platforms", wanted["JAX_PLATFORMS"])
    if "jax" in sys.modules and "JAX_COMPILATION_CACHE_DIR" in wanted:
        # Likewise the cache.
        import jax

        jax.config.update("jax_compilation_cache_dir", wanted["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs",
            float(wanted["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
        )


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout of a future JAX
        return True
    return bool(getattr(xla_bridge, "_backends", {}))
