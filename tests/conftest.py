"""Test-wide setup. JAX sees 8 virtual CPU devices so sharding tests run on any machine;
this must happen before anything imports jax."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()


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
