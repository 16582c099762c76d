"""A run laid out for a cluster: which processes run, how many, on what, with which args.

One plan feeds both renderers — `gke.py` (JobSet manifests) and `xmanager.py`
(XManager jobs) — so both start the same `rlax-tpu` commands. The plan needs only the
config (no JAX, no cluster): `check_deployable` says what would stop the run on a cluster
before anything is launched.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from rlax_tpu.config import ConfigError, MeshConfig, RunConfig, TpuSliceConfig

# gRPC port of each component (one process per pod, so fixed ports never collide).
PORTS = {"param-server": 50051, "trainer": 50052, "inference": 50053, "verifier": 50054}
# jax.distributed's coordinator on process 0 of a multi-host slice (rlax_tpu.distributed).
COORDINATOR_PORT = 8476
# TPU multi-slice (trainer.mesh.num_slices > 1): every trainer process gets these; libtpu
# joins the slices over DCN from them, and rlax_tpu.distributed reads the count and the
# process's slice. The names are those JAX's TPU cluster detection reads
# (jax/_src/clusters/cloud_tpu_cluster.py) and Ray's TPU support sets; the values follow the
# injection JobSet once had for TPU Jobs (kubernetes-sigs/jobset 1a3f0e10,
# pkg/util/accelerator/tpu.go, removed again in e979ed23): the coordinator is the first pod
# of the first slice's Job (<jobset>-<replicated job>-0-0.<subdomain>), the slice the Job's
# index, the count the replicated job's replicas. 8080 is the port xpk's TPU pods open for
# megascale (AI-Hypercomputer/xpk, src/xpk/core/docker_resources.py, add_container_ports).
MEGASCALE_COORDINATOR_ENV = "MEGASCALE_COORDINATOR_ADDRESS"
MEGASCALE_NUM_SLICES_ENV = "MEGASCALE_NUM_SLICES"
MEGASCALE_SLICE_ID_ENV = "MEGASCALE_SLICE_ID"
MEGASCALE_PORT_ENV = "MEGASCALE_PORT"
MEGASCALE_PORT = 8080
# Stands for the instance index in `Component.args` (a parameter-server replica, a worker).
REPLICA = "<replica>"
COMPONENTS = ("controller", "param-server", "verifier", "inference", "trainer")
TEST_DATA_CACHE = "/var/cache/rlax-tpu/test_data"
# Longest DNS label: a pod's hostname `<run>-<component>-<replica>-<host>` must fit.
_DNS_LABEL = 63
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class DeployError(ValueError):
    """The config cannot run on a cluster as it stands; the message lists what to change."""


@dataclasses.dataclass(frozen=True)
class Component:
    """One kind of process of the run.

    `replicas` independent instances (parameter-server replicas, inference workers,
    verifiers), each of `slices` TPU slices (the trainer's `trainer.mesh.num_slices`; 1
    elsewhere) of `hosts` processes each (the hosts of one slice; 1 off TPU). `args` follow
    `rlax-tpu`; `REPLICA` in them stands for the instance's index.
    """

    name: str
    replicas: int
    hosts: int
    args: tuple[str, ...]
    port: int | None = None  # gRPC port; None for the controller (it only calls out)
    tpu: TpuSliceConfig | None = None  # one slice's
    cpu: str | None = None
    memory: str | None = None
    node_pool: str = ""
    sandboxed: bool = False  # gVisor: the verifier pool runs untrusted code
    slices: int = 1

    def __post_init__(self) -> None:
        if self.slices > 1 and self.replicas > 1:
            raise ValueError(f"{self.name}: a multi-slice component has one instance")

    def args_for(self, replica: int | str) -> list[str]:
        return [a.replace(REPLICA, str(replica)) for a in self.args]

    @property
    def processes(self) -> int:
        """The processes of one instance, which form one JAX job: slices × hosts."""
        return self.slices * self.hosts

    @property
    def multi_host(self) -> bool:
        """Whether one instance spans several hosts (of one slice, or of several)."""
        return self.processes > 1

    @property
    def multi_slice(self) -> bool:
        return self.slices > 1


HostFn = Callable[[str, "int | str"], str]


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str  # the run's DNS-safe name (JobSet name, prefix of every object)
    config: RunConfig
    components: tuple[Component, ...]
    # host(component, replica): the DNS name of that instance's first process (build_plan).
    host: HostFn

    def component(self, name: str) -> Component:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)


def dns_name(name: str) -> str:
    """`name` as a DNS label: lower case, `_` and other characters as `-`."""
    out = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    return out if out[:1].isalpha() else f"rlax-{out}".rstrip("-")


def _is_gs(url: str) -> bool:
    return url.startswith("gs://")


def _mesh_problem(mesh: MeshConfig, tpu: TpuSliceConfig, section: str, field: str) -> str:
    slices = mesh.num_slices
    try:
        mesh.shape_for(tpu.chips * slices)
    except ConfigError as e:
        if slices == 1:
            return (
                f"{section}.mesh must fill deploy.{field} (topology {tpu.topology} = "
                f"{tpu.chips} chips, {tpu.chips_per_host} per host): {e.detail}"
            )
        return (
            f"{section}.mesh must fill {slices} slices of deploy.{field} ({section}.mesh."
            f"num_slices; topology {tpu.topology} = {tpu.chips} chips a slice, "
            f"{tpu.chips_per_host} per host: {tpu.chips * slices} chips): {e.detail}"
        )
    return ""


def problems(config: RunConfig, name: str | None = None) -> list[str]:
    """Everything that would stop `config` on a cluster (empty: it can be deployed)."""
    out = []
    run_dir = config.storage.run_dir
    if not _is_gs(run_dir):
        out.append(
            f"storage.run_dir must be a gs:// URL: every pod reads and writes it (got {run_dir!r})"
        )
    if not _is_gs(config.model.hf_checkpoint):
        out.append(
            "model.hf_checkpoint must be a gs:// Hugging Face checkpoint the pods can read "
            f"(got {config.model.hf_checkpoint!r})"
        )
    tokenizer = config.model.tokenizer
    if tokenizer and not (_is_gs(tokenizer) or tokenizer.startswith("builtin:")):
        out.append(f"model.tokenizer must be empty, builtin:… or gs:// (got {tokenizer!r})")
    if not config.training_datasets:
        out.append("data and controller.datasets are empty: the controller needs prompts")
    paths = [d.path for d in config.training_datasets]
    if config.controller.eval_dataset:
        paths.append(config.controller.eval_dataset)
    for path in paths:
        if not (_is_gs(path) or path.startswith("builtin:")):
            out.append(f"dataset {path!r} must be gs:// (or builtin:…): pods share no disk")
    deploy = config.deploy
    for section, field, tpu in (
        ("trainer", "trainer_tpu", deploy.trainer_tpu),
        ("inference", "inference_tpu", deploy.inference_tpu),
    ):
        problem = _mesh_problem(getattr(config, section).mesh, tpu, section, field)
        if problem:
            out.append(problem)
    slices = config.trainer.mesh.num_slices
    if slices > 1 and deploy.trainer_tpu.hosts == 1:
        # cloud.google.com/kubernetes-engine/docs/how-to/tpu-multislice, "Multislice
        # availability in GKE": multi-host TPU slice node pools only.
        out.append(
            f"trainer.mesh.num_slices={slices} joins single-host slices (deploy.trainer_tpu "
            f"topology {deploy.trainer_tpu.topology} = {deploy.trainer_tpu.chips} chips, one "
            "host): GKE runs TPU multi-slice on multi-host slice node pools only; use a "
            "multi-host deploy.trainer_tpu, or one slice"
        )
    if config.inference.colocated:
        out.append(
            "inference.colocated runs the inference worker inside the trainer's process on "
            "one host (the local launcher, `rlax-tpu run`); a deploy runs the workers as their "
            "own pods: set inference.colocated=false"
        )
    if deploy.inference_tpu.hosts > 1:
        out.append(
            f"deploy.inference_tpu spans {deploy.inference_tpu.hosts} hosts: an inference worker "
            "runs on one host's chips (rlax_tpu/inference/server.py); use a single-host slice "
            "(chips <= chips_per_host) and more workers"
        )
    run = dns_name(name or config.name)
    if not _NAME.match(run):
        out.append(f"the run name {run!r} is not a DNS label; pass --name")
    replicas = max(
        config.param_server.num_replicas,
        config.inference.num_workers,
        deploy.verifier_replicas,
        slices,  # the trainer's pods are <run>-trainer-<slice>-<host>
    )
    hosts = max(deploy.trainer_tpu.hosts, deploy.inference_tpu.hosts)
    longest = f"{run}-param-server-{replicas - 1}-{hosts - 1}"
    if len(longest) > _DNS_LABEL:
        out.append(
            f"pod hostnames such as {longest!r} exceed {_DNS_LABEL} characters; pass a "
            "shorter --name"
        )
    return out


def check_deployable(config: RunConfig, name: str | None = None) -> None:
    """Raise DeployError listing every problem of `problems(config)`."""
    found = problems(config, name)
    if found:
        raise DeployError("the config cannot be deployed:\n" + "\n".join(f"  - {p}" for p in found))


def build_plan(
    config: RunConfig,
    *,
    config_args: Sequence[str],
    host: HostFn,
    name: str | None = None,
) -> Plan:
    """The components of `config`.

    `config_args` name the config to every process (a path, maybe followed by `--set`s);
    `host(component, replica)` is the DNS name of that instance's first process, which
    serves its gRPC port (and, on a multi-host slice, the coordinator; of a multi-slice
    trainer, the first host of its first slice).
    """
    check_deployable(config, name)
    deploy, cfg = config.deploy, list(config_args)
    listen = ["--host=0.0.0.0"]

    def address(component: str, replica: int | str) -> str:
        return f"{host(component, replica)}:{PORTS[component]}"

    ps_replicas = config.param_server.num_replicas
    param_servers = [address("param-server", r) for r in range(ps_replicas)]
    ps_flags = [f"--param-server={a}" for a in param_servers]
    num_workers = config.inference.num_workers
    components = [
        Component(
            name="controller",
            replicas=1,
            hosts=1,
            args=(
                "run",
                *cfg,
                "--connect",
                *ps_flags,
                f"--trainer={address('trainer', 0)}",
                *(f"--inference={address('inference', i)}" for i in range(num_workers)),
                *(f"--verifier={address('verifier', v)}" for v in range(deploy.verifier_replicas)),
            ),
            cpu=deploy.controller_cpu,
            memory=deploy.controller_memory,
            node_pool=deploy.cpu_node_pool,
        ),
        Component(
            name="param-server",
            replicas=ps_replicas,
            hosts=1,
            args=(
                "serve",
                "param-server",
                *cfg,
                *listen,
                f"--port={PORTS['param-server']}",
                f"--replica={REPLICA}",
                f"--num-replicas={ps_replicas}",
            ),
            port=PORTS["param-server"],
            cpu=deploy.param_server_cpu,
            memory=deploy.param_server_memory,
            node_pool=deploy.cpu_node_pool,
        ),
        Component(
            name="verifier",
            replicas=deploy.verifier_replicas,
            hosts=1,
            args=(
                "serve",
                "verifier",
                *cfg,
                *listen,
                f"--port={PORTS['verifier']}",
                f"--worker-id=verifier-{REPLICA}",
                f"--test-data-cache={TEST_DATA_CACHE}",
            ),
            port=PORTS["verifier"],
            cpu=deploy.verifier_cpu,
            memory=deploy.verifier_memory,
            node_pool=deploy.verifier_node_pool,
            sandboxed=True,
        ),
        Component(
            name="inference",
            replicas=num_workers,
            hosts=deploy.inference_tpu.hosts,
            args=(
                "serve",
                "inference",
                *cfg,
                *listen,
                f"--port={PORTS['inference']}",
                *ps_flags,
                f"--worker-id=inference_worker-{REPLICA}",
            ),
            port=PORTS["inference"],
            tpu=deploy.inference_tpu,
        ),
        Component(
            name="trainer",
            replicas=1,
            hosts=deploy.trainer_tpu.hosts,
            args=(
                "serve",
                "trainer",
                *cfg,
                *listen,
                f"--port={PORTS['trainer']}",
                *ps_flags,
            ),
            port=PORTS["trainer"],
            tpu=deploy.trainer_tpu,
            slices=config.trainer.mesh.num_slices,
        ),
    ]
    return Plan(
        name=dns_name(name or config.name), config=config, components=tuple(components), host=host
    )
