"""Launch a run as XManager jobs: the processes, args and config of the GKE manifests
(both come from rlax_tpu.deploy.plan), one job per instance, TPU requirements per slice.

    xmanager launch deploy/xmanager/launch.py -- \
        --config=configs/llama3_1_8b_tpu_v5p_64.py --set=storage.run_dir=gs://BUCKET/runs/x
    python deploy/xmanager/launch.py --config=configs/llama3_1_8b_tpu_v5p_64.py --dry_run

--dry_run prints the job specs as JSON and launches nothing: it imports neither xmanager
nor anything that uses the network. A launch imports xmanager lazily; install it in an
environment of its own (it pins protobuf<7, rlax_tpu needs >=7): this script needs only
`rlax_tpu.config` and `rlax_tpu.deploy`, which it imports from this source tree.

Jobs name their config by the path given to --config, relative to the image's working
directory (/opt/rlax-tpu holds configs/), followed by the same --set overrides. The auth
token is read from the launcher's environment at launch and never printed.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
try:
    import rlax_tpu  # noqa: F401
except ImportError:  # run from a source tree in an environment without the package
    sys.path.insert(0, str(REPO_ROOT))

from rlax_tpu.config import load_config  # noqa: E402 - after the sys.path fallback
from rlax_tpu.deploy.plan import COORDINATOR_PORT, DeployError, Plan, build_plan  # noqa: E402

# GKE accelerator label -> XManager resource name (xm.ResourceType, lower case).
XM_TPU = {
    "tpu-v4-podslice": "tpu_v4",
    "tpu-v5-lite-podslice": "tpu_v5e",
    "tpu-v5p-slice": "tpu_v5p",
    "tpu-v6e-slice": "tpu_v6e",
}
# xm_local's Kubernetes executor names a job's pod `<experiment id>_<work unit>_<job>` (with
# `-` for `_`) under the service `experiments`; this is the first work unit's.
DEFAULT_ADDRESS_TEMPLATE = "{experiment}-1-{job}.experiments"
DRY_RUN_EXPERIMENT = "EXPERIMENT"
# Components with one instance: their jobs go by the component's name alone.
SINGLE = ("controller", "trainer")
_UNITS = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity(text: str) -> float:
    """A Kubernetes quantity ("8", "500m", "32Gi") as a number."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise DeployError(f"cannot read the quantity {text!r} (use e.g. 8, 500m, 32Gi)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def job_name(component: str, replica: int | None = None) -> str:
    """An XManager job name (a Python identifier): trainer, param_server_0, inference_3."""
    base = component.replace("-", "_")
    return base if replica is None else f"{base}_{replica}"


def _requirements(component: Any) -> dict[str, Any]:
    if component.tpu is not None:
        name = XM_TPU.get(component.tpu.accelerator)
        if name is None:
            raise DeployError(
                f"no XManager resource for accelerator {component.tpu.accelerator!r}; "
                f"known: {', '.join(sorted(XM_TPU))}"
            )
        return {name: component.tpu.topology}
    return {"cpu": quantity(component.cpu), "ram": int(quantity(component.memory))}


def _ports(component: Any) -> dict[str, int]:
    ports = {"grpc": component.port} if component.port is not None else {}
    if component.multi_host:
        ports["coordinator"] = COORDINATOR_PORT
    return ports


def specs_of(plan: Plan, *, image: str) -> list[dict[str, Any]]:
    """One plain spec per XManager job: name, image, args, env, requirements."""
    token_env = plan.config.param_server.auth_token_env
    specs = []
    for component in plan.components:
        single = component.name in SINGLE
        for replica in range(component.replicas):
            env = {}
            if component.multi_host:
                # The slice is one job; the platform runs a task per host and JAX finds its
                # peers itself (rlax_tpu.distributed).
                env["RLAX_TPU_DISTRIBUTED"] = "auto"
            specs.append(
                {
                    "name": job_name(component.name, None if single else replica),
                    "component": component.name,
                    "image": image,
                    "args": component.args_for(replica),
                    "env": env,
                    # Filled from the launcher's environment at launch; never in a spec.
                    "secret_env": [token_env],
                    "requirements": _requirements(component),
                    "hosts": component.hosts,
                    "ports": _ports(component),
                }
            )
    return specs


def image_path(config_path: str) -> str:
    """The config's path in the image: relative to the repository root when it lies in this
    source tree (configs/x.py), else as given (such a config must be put in the image)."""
    path = Path(config_path).resolve()
    if path.is_relative_to(REPO_ROOT):
        return path.relative_to(REPO_ROOT).as_posix()
    return config_path


def build_specs(
    config_path: str,
    overrides: Sequence[str] = (),
    *,
    image: str | None = None,
    address_template: str = DEFAULT_ADDRESS_TEMPLATE,
    experiment: str = DRY_RUN_EXPERIMENT,
) -> list[dict[str, Any]]:
    """The job specs of `config_path` with `overrides` (DeployError if it cannot deploy)."""
    config = load_config(config_path, list(overrides))

    def host(component: str, replica: int | str) -> str:
        job = job_name(component, None if component in SINGLE else int(replica))
        name = address_template.format(experiment=experiment, job=job)
        return name.replace("_", "-").lower()

    plan = build_plan(
        config,
        config_args=[image_path(config_path), *(f"--set={o}" for o in overrides)],
        host=host,
    )
    return specs_of(plan, image=image or config.deploy.image)


def launch(specs_for: Any, *, title: str, environ: Mapping[str, str] | None = None) -> None:
    """Create the experiment and add every job as one JobGroup (xmanager imported here)."""
    from xmanager import xm, xm_local

    env_in = os.environ if environ is None else environ
    with xm_local.create_experiment(experiment_title=title) as experiment:
        specs = specs_for(str(experiment.experiment_id))
        secrets = {}
        for name in {n for s in specs for n in s["secret_env"]}:
            if not env_in.get(name):
                raise DeployError(f"set {name} to the run's auth token before launching")
            secrets[name] = env_in[name]
        [executable] = experiment.package(
            [xm.container(image_path=specs[0]["image"], executor_spec=xm_local.Kubernetes.Spec())]
        )
        jobs = {
            s["name"]: xm.Job(
                executable=executable,
                executor=xm_local.Kubernetes(requirements=xm.JobRequirements(**s["requirements"])),
                args=s["args"],
                env_vars={**s["env"], **{n: secrets[n] for n in s["secret_env"]}},
            )
            for s in specs
        }
        experiment.add(xm.JobGroup(**jobs))


def main(argv: Sequence[str]) -> None:
    del argv  # flags only
    flags = _FLAGS
    try:

        def specs_for(experiment: str) -> list[dict[str, Any]]:
            return build_specs(
                flags.config,
                flags.set,
                image=flags.image,
                address_template=flags.address_template,
                experiment=experiment,
            )

        if flags.dry_run:
            print(json.dumps(specs_for(DRY_RUN_EXPERIMENT), indent=2))
            return
        launch(specs_for, title=flags.experiment_title or Path(flags.config).stem)
    except DeployError as e:
        sys.exit(f"launch.py: {e}")


def _define_flags() -> Any:
    from absl import flags

    flags.DEFINE_string("config", None, "configs/*.py file (path inside the image too)")
    flags.DEFINE_multi_string("set", [], "config override KEY=VALUE (repeatable)")
    flags.DEFINE_bool("dry_run", False, "print the job specs as JSON; launch nothing")
    flags.DEFINE_string("image", None, "container image (default: the config's deploy.image)")
    flags.DEFINE_string(
        "address_template",
        DEFAULT_ADDRESS_TEMPLATE,
        "DNS name of a job from {experiment} and {job} (e.g. param_server_0)",
    )
    flags.DEFINE_string("experiment_title", None, "default: the config file's name")
    flags.mark_flag_as_required("config")
    return flags.FLAGS


_FLAGS = _define_flags()

if __name__ == "__main__":
    from absl import app

    app.run(main)
