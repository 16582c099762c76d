"""A real GCS emulator (the gcp-storage-emulator package) in a subprocess, for gs:// tests.

tests/conftest.py wraps it in fixtures: `gcs_emulator` (one process per session) and
`gcs_bucket` (a fresh bucket per test, yielded as "gs://<bucket>", with the env vars set).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

# Environment variables that point GCS clients at the emulator.
ENV_VARS = (
    "STORAGE_EMULATOR_HOST",  # gcsfs, google-cloud-storage
    "TENSORSTORE_GCS_HTTP_URL",  # tensorstore's gcs kvstore
)


# Started as `python -c _LAUNCHER args…`: on Linux the child asks to get SIGTERM if pytest
# dies without teardown, then runs the emulator. (Doing this in preexec_fn would fork a
# multithreaded JAX process, which can deadlock.)
_LAUNCHER = (
    "import ctypes, runpy, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "sys.argv = ['gcp-storage-emulator', *sys.argv[1:]]\n"
    "runpy.run_module('gcp_storage_emulator', run_name='__main__')\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """An in-memory emulator on 127.0.0.1:<free port>; `stop()` kills exactly that process."""

    def __init__(self, start_timeout_s: float = 20.0) -> None:
        self._log = tempfile.TemporaryFile()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", _LAUNCHER, "start"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--in-memory", "--quiet"]
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"GCS emulator exited with {self.process.returncode}: {self.log()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"GCS emulator not ready on {self.url} after {timeout_s}s: {self.log()}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def env(self) -> dict[str, str]:
        return dict.fromkeys(ENV_VARS, self.url)

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default) and return its name."""
        name = name or f"test-{uuid.uuid4().hex[:16]}"
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=10):
                pass
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"creating bucket {name!r} failed: {e.code} {e.read()!r}") from e
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # SIGTERM to this pid only
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()
