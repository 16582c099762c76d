"""Multi-host JAX: which process of how many this is, and bringing up `jax.distributed`.

A trainer (or any JAX component) that spans several hosts runs one process per host; they
find each other through a coordinator (process 0) and then see every host's devices in
`jax.devices()`, so the mesh and the shardings are built exactly as on one host.
`DistributedEnv.from_environ()` reads what the job gives each process; `initialize(env)`
calls `jax.distributed.initialize` once, before JAX starts its backends. One process and no
variables set is the default and changes nothing.

Variables, each value taken from the first that is set:

    RLAX_TPU_DISTRIBUTED            "auto": let JAX detect the cluster (Cloud TPU VMs, GKE
                                    TPU node pools, Slurm, Open MPI); "off": one process,
                                    whatever else is set; unset: decided by the variables below
    RLAX_TPU_COORDINATOR_ADDRESS    host:port of process 0's coordinator  (else
                                    JAX_COORDINATOR_ADDRESS)
    RLAX_TPU_NUM_PROCESSES          how many processes take part
    RLAX_TPU_PROCESS_ID             this process, in [0, num_processes)  (else
                                    JOB_COMPLETION_INDEX: Kubernetes indexed Jobs / JobSet);
                                    with several slices, its index within its slice
    RLAX_TPU_NUM_SLICES             TPU slices the processes span (default 1; else
                                    MEGASCALE_NUM_SLICES)
    RLAX_TPU_SLICE_ID               this process's slice, in [0, num_slices)  (else
                                    MEGASCALE_SLICE_ID)
    RLAX_TPU_INITIALIZATION_TIMEOUT_S   how long to wait for every process (default 300)

Multi-host starts when RLAX_TPU_NUM_PROCESSES > 1 (then the address and the id must be
known) or with RLAX_TPU_DISTRIBUTED=auto.

Multi-slice (TPU slices joined over DCN, `MeshConfig.num_slices`): the processes of every
slice form one job, numbered slice by slice as JAX numbers them on a multi-slice TPU job
(jax/_src/clusters/cloud_tpu_cluster.py: process id = slice id × processes per slice + the
index within the slice), so that a Job per slice need only give each pod its index within
the slice and its slice. libtpu itself joins the slices from the MEGASCALE_* variables
(MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID, MEGASCALE_PORT),
which the job sets (rlax_tpu/deploy/gke.py) and this module only reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

_log = logging.getLogger(__name__)

MODE_VAR = "RLAX_TPU_DISTRIBUTED"
COORDINATOR_VAR = "RLAX_TPU_COORDINATOR_ADDRESS"
NUM_PROCESSES_VAR = "RLAX_TPU_NUM_PROCESSES"
PROCESS_ID_VAR = "RLAX_TPU_PROCESS_ID"
TIMEOUT_VAR = "RLAX_TPU_INITIALIZATION_TIMEOUT_S"
NUM_SLICES_VAR = "RLAX_TPU_NUM_SLICES"
SLICE_ID_VAR = "RLAX_TPU_SLICE_ID"
# What platforms give, used when ours are unset.
JAX_COORDINATOR_VAR = "JAX_COORDINATOR_ADDRESS"
JOB_COMPLETION_INDEX_VAR = "JOB_COMPLETION_INDEX"  # Kubernetes indexed Jobs (JobSet's pods)
MEGASCALE_NUM_SLICES_VAR = "MEGASCALE_NUM_SLICES"  # TPU multi-slice (libtpu reads them too)
MEGASCALE_SLICE_ID_VAR = "MEGASCALE_SLICE_ID"
DEFAULT_TIMEOUT_S = 300

Mode = Literal["single", "explicit", "auto"]


class DistributedConfigError(ValueError):
    """The environment describes a multi-host job incompletely or inconsistently."""


class DistributedInitError(RuntimeError):
    """`jax.distributed` cannot be brought up in this process as asked."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedEnv:
    """How this process takes part in a multi-host JAX job.

    mode "single": one process, nothing to initialise; "explicit": coordinator, count and
    id are all known; "auto": JAX detects what is unset (Cloud TPU, Slurm, Open MPI, k8s).
    `process_id` is the job-wide one; with `num_slices` > 1 the processes are numbered
    slice by slice, `slice_id` being this one's slice. `sources` names the variable each
    value came from (for messages and logs).
    """

    mode: Mode = "single"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = DEFAULT_TIMEOUT_S
    num_slices: int = 1
    slice_id: int = 0
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("single", "explicit", "auto"):
            raise DistributedConfigError(f"unknown mode {self.mode!r}")
        if self.mode == "explicit":
            missing = [
                name
                for name, value in (
                    ("coordinator_address", self.coordinator_address),
                    ("num_processes", self.num_processes),
                    ("process_id", self.process_id),
                )
                if value is None
            ]
            if missing:
                raise DistributedConfigError(f"explicit mode needs {', '.join(missing)}")
        if self.num_processes is not None and self.num_processes < 1:
            raise DistributedConfigError(
                f"{self._name('num_processes')} must be >= 1, got {self.num_processes}"
            )
        if self.process_id is not None and (
            self.process_id < 0
            or (self.num_processes is not None and self.process_id >= self.num_processes)
        ):
            raise DistributedConfigError(
                f"{self._name('process_id')} must lie in [0, {self.num_processes}) "
                f"({self._name('num_processes')}), got {self.process_id}"
            )
        if self.coordinator_address is not None:
            _check_address(self.coordinator_address, self._name("coordinator_address"))
        if self.initialization_timeout_s < 1:
            raise DistributedConfigError(
                f"{TIMEOUT_VAR} must be >= 1, got {self.initialization_timeout_s}"
            )
        if self.num_slices < 1 or not 0 <= self.slice_id < self.num_slices:
            raise DistributedConfigError(
                f"{self._name('slice_id')}={self.slice_id} must lie in [0, {self.num_slices}) "
                f"({self._name('num_slices')})"
            )

    def _name(self, field: str) -> str:
        return self.sources.get(field, field)

    @property
    def is_multi_process(self) -> bool:
        return self.mode != "single"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistributedEnv:
        """Parse `environ` (default os.environ); DistributedConfigError says what is wrong."""
        env = os.environ if environ is None else environ
        sources: dict[str, str] = {}

        def first(field: str, *names: str) -> str | None:
            for name in names:
                value = env.get(name, "").strip()
                if value:
                    sources[field] = name
                    return value
            return None

        mode_value = env.get(MODE_VAR, "").strip().lower()
        if mode_value not in ("", "auto", "off"):
            raise DistributedConfigError(
                f"{MODE_VAR}={env[MODE_VAR]!r}: use 'auto' (JAX detects the cluster), 'off' "
                f"(one process) or leave it unset (use {NUM_PROCESSES_VAR} and friends)"
            )
        if mode_value == "off":
            return cls(sources={"mode": MODE_VAR})
        coordinator = first("coordinator_address", COORDINATOR_VAR, JAX_COORDINATOR_VAR)
        num = _int(first("num_processes", NUM_PROCESSES_VAR), sources.get("num_processes"))
        # Any indexed Job has a completion index: it counts only when a count is given.
        pid_vars = (PROCESS_ID_VAR, JOB_COMPLETION_INDEX_VAR) if num is not None else ()
        pid = _int(first("process_id", *pid_vars or (PROCESS_ID_VAR,)), sources.get("process_id"))
        timeout = _int(first("timeout", TIMEOUT_VAR), TIMEOUT_VAR)
        fields = dict(
            coordinator_address=coordinator,
            num_processes=num,
            process_id=pid,
            initialization_timeout_s=DEFAULT_TIMEOUT_S if timeout is None else timeout,
            sources=sources,
        )
        if mode_value == "auto":
            return cls(mode="auto", **fields)
        if num is None:
            ours = [v for v in (COORDINATOR_VAR, PROCESS_ID_VAR) if env.get(v, "").strip()]
            if ours:
                raise DistributedConfigError(
                    f"{' and '.join(ours)} set but {NUM_PROCESSES_VAR} is not: set it to the "
                    f"number of processes (1 for a single process), or set {MODE_VAR}=auto to "
                    "let JAX detect the cluster"
                )
            return cls(sources=sources)
        if num == 1:
            if pid not in (None, 0):
                raise DistributedConfigError(
                    f"{sources['process_id']}={pid} but {NUM_PROCESSES_VAR}=1: the only "
                    "process is 0"
                )
            return cls(sources=sources)
        slices = _int(
            first("num_slices", NUM_SLICES_VAR, MEGASCALE_NUM_SLICES_VAR), sources.get("num_slices")
        )
        if slices is not None and slices < 1:
            raise DistributedConfigError(f"{sources['num_slices']} must be >= 1, got {slices}")
        if slices is not None and slices > 1:
            fields.update(_slice_fields(num, pid, slices, first, sources))
        missing = []
        if coordinator is None:
            missing.append(
                f"{COORDINATOR_VAR} (host:port of process 0, e.g. the headless "
                "service name of the trainer's first pod)"
            )
        if pid is None:
            missing.append(f"{PROCESS_ID_VAR} (or {JOB_COMPLETION_INDEX_VAR} in an indexed Job)")
        if missing:
            raise DistributedConfigError(f"{NUM_PROCESSES_VAR}={num} needs {' and '.join(missing)}")
        return cls(mode="explicit", **fields)

    def describe(self) -> str:
        if self.mode == "single":
            return "single process"
        if self.mode == "auto":
            return "multi-host, detected by JAX"
        slices = f" (slice {self.slice_id} of {self.num_slices})" if self.num_slices > 1 else ""
        return (
            f"process {self.process_id} of {self.num_processes}{slices}, coordinator "
            f"{self.coordinator_address}"
        )


def _slice_fields(
    num: int,
    index: int | None,
    slices: int,
    first: Callable[..., str | None],
    sources: dict[str, str],
) -> dict[str, Any]:
    """The job-wide fields of a process of slice `slice_id` (read here) whose index within
    its slice is `index`: processes are numbered slice by slice."""
    if num % slices:
        raise DistributedConfigError(
            f"{NUM_PROCESSES_VAR}={num} is not a multiple of {sources['num_slices']}={slices}: "
            "every slice runs as many processes (its hosts)"
        )
    per_slice = num // slices
    slice_id = _int(
        first("slice_id", SLICE_ID_VAR, MEGASCALE_SLICE_ID_VAR), sources.get("slice_id")
    )
    if slice_id is None:
        raise DistributedConfigError(
            f"{sources['num_slices']}={slices} needs {SLICE_ID_VAR} (or "
            f"{MEGASCALE_SLICE_ID_VAR}): this process's slice, 0 … {slices - 1}"
        )
    if not 0 <= slice_id < slices:
        raise DistributedConfigError(
            f"{sources['slice_id']}={slice_id} must lie in [0, {slices}) ({sources['num_slices']})"
        )
    if index is not None and not 0 <= index < per_slice:
        raise DistributedConfigError(
            f"{sources['process_id']}={index} must lie in [0, {per_slice}): with {slices} "
            f"slices it is the process's index within its slice ({NUM_PROCESSES_VAR}={num} "
            f"processes, {per_slice} a slice)"
        )
    return {
        "num_slices": slices,
        "slice_id": slice_id,
        "process_id": None if index is None else slice_id * per_slice + index,
    }


def _int(value: str | None, name: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedConfigError(f"{name}={value!r} is not an integer") from None


def _check_address(address: str, name: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedConfigError(
            f"{name}={address!r} must be host:port (e.g. trainer-0.trainer:8476)"
        )


_initialized: DistributedEnv | None = None


def initialize(env: DistributedEnv) -> None:
    """Join the multi-host job `env` describes (no-op for a single process).

    Must run before anything touches a JAX device; a second call with the same env does
    nothing, with another env it is an error. On CPU, cross-process collectives use gloo.
    """
    global _initialized
    if not env.is_multi_process:
        return
    if _initialized is not None:
        if _initialized == env:
            return
        raise DistributedInitError(
            f"jax.distributed is already initialised ({_initialized.describe()}); "
            f"cannot join another job ({env.describe()})"
        )
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DistributedInitError(
            "JAX started its backends before jax.distributed could be initialised "
            f"({env.describe()}): call rlax_tpu.distributed.initialize first, before anything "
            "asks for devices or runs a computation"
        )
    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        # Cross-process collectives of the CPU backend (tests, CPU-only jobs); no effect on
        # TPU or GPU. gloo is JAX's default today; set so that a changed default is seen.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {"initialization_timeout": env.initialization_timeout_s}
    if env.coordinator_address is not None:
        kwargs["coordinator_address"] = env.coordinator_address
    if env.num_processes is not None:
        kwargs["num_processes"] = env.num_processes
    if env.process_id is not None:
        kwargs["process_id"] = env.process_id
    _log.info("joining the multi-host job: %s", env.describe())
    jax.distributed.initialize(**kwargs)
    _initialized = env
    _log.info(
        "jax.distributed up: process %d of %d, %d local and %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def initialize_from_environment(environ: Mapping[str, str] | None = None) -> DistributedEnv:
    """`initialize(DistributedEnv.from_environ(environ))`; returns the env."""
    env = DistributedEnv.from_environ(environ)
    initialize(env)
    return env


# -- helpers for code that runs in every process ---------------------------------------------
def process_index() -> int:
    import jax

    return jax.process_index()


def process_count() -> int:
    import jax

    return jax.process_count()


def broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (the others pass None). A collective: every
    process calls it, in the same order. Sizes are padded to powers of two so that only a
    few broadcast programs get compiled."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        if data is None:
            raise ValueError("broadcast_bytes: the only process must pass the data")
        return bytes(data)
    source = jax.process_index() == 0
    if source and data is None:
        raise ValueError("broadcast_bytes: process 0 must pass the data")
    size = np.array([len(data) if source else 0], np.int64)
    size = int(multihost_utils.broadcast_one_to_all(size, is_source=source)[0])
    padded = max(1024, 1 << (size - 1).bit_length())
    buffer = np.zeros(padded, np.uint8)
    if source:
        buffer[:size] = np.frombuffer(data, np.uint8)
    out = multihost_utils.broadcast_one_to_all(buffer, is_source=source)
    return np.asarray(out)[:size].tobytes()


__all__ = [
    "COORDINATOR_VAR",
    "MODE_VAR",
    "NUM_PROCESSES_VAR",
    "NUM_SLICES_VAR",
    "PROCESS_ID_VAR",
    "SLICE_ID_VAR",
    "TIMEOUT_VAR",
    "DistributedConfigError",
    "DistributedEnv",
    "DistributedInitError",
    "broadcast_bytes",
    "initialize",
    "initialize_from_environment",
    "process_count",
    "process_index",
]
