"""Real rlax_tpu server processes for tests: start one, wait for its READY line, stop exactly it.

`ServerProcess` runs `python -m rlax_tpu serve COMPONENT ...` on 127.0.0.1; `ProcessGroup`
starts several and stops every one it started (use it in a fixture). The child gets
SIGTERM if the test process dies without teardown (PR_SET_PDEATHSIG, set by a `python -c`
launcher rather than preexec_fn: forking a multithreaded JAX process can deadlock).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence

from rlax_tpu.rpc.process import CHILD_LAUNCHER as _LAUNCHER

# The same parent-death signal for a test's own server scripts: `python -c ... SCRIPT ARGS`.
_SCRIPT_LAUNCHER = (
    "import ctypes, runpy, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


class ServerProcess:
    """One `rlax-tpu serve ...` process; `address` is "host:port" from its READY line."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 30.0,
        script: str | None = None,
    ) -> None:
        """`script`: run this Python file with `args` instead of `rlax-tpu args`."""
        self.args = list(args)
        self._stderr = tempfile.TemporaryFile()
        full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        launcher = [_LAUNCHER] if script is None else [_SCRIPT_LAUNCHER, script]
        self.process = subprocess.Popen(
            [sys.executable, "-c", *launcher, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=full_env,
            text=True,
        )
        self.pid = self.process.pid
        self.stdout_lines: list[str] = []
        self._terminated = False
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        if not self._ready.wait(ready_timeout_s) or not self.address:
            self.kill()
            raise RuntimeError(
                f"{' '.join(self.args)} did not print READY within {ready_timeout_s}s "
                f"(exit code {self.process.returncode}); stderr:\n{self.stderr()}"
            )

    @property
    def address(self) -> str | None:
        ready = [line for line in self.stdout_lines if line.startswith("READY ")]
        return ready[0].split(" ", 1)[1] if ready else None

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.stdout_lines.append(line.rstrip("\n"))
            if line.startswith("READY "):
                self._ready.set()
        self._ready.set()  # exited: stop waiting

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-6000:]

    def running(self) -> bool:
        return self.process.poll() is None

    def terminate(self) -> None:
        """SIGTERM to this pid only, once (`stop` then waits for it)."""
        if self.running() and not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM to this pid only (unless `terminate` sent it); SIGKILL if it has not
        exited after `timeout_s`."""
        self.terminate()
        if self.running():
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.wait()

    def kill(self) -> None:
        """SIGKILL: the process dies without any cleanup, as in a crash."""
        if self.running():
            self.process.kill()
        self.process.wait()


def _stop_stage(process: ServerProcess) -> str:
    args = process.args
    component = args[1] if len(args) > 1 and args[0] == "serve" else ""
    return component if component in ("trainer", "param-server") else "other"


class ProcessGroup:
    """Starts servers and, at `stop_all`, stops every one of them (and nothing else)."""

    def __init__(self) -> None:
        self.processes: list[ServerProcess] = []

    def start(self, args: Sequence[str], **kwargs) -> ServerProcess:
        process = ServerProcess(args, **kwargs)
        self.processes.append(process)
        return process

    def start_param_server(
        self,
        storage: str | None,
        *,
        token: str,
        token_env: str = "RLAX_TPU_AUTH_TOKEN",
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        **kwargs,
    ) -> ServerProcess:
        """`serve param-server --port 0` on `storage` (None: --memory-only), token via env.

        gs:// storage needs the emulator's variables: they are inherited from os.environ
        (the gcs_bucket fixture sets them) or passed in `env`.
        """
        where = ["--memory-only"] if storage is None else ["--storage", storage]
        command = ["serve", "param-server", *where, "--host", "127.0.0.1", "--port", "0", *args]
        return self.start(command, env={**(env or {}), token_env: token}, **kwargs)

    def start_component(
        self,
        component: str,
        config: str | None,
        *,
        token: str,
        param_servers: Sequence[str] = (),
        overrides: Sequence[str] = (),
        token_env: str = "RLAX_TPU_AUTH_TOKEN",
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        **kwargs,
    ) -> ServerProcess:
        """`serve COMPONENT CONFIG --set ... --param-server ... --port 0`, token via env."""
        command = ["serve", component, *([config] if config else [])]
        command += [f"--set={o}" for o in overrides]
        command += [f"--param-server={a}" for a in param_servers]
        command += ["--host", "127.0.0.1", "--port", "0", *args]
        return self.start(command, env={**(env or {}), token_env: token}, **kwargs)

    def start_inference_worker(self, config: str | None, **kwargs) -> ServerProcess:
        """An inference worker pulling from `param_servers`. JAX startup and the engine build
        take a few seconds, hence the longer wait."""
        kwargs.setdefault("ready_timeout_s", 60.0)
        return self.start_component("inference", config, **kwargs)

    def start_trainer(self, config: str | None, **kwargs) -> ServerProcess:
        """A trainer publishing to `param_servers`. It restores or initializes (and
        compiles) before READY, hence the long wait."""
        kwargs.setdefault("ready_timeout_s", 120.0)
        return self.start_component("trainer", config, **kwargs)

    def start_verifier(
        self,
        *,
        token: str,
        test_data_cache: str,
        overrides: Sequence[str] = (),
        args: Sequence[str] = (),
        **kwargs,
    ) -> ServerProcess:
        """`serve verifier --test-data-cache DIR --port 0` with `args` (--num-workers,
        --queue-size, ...); its pool workers start after READY, in the background."""
        args = ["--test-data-cache", test_data_cache, *args]
        return self.start_component("verifier", None, token=token, overrides=overrides, args=args)

    def start_run_components(
        self, config: str, run_dir: str, *, token: str, env: Mapping[str, str] | None = None
    ) -> tuple[ServerProcess, ServerProcess, ServerProcess]:
        """A run's parameter server (persisting under RUN_DIR/params), trainer and one
        inference worker for `config`, as `rlax-tpu run --connect` drives them; the test
        adds its verifier. Returns (parameter server, trainer, worker)."""
        ps = self.start_param_server(os.path.join(run_dir, "params"), token=token)
        kwargs = {"token": token, "param_servers": [ps.address], "env": env}
        trainer = self.start_trainer(config, **kwargs)
        return ps, trainer, self.start_inference_worker(config, **kwargs)

    def stop_all(self) -> None:
        """Trainers first (they save, and may still publish), then the other servers
        together, parameter servers last (as rlax_tpu.launch.LocalCluster stops a run)."""
        for stage in ("trainer", "other", "param-server"):
            group = [p for p in self.processes if _stop_stage(p) == stage]
            for process in group:
                process.terminate()
            for process in group:
                process.stop()
        self.processes.clear()
