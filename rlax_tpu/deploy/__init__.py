"""Running a run on a cluster: the plan of its processes (`plan.py`) and its GKE JobSet
manifests (`gke.py`, `rlax-tpu deploy gke`); `xmanager.py` (`rlax-tpu deploy xmanager`)
builds the same processes as XManager jobs. See docs/deploy.md."""

from rlax_tpu.deploy.plan import (
    COORDINATOR_PORT,
    PORTS,
    Component,
    DeployError,
    Plan,
    build_plan,
    check_deployable,
    problems,
)

__all__ = [
    "COORDINATOR_PORT",
    "PORTS",
    "Component",
    "DeployError",
    "Plan",
    "build_plan",
    "check_deployable",
    "problems",
]
