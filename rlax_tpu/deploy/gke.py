"""GKE manifests of a run: a JobSet with one replicated job per component, a headless
Service per served component, and a ConfigMap with the resolved config.

Wiring: JobSet's own headless service (`network.subdomain`, the run's name) gives every
pod a DNS name `<run>-<component>-<replica>-<host>.<run>`; those names are the addresses in
the processes' args and the multi-host coordinator address. A multi-slice trainer
(`trainer.mesh.num_slices` > 1) is one Job per slice (`<run>-trainer-<slice>-<host>`), each
on a node pool of its own, joined into one JAX job, and over DCN by the MEGASCALE_*
variables. The per-component Services name the ports (`grpc`, `coordinator`, `megascale`)
and list a component's pods. The auth token comes from a Secret (`deploy.auth_secret`, key
`token`) and is never written here.

What restarts what: a lost parameter-server, verifier or inference-worker pod, or the
controller's, is replaced alone by its Job (same name, so same address): preempted pods
(`DisruptionTarget`) without limit, crashed ones up to `controller.component_restarts`
times. The others carry on: the controller waits for the lost component and reassigns its
work, and a new controller reattaches to the live components (docs/controller.md,
"Elastic recovery"). A trainer pod that fails fails the trainer's Job (a multi-host slice
cannot lose one host), as does a controller that exits 1 or 2 (it stopped because the run
cannot go on as it is: the trainer is gone, no worker came back, a refused config), or a
component that exits 2 (refused its config) or exhausts its restarts; then JobSet restarts
the whole run (`failurePolicy.maxRestarts`) and the controller resumes from the newest
snapshot in the gs:// run directory. The run succeeds when the controller's job completes.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from typing import Any

import yaml

from rlax_tpu.config import RunConfig
from rlax_tpu.deploy.plan import (
    COORDINATOR_PORT,
    MEGASCALE_COORDINATOR_ENV,
    MEGASCALE_NUM_SLICES_ENV,
    MEGASCALE_PORT,
    MEGASCALE_PORT_ENV,
    MEGASCALE_SLICE_ID_ENV,
    TEST_DATA_CACHE,
    Component,
    Plan,
    build_plan,
    dns_name,
)

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
CONFIG_DIR = "/etc/rlax-tpu"
CONFIG_FILE = f"{CONFIG_DIR}/config.json"
TOKEN_KEY = "token"
# The instance index of a pod: JobSet's job index (parameter-server replica, worker, ...;
# the slice, for the Jobs of a multi-slice trainer).
REPLICA_ENV = "RLAX_TPU_REPLICA"
# rlax_tpu.distributed reads these on every process of a multi-host slice.
COORDINATOR_ENV = "RLAX_TPU_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "RLAX_TPU_NUM_PROCESSES"
PROCESS_ID_ENV = "RLAX_TPU_PROCESS_ID"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
GVISOR = "gvisor"
# Replaced alone when their pod is lost; the trainer's slice restarts with the whole run.
RESTARTED_ALONE = ("controller", "param-server", "verifier", "inference")
# A replaceable server stopped by SIGTERM exits with this (128 + SIGTERM) rather than 0:
# its pod then fails, and its Job replaces it; a pod that succeeded would complete the Job.
STOPPED_EXIT_CODE = 143
# Exit codes that end a Job at once rather than being retried: 2 is a refusal (bad config,
# a run directory of another config) for every command; the controller's 1 means it
# stopped because the run cannot go on as it is (rlax_tpu/cli, main).
EXIT_REFUSED = 2
EXIT_CONTROLLER_GAVE_UP = 1


def pod_host(run: str, component: str, replica: int | str, host: int = 0) -> str:
    """The DNS name JobSet gives a pod (hostname `.` subdomain)."""
    return f"{run}-{component}-{replica}-{host}.{run}"


def gke_plan(config: RunConfig, *, name: str | None = None) -> Plan:
    """The plan with pods addressed by their JobSet DNS names and the config in the
    ConfigMap (overrides already applied)."""
    run = dns_name(name or config.name)
    return build_plan(
        config,
        config_args=[CONFIG_FILE],
        host=lambda component, replica: pod_host(run, component, replica),
        name=run,
    )


def _labels(plan: Plan, component: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "rlax-tpu", "app.kubernetes.io/instance": plan.name}
    if component:
        labels["app.kubernetes.io/component"] = component
    return labels


def _replica(component: Component) -> int | str:
    """The instance index as the pod sees it: expanded by Kubernetes from REPLICA_ENV."""
    return f"$({REPLICA_ENV})" if component.replicas > 1 else 0


def _env(plan: Plan, component: Component) -> list[dict[str, Any]]:
    config = plan.config
    env: list[dict[str, Any]] = [
        {
            "name": config.param_server.auth_token_env,
            "valueFrom": {"secretKeyRef": {"name": config.deploy.auth_secret, "key": TOKEN_KEY}},
        }
    ]
    if component.replicas > 1:
        env.append(
            {
                "name": REPLICA_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_INDEX_LABEL}']"}},
            }
        )
    # Process 0 of the instance (of its first slice, when it has several).
    coordinator = pod_host(plan.name, component.name, _replica(component))
    if component.multi_host:
        env += [
            {"name": COORDINATOR_ENV, "value": f"{coordinator}:{COORDINATOR_PORT}"},
            {"name": NUM_PROCESSES_ENV, "value": str(component.processes)},
            {
                # Within the slice when there are several (rlax_tpu.distributed adds the
                # slice's offset): an indexed Job's completion index.
                "name": PROCESS_ID_ENV,
                "valueFrom": {
                    "fieldRef": {
                        "fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"
                    }
                },
            },
        ]
    if component.multi_slice:
        env += [
            {"name": MEGASCALE_COORDINATOR_ENV, "value": f"{coordinator}:{MEGASCALE_PORT}"},
            {"name": MEGASCALE_PORT_ENV, "value": str(MEGASCALE_PORT)},
            {"name": MEGASCALE_NUM_SLICES_ENV, "value": str(component.slices)},
            {
                # One Job per slice: the slice is the Job's index in its replicated job.
                "name": MEGASCALE_SLICE_ID_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_INDEX_LABEL}']"}},
            },
        ]
    return env


def _ports(component: Component) -> list[dict[str, Any]]:
    ports = [{"name": "grpc", "containerPort": component.port, "protocol": "TCP"}]
    if component.multi_host:
        ports.append({"name": "coordinator", "containerPort": COORDINATOR_PORT, "protocol": "TCP"})
    if component.multi_slice:
        ports.append({"name": "megascale", "containerPort": MEGASCALE_PORT, "protocol": "TCP"})
    return ports


def _args(component: Component) -> list[str]:
    args = component.args_for(_replica(component))
    if component.port is not None and component.name in RESTARTED_ALONE:
        args.insert(2, f"--stopped-exit-code={STOPPED_EXIT_CODE}")  # after `serve NAME`
    return args


def _pod_spec(plan: Plan, component: Component) -> dict[str, Any]:
    deploy = plan.config.deploy
    container: dict[str, Any] = {
        "name": component.name,
        "image": deploy.image,
        "command": ["rlax-tpu"],
        "args": _args(component),
        "env": _env(plan, component),
    }
    if component.port is not None:
        container["ports"] = _ports(component)
    volumes = [{"name": "config", "configMap": {"name": f"{plan.name}-config"}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    node_selector: dict[str, str] = {}
    if component.tpu is not None:
        chips = component.tpu.chips_per_host
        container["resources"] = {
            "requests": {TPU_RESOURCE: chips},
            "limits": {TPU_RESOURCE: chips},
        }
        node_selector[TPU_ACCELERATOR_LABEL] = component.tpu.accelerator
        node_selector[TPU_TOPOLOGY_LABEL] = component.tpu.topology
    else:
        container["resources"] = {
            "requests": {"cpu": component.cpu, "memory": component.memory},
            "limits": {"memory": component.memory},
        }
        if component.node_pool:
            node_selector[NODE_POOL_LABEL] = component.node_pool
    if component.name == "verifier":
        volumes.append({"name": "test-data", "emptyDir": {}})
        mounts.append({"name": "test-data", "mountPath": TEST_DATA_CACHE})
    container["volumeMounts"] = mounts
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": deploy.termination_grace_period_s,
    }
    if deploy.service_account:
        spec["serviceAccountName"] = deploy.service_account
    if component.sandboxed:
        spec["runtimeClassName"] = GVISOR
    if node_selector:
        spec["nodeSelector"] = node_selector
    spec["containers"] = [container]
    spec["volumes"] = volumes
    return spec


def _restarts(plan: Plan, component: Component) -> dict[str, Any]:
    """The Job's retry settings. The trainer: none, a failed pod fails the Job and JobSet
    restarts the run. The others: a replacement pod (same index, so same DNS name), free
    for a preempted pod, counted for a crashed one; a refusal fails the Job at once."""
    if component.name not in RESTARTED_ALONE:
        return {"backoffLimit": 0}
    fatal = [EXIT_REFUSED]
    if component.name == "controller":
        fatal.insert(0, EXIT_CONTROLLER_GAVE_UP)
    return {
        "backoffLimit": plan.config.controller.component_restarts,
        "podFailurePolicy": {
            "rules": [
                # Preempted or evicted (spot nodes, maintenance): replaced, not counted.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": component.name,
                        "operator": "In",
                        "values": fatal,
                    },
                },
            ]
        },
    }


def _replicated_job(plan: Plan, component: Component) -> dict[str, Any]:
    job_metadata: dict[str, Any] = {"labels": _labels(plan, component.name)}
    if component.tpu is not None and component.multi_host:
        # A multi-host slice is a node pool: one Job per slice, never two on one pool.
        job_metadata["annotations"] = {EXCLUSIVE_TOPOLOGY: NODE_POOL_LABEL}
    return {
        "name": component.name,
        # A Job per instance; a multi-slice instance is a Job per slice, each of the
        # slice's hosts (the JobSet of xpk and of JobSet's TPU multi-slice example).
        "replicas": component.slices if component.multi_slice else component.replicas,
        "template": {
            "metadata": job_metadata,
            "spec": {
                "parallelism": component.hosts,
                "completions": component.hosts,
                "completionMode": "Indexed",
                **_restarts(plan, component),
                "template": {
                    "metadata": {"labels": _labels(plan, component.name)},
                    "spec": _pod_spec(plan, component),
                },
            },
        },
    }


def _service(plan: Plan, component: Component) -> dict[str, Any]:
    ports = [{"name": "grpc", "port": component.port, "targetPort": "grpc", "protocol": "TCP"}]
    if component.multi_host:
        ports.append(
            {
                "name": "coordinator",
                "port": COORDINATOR_PORT,
                "targetPort": "coordinator",
                "protocol": "TCP",
            }
        )
    if component.multi_slice:
        ports.append(
            {
                "name": "megascale",
                "port": MEGASCALE_PORT,
                "targetPort": "megascale",
                "protocol": "TCP",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": f"{plan.name}-{component.name}",
            "namespace": plan.config.deploy.namespace,
            "labels": _labels(plan, component.name),
        },
        "spec": {
            "clusterIP": "None",
            # Components are reachable before they answer (the controller waits for them).
            "publishNotReadyAddresses": True,
            "selector": _labels(plan, component.name),
            "ports": ports,
        },
    }


def manifests(plan: Plan) -> list[dict[str, Any]]:
    """The Kubernetes objects of `plan`, in apply order: ConfigMap, Services, JobSet."""
    deploy = plan.config.deploy
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{plan.name}-config",
            "namespace": deploy.namespace,
            "labels": _labels(plan),
        },
        "data": {"config.json": json.dumps(plan.config.to_dict(), indent=2) + "\n"},
    }
    services = [_service(plan, c) for c in plan.components if c.port is not None]
    jobset = {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": plan.name, "namespace": deploy.namespace, "labels": _labels(plan)},
        "spec": {
            # JobSet's headless service: pod DNS names <run>-<job>-<replica>-<host>.<run>.
            "network": {"enableDNSHostnames": True, "subdomain": plan.name},
            # A failed Job (the trainer's, or one that gave up) restarts the run whole;
            # the controller resumes it from its newest snapshot.
            "failurePolicy": {"maxRestarts": deploy.max_restarts},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["controller"]},
            "replicatedJobs": [_replicated_job(plan, c) for c in plan.components],
        },
    }
    return [config_map, *services, jobset]


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the config JSON), and no aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def output_name(config: RunConfig) -> str:
    """The manifest file's name: `<config name>.yaml` (deploy/gke/ holds the shipped ones)."""
    return f"{config.name}.yaml"


def header(plan: Plan, command: Sequence[str]) -> str:
    deploy = plan.config.deploy
    env = plan.config.param_server.auth_token_env
    return (
        f"# GKE manifests of run {plan.config.name!r}, generated by:\n"
        f"#   {shlex.join(command)}\n"
        "# Do not edit: change the config and render again (docs/deploy.md).\n"
        "# Needs the JobSet controller and the auth token Secret ("
        f"{env} in every pod):\n"
        f"#   kubectl -n {deploy.namespace} create secret generic {deploy.auth_secret} \\\n"
        f"#     --from-literal={TOKEN_KEY}=$(python3 -c 'import secrets; "
        "print(secrets.token_hex(32))')\n"
        f"#   kubectl apply -f {output_name(plan.config)}\n"
    )


def to_yaml(objects: Sequence[dict[str, Any]], *, comment: str = "") -> str:
    body = yaml.dump_all(
        objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100
    )
    return comment + body


def render(config: RunConfig, *, command: Sequence[str], name: str | None = None) -> str:
    """The YAML of `config`'s manifests, with a header naming `command`."""
    plan = gke_plan(config, name=name)
    return to_yaml(manifests(plan), comment=header(plan, command))
