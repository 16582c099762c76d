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


def configure_jax(config: RunConfig) -> None:
    """Expose `config.cpu_devices` virtual devices on the CPU platform (if > 0)."""
    if config.cpu_devices <= 0:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG in flags:
        return  # the caller chose explicitly
    if "jax" in sys.modules and _backends_started():
        _log.warning(
            "JAX is already initialised; cpu_devices=%d cannot take effect in this process",
            config.cpu_devices,
        )
        return
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={config.cpu_devices}".strip()


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout of a future JAX
        return True
    return bool(getattr(xla_bridge, "_backends", {}))
