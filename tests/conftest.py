"""Test-wide setup. JAX sees 8 virtual CPU devices so sharding tests run on any machine;
this must happen before anything imports jax.

Every process of the session (this one and the components tests start) shares one
persistent JAX compilation cache: dozens of short-lived trainer, inference and job
processes compile the same tiny programs, and a cached executable is the same program, so
results are unchanged. The cache lives in a temporary directory removed at the end."""

import atexit
import os
import shutil
import tempfile

from jobenv import CODEGEN_VARIABLE

from rlax_tpu.runtime import cpu_devices_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = f"{_flags} --xla_force_host_platform_device_count=8".strip()
# XLA:CPU's quick code generation (no LLVM optimisation, the classic emitters) for every
# process of the suite: the tests' programs are tiny, so compiling is most of their cost
# (2 cores, beside other load: tests/test_trainer.py + tests/test_engine_paging.py 225 s ->
# 77 s, tests/test_controller_e2e.py 208 s -> 172 s). Both sides of every comparison are
# compiled alike, so what a test compares (a resumed run with an uninterrupted one, a sharded
# step with an unsharded one) is the same comparison; a user's runs get XLA's defaults, and
# RLAX_TPU_TEST_CODEGEN=default runs the whole suite with them. Processes a test starts as a
# user would (a job, a tool) get these flags and no others (tests/jobenv.py).
FAST_CODEGEN = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if os.environ.get("RLAX_TPU_TEST_CODEGEN", "fast") == "fast":
    _names = {f.split("=", 1)[0] for f in _flags.split()}
    _flags = " ".join(
        [*_flags.split(), *(f for f in FAST_CODEGEN if f.split("=")[0] not in _names)]
    )
    # What tests/jobenv.py hands the processes tests start as a user would.
    os.environ.setdefault(CODEGEN_VARIABLE, " ".join(FAST_CODEGEN))
# Several CPU devices need single-threaded ops per device (rlax_tpu.runtime.CPU_DEVICES_FLAGS:
# else a program with collectives can deadlock XLA:CPU's thread pool); the components the
# tests start inherit these flags.
os.environ["XLA_FLAGS"] = cpu_devices_flags(_flags)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="rlax-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # The test processes themselves keep only programs that took a second or more to
    # compile: writing an entry serializes the executable, which on XLA:CPU costs about as
    # much as compiling it, and the in-process tests compile many programs that no later
    # test asks for again (measured on tests/test_trainer.py: 134 s with every program kept,
    # 112 s with this). The components they start (inheriting the variables above) keep
    # every program: a restarted or later component compiles the same small ones again.
    import jax  # noqa: E402 - after the variables above, which JAX reads when imported

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


# --- GCS emulator (tests/gcs_emulator.py) -----------------------------------------------
import pytest  # noqa: E402
from gcs_emulator import GcsEmulator  # noqa: E402


@pytest.fixture(scope="session")
def gcs_emulator():
    """One in-memory GCS emulator process for the whole session."""
    emulator = GcsEmulator()
    yield emulator
    emulator.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator, monkeypatch):
    """A fresh, empty bucket on the emulator as "gs://<bucket>"; gs:// clients are pointed at
    the emulator (STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL) for this test."""
    for name, value in gcs_emulator.env().items():
        monkeypatch.setenv(name, value)
    return f"gs://{gcs_emulator.create_bucket()}"
