"""Multi-host JAX on one machine: two trainer processes on loopback (gloo collectives, 4
virtual CPU devices each) form one 8-device mesh, train, publish to and pull from a real
two-replica parameter server, and checkpoint; everything equals one process with 8 devices.

The mesh (data=1, fsdp=4, tensor=2) puts the fsdp axis across the two processes, so the
batch, the parameters, the gradient reductions, the publish (each process sends the replica
it is assigned, gathering the boxes it does not hold) and the pull (each process fetches
only its shards) all cross the process boundary.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jobenv import with_codegen
from multihost_worker import config_for
from processes import ProcessGroup
from trainer_helpers import rollout_batch

from rlax_tpu.api.param_server import ParamServerClient
from rlax_tpu.config import MeshConfig
from rlax_tpu.distributed import (
    DistributedConfigError,
    DistributedEnv,
    DistributedInitError,
    initialize,
)
from rlax_tpu.param_server.trees import TreeClient
from rlax_tpu.runtime import cpu_devices_flags
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer.server import replica_plan_for_model
from rlax_tpu.tree import flatten

WORKER = Path(__file__).with_name("multihost_worker.py")
MESH = MeshConfig(data=1, fsdp=4, tensor=2)
STEPS = 2
PROCESSES = 2
FOUR_DEVICES = "--xla_force_host_platform_device_count=4"  # each process's devices
WORKER_TIMEOUT_S = 240.0
# Another process layout reduces in another order (gloo across processes, XLA's in-process
# collectives within one): results agree to float32 rounding, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6


def _config(run_dir: str):
    return config_for(run_dir, data=MESH.data, fsdp=MESH.fsdp, tensor=MESH.tensor)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host_params(trainer: Trainer) -> dict[str, np.ndarray]:
    return {path: np.asarray(x) for path, x in flatten(trainer.params()).items()}


# -- the environment -> DistributedEnv ------------------------------------------------------
def test_no_variables_mean_a_single_process():
    env = DistributedEnv.from_environ({})
    assert env.mode == "single" and not env.is_multi_process


def test_our_variables_describe_the_job():
    env = DistributedEnv.from_environ(
        {
            "RLAX_TPU_COORDINATOR_ADDRESS": "trainer-0.trainer:8476",
            "RLAX_TPU_NUM_PROCESSES": "4",
            "RLAX_TPU_PROCESS_ID": "3",
            "JOB_COMPLETION_INDEX": "1",  # ours win
        }
    )
    assert (env.mode, env.coordinator_address, env.num_processes, env.process_id) == (
        "explicit",
        "trainer-0.trainer:8476",
        4,
        3,
    )
    assert env.sources["process_id"] == "RLAX_TPU_PROCESS_ID"


def test_an_indexed_job_gives_the_process_id():
    env = DistributedEnv.from_environ(
        {
            "JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234",
            "RLAX_TPU_NUM_PROCESSES": "2",
            "JOB_COMPLETION_INDEX": "1",
        }
    )
    assert (env.coordinator_address, env.process_id) == ("10.0.0.2:1234", 1)
    assert env.sources["process_id"] == "JOB_COMPLETION_INDEX"
    # Any indexed Job has a completion index: alone it is not a multi-host job.
    assert not DistributedEnv.from_environ({"JOB_COMPLETION_INDEX": "1"}).is_multi_process


def test_one_process_or_off_is_a_single_process():
    assert not DistributedEnv.from_environ({"RLAX_TPU_NUM_PROCESSES": "1"}).is_multi_process
    off = {"RLAX_TPU_DISTRIBUTED": "off", "RLAX_TPU_NUM_PROCESSES": "8"}
    assert not DistributedEnv.from_environ(off).is_multi_process


def test_auto_lets_jax_detect_what_is_unset():
    env = DistributedEnv.from_environ({"RLAX_TPU_DISTRIBUTED": "auto"})
    assert env.mode == "auto" and env.is_multi_process
    assert env.coordinator_address is None and env.process_id is None


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RLAX_TPU_NUM_PROCESSES": "2", "RLAX_TPU_PROCESS_ID": "0"}, "COORDINATOR_ADDRESS"),
        ({"RLAX_TPU_NUM_PROCESSES": "2", "RLAX_TPU_COORDINATOR_ADDRESS": "h:1"}, "PROCESS_ID"),
        ({"RLAX_TPU_COORDINATOR_ADDRESS": "h:1", "RLAX_TPU_PROCESS_ID": "0"}, "NUM_PROCESSES"),
        (
            {
                "RLAX_TPU_NUM_PROCESSES": "2",
                "RLAX_TPU_PROCESS_ID": "2",
                "JAX_COORDINATOR_ADDRESS": "h:1",
            },
            "must lie in [0, 2)",
        ),
        (
            {
                "RLAX_TPU_NUM_PROCESSES": "2",
                "RLAX_TPU_PROCESS_ID": "0",
                "RLAX_TPU_COORDINATOR_ADDRESS": "h",
            },
            "host:port",
        ),
        ({"RLAX_TPU_NUM_PROCESSES": "two"}, "not an integer"),
        ({"RLAX_TPU_DISTRIBUTED": "yes"}, "'auto'"),
    ],
)
def test_an_incomplete_or_inconsistent_job_is_refused(environ, message):
    with pytest.raises(DistributedConfigError, match=re.escape(message)):
        DistributedEnv.from_environ(environ)


# The environment of pod `host` of slice 1's Job of a 2 × 8-host trainer, as
# rlax_tpu/deploy/gke.py writes it (tests/test_deploy.py checks the manifest's side).
def _slice_pod(host: int, **more: str) -> dict[str, str]:
    return {
        "RLAX_TPU_COORDINATOR_ADDRESS": "run-trainer-0-0.run:8476",
        "RLAX_TPU_NUM_PROCESSES": "16",
        "JOB_COMPLETION_INDEX": str(host),
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1",
        **more,
    }


def test_several_slices_number_the_processes_slice_by_slice():
    env = DistributedEnv.from_environ(_slice_pod(3))
    assert (env.process_id, env.num_processes, env.slice_id, env.num_slices) == (11, 16, 1, 2)
    assert env.sources["slice_id"] == "MEGASCALE_SLICE_ID"
    assert env.describe() == "process 11 of 16 (slice 1 of 2), coordinator run-trainer-0-0.run:8476"
    ours = DistributedEnv.from_environ(
        _slice_pod(3, RLAX_TPU_NUM_SLICES="4", RLAX_TPU_SLICE_ID="0")
    )
    assert (ours.process_id, ours.num_slices) == (3, 4)  # ours win over MEGASCALE_*
    # One process: the slice variables a platform sets change nothing.
    single = {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1"}
    assert not DistributedEnv.from_environ(single).is_multi_process


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RLAX_TPU_NUM_PROCESSES": "15"}, "15 is not a multiple of MEGASCALE_NUM_SLICES=2"),
        ({"MEGASCALE_SLICE_ID": ""}, "needs RLAX_TPU_SLICE_ID"),
        ({"MEGASCALE_SLICE_ID": "2"}, "MEGASCALE_SLICE_ID=2 must lie in [0, 2)"),
        ({"JOB_COMPLETION_INDEX": "8"}, "must lie in [0, 8): with 2 slices it is the process"),
        ({"RLAX_TPU_NUM_SLICES": "0"}, "RLAX_TPU_NUM_SLICES must be >= 1"),
    ],
)
def test_an_inconsistent_multi_slice_job_is_refused(change, message):
    with pytest.raises(DistributedConfigError, match=re.escape(message)):
        DistributedEnv.from_environ(_slice_pod(0, **change))


def test_initialize_is_a_no_op_for_one_process_and_refused_once_jax_started():
    initialize(DistributedEnv())  # nothing to do
    jax.devices()  # backends started
    env = DistributedEnv(
        mode="explicit", coordinator_address="127.0.0.1:1", num_processes=2, process_id=0
    )
    with pytest.raises(DistributedInitError, match="before jax.distributed"):
        initialize(env)


def _single_process(run_dir: str) -> tuple[list[dict[str, np.ndarray]], list]:
    """The same steps in this process, on 8 local devices: the reference (params of every
    version, step results)."""
    assert jax.device_count() == 8
    trainer = Trainer(_config(run_dir))
    trainer.initialize()
    params, results = [_host_params(trainer)], []
    for step in range(STEPS):
        results.append(trainer.train_step(step, rollout_batch(step)))
        params.append(_host_params(trainer))
    trainer.close()
    return params, results


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.token = secrets.token_hex(16)
        self.group = ProcessGroup()
        self.workers: list[subprocess.Popen] = []
        self.run_dir = str(tmp / "run")
        self.outputs = [tmp / f"process-{p}.json" for p in range(PROCESSES)]
        self.logs = [tmp / f"process-{p}.log" for p in range(PROCESSES)]

    def start(self) -> None:
        self.param_servers = [
            self.group.start_param_server(
                None,
                token=self.token,
                args=["--num-replicas", "2", "--replica", str(r), "--hot-versions", "4"],
            ).address
            for r in range(2)
        ]
        coordinator = f"127.0.0.1:{_free_port()}"
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("RLAX_TPU_") and k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS")
        }
        for p in range(PROCESSES):
            env = {
                **base,
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": cpu_devices_flags(with_codegen(FOUR_DEVICES)),
                "RLAX_TPU_AUTH_TOKEN": self.token,
                "RLAX_TPU_COORDINATOR_ADDRESS": coordinator,
                "RLAX_TPU_NUM_PROCESSES": str(PROCESSES),
                "RLAX_TPU_PROCESS_ID": str(p),
                "RLAX_TPU_INITIALIZATION_TIMEOUT_S": "60",
            }
            command = [sys.executable, str(WORKER), "--run-dir", self.run_dir]
            command += [f"--param-server={a}" for a in self.param_servers]
            command += ["--mesh", f"{MESH.data},{MESH.fsdp},{MESH.tensor}"]
            command += ["--steps", str(STEPS), "--out", str(self.outputs[p])]
            with open(self.logs[p], "wb") as log:
                self.workers.append(
                    subprocess.Popen(
                        command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
                    )
                )

    def wait(self) -> list[dict]:
        """Every worker's report; a failed worker stops the others (they would wait in a
        collective) and fails the test with the logs."""
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [w.poll() for w in self.workers]
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
        codes = [w.poll() for w in self.workers]
        if codes != [0] * PROCESSES:
            self.stop_workers()
            logs = "\n".join(
                f"--- process {p} (exit {codes[p]}):\n{self.logs[p].read_text()[-4000:]}"
                for p in range(PROCESSES)
            )
            pytest.fail(f"multi-host workers failed or timed out:\n{logs}")
        return [json.loads(path.read_text()) for path in self.outputs]

    def stop_workers(self) -> None:
        for worker in self.workers:  # only the processes this fixture started, by pid
            if worker.poll() is None:
                worker.kill()
            worker.wait()

    def stop(self) -> None:
        self.stop_workers()
        self.group.stop_all()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    cluster = Cluster(tmp)
    try:
        cluster.start()
        # While the two processes start and compile: the single-process reference.
        cluster.reference = _single_process(str(tmp / "single"))
        cluster.reports = cluster.wait()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def single_process(cluster):
    return cluster.reference


def _client(cluster: Cluster) -> ParamServerClient:
    config = _config(cluster.run_dir)
    plan = replica_plan_for_model(config.model, config.trainer.mesh.logical_axis_rules, 2)
    return TreeClient(cluster.param_servers, auth_token=cluster.token, plan=plan)


def test_processes_form_one_mesh_over_both_hosts(cluster):
    for p, report in enumerate(cluster.reports):
        assert report["process_id"] == p
        assert report["process_count"] == PROCESSES
        assert (report["local_devices"], report["global_devices"]) == (4, 8)
        assert report["mesh_shape"] == {"data": 1, "fsdp": 4, "tensor": 2}
        assert report["mesh_processes"] == [0, 1]
        assert report["versions"] == list(range(1, STEPS + 1))


def test_step_metrics_equal_single_process(cluster, single_process):
    _, reference = single_process
    first, second = cluster.reports
    for step in range(STEPS):
        expected = reference[step].metrics
        for key in ("loss", "policy_loss", "kl", "grad_norm", "entropy", "advantage/std"):
            # Every process reads the same replicated metrics.
            assert first["metrics"][step][key] == second["metrics"][step][key], key
            np.testing.assert_allclose(
                first["metrics"][step][key], expected[key], rtol=RTOL, atol=ATOL, err_msg=key
            )


def test_published_versions_equal_single_process(cluster, single_process):
    reference, _ = single_process
    with _client(cluster) as client:
        assert client.versions() == list(range(STEPS + 1))
        for version in range(STEPS + 1):
            pulled = client.pull_arrays(version)
            assert pulled.keys() == reference[version].keys()
            for path, expected in reference[version].items():
                np.testing.assert_allclose(
                    pulled[path], expected, rtol=RTOL, atol=ATOL, err_msg=f"{version} {path}"
                )


def test_each_process_pulls_only_its_shards(cluster, single_process):
    reference, _ = single_process
    total = sum(x.nbytes for x in reference[-1].values())
    for report in cluster.reports:
        assert report["pulled_equal"]  # the pulled version equals the params it published
        assert 0 < report["bytes_pulled"] < total  # fsdp-sharded arrays: only this half


def test_multi_host_checkpoint_restores_in_one_process(cluster, tmp_path):
    trainer = Trainer(_config(cluster.run_dir))
    assert trainer.restore() == STEPS
    with _client(cluster) as client:
        published = client.pull_arrays(STEPS)
    restored = _host_params(trainer)
    trainer.close()
    for path, expected in published.items():
        np.testing.assert_array_equal(restored[path], expected, err_msg=path)


# -- `rlax-tpu serve trainer` on two processes ---------------------------------------------
TINY = str(Path(__file__).resolve().parent / "tiny_components_config.py")
SERVE_OVERRIDES = [
    "cpu_devices=0",  # the processes' XLA_FLAGS give 4 devices each
    "model.num_layers=1",
    "trainer.checkpoint_every=1000",
    "trainer.max_seq_len=32",
    "inference.max_prompt_len=16",  # a prompt and a response fit the trainer's 32 tokens
    "inference.max_new_tokens=16",
]


@pytest.mark.slow
def test_served_trainer_on_two_processes_equals_one_process(tmp_path):
    """Process 0 serves gRPC and broadcasts each step to process 1; both train on the
    2 x 2 x 2 mesh (data across the processes); SIGTERM to the leader saves on both and
    stops both."""
    from test_trainer_service import SEQ
    from test_trainer_service import rollout_batch as service_batch

    from rlax_tpu.api.trainer import TrainerClient
    from rlax_tpu.checkpoints import CheckpointStore
    from rlax_tpu.config import load_config
    from rlax_tpu.rpc.process import CHILD_LAUNCHER

    token = secrets.token_hex(16)
    run_dir = str(tmp_path / "run")
    overrides = [*SERVE_OVERRIDES, f"storage.run_dir={run_dir}"]
    group = ProcessGroup()
    follower = None
    try:
        param_server = group.start_param_server(None, token=token).address
        coordinator = f"127.0.0.1:{_free_port()}"

        def env(p: int) -> dict[str, str]:
            return {
                "XLA_FLAGS": cpu_devices_flags(with_codegen(FOUR_DEVICES)),
                "RLAX_TPU_AUTH_TOKEN": token,
                "RLAX_TPU_COORDINATOR_ADDRESS": coordinator,
                "RLAX_TPU_NUM_PROCESSES": "2",
                "RLAX_TPU_PROCESS_ID": str(p),
                "RLAX_TPU_INITIALIZATION_TIMEOUT_S": "60",
            }

        command = ["serve", "trainer", TINY, *(f"--set={o}" for o in overrides)]
        command += [f"--param-server={param_server}", "--host", "127.0.0.1", "--port", "0"]
        follower_log = tmp_path / "follower.log"
        with open(follower_log, "wb") as log:
            follower = subprocess.Popen(
                [sys.executable, "-c", CHILD_LAUNCHER, *command],
                env={**os.environ, "JAX_PLATFORMS": "cpu", **env(1)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        leader = group.start(command, env=env(0), ready_timeout_s=WORKER_TIMEOUT_S)

        config = load_config(TINY, [*overrides[:-1], f"storage.run_dir={tmp_path / 'single'}"])
        reference = Trainer(config)
        reference.initialize()
        with TrainerClient(leader.address, auth_token=token, timeout_s=300) as client:
            for step in range(STEPS):
                batch = service_batch(config, step)
                assert batch.tokens.shape[1] == SEQ
                got = client.train_step(step, batch)
                want = reference.train_step(step, batch)
                assert got.version == step + 1
                for key in ("loss", "kl", "grad_norm", "entropy"):
                    np.testing.assert_allclose(
                        got.metrics[key], want.metrics[key], rtol=RTOL, atol=ATOL, err_msg=key
                    )
            assert client.status().version == STEPS
        with TreeClient([param_server], auth_token=token) as ps:
            published = ps.pull_arrays(STEPS)
        for path, expected in _host_params(reference).items():
            np.testing.assert_allclose(published[path], expected, rtol=RTOL, atol=ATOL)
        reference.close()

        assert leader.stop(timeout_s=120) == 0, leader.stderr()
        assert follower.wait(timeout=60) == 0, follower_log.read_text()[-4000:]
        store = CheckpointStore(f"{run_dir}/checkpoints", max_to_keep=2)
        assert store.steps() == [STEPS]  # saved by both processes at the leader's shutdown
        store.close()
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait()
        group.stop_all()


# One process per slice: joins the job from the slice variables, builds the 2-slice mesh
# (CPU devices have no slice_index: each process is a slice) and sums over the DCN axis.
SLICE_WORKER = """
import json
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from rlax_tpu.distributed import initialize_from_environment
env = initialize_from_environment()
from rlax_tpu.config import MeshConfig
from rlax_tpu.sharding import build_mesh
mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2, num_slices=2))
sharding = NamedSharding(mesh, PartitionSpec("data", ("fsdp", "tensor")))
rows = np.arange(2, dtype=np.float32)[:, None] * np.ones((2, 8), np.float32)
x = jax.make_array_from_callback((2, 8), sharding, lambda index: rows[index])
total = float(jax.jit(lambda a: a.sum(axis=0))(x)[0])
processes = np.vectorize(lambda d: d.process_index)(mesh.devices).tolist()
print(json.dumps({"process": jax.process_index(), "slice": env.slice_id,
                  "mesh_processes": processes, "sum_over_data": total}))
"""


def test_two_slices_form_one_job_with_the_data_axis_across_them(tmp_path):
    coordinator = f"127.0.0.1:{_free_port()}"
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RLAX_TPU_", "MEGASCALE_")) and k not in ("XLA_FLAGS",)
    }
    workers = []
    for p in range(2):
        env = {
            **base,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": with_codegen(FOUR_DEVICES),
            # As a Job per slice gives them: the index within the slice, and the slice.
            "RLAX_TPU_COORDINATOR_ADDRESS": coordinator,
            "RLAX_TPU_NUM_PROCESSES": "2",
            "JOB_COMPLETION_INDEX": "0",
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": str(p),
            "RLAX_TPU_INITIALIZATION_TIMEOUT_S": "60",
        }
        log = open(tmp_path / f"slice-{p}.log", "wb")  # noqa: SIM115 (closed below)
        workers.append(
            (
                subprocess.Popen(
                    [sys.executable, "-c", SLICE_WORKER],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=log,
                ),
                log,
            )
        )
    reports = []
    try:
        for worker, log in workers:
            out, _ = worker.communicate(timeout=WORKER_TIMEOUT_S)
            log.close()
            logs = (tmp_path / f"slice-{len(reports)}.log").read_text()[-3000:]
            assert worker.returncode == 0, logs
            reports.append(json.loads(out.decode().splitlines()[-1]))
    finally:
        for worker, log in workers:  # only the processes this test started, by handle
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            log.close()
    for p, report in enumerate(reports):
        assert (report["process"], report["slice"]) == (p, p)
        # data index i on slice (process) i; fsdp and tensor within it.
        assert report["mesh_processes"] == [[[0, 0], [0, 0]], [[1, 1], [1, 1]]]
        assert report["sum_over_data"] == 1.0  # rows 0 and 1, one from each slice


def test_a_serve_command_with_an_inconsistent_environment_says_which_variable(monkeypatch, capsys):
    from rlax_tpu.rpc.process import join_distributed_job

    monkeypatch.setenv("RLAX_TPU_NUM_PROCESSES", "2")
    monkeypatch.setenv("RLAX_TPU_PROCESS_ID", "0")
    monkeypatch.delenv("RLAX_TPU_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert join_distributed_job("trainer") is None
    err = capsys.readouterr().err
    assert err.startswith("rlax-tpu serve trainer:") and "COORDINATOR_ADDRESS" in err
