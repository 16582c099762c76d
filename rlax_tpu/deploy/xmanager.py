"""Launch a run as XManager jobs: the processes, args and config of the GKE manifests (both
come from `plan`), one job per instance, TPU requirements per slice.

    rlax-tpu deploy xmanager CONFIG [--set k=v ...] --dry-run   # the job specs as JSON
    rlax-tpu deploy xmanager CONFIG [--set k=v ...]             # create the experiment
    xmanager launch deploy/xmanager/launch.py -- --config=CONFIG --set=k=v   # the same

A dry run imports neither xmanager nor anything that uses the network. A launch imports
xmanager lazily, which pins protobuf<7 while rlax_tpu needs >=7: install both in an
environment of their own, rlax_tpu there with `--no-deps` (this module needs only the
standard library, `rlax_tpu.config` and `rlax_tpu.deploy`).

Jobs name their config by its path relative to the source checkout (configs/x.py; the
image's working directory /opt/rlax-tpu holds configs/), followed by the same --set
overrides. The auth token is read from the launcher's environment at launch and never
printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlax_tpu.config import load_config
from rlax_tpu.deploy.plan import (
    COORDINATOR_PORT,
    MEGASCALE_COORDINATOR_ENV,
    MEGASCALE_NUM_SLICES_ENV,
    MEGASCALE_PORT,
    MEGASCALE_PORT_ENV,
    MEGASCALE_SLICE_ID_ENV,
    DeployError,
    Plan,
    build_plan,
)

NO_XMANAGER = (
    "launching needs the xmanager package, which pins protobuf<7 while rlax_tpu needs >=7: "
    "install xmanager and rlax_tpu (`pip install --no-deps`) in an environment of their own "
    "and launch from there, or print the specs with --dry-run"
)

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


def job_name(component: str, replica: int | None = None, *, multi_slice: bool = False) -> str:
    """An XManager job name (a Python identifier): trainer, param_server_0, inference_3;
    trainer_slice_1 for a slice of a multi-slice trainer (`replica` is then the slice)."""
    base = component.replace("-", "_")
    if multi_slice:
        return f"{base}_slice_{replica}"
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
    if component.multi_slice:
        ports["megascale"] = MEGASCALE_PORT
    return ports


def specs_of(plan: Plan, *, image: str) -> list[dict[str, Any]]:
    """One plain spec per XManager job: name, image, args, env, requirements. A multi-slice
    trainer is a job per slice (trainer_slice_I), each told the slice count, its slice and
    the first slice's first host in the MEGASCALE_* variables libtpu and JAX's TPU cluster
    detection read (as the GKE manifests set them: rlax_tpu/deploy/gke.py)."""
    token_env = plan.config.param_server.auth_token_env
    specs = []
    for component in plan.components:
        single = component.name in SINGLE
        for index in range(component.slices if component.multi_slice else component.replicas):
            replica = 0 if component.multi_slice else index
            env = {}
            if component.multi_host:
                # The slice is one job; the platform runs a task per host and JAX finds its
                # peers itself (rlax_tpu.distributed).
                env["RLAX_TPU_DISTRIBUTED"] = "auto"
            if component.multi_slice:
                env.update(
                    {
                        MEGASCALE_COORDINATOR_ENV: f"{plan.host(component.name, 0)}:"
                        f"{MEGASCALE_PORT}",
                        MEGASCALE_PORT_ENV: str(MEGASCALE_PORT),
                        MEGASCALE_NUM_SLICES_ENV: str(component.slices),
                        MEGASCALE_SLICE_ID_ENV: str(index),
                    }
                )
            name = (
                job_name(component.name, index, multi_slice=True)
                if component.multi_slice
                else job_name(component.name, None if single else replica)
            )
            specs.append(
                {
                    "name": name,
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


def _source_root() -> Path | None:
    """The source checkout this package runs from (it holds configs/), or None when the
    package is installed (then config paths are taken as given)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "configs").is_dir() and (root / "rlax_tpu").is_dir() else None


def image_path(config_path: str) -> str:
    """The config's path in the image: relative to the repository root when it lies in this
    source tree (configs/x.py), else as given (such a config must be put in the image)."""
    path, root = Path(config_path).resolve(), _source_root()
    if root is not None and path.is_relative_to(root):
        return path.relative_to(root).as_posix()
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
        if component == "trainer" and config.trainer.mesh.num_slices > 1:
            job = job_name(component, 0, multi_slice=True)  # the first slice's job
        else:
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
    try:
        from xmanager import xm, xm_local
    except ImportError:
        raise DeployError(NO_XMANAGER) from None

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


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `rlax-tpu deploy xmanager` (the config and --set come from the caller)."""
    parser.add_argument(
        "--dry-run", action="store_true", help="print the job specs as JSON; launch nothing"
    )
    parser.add_argument("--image", help="container image (default: the config's deploy.image)")
    parser.add_argument(
        "--address-template",
        default=DEFAULT_ADDRESS_TEMPLATE,
        help="DNS name of a job from {experiment} and {job} (e.g. param_server_0)",
    )
    parser.add_argument("--experiment-title", help="default: the config file's name")


def main(
    config: str,
    overrides: Sequence[str],
    *,
    dry_run: bool,
    image: str | None = None,
    address_template: str = DEFAULT_ADDRESS_TEMPLATE,
    experiment_title: str | None = None,
) -> None:
    """Print the specs (`dry_run`) or launch them; DeployError says why it cannot."""

    def specs_for(experiment: str) -> list[dict[str, Any]]:
        return build_specs(
            config,
            overrides,
            image=image,
            address_template=address_template,
            experiment=experiment,
        )

    if dry_run:
        print(json.dumps(specs_for(DRY_RUN_EXPERIMENT), indent=2))
        return
    launch(specs_for, title=experiment_title or Path(config).stem)
