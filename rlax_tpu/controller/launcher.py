"""The local launcher: every component of a run as a subprocess on loopback.

`LocalCluster` starts the parameter server, the trainer, N inference workers and the
verifier service with a fresh auth token, each with its log file in the run directory,
and watches them: the death of any child sets `failed`, which stops the controller. On
exit it stops every child it started (SIGTERM, then SIGKILL) and nothing else; each
child also gets SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from rlax_tpu.rpc.process import CHILD_LAUNCHER


class ComponentFailed(RuntimeError):
    """A component process exited or did not become ready."""


class Child:
    """One `rlax-tpu serve ...` process; `address` comes from its READY line."""

    def __init__(self, name: str, args: Sequence[str], *, env: dict[str, str], log: Path) -> None:
        self.name, self.args, self.log_path = name, list(args), log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in wait()
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD_LAUNCHER, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
        )
        self.pid = self.process.pid
        self.address: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            if line.startswith("READY ") and self.address is None:
                self.address = line.split(" ", 1)[1].strip()
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> str:
        if not self._ready.wait(timeout_s) or self.address is None:
            raise ComponentFailed(
                f"{self.name} did not become ready within {timeout_s:.0f}s (exit code "
                f"{self.process.poll()}); its log {self.log_path} ends with:\n{self.log_tail()}"
            )
        return self.address

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to this pid; SIGKILL if it has not exited after `timeout_s`."""
        if self.running():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        self._log.close()


class LocalCluster:
    """The components of one run on this machine. Use as a context manager."""

    def __init__(
        self,
        config_path: str,
        *,
        num_workers: int,
        log_dir: Path,
        param_storage: str,
        env: dict[str, str] | None = None,
        token_env: str = "RLAX_TPU_AUTH_TOKEN",
        overrides: Sequence[str] = (),
    ) -> None:
        self.config_path = config_path
        self.num_workers = num_workers
        self.log_dir = Path(log_dir)
        self.param_storage = param_storage
        self.token = secrets.token_hex(16)
        self.env = {**os.environ, **(env or {}), token_env: self.token}
        self.overrides = [f"--set={o}" for o in overrides]
        self.children: list[Child] = []
        self.failed = threading.Event()
        self.failure: str | None = None
        self._closing = False
        self.addresses: dict[str, list[str]] = {}

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self, name: str, args: Sequence[str], ready_timeout_s: float) -> str:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child(name, args, env=self.env, log=self.log_dir / f"{name}.log")
        self.children.append(child)
        address = child.wait_ready(ready_timeout_s)
        self.addresses.setdefault(name.rsplit("-", 1)[0], []).append(address)
        return address

    def start(self) -> None:
        """Start everything (parameter server first: the others connect to it)."""
        common = [self.config_path, *self.overrides, "--host", "127.0.0.1", "--port", "0"]
        ps = self._start(
            "param_server-0",
            ["serve", "param-server", *common, "--storage", self.param_storage],
            60,
        )
        cache = str(self.log_dir.parent / "test_data_cache")
        verifier = ["serve", "verifier", *common, f"--test-data-cache={cache}"]
        self._start("verifier-0", verifier, 60)
        for i in range(self.num_workers):
            args = ["serve", "inference", *common, f"--param-server={ps}"]
            self._start(f"inference_worker-{i}", [*args, f"--worker-id=inference_worker-{i}"], 180)
        self._start("trainer-0", ["serve", "trainer", *common, f"--param-server={ps}"], 300)
        # Who is who, for operators (and tests that kill one component on purpose).
        (self.log_dir / "processes.json").write_text(
            json.dumps({c.name: {"pid": c.pid, "address": c.address} for c in self.children})
        )
        threading.Thread(target=self._watch, name="cluster-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._closing:
            for child in self.children:
                if not child.running() and not self._closing:
                    self.failure = (
                        f"{child.name} (pid {child.pid}) exited with code "
                        f"{child.process.returncode}; its log {child.log_path} ends with:\n"
                        f"{child.log_tail()}"
                    )
                    self.failed.set()
                    return
            time.sleep(0.2)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every child, trainer first (it saves), then the rest."""
        self._closing = True
        for child in sorted(self.children, key=lambda c: not c.name.startswith("trainer")):
            child.stop(timeout_s)
        self.children = []
