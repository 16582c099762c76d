"""The local launcher's per-process environment: GPU memory shares for the trainer and the
inference workers from the config, no accelerator for the parameter server and the
verifier, and overlapping shares refused before anything starts."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlax_tpu.config import ConfigError, InferenceConfig, RunConfig, TrainerConfig, load_config
from rlax_tpu.launch import launcher
from rlax_tpu.launch.launcher import (
    LocalCluster,
    check_colocated_gpu_memory,
    component_env,
    host_gpu_visible,
    shares_gpus,
)

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.py")


def shared_gpu_config(trainer: float = 0.55, inference: float = 0.35, workers: int = 1):
    """A config whose trainer and workers run on one machine's H100s."""
    return RunConfig(
        trainer=TrainerConfig(gpu_memory_fraction=trainer, gpu="h100"),
        inference=InferenceConfig(gpu_memory_fraction=inference, num_workers=workers, gpu="h100"),
    )


def test_trainer_and_workers_get_their_gpu_memory_share():
    config = shared_gpu_config(0.6, 0.3)
    assert component_env(config, "trainer") == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
    }
    assert component_env(config, "inference_worker") == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
    }


@pytest.mark.parametrize("component", ["param_server", "verifier"])
def test_param_server_and_verifier_get_no_accelerator(component):
    env = component_env(shared_gpu_config(), component)
    assert env == {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}


def test_default_shares_of_trainer_and_one_worker_fit_one_gpu():
    config = RunConfig()
    assert config.trainer.gpu_memory_fraction + config.inference.gpu_memory_fraction < 1
    check_colocated_gpu_memory(config)


def test_overlapping_gpu_shares_are_refused_naming_the_fields_and_the_fix():
    config = shared_gpu_config(0.55, 0.35, workers=2)  # 0.55 + 2 × 0.35 = 1.25
    with pytest.raises(ConfigError) as e:
        check_colocated_gpu_memory(config)
    message = str(e.value)
    assert e.value.field == "inference.gpu_memory_fraction"
    for name in (
        "trainer.gpu_memory_fraction",
        "inference.num_workers",
        "inference.gpu_memory_fraction",
    ):
        assert name in message
    assert "1.25" in message and "at most 0.225" in message


def test_shares_that_sum_to_exactly_one_are_accepted():
    check_colocated_gpu_memory(shared_gpu_config(0.5, 0.25, workers=2))


def test_two_cpu_workers_are_not_held_to_gpu_shares(monkeypatch):
    # `rlax-tpu run configs/tiny_cpu.py --set inference.num_workers=2` exited 2 on a CPU host
    # (issue 38): 0.55 + 2 × 0.35 > 1, shares that nothing reads there.
    config = load_config(TINY, ["inference.num_workers=2"])
    assert config.trainer.gpu_memory_fraction + 2 * config.inference.gpu_memory_fraction > 1
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    check_colocated_gpu_memory(config)
    monkeypatch.delenv("JAX_PLATFORMS")  # JAX picks: a GPU only where the host has one
    if not host_gpu_visible():
        check_colocated_gpu_memory(config)


@pytest.mark.parametrize(
    ("environ", "shared"),
    [
        ({"JAX_PLATFORMS": "cpu"}, False),
        ({"JAX_PLATFORMS": "tpu"}, False),
        ({"JAX_PLATFORMS": "cuda"}, True),
        ({"JAX_PLATFORMS": "cuda,cpu"}, True),
        ({"JAX_PLATFORMS": "rocm"}, True),
    ],
)
def test_gpu_shares_apply_where_jax_starts_on_a_gpu(environ, shared):
    cpu = load_config(TINY, ["inference.num_workers=2"])
    assert shares_gpus(cpu, environ) is shared
    if shared:
        with pytest.raises(ConfigError, match="inference.gpu_memory_fraction"):
            check_colocated_gpu_memory(cpu, environ=environ)
    # A config that names GPUs is held to its shares whatever the launcher's platform.
    assert shares_gpus(shared_gpu_config(), environ)


def test_a_gpu_config_that_overcommits_is_refused_on_any_host(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    gpu = load_config(TINY, ["inference.num_workers=2", "trainer.gpu=h100:2", "inference.gpu=h100"])
    with pytest.raises(ConfigError, match="at most 0.225") as e:
        check_colocated_gpu_memory(gpu)
    assert e.value.field == "inference.gpu_memory_fraction"


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, float("nan")])
@pytest.mark.parametrize("section", [TrainerConfig, InferenceConfig])
def test_gpu_memory_fraction_outside_zero_one_is_refused(section, fraction):
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        section(gpu_memory_fraction=fraction)


class _RecordedChild:
    """Stands in for a component process: records the environment it was started with, and
    the order of the launcher's calls (`events`)."""

    started: list = []
    events: list = []

    def __init__(self, name, args, *, env, log):
        self.name, self.args, self.env, self.log_path = name, args, env, log
        self.pid, self.address = 0, f"127.0.0.1:{1000 + len(self.started)}"
        self.also = {}  # services announced besides its own (ALSO lines)
        self.started.append(self)
        self.events.append(("spawn", name))

    def wait_ready(self, timeout_s):
        self.events.append(("ready", self.name))
        return self.address

    def running(self):
        return True

    def terminate(self):
        self.events.append(("terminate", self.name))

    def stop(self, timeout_s):
        self.events.append(("stop", self.name))


def test_local_cluster_starts_each_child_with_its_share(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "Child", _RecordedChild)
    monkeypatch.setattr(_RecordedChild, "started", [])
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # the config wins
    config = shared_gpu_config(0.5, 0.2, workers=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    with LocalCluster(
        str(path), num_workers=2, log_dir=tmp_path / "logs", param_storage=str(tmp_path)
    ) as cluster:
        cluster.start()
        envs = {c.name: c.env for c in _RecordedChild.started}
    assert sorted(envs) == [
        "inference_worker-0",
        "inference_worker-1",
        "param_server-0",
        "trainer-0",
        "verifier-0",
    ]
    assert envs["trainer-0"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    for worker in ("inference_worker-0", "inference_worker-1"):
        assert envs[worker]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2"
    for cpu_only in ("param_server-0", "verifier-0"):
        assert envs[cpu_only]["JAX_PLATFORMS"] == "cpu"
        assert envs[cpu_only]["CUDA_VISIBLE_DEVICES"] == ""
    # Everything else is the launcher's environment, token included.
    assert all(env["RLAX_TPU_AUTH_TOKEN"] == cluster.token for env in envs.values())


def test_local_cluster_starts_all_once_the_param_server_serves_and_stops_it_last(
    tmp_path, monkeypatch
):
    """The components start together (only the parameter server's address is awaited
    first); the trainer stops first (it saves), the parameter server last (a worker's pull
    would otherwise hold its stop), the rest together in between."""
    monkeypatch.setattr(launcher, "Child", _RecordedChild)
    monkeypatch.setattr(_RecordedChild, "started", [])
    monkeypatch.setattr(_RecordedChild, "events", [])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(shared_gpu_config(0.5, 0.2, workers=2).to_dict()))
    with LocalCluster(
        str(path), num_workers=2, log_dir=tmp_path / "logs", param_storage=str(tmp_path)
    ) as cluster:
        cluster.start()
        assert _RecordedChild.events == [
            ("spawn", "param_server-0"),
            ("spawn", "verifier-0"),  # needs no address: spawned at once
            ("ready", "param_server-0"),
            ("spawn", "inference_worker-0"),
            ("spawn", "inference_worker-1"),
            ("spawn", "trainer-0"),
            ("ready", "verifier-0"),
            ("ready", "inference_worker-0"),
            ("ready", "inference_worker-1"),
            ("ready", "trainer-0"),
        ]
        assert cluster.addresses["inference_worker"] == ["127.0.0.1:1002", "127.0.0.1:1003"]
        _RecordedChild.events.clear()
    stops = _RecordedChild.events
    assert stops[:2] == [("terminate", "trainer-0"), ("stop", "trainer-0")]
    assert stops[-2:] == [("terminate", "param_server-0"), ("stop", "param_server-0")]
    middle = stops[2:-2]
    others = ["verifier-0", "inference_worker-0", "inference_worker-1"]
    assert sorted(middle[: len(others)]) == sorted(("terminate", n) for n in others)
    assert sorted(middle[len(others) :]) == sorted(("stop", n) for n in others)


def test_local_cluster_refuses_overlapping_shares_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "Child", _RecordedChild)
    monkeypatch.setattr(_RecordedChild, "started", [])
    config = shared_gpu_config(0.55, 0.35, workers=1)
    with pytest.raises(ConfigError, match="inference.gpu_memory_fraction"):
        LocalCluster(
            "unused.json",
            num_workers=2,  # the cluster's count, not the config's, is what runs
            log_dir=tmp_path / "logs",
            param_storage=str(tmp_path),
            config=config,
        )
    assert _RecordedChild.started == []


def test_a_child_whose_launcher_died_before_it_started_exits_at_once():
    """PR_SET_PDEATHSIG is set by the child itself, so a launcher that dies in between
    sends no signal: the child compares its parent with the pid the launcher gave it."""
    import os
    import subprocess
    import sys

    from rlax_tpu.rpc.process import CHILD_LAUNCHER, PARENT_PID_ENV

    def launch(parent: int) -> subprocess.CompletedProcess:
        env = {**os.environ, PARENT_PID_ENV: str(parent)}
        return subprocess.run(
            [sys.executable, "-c", CHILD_LAUNCHER, "--help"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    orphan = launch(parent=os.getpid() + 10**6)  # not its parent: the launcher is gone
    assert orphan.returncode == 1 and "the launcher died" in orphan.stderr
    ours = launch(parent=os.getpid())
    assert ours.returncode == 0 and "usage: rlax-tpu" in ours.stdout


STOP_WAITER = """
import os, signal
from rlax_tpu.rpc.process import stop_on_signals
stop = stop_on_signals()
handler = signal.getsignal(signal.SIGTERM)
# A SIGTERM that arrives while the main thread holds the event's lock (inside Event.wait, or
# inside the set of an earlier signal) runs the handler right there.
with stop._cond:
    handler(signal.SIGTERM, None)
print("handled", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("stopped" if stop.wait(30) else "not stopped", flush=True)
"""


def test_a_stop_signal_that_arrives_while_the_stop_event_is_locked_still_stops():
    """A SIGTERM handler that sets the stop event itself can run while the main thread holds
    that event's lock: the process then hangs forever and outlives its run (a verifier did,
    its stack four handlers deep in Event.set). The handler must take no lock; the event is
    still set, by the signal's own thread."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", STOP_WAITER], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["handled", "stopped"], done.stderr


def test_the_run_and_compile_start_jax_with_the_same_compiler_flags():
    """One place (runtime.jax_environment) says what JAX starts with: `configure_jax` in
    every process of a run, and `rlax-tpu compile` before it compiles."""
    import inspect

    from rlax_tpu.cli import compile as compile_cli
    from rlax_tpu.config import RunConfig
    from rlax_tpu.runtime import jax_environment

    config = RunConfig(
        cpu_devices=4,
        xla_flags="--xla_a=1 --xla_b=2",
        libtpu_flags="--t=1",
        compilation_cache="off",
    )
    chosen = {"JAX_PLATFORMS": "cpu"}  # the platform the caller chose is left alone
    env = jax_environment(config, {"XLA_FLAGS": "--xla_a=1", **chosen})
    assert env == {
        "XLA_FLAGS": "--xla_a=1 --xla_b=2 --xla_force_host_platform_device_count=4"
        " --xla_cpu_multi_thread_eigen=false",  # several CPU devices: runtime.CPU_DEVICES_FLAGS
        "LIBTPU_INIT_ARGS": "--t=1",
    }
    # A child that inherits its parent's variables gets the same, not the flags twice.
    assert jax_environment(config, {**env, **chosen}) == env
    assert jax_environment(RunConfig(compilation_cache="off"), chosen) == {}
    # One CPU device keeps XLA's multi-threaded ops; a flag the caller set is kept as set.
    one = jax_environment(dataclasses.replace(config, cpu_devices=1), chosen)
    assert "eigen" not in one["XLA_FLAGS"]
    mine = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true", **chosen}
    assert jax_environment(config, mine)["XLA_FLAGS"].count("eigen") == 1
    assert "jax_environment(" in inspect.getsource(compile_cli.main)


@pytest.mark.parametrize("accelerator", [False, True])
def test_a_host_without_an_accelerator_starts_jax_on_the_cpu_alone(monkeypatch, accelerator):
    from rlax_tpu import runtime
    from rlax_tpu.config import RunConfig

    monkeypatch.setattr(runtime, "_accelerator_present", lambda: accelerator)
    env = runtime.jax_environment(RunConfig(compilation_cache="off"), {})
    assert env == ({} if accelerator else {"JAX_PLATFORMS": "cpu"})
    # A config for a TPU slice or a GPU is never pinned to the CPU: JAX looks for its chips.
    configs = Path(TINY).parent
    tpu = load_config(str(configs / "qwen2_5_0_5b_gsm8k_tpu.py"), ["compilation_cache=off"])
    gpu = load_config(str(configs / "qwen2_5_0_5b_gsm8k_gpu.py"), ["compilation_cache=off"])
    assert runtime.jax_environment(tpu, {}) == runtime.jax_environment(gpu, {}) == {}


def test_jax_starts_on_a_cpu_host_without_tpu_plugin_noise():
    """With jax[tpu] installed (the test extra has it) and no TPU chip, a run's process
    starts JAX without a word from libtpu."""
    code = (
        "from rlax_tpu.config import load_config\n"
        "from rlax_tpu.runtime import configure_jax\n"
        "configure_jax(load_config('configs/tiny_cpu.py', ['compilation_cache=off']))\n"
        "import jax\n"
        "print(jax.devices()[0].platform)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "cpu"
    assert done.stderr == "", done.stderr[-3000:]


def test_every_process_of_a_run_keeps_its_compiled_programs(tmp_path):
    """The persistent compilation cache is on by default: under a local run directory, in
    the user's cache for a remote one, or where the config says; the environment's wins."""
    from rlax_tpu.config import StorageConfig
    from rlax_tpu.runtime import jax_environment

    local = RunConfig(storage=StorageConfig(run_dir=str(tmp_path / "run")))
    assert jax_environment(local, {})["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert jax_environment(local, {})["JAX_COMPILATION_CACHE_DIR"] == str(
        tmp_path / "run" / "compile_cache"
    )
    remote = RunConfig(storage=StorageConfig(run_dir="gs://bucket/runs/x"))
    assert jax_environment(remote, {})["JAX_COMPILATION_CACHE_DIR"].endswith(
        ".cache/rlax_tpu/compile_cache"
    )
    chosen = RunConfig(compilation_cache="gs://bucket/cache")
    assert jax_environment(chosen, {})["JAX_COMPILATION_CACHE_DIR"] == "gs://bucket/cache"
    assert "JAX_COMPILATION_CACHE_DIR" not in jax_environment(
        local, {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}
    )
    assert "JAX_COMPILATION_CACHE_DIR" not in jax_environment(
        RunConfig(compilation_cache="off"), {}
    )


def test_a_stop_names_the_process_that_died_how_and_its_last_log_lines():
    """A trainer killed mid-run used to end as a raw RPC error (`TrainerCallError: ...
    UNAVAILABLE ... Connection refused`) and a literal `rlax-tpu resume RUN_DIR`."""
    import signal as signals

    assert launcher.exit_description(-signals.SIGKILL) == "was killed by SIGKILL"
    assert launcher.exit_description(3) == "exited with code 3"
    log = "\n".join(f"line {i}" for i in range(20)) + "\n\n"
    assert launcher.last_lines(log, 3) == "    line 17\n    line 18\n    line 19"


def test_the_resume_command_names_the_run_directory(monkeypatch, capsys, tmp_path):
    from rlax_tpu.cli import main
    from rlax_tpu.launch import job

    def dies(config, **kwargs):
        failed = launcher.ComponentFailed("trainer-0 (pid 7) was killed by SIGKILL; ...")
        failed.run_dir = str(tmp_path / "run")
        raise failed

    monkeypatch.setattr(job, "main", dies)
    assert main(["run", TINY, "--set", f"storage.run_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "rlax-tpu run: ComponentFailed: trainer-0 (pid 7) was killed by SIGKILL" in err
    assert f"`rlax-tpu resume {tmp_path / 'run'}` continues from there" in err
    assert "Traceback" not in err
