"""The local launcher: every component of a run as a subprocess on loopback.

`LocalCluster` starts the parameter server, the trainer, N inference workers and the
verifier service with a fresh auth token, together (only the parameter server's address is
awaited before the workers and the trainer start, as they are given it; with
inference.colocated, the one inference worker runs inside the trainer's process, which
announces its address), each with its log file in
the run directory (with `verifiers.address` set it starts no verifier: the run uses the
services there, and their token, from the environment, is the run's), and watches them. A
dead inference worker, verifier or parameter server is started again on its port (so every
client finds it where it was), up to controller.component_restarts times each, after a
backoff of 1 s doubling; meanwhile the controller moves its work to the others or waits for it
(docs/controller.md, "Elastic recovery"). The death of the trainer, or of a component
out of restarts, sets `failed`, which stops the controller (then `rlax-tpu resume`); a
parameter server out of restarts also gets the trainer SIGTERM, which ends the wait of a
step publishing to it. The
trainer and the workers share this machine's GPUs, each with its memory share from the config
(`component_env`); the parameter server and the verifier get no accelerator. On exit it
stops every child it started (SIGTERM, then SIGKILL) and nothing else; each child also
gets SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlax_tpu.config import ConfigError, RunConfig, load_config
from rlax_tpu.launch.remote import HealthProbe, wait_until_serving
from rlax_tpu.rpc.process import ALSO_PREFIX, CHILD_LAUNCHER, PARENT_PID_ENV, PROGRESS_PREFIX

# Components the launcher starts again when they die: passive, with nothing a restart loses
# (the parameter server recovers its versions from storage).
RESTARTABLE = ("inference_worker", "verifier", "param_server")

# Components that never need an accelerator: JAX (if anything imports it) stays on the CPU
# and CUDA sees no GPU, so they take no GPU memory and hold no TPU.
_NO_ACCELERATOR = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}


# JAX_PLATFORMS values that start JAX on a GPU.
_GPU_PLATFORMS = ("cuda", "gpu", "rocm")


def host_gpu_visible(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a GPU driver exposes a device on this host that `environ` (default
    os.environ) leaves visible: NVIDIA's /dev/nvidiaN unless CUDA_VISIBLE_DEVICES hides them
    all, or ROCm's /dev/kfd."""
    environ = os.environ if environ is None else environ
    nvidia = bool(glob.glob("/dev/nvidia[0-9]*"))
    hidden = environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1")
    return (nvidia and not hidden) or os.path.exists("/dev/kfd")


def shares_gpus(config: RunConfig, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the trainer and the inference workers started here would share GPUs: the
    config names GPUs (trainer.gpu, inference.gpu), or JAX would start on one under
    `environ` (default os.environ): JAX_PLATFORMS names cuda, gpu or rocm, or is unset on a
    host with a visible GPU. Decided without starting JAX, which would take GPU memory in
    this process."""
    if config.trainer.gpu or config.inference.gpu:
        return True
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return any(p.strip() in _GPU_PLATFORMS for p in platforms.split(","))
    return host_gpu_visible(environ)


def check_colocated_gpu_memory(
    config: RunConfig,
    num_workers: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """The local launcher runs the trainer and every inference worker (`num_workers`, default
    inference.num_workers) on this machine, each process taking its `gpu_memory_fraction` of
    every GPU: where they share GPUs (`shares_gpus` under `environ`), refuse shares that
    overlap (they would sum to more than the GPU, and a process would fail at start or in
    the middle of the run). On CPU and TPU the shares are read by nothing, so any pass.
    With inference.colocated the worker is the trainer's process and has its share."""
    if not shares_gpus(config, environ):
        return
    trainer, inference = config.trainer, config.inference
    workers = inference.num_workers if num_workers is None else num_workers
    if inference.colocated:
        workers = 0
    total = trainer.gpu_memory_fraction + workers * inference.gpu_memory_fraction
    if total > 1 + 1e-9:
        room = (1 - trainer.gpu_memory_fraction) / max(workers, 1)
        raise ConfigError(
            f"the local launcher runs the trainer and {workers} inference worker(s) on the "
            f"same GPUs: trainer.gpu_memory_fraction ({trainer.gpu_memory_fraction}) + "
            f"inference.num_workers ({workers}) × inference.gpu_memory_fraction "
            f"({inference.gpu_memory_fraction}) = {total:.3g} of each GPU's memory, over 1. "
            f"Set inference.gpu_memory_fraction to at most {room:.3g}, lower "
            "trainer.gpu_memory_fraction or inference.num_workers",
            field="inference.gpu_memory_fraction",
        )


def component_env(config: RunConfig, component: str) -> dict[str, str]:
    """The variables the local launcher sets for one component's process (`component`:
    param_server, verifier, inference_worker, trainer) over the launcher's environment.

    The trainer and the inference workers get their GPU memory share
    (XLA_PYTHON_CLIENT_MEM_FRACTION, from `trainer.gpu_memory_fraction` /
    `inference.gpu_memory_fraction`; JAX's default is 75% each) and take it at start
    (XLA_PYTHON_CLIENT_PREALLOCATE): a share that does not fit fails at once, and one
    process cannot grow into another's. Harmless on CPU and TPU. The parameter server and
    the verifier get no accelerator at all."""
    fraction = {
        "trainer": config.trainer.gpu_memory_fraction,
        "inference_worker": config.inference.gpu_memory_fraction,
    }.get(component)
    if fraction is None:
        return dict(_NO_ACCELERATOR)
    return {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": str(fraction),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
    }


class ComponentFailed(RuntimeError):
    """A component process exited or did not become ready. `run_dir`, when known, is the
    run directory a resume continues."""

    run_dir: str = ""


def exit_description(returncode: int | None) -> str:
    """ "exited with code 1", "was killed by SIGKILL": how a process ended."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def last_lines(text: str, count: int = 8) -> str:
    """The last `count` non-empty lines of `text`, indented."""
    lines = [line for line in text.splitlines() if line.strip()][-count:]
    return "\n".join(f"    {line}" for line in lines)


class Child:
    """One `rlax-tpu serve ...` process; `address` comes from its READY line, `also` from its
    `ALSO <name> host:port` lines (services it serves besides its own). Its
    `PROGRESS <text>` lines (rpc.process.announce_progress: checkpoint loads, first
    compiles) are echoed to this process's stdout as `[<name>] <text>`."""

    def __init__(self, name: str, args: Sequence[str], *, env: dict[str, str], log: Path) -> None:
        self.name, self.args, self.log_path = name, list(args), log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in wait()
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD_LAUNCHER, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**env, PARENT_PID_ENV: str(os.getpid())},
            text=True,
            # Its own session: a terminal's Ctrl-C reaches the run, which stops its
            # components in order (a snapshot first), not every process at once.
            start_new_session=True,
        )
        self.pid = self.process.pid
        self.address: str | None = None
        self.also: dict[str, str] = {}
        self.ready_timeout_s = 60.0  # how long its start may take (the launcher sets it)
        self._ready = threading.Event()
        self._terminated = False  # SIGTERM sent (by terminate or stop)
        threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            if line.startswith("READY ") and self.address is None:
                self.address = line.split(" ", 1)[1].strip()
                self._ready.set()
            elif line.startswith(ALSO_PREFIX):
                name, _, address = line[len(ALSO_PREFIX) :].strip().partition(" ")
                self.also[name] = address
            elif line.startswith(PROGRESS_PREFIX):
                print(f"[{self.name}] {line[len(PROGRESS_PREFIX) :].strip()}", flush=True)
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

    def terminate(self) -> None:
        """SIGTERM to this pid, once, if it runs (`stop` then waits for it)."""
        if self.running() and not self._terminated:
            self._terminated = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to this pid (unless `terminate` sent it); SIGKILL if it has not exited
        after `timeout_s`."""
        self.terminate()
        if self.running():
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        self._log.close()


def _stop_stage(name: str) -> str:
    component = name.rsplit("-", 1)[0]
    return component if component in ("trainer", "param_server") else "other"


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
        config: RunConfig | None = None,
    ) -> None:
        # The config the children load (config_path with overrides; read here when not
        # given): each child's GPU memory share comes from it (component_env).
        self.config = config if config is not None else load_config(config_path, list(overrides))
        check_colocated_gpu_memory(self.config, num_workers, {**os.environ, **(env or {})})
        self.colocated = self.config.inference.colocated
        self.config_path = config_path
        self.num_workers = num_workers
        self.log_dir = Path(log_dir)
        self.param_storage = param_storage
        given = {**os.environ, **(env or {})}
        # verifiers.address: verifier services already running, started with their own
        # token; every component then shares that token (from token_env), else a fresh one.
        self.verifier_addresses = self.config.verifiers.addresses()
        self.token = secrets.token_hex(16)
        if self.verifier_addresses:
            self.token = given.get(token_env, "")
            if not self.token:
                raise ComponentFailed(
                    f"verifiers.address = {self.config.verifiers.address!r}: the run uses the "
                    f"verifier services there, which check an auth token; set {token_env} to "
                    "the token they were started with (the run's components get it too)"
                )
        self.env = {**given, token_env: self.token}
        self.overrides = [f"--set={o}" for o in overrides]
        self.children: list[Child] = []
        self.restarts: dict[str, int] = {}  # by child name
        self._restarting: set[str] = set()  # names of children being started again
        self._lock = threading.Lock()  # children, while a restart replaces one
        self.failed = threading.Event()
        self.failure: str | None = None
        self._closing = False
        self.addresses: dict[str, list[str]] = {}

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, args: Sequence[str], ready_timeout_s: float) -> Child:
        """Start child `name` (not waiting for it: see `_ready`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        component = name.rsplit("-", 1)[0]
        env = {**self.env, **component_env(self.config, component)}
        child = Child(name, args, env=env, log=self.log_dir / f"{name}.log")
        child.ready_timeout_s = ready_timeout_s
        self.children.append(child)
        return child

    def _ready(self, child: Child) -> str:
        """Wait until `child` serves; its address (and its co-located services') recorded."""
        address = child.wait_ready(child.ready_timeout_s)
        component = child.name.rsplit("-", 1)[0]
        self.addresses.setdefault(component, []).append(address)
        for also, also_address in child.also.items():
            self.addresses.setdefault(also.rsplit("-", 1)[0], []).append(also_address)
        return address

    def _write_processes(self) -> None:
        """Who is who, for operators (and tests that kill one component on purpose)."""
        with self._lock:
            entries = {c.name: {"pid": c.pid, "address": c.address} for c in self.children}
            for child in self.children:  # co-located services: their host's process
                for name, address in child.also.items():
                    entries[name] = {"pid": child.pid, "address": address, "in": child.name}
        (self.log_dir / "processes.json").write_text(json.dumps(entries))

    def start(self) -> None:
        """Start everything (parameter server first: the others connect to it). With
        verifiers.address set, no verifier is started: those services must answer first
        (within 60 s), and addresses["verifier"] names them."""
        if self.verifier_addresses:
            named = {f"verifier-{i}": a for i, a in enumerate(self.verifier_addresses)}
            probe = HealthProbe(named, auth_token=self.token, timeout_s=5.0)
            try:
                wait_until_serving(probe, timeout_s=60.0, stop=threading.Event(), poll_s=1.0)
            finally:
                probe.close()
            self.addresses["verifier"] = list(self.verifier_addresses)
        common = [self.config_path, *self.overrides, "--host", "127.0.0.1", "--port", "0"]
        # The components start at once, each importing JAX and building its part in
        # parallel; only the parameter server's address is awaited first (the workers and the
        # trainer are given it). Addresses are recorded in the children's order.
        ps_child = self._spawn(
            "param_server-0",
            ["serve", "param-server", *common, "--storage", self.param_storage],
            60,
        )
        starting = []
        if not self.verifier_addresses:
            cache = str(self.log_dir.parent / "test_data_cache")
            verifier = ["serve", "verifier", *common, f"--test-data-cache={cache}"]
            starting.append(self._spawn("verifier-0", verifier, 60))
        ps = self._ready(ps_child)
        for i in range(0 if self.colocated else self.num_workers):
            args = ["serve", "inference", *common, f"--param-server={ps}"]
            worker = [*args, f"--worker-id=inference_worker-{i}"]
            starting.append(self._spawn(f"inference_worker-{i}", worker, 180))
        # Co-located, the trainer's process builds and serves the worker too (`ALSO`).
        timeout = 300 + (180 if self.colocated else 0)
        trainer = ["serve", "trainer", *common, f"--param-server={ps}"]
        starting.append(self._spawn("trainer-0", trainer, timeout))
        for child in starting:
            self._ready(child)
        if self.colocated and "inference_worker" not in self.addresses:
            raise ComponentFailed(
                "inference.colocated: the trainer started without announcing its inference "
                f"worker; its log {self.log_dir / 'trainer-0.log'} says why"
            )
        self._write_processes()
        threading.Thread(target=self._watch, name="cluster-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._closing:
            with self._lock:
                dead = [
                    c for c in self.children if not c.running() and c.name not in self._restarting
                ]
            for child in dead:
                if self._closing:
                    return
                why = f"{child.name} (pid {child.pid}) {exit_description(child.process.returncode)}"
                component = child.name.rsplit("-", 1)[0]
                count = self.restarts.get(child.name, 0)
                if component in RESTARTABLE and count < self.config.controller.component_restarts:
                    self._restarting.add(child.name)
                    print(
                        f"{why}; starting it again on {child.address} (restart {count + 1} of "
                        f"{self.config.controller.component_restarts})",
                        flush=True,
                    )
                    threading.Thread(
                        target=self._restart,
                        args=(child,),
                        daemon=True,
                        name=f"restart-{child.name}",
                    ).start()
                    continue
                if component in RESTARTABLE:
                    why += f", after {count} restarts (controller.component_restarts)"
                self.failure = (
                    f"{why}; the last lines of its log {child.log_path}:\n"
                    f"{last_lines(child.log_tail())}"
                )
                self.failed.set()
                if component == "param_server":
                    self._stop_waiting_trainer()
                return
            time.sleep(0.2)

    def _stop_waiting_trainer(self) -> None:
        """The parameter server is gone for good: a trainer step in it waits for the server
        (its publish, up to controller.component_wait_s), and the controller's call with
        it, so the run could not stop. SIGTERM ends that wait; the trainer saves its
        checkpoint and exits, and the run stops (then `rlax-tpu resume`)."""
        with self._lock:
            trainers = [c for c in self.children if c.name.startswith("trainer")]
        for child in trainers:
            if child.running():
                child.process.send_signal(signal.SIGTERM)

    def _restart(self, old: Child) -> None:
        """`old`'s process again, on its port, after a backoff; a child that does not come
        up fails the run. Runs on its own thread until the new child exits."""
        name = old.name
        count = self.restarts[name] = self.restarts.get(name, 0) + 1
        old.stop(0)  # reaped, its log closed
        time.sleep(min(2.0 ** (count - 1), 30.0))
        port = old.address.rsplit(":", 1)[1]
        args = list(old.args)
        args[args.index("--port") + 1] = port
        component = name.rsplit("-", 1)[0]
        env = {**self.env, **component_env(self.config, component)}
        with self._lock:
            if self._closing:
                return
            child = Child(name, args, env=env, log=old.log_path)
            child.ready_timeout_s = old.ready_timeout_s
            self.children[self.children.index(old)] = child
        try:
            child.wait_ready(child.ready_timeout_s)
        except ComponentFailed as e:
            if not self._closing:
                self.failure = f"{name} did not come back after a restart: {e}"
                self.failed.set()
            return
        self._write_processes()
        print(f"{name} is back (pid {child.pid}) on {child.address}", flush=True)
        self._restarting.discard(name)
        # The kernel's parent-death signal (PR_SET_PDEATHSIG) follows the thread that started
        # a child, not the process: this thread lives as long as its child.
        child.process.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every child: the trainer first (it saves), then the workers and verifiers
        together, the parameter servers last."""
        with self._lock:
            self._closing = True
            children, self.children = self.children, []
        # The trainer first (it saves, and may still publish), then the workers and
        # verifiers together, the parameter servers last (what reads them is gone by then).
        for stage in ("trainer", "other", "param_server"):
            group = [c for c in children if _stop_stage(c.name) == stage]
            for child in group:
                child.terminate()
            for child in group:
                child.stop(timeout_s)
