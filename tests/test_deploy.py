"""Deployment: GKE manifests of every shipped TPU config checked structurally and against
the checked-in files, the XManager dry run, the container image's Dockerfile, and the
controller's `--connect` entry point (addresses, waiting for components, watching them)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from rlax_tpu.cli import main as cli_main
from rlax_tpu.config import ConfigError, RunConfig, TpuSliceConfig, load_config
from rlax_tpu.deploy import DeployError, check_deployable, problems
from rlax_tpu.deploy.gke import render
from rlax_tpu.launch.remote import (
    ComponentAddresses,
    ConnectError,
    HealthProbe,
    Watchdog,
    wait_until_serving,
)

ROOT = Path(__file__).resolve().parents[1]
TPU_CONFIGS = sorted((ROOT / "configs").glob("*tpu*.py"))
CHECKED_IN = ROOT / "deploy" / "gke"
LAUNCH = ROOT / "deploy" / "xmanager" / "launch.py"
COMPONENTS = {"controller", "param-server", "verifier", "inference", "trainer"}
# Blocks every socket connection in a child process (the dry run must not need any).
NO_NETWORK = """
import socket, sys
def _refuse(*args, **kwargs):
    raise OSError("network access in a dry run")
socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.create_connection = _refuse
socket.getaddrinfo = _refuse
"""


def rendered(path: Path, *overrides: str) -> list[dict]:
    config = load_config(str(path), list(overrides))
    return list(yaml.safe_load_all(render(config, command=["rlax-tpu", "deploy", "gke"])))


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def jobs_of(jobset: dict) -> dict[str, dict]:
    return {rj["name"]: rj for rj in jobset["spec"]["replicatedJobs"]}


def container_of(replicated_job: dict) -> dict:
    [container] = replicated_job["template"]["spec"]["template"]["spec"]["containers"]
    return container


def pod_spec(replicated_job: dict) -> dict:
    return replicated_job["template"]["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def flag_values(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"{flag}=")]


@pytest.fixture(scope="module", params=TPU_CONFIGS, ids=lambda p: p.stem)
def shipped(request):
    path = request.param
    return load_config(str(path)), rendered(path)


def assert_restarts(name: str, job: dict, config) -> None:
    """What restarts what (docs/deploy.md): a failed trainer pod fails its Job, and JobSet
    restarts the run; every other component's pod is replaced alone by its Job, free when
    preempted, counted when it crashed; a refusal (exit 2), or the controller giving up
    (exit 1), fails the Job at once."""
    [container] = job["template"]["spec"]["containers"]
    stopped = [a for a in container["args"] if a.startswith("--stopped-exit-code")]
    if name == "trainer":
        assert job["backoffLimit"] == 0 and "podFailurePolicy" not in job and not stopped
        return
    # A server stopped by SIGTERM must fail its pod (so its Job replaces it), never succeed.
    assert stopped == ([] if name == "controller" else ["--stopped-exit-code=143"])
    assert job["backoffLimit"] == config.controller.component_restarts > 0
    preempted, fatal = job["podFailurePolicy"]["rules"]
    assert preempted == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert fatal["action"] == "FailJob"
    assert fatal["onExitCodes"]["containerName"] == container["name"] == name
    assert fatal["onExitCodes"]["operator"] == "In"
    assert fatal["onExitCodes"]["values"] == ([1, 2] if name == "controller" else [2])
    # podFailurePolicy needs restartPolicy Never: a replacement is a new pod, same index.
    assert job["template"]["spec"]["restartPolicy"] == "Never"


def test_every_shipped_tpu_config_renders_the_five_components(shipped):
    config, objects = shipped
    assert [o["kind"] for o in objects] == ["ConfigMap", *["Service"] * 4, "JobSet"]
    for obj in objects:
        assert obj["metadata"]["name"] and obj["metadata"]["namespace"] == "default"
        assert obj["apiVersion"]
    [jobset] = by_kind(objects, "JobSet")
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    spec = jobset["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": jobset["metadata"]["name"]}
    assert spec["failurePolicy"]["maxRestarts"] == config.deploy.max_restarts > 0
    assert spec["successPolicy"]["targetReplicatedJobs"] == ["controller"]
    jobs = jobs_of(jobset)
    assert set(jobs) == COMPONENTS
    for name, rj in jobs.items():
        job = rj["template"]["spec"]
        assert job["parallelism"] == job["completions"] >= 1
        assert job["completionMode"] == "Indexed"
        assert_restarts(name, job, config)
        pod = pod_spec(rj)
        assert pod["restartPolicy"] == "Never"
        assert (
            pod["terminationGracePeriodSeconds"] == config.deploy.termination_grace_period_s >= 300
        )
        assert pod["serviceAccountName"] == config.deploy.service_account
        container = container_of(rj)
        assert container["image"] == config.deploy.image
        assert container["command"] == ["rlax-tpu"]
        assert (
            container["args"][0] in ("run", "serve")
            and "/etc/rlax-tpu/config.json" in (container["args"])
        )
        assert rj["template"]["spec"]["template"]["metadata"]["labels"][
            "app.kubernetes.io/component"
        ] == (name)
    assert jobs["controller"]["replicas"] == 1
    assert container_of(jobs["controller"])["args"][:3] == [
        "run",
        "/etc/rlax-tpu/config.json",
        "--connect",
    ]
    assert jobs["inference"]["replicas"] == config.inference.num_workers
    assert jobs["param-server"]["replicas"] == config.param_server.num_replicas
    assert jobs["verifier"]["replicas"] == config.deploy.verifier_replicas
    verifier = pod_spec(jobs["verifier"])
    assert verifier["runtimeClassName"] == "gvisor"
    assert verifier["nodeSelector"] == {
        "cloud.google.com/gke-nodepool": config.deploy.verifier_node_pool
    }
    for cpu_job in ("controller", "param-server", "verifier"):
        resources = container_of(jobs[cpu_job])["resources"]
        assert set(resources["requests"]) == {"cpu", "memory"}


def kubernetes_round_trip(obj: dict, model: str) -> dict:
    """`obj` read into the Kubernetes client's model of `model` (batch/v1, core/v1) and
    written back: a field name the API does not know is dropped on the way."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    return api.sanitize_for_serialization(api.deserialize(json.dumps(obj), model, None))


def test_the_manifests_use_only_fields_the_kubernetes_api_knows(shipped):
    """JobSet's replicated jobs embed batch/v1 Job templates; those, the Services and the
    ConfigMap must survive a trip through the Kubernetes API's models unchanged (a misspelt
    `podFailurePolicy` field would be dropped by the API server, silently)."""
    _, objects = shipped
    for obj in objects[:-1]:
        assert kubernetes_round_trip(obj, f"V1{obj['kind']}") == obj
    templates = {}
    for name, rj in jobs_of(by_kind(objects, "JobSet")[0]).items():
        template = templates[name] = json.loads(json.dumps(rj["template"]))
        # A quantity may be a number in YAML (the API server takes `google.com/tpu: 4`);
        # the client's model takes only its string form.
        resources = template["spec"]["template"]["spec"]["containers"][0]["resources"]
        for quantities in resources.values():
            quantities.update({k: str(v) for k, v in quantities.items()})
        assert kubernetes_round_trip(template, "V1JobTemplateSpec") == template
    misspelt = templates["inference"]
    rule = misspelt["spec"]["podFailurePolicy"]["rules"][0]
    rule["onPodCondition"] = rule.pop("onPodConditions")
    assert kubernetes_round_trip(misspelt, "V1JobTemplateSpec") != misspelt


def test_tpu_hosts_times_chips_per_host_is_the_mesh_size(shipped):
    config, objects = shipped
    jobs = jobs_of(by_kind(objects, "JobSet")[0])
    for name, section, tpu in (
        ("trainer", config.trainer, config.deploy.trainer_tpu),
        ("inference", config.inference, config.deploy.inference_tpu),
    ):
        rj = jobs[name]
        hosts = rj["template"]["spec"]["parallelism"]
        resources = container_of(rj)["resources"]
        chips_per_host = resources["limits"]["google.com/tpu"]
        assert resources["requests"]["google.com/tpu"] == chips_per_host == tpu.chips_per_host
        topology = pod_spec(rj)["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
        assert topology == tpu.topology
        assert pod_spec(rj)["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == (
            tpu.accelerator
        )
        chips = math.prod(int(d) for d in topology.split("x"))
        assert hosts * chips_per_host == chips
        mesh = section.mesh
        sizes = [mesh.data, mesh.fsdp, mesh.tensor]
        if -1 in sizes:  # the free axis takes the rest: the fixed ones must divide the slice
            fixed = math.prod(s for s in sizes if s != -1)
            assert chips % fixed == 0
        else:
            assert math.prod(sizes) == chips
        assert math.prod(mesh.shape_for(chips).values()) == hosts * chips_per_host


def test_multi_host_slices_get_the_distributed_environment(shipped):
    config, objects = shipped
    jobset = by_kind(objects, "JobSet")[0]
    run, subdomain = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    multi = 0
    for name, rj in jobs_of(jobset).items():
        hosts = rj["template"]["spec"]["parallelism"]
        env = env_of(container_of(rj))
        if hosts == 1:
            assert "RLAX_TPU_NUM_PROCESSES" not in env
            continue
        multi += 1
        assert env["RLAX_TPU_NUM_PROCESSES"]["value"] == str(hosts)
        assert env["RLAX_TPU_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        )
        address = env["RLAX_TPU_COORDINATOR_ADDRESS"]["value"]
        replica = "0" if rj["replicas"] == 1 else "$(RLAX_TPU_REPLICA)"
        ports = {p["name"]: p["containerPort"] for p in container_of(rj)["ports"]}
        assert address == f"{run}-{name}-{replica}-0.{subdomain}:{ports['coordinator']}"
        names = [e["name"] for e in container_of(rj)["env"]]
        # One slice: no multi-slice variables (libtpu would try to join the others).
        assert not [n for n in names if n.startswith("MEGASCALE_")]
        if replica != "0":  # $(VAR) expands only from variables defined before it
            assert names.index("RLAX_TPU_REPLICA") < names.index("RLAX_TPU_COORDINATOR_ADDRESS")
        annotations = rj["template"]["metadata"]["annotations"]
        assert annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] == (
            "cloud.google.com/gke-nodepool"
        )
    # The pod configs' trainers span several hosts; the small-slice recipe's is one host.
    assert multi >= (config.deploy.trainer_tpu.hosts > 1)


def test_services_ports_and_addresses_agree_between_components(shipped):
    config, objects = shipped
    jobset = by_kind(objects, "JobSet")[0]
    run, subdomain = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    jobs = jobs_of(jobset)
    grpc_port = {}
    for name, rj in jobs.items():
        container = container_of(rj)
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        if name == "controller":
            assert not ports
            continue
        # The port a server binds is the port its pod declares.
        assert flag_values(container["args"], "--port") == [str(ports["grpc"])]
        assert flag_values(container["args"], "--host") == ["0.0.0.0"]
        grpc_port[name] = ports["grpc"]
    assert len(set(grpc_port.values())) == len(grpc_port)
    # Each Service selects exactly one component's pods and names that container's ports.
    services = by_kind(objects, "Service")
    assert {s["metadata"]["name"] for s in services} == {
        f"{run}-{c}" for c in COMPONENTS - {"controller"}
    }
    for service in services:
        assert service["spec"]["clusterIP"] == "None"
        selector = service["spec"]["selector"]
        matching = [
            name
            for name, rj in jobs.items()
            if selector.items() <= rj["template"]["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matching) == 1
        container = container_of(jobs[matching[0]])
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            assert declared[port["targetPort"]] == port["port"]
    # Every address a process is given is a pod of the named component at its gRPC port.
    pattern = re.compile(rf"^{re.escape(run)}-([a-z-]+?)-(\d+)-0\.{re.escape(subdomain)}:(\d+)$")
    wanted = {
        "--param-server": "param-server",
        "--trainer": "trainer",
        "--inference": "inference",
        "--verifier": "verifier",
    }
    for name, rj in jobs.items():
        args = container_of(rj)["args"]
        for flag, component in wanted.items():
            addresses = flag_values(args, flag)
            for address in addresses:
                match = pattern.match(address)
                assert match, address
                assert match.group(1) == component
                assert int(match.group(2)) < jobs[component]["replicas"]
                assert int(match.group(3)) == grpc_port[component]
            if name == "controller" or (
                flag == "--param-server" and name in ("inference", "trainer")
            ):
                # every instance, each once, in replica order
                count = 1 if component == "trainer" else jobs[component]["replicas"]
                assert [pattern.match(a).group(2) for a in addresses] == [
                    str(i) for i in range(count)
                ]


def test_the_token_comes_from_a_secret_never_a_literal(shipped):
    config, objects = shipped
    assert not by_kind(objects, "Secret")
    token_env = config.param_server.auth_token_env
    for name, rj in jobs_of(by_kind(objects, "JobSet")[0]).items():
        entries = [e for e in container_of(rj)["env"] if e["name"] == token_env]
        assert len(entries) == 1, name
        assert "value" not in entries[0]
        assert entries[0]["valueFrom"]["secretKeyRef"] == {
            "name": config.deploy.auth_secret,
            "key": "token",
        }


def test_the_config_map_holds_the_resolved_config(shipped):
    config, objects = shipped
    [config_map] = by_kind(objects, "ConfigMap")
    assert RunConfig.from_dict(json.loads(config_map["data"]["config.json"])) == config
    for rj in jobs_of(by_kind(objects, "JobSet")[0]).values():
        volumes = {v["name"]: v for v in pod_spec(rj)["volumes"]}
        assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]


def test_overrides_reach_the_config_map():
    objects = rendered(
        TPU_CONFIGS[0], "storage.run_dir=gs://elsewhere/run", "deploy.max_restarts=3"
    )
    config = json.loads(by_kind(objects, "ConfigMap")[0]["data"]["config.json"])
    assert config["storage"]["run_dir"] == "gs://elsewhere/run"
    assert by_kind(objects, "JobSet")[0]["spec"]["failurePolicy"]["maxRestarts"] == 3


@pytest.mark.parametrize("path", TPU_CONFIGS, ids=lambda p: p.stem)
def test_checked_in_manifests_equal_a_fresh_render(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    rel = path.relative_to(ROOT).as_posix()
    assert cli_main(["deploy", "gke", rel, "--out", str(tmp_path)]) == 0
    name = load_config(rel).name
    fresh = (tmp_path / f"{name}.yaml").read_text()
    checked_in = CHECKED_IN / f"{name}.yaml"
    assert checked_in.exists(), f"render it: rlax-tpu deploy gke {rel} --out deploy/gke"
    assert checked_in.read_text() == fresh, f"stale: rlax-tpu deploy gke {rel} --out deploy/gke"


def test_every_checked_in_manifest_has_a_shipped_config():
    names = {load_config(str(p)).name for p in TPU_CONFIGS}
    assert {p.stem for p in CHECKED_IN.glob("*.yaml")} == names


def test_a_local_config_is_refused_with_every_reason(capsys):
    assert cli_main(["deploy", "gke", str(ROOT / "configs" / "tiny_cpu.py")]) == 2
    err = capsys.readouterr().err
    for reason in ("storage.run_dir", "hf_checkpoint", "trainer.mesh"):
        assert reason in err
    assert "warm_start" not in err  # the warm start runs on the trainer, deployed or not
    config = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    with pytest.raises(DeployError, match="gs://"):
        check_deployable(config)


def test_a_pod_config_with_an_sft_warm_start_is_deployable():
    assert problems(load_config(str(TPU_CONFIGS[0]), ["trainer.warm_start.steps=10"])) == []


def test_a_mesh_that_does_not_fill_its_slice_is_refused():
    # With the mesh's own topology cleared (it follows the deploy slice): a mesh that names
    # its topology is refused when the config loads (tests/test_compile.py).
    config = load_config(
        str(TPU_CONFIGS[0]), ["inference.mesh.topology=", "inference.mesh.tensor=2"]
    )
    [problem] = problems(config)
    assert problem.startswith("inference.mesh must fill deploy.inference_tpu")
    config = load_config(str(TPU_CONFIGS[0]), ["trainer.mesh.topology=", "trainer.mesh.fsdp=4"])
    assert any(p.startswith("trainer.mesh") for p in problems(config))


# -- multi-slice ----------------------------------------------------------------------------
V5P_64 = ROOT / "configs" / "llama3_1_8b_tpu_v5p_64.py"
# The 8B trainer on two v5p-64 slices: data 2 across them, fsdp 8 × tensor 4 within each.
TWO_SLICES = ("trainer.mesh.data=2", "trainer.mesh.num_slices=2")


def pod_environ(container: dict, slice_: int, host: int) -> dict[str, str]:
    """The environment Kubernetes gives the trainer pod `host` of slice `slice_`'s Job:
    the literal values, and the fields of the pod that the manifest refers to."""
    fields = {
        "metadata.labels['jobset.sigs.k8s.io/job-index']": str(slice_),
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(host),
    }
    out = {}
    for e in container["env"]:
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def test_a_multi_slice_trainer_is_a_job_per_slice_forming_one_jax_job():
    from rlax_tpu.distributed import DistributedEnv

    config = load_config(str(V5P_64), list(TWO_SLICES))
    assert problems(config) == []
    objects = rendered(V5P_64, *TWO_SLICES)
    jobset = by_kind(objects, "JobSet")[0]
    run, subdomain = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    trainer, tpu = jobs_of(jobset)["trainer"], config.deploy.trainer_tpu
    # One Job per slice, each of the slice's hosts, on a node pool of its own.
    assert trainer["replicas"] == 2
    job = trainer["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (8, 8, "Indexed")
    assert job["backoffLimit"] == 0  # a lost host of any slice restarts the run
    annotations = trainer["template"]["metadata"]["annotations"]
    assert annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] == (
        "cloud.google.com/gke-nodepool"
    )
    assert pod_spec(trainer)["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x4x4",
    }
    container = container_of(trainer)
    chips = container["resources"]["limits"]["google.com/tpu"]
    mesh = config.trainer.mesh.shape_for(2 * tpu.chips)
    assert 2 * job["parallelism"] * chips == math.prod(mesh.values()) == 64
    # Every pod's environment makes it one process of one 16-process job, numbered slice by
    # slice, with the first slice's first host as the coordinator of JAX and of megascale.
    first = f"{run}-trainer-0-0.{subdomain}"
    pods = [pod_environ(container, s, h) for s in range(2) for h in range(8)]
    envs = [DistributedEnv.from_environ(pod) for pod in pods]
    assert [e.process_id for e in envs] == list(range(16))
    assert {(e.num_processes, e.num_slices, e.coordinator_address) for e in envs} == {
        (16, 2, f"{first}:8476")
    }
    assert [e.slice_id for e in envs] == [0] * 8 + [1] * 8
    assert {pod["MEGASCALE_COORDINATOR_ADDRESS"] for pod in pods} == {f"{first}:8080"}
    assert {(pod["MEGASCALE_NUM_SLICES"], pod["MEGASCALE_PORT"]) for pod in pods} == {("2", "8080")}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50052, "coordinator": 8476, "megascale": 8080}
    [service] = [
        s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("-trainer")
    ]
    assert {p["name"] for p in service["spec"]["ports"]} == set(ports)
    # Only fields the Kubernetes API knows (as in the test of the shipped manifests).
    template = json.loads(json.dumps(trainer["template"]))
    for quantities in template["spec"]["template"]["spec"]["containers"][0]["resources"].values():
        quantities.update({k: str(v) for k, v in quantities.items()})
    assert kubernetes_round_trip(template, "V1JobTemplateSpec") == template
    assert kubernetes_round_trip(service, "V1Service") == service
    # The controller talks to process 0; every other component is as on one slice.
    controller = container_of(jobs_of(jobset)["controller"])
    assert flag_values(controller["args"], "--trainer") == [f"{first}:50052"]
    one_slice = jobs_of(by_kind(rendered(V5P_64, TWO_SLICES[0]), "JobSet")[0])
    for name in COMPONENTS - {"trainer"}:
        assert jobs_of(jobset)[name] == one_slice[name]


def test_a_multi_slice_trainer_needs_multi_host_slices_that_its_mesh_fills():
    single_host = ["trainer.mesh.topology=", "deploy.trainer_tpu.topology=2x2x1", *TWO_SLICES]
    [problem] = problems(load_config(str(V5P_64), single_host))
    assert "joins single-host slices" in problem and "multi-host slice node pools only" in problem
    # fsdp 4 fills one slice of 32 chips, not two.
    half = ["trainer.mesh.topology=", *TWO_SLICES, "trainer.mesh.fsdp=4"]
    [problem] = problems(load_config(str(V5P_64), half))
    assert problem.startswith(
        "trainer.mesh must fill 2 slices of deploy.trainer_tpu (trainer.mesh.num_slices; "
        "topology 2x4x4 = 32 chips a slice, 4 per host: 64 chips)"
    )


def test_an_inference_slice_of_several_hosts_is_refused():
    qwen = ROOT / "configs" / "qwen2_5_32b_tpu_v5p_256.py"
    overrides = [
        "inference.mesh.topology=",  # follow the deploy slice
        "deploy.inference_tpu.topology=2x2x2",
        "inference.mesh.tensor=8",
    ]
    [problem] = problems(load_config(str(qwen), overrides))
    assert "an inference worker runs on one host" in problem


def test_a_tpu_slice_derives_its_hosts_and_checks_chips_per_host():
    tpu = TpuSliceConfig(topology="4x4x8", chips_per_host=4)
    assert (tpu.chips, tpu.hosts) == (128, 32)
    with pytest.raises(ConfigError, match="chips_per_host"):
        TpuSliceConfig(topology="1x1x3", chips_per_host=4)
    with pytest.raises(ConfigError, match="topology"):
        TpuSliceConfig(topology="2by2")


# -- XManager ---------------------------------------------------------------------------------
# The packaged command, and the script `xmanager launch` runs (a thin wrapper over it).
XMANAGER_ENTRY_POINTS = {
    "rlax-tpu": "from rlax_tpu.cli import main\n"
    "sys.exit(main(['deploy', 'xmanager', {config!r}, '--dry-run', *{overrides!r}]))\n",
    "launch.py": "import runpy\n"
    f"sys.argv = [{str(LAUNCH)!r}, '--config={{config}}', '--dry_run', *{{overrides!r}}]\n"
    f"runpy.run_path({str(LAUNCH)!r}, run_name='__main__')\n",
}


@pytest.mark.parametrize("entry", sorted(XMANAGER_ENTRY_POINTS))
def test_xmanager_dry_run_builds_the_same_jobs_without_network(tmp_path, entry):
    config_path = TPU_CONFIGS[0]
    overrides = ["--set=storage.run_dir=gs://bucket/runs/x"]
    run = XMANAGER_ENTRY_POINTS[entry].format(config=str(config_path), overrides=overrides)
    code = NO_NETWORK + (
        "try:\n" + "".join(f"    {line}\n" for line in run.splitlines()) + "finally:\n"
        "    assert 'xmanager' not in sys.modules and 'grpc' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RLAX_TPU_AUTH_TOKEN"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    specs = json.loads(done.stdout)
    config = load_config(str(config_path), ["storage.run_dir=gs://bucket/runs/x"])
    by_name = {s["name"]: s for s in specs}
    assert set(by_name) == {
        "controller",
        "trainer",
        *(f"param_server_{i}" for i in range(config.param_server.num_replicas)),
        *(f"inference_{i}" for i in range(config.inference.num_workers)),
        *(f"verifier_{i}" for i in range(config.deploy.verifier_replicas)),
    }
    trainer = config.deploy.trainer_tpu
    assert by_name["trainer"]["requirements"] == {"tpu_v5p": trainer.topology}
    assert by_name["trainer"]["hosts"] == trainer.hosts > 1
    assert by_name["trainer"]["env"] == {"RLAX_TPU_DISTRIBUTED": "auto"}
    assert by_name["inference_0"]["requirements"] == {
        "tpu_v5p": config.deploy.inference_tpu.topology
    }
    assert by_name["param_server_0"]["requirements"]["ram"] > 0
    rel = config_path.relative_to(ROOT).as_posix()
    for spec in specs:
        # The same config (its path in the image) and the same overrides, in every job.
        assert spec["args"][spec["args"].index(rel) + 1] == overrides[0]
        assert spec["secret_env"] == ["RLAX_TPU_AUTH_TOKEN"]
        assert "RLAX_TPU_AUTH_TOKEN" not in spec["env"]
        assert spec["image"] == config.deploy.image
    # The same processes as on GKE: the args differ only in the config and the addresses
    # (and in the exit code of a stopped server that GKE replaces alone).
    gke = jobs_of(by_kind(rendered(config_path, "storage.run_dir=gs://bucket/runs/x"), "JobSet")[0])
    strip = {rel, overrides[0], "/etc/rlax-tpu/config.json", "--stopped-exit-code=143"}

    def shape(args):
        return [a.split("=")[0] for a in args if a not in strip and not a.startswith("--replica")]

    for name, component in (("trainer", "trainer"), ("param_server_1", "param-server")):
        assert shape(by_name[name]["args"]) == shape(container_of(gke[component])["args"])


def test_xmanager_runs_a_multi_slice_trainer_as_a_job_per_slice():
    from rlax_tpu.deploy.xmanager import build_specs

    specs = {s["name"]: s for s in build_specs(str(V5P_64), TWO_SLICES, experiment="7")}
    assert "trainer" not in specs
    first = "7-1-trainer-slice-0.experiments"
    for i in range(2):
        spec = specs[f"trainer_slice_{i}"]
        assert spec["requirements"] == {"tpu_v5p": "2x4x4"} and spec["hosts"] == 8
        assert spec["env"] == {
            "RLAX_TPU_DISTRIBUTED": "auto",
            "MEGASCALE_COORDINATOR_ADDRESS": f"{first}:8080",
            "MEGASCALE_PORT": "8080",
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": str(i),
        }
    assert f"--trainer={first}:50052" in specs["controller"]["args"]


# -- container image ------------------------------------------------------------------------
def test_the_dockerfile_installs_the_package_with_its_tpu_extra_and_the_sandbox():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    instructions = [
        line for line in dockerfile.splitlines() if line.strip() and not line.startswith("#")
    ]
    text = "\n".join(instructions)
    assert re.search(r"apt-get install .*bubblewrap", text)
    assert "util-linux" in text and "g++" in text
    assert 'pip install ".[tpu]"' in text
    # The build compiles protos/ (setup.py runs tools/gen_protos.py): both are in the image.
    assert "COPY protos/ protos/" in text
    assert "COPY tools/gen_protos.py" in text
    assert re.search(r"^COPY .*\bsetup\.py\b", text, re.M)
    assert 'ENTRYPOINT ["rlax-tpu"]' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^tpu = \["jax\[tpu\]>=0\.10\.2,<0\.11"\]', pyproject, re.M)
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    for needed in ("!protos/", "!rlax_tpu/", "!tools/gen_protos.py", "!setup.py"):
        assert needed in ignore


# -- run --connect ----------------------------------------------------------------------------
def test_addresses_come_from_flags_else_from_the_environment():
    env = {
        "RLAX_TPU_PARAM_SERVER": "ps0:1, ps1:1",
        "RLAX_TPU_TRAINER": "t:2",
        "RLAX_TPU_INFERENCE": "i0:3,i1:3",
        "RLAX_TPU_VERIFIER": "v:4",
    }
    addresses = ComponentAddresses.resolve(environ=env, verifier=["flag:5"])
    assert addresses == ComponentAddresses(
        param_server=("ps0:1", "ps1:1"),
        trainer="t:2",
        inference=("i0:3", "i1:3"),
        verifier=("flag:5",),
    )
    assert list(addresses.named()) == [
        "param_server-0",
        "param_server-1",
        "trainer",
        "inference_worker-0",
        "inference_worker-1",
        "verifier-0",
    ]
    with pytest.raises(ConnectError, match="--trainer .or RLAX_TPU_TRAINER.*--verifier"):
        ComponentAddresses.resolve(param_server=["a:1"], inference=["b:1"], environ={})


def test_component_addresses_without_connect_are_refused(capsys):
    args = ["run", str(ROOT / "configs" / "tiny_cpu.py"), "--trainer=t:1"]
    assert cli_main(args) == 2
    assert "need --connect" in capsys.readouterr().err


@pytest.fixture
def health_server():
    """A server answering Health with token "t0ken" (what every component serves)."""
    from rlax_tpu.rpc import HealthServicer, format_address, make_server

    server, port = make_server("127.0.0.1", 0, auth_token="t0ken")
    HealthServicer(lambda: {"component": "trainer", "instance_id": "trainer-0"}).add_to_server(
        server
    )
    server.start()
    yield server, format_address("127.0.0.1", port)
    server.stop(0).wait()


def test_waiting_ends_when_every_component_answers(health_server):
    _, address = health_server
    probe = HealthProbe({"trainer": address}, auth_token="t0ken", timeout_s=2)
    try:
        assert wait_until_serving(probe, timeout_s=10, stop=threading.Event(), poll_s=0.05)
    finally:
        probe.close()


def test_waiting_names_the_components_that_never_answer(health_server):
    from rlax_tpu.rpc import format_address

    _, address = health_server
    with __import__("socket").socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = format_address("127.0.0.1", s.getsockname()[1])
    probe = HealthProbe({"trainer": address, "verifier-0": dead}, auth_token="t0ken", timeout_s=1)
    try:
        with pytest.raises(ConnectError, match=f"verifier-0 \\({dead}\\)"):
            wait_until_serving(probe, timeout_s=0.3, stop=threading.Event(), poll_s=0.05)
    finally:
        probe.close()


def test_a_wrong_token_is_reported_at_once(health_server):
    _, address = health_server
    probe = HealthProbe({"trainer": address}, auth_token="wrong", timeout_s=2)
    try:
        with pytest.raises(ConnectError, match="refused the auth token"):
            wait_until_serving(probe, timeout_s=30, stop=threading.Event(), poll_s=0.05)
    finally:
        probe.close()


def test_the_watchdog_fails_the_run_when_a_component_stops_answering(health_server):
    server, address = health_server
    probe = HealthProbe({"trainer": address}, auth_token="t0ken", timeout_s=1)
    watchdog = Watchdog(probe, interval_s=0.05, misses=2).start()
    try:
        time.sleep(0.3)
        assert not watchdog.failed.is_set()
        server.stop(0).wait()
        assert watchdog.failed.wait(10)
        assert watchdog.failure.startswith(f"trainer ({address}) stopped answering")
    finally:
        watchdog.close()
        probe.close()


def test_the_watchdog_waits_for_a_lost_worker_and_says_when_it_is_back(health_server):
    """Only the trainer's loss stops a connected controller: a worker whose pod is being
    replaced is reported when it stops answering and again when its replacement answers."""
    from rlax_tpu.rpc import HealthServicer, format_address, make_server

    _, trainer = health_server

    def worker(port: int):
        server, port = make_server("127.0.0.1", port, auth_token="t0ken")
        HealthServicer(lambda: {"component": "inference", "instance_id": "w"}).add_to_server(server)
        server.start()
        return server, port

    server, port = worker(0)
    address = format_address("127.0.0.1", port)
    named = {"trainer": trainer, "inference_worker-0": address}
    probe = HealthProbe(named, auth_token="t0ken", timeout_s=1)
    lines: list[str] = []
    watchdog = Watchdog(probe, interval_s=0.05, misses=2, report=lines.append).start()
    try:
        server.stop(0).wait()
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines and lines[0].startswith(f"inference_worker-0 ({address}) stopped answering")
        time.sleep(0.5)  # many more missed polls: still not a failure
        assert not watchdog.failed.is_set() and len(lines) == 1
        server, _ = worker(port)  # the replacement, at the same address
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lines[1:] == ["inference_worker-0 answers again"]
        assert not watchdog.failed.is_set()
    finally:
        watchdog.close()
        probe.close()
        server.stop(0).wait()


@pytest.mark.slow
def test_a_connected_controller_drives_running_components_and_resumes(tmp_path, monkeypatch):
    """`run --connect` against components started elsewhere (here: the local launcher's),
    stopped by SIGTERM mid-run and started again: it resumes and finishes the run."""
    import signal

    from tiny_job import tiny_job_config

    from rlax_tpu.config import ControllerConfig, DatasetConfig
    from rlax_tpu.launch.launcher import LocalCluster

    steps = 6
    config = tiny_job_config(
        "connect",
        tmp_path / "run",
        seed=5,
        trainer={"checkpoint_every": 2},
        controller=ControllerConfig(
            num_steps=steps,
            prompts_per_batch=2,
            samples_per_prompt=4,
            datasets=(DatasetConfig(path="builtin:arithmetic", verifier="arithmetic"),),
        ),
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # each process sets its own (cpu_devices)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with LocalCluster(
        str(path),
        num_workers=1,
        log_dir=tmp_path / "logs",
        param_storage=str(tmp_path / "run" / "params"),
        env=env,
    ) as cluster:
        cluster.start()
        flags = [f"--param-server={a}" for a in cluster.addresses["param_server"]]
        flags += [f"--trainer={cluster.addresses['trainer'][0]}"]
        flags += [f"--inference={a}" for a in cluster.addresses["inference_worker"]]
        flags += [f"--verifier={a}" for a in cluster.addresses["verifier"]]
        command = [sys.executable, "-m", "rlax_tpu", "run", str(path), "--connect", *flags]
        controller_env = {**env, "RLAX_TPU_AUTH_TOKEN": cluster.token}
        first = subprocess.Popen(
            command, cwd=ROOT, env=controller_env, stdout=subprocess.PIPE, text=True
        )
        for line in first.stdout:  # stop it once it has trained a step
            if line.startswith("step    2/"):
                first.send_signal(signal.SIGTERM)
                break
        assert first.wait(120) == 130
        done = subprocess.run(
            command, cwd=ROOT, env=controller_env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert cluster.failure is None
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # It resumed from a snapshot of the stopped run (not after it: nothing was lost).
    assert summary["start_step"] <= 2 and summary["end_step"] == steps
    assert "run dir" in done.stdout and "done: 6 steps" in done.stdout
    consumed = sorted(p.name for p in (tmp_path / "run" / "consumed").glob("batch_*.json"))
    assert len(consumed) == steps
