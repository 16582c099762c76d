"""Failpoints: named places where a process can be told to die, for the chaos tests
(tests/test_controller_e2e.py, harness tests/e2e_job.py) and tools/bench_recovery.py.
Random SIGKILLs from outside cannot hit a window a few milliseconds wide; these can, every
time.

`RLAX_TPU_FAILPOINTS="name@key,name@key"` makes the process that passes `failpoint(name,
key)` with that key (a step or a version; `*` for any) SIGKILL itself there, once per
run: it first creates the point's marker file under `RLAX_TPU_FAILPOINTS_DIR` (exclusive
create), so a restarted process, or the same point passed again after a resume, goes on.
Without the variable (every real run) a failpoint is one check of a module constant.

The places, each in the middle of something whose interruption must lose nothing:

* `controller.snapshot` (step): a snapshot's checkpoint and versions are ready, its file
  is not written yet (`Recovery.snapshot`); the controller dies.
* `trainer.checkpoint` (step): a checkpoint's save started and has not finished
  (`CheckpointStore.save`); the trainer dies.
* `trainer.restore` (step): a resume's Restore of a checkpoint reached the trainer, which
  has not acted on it (`Trainer.restore`); the trainer dies.
* `trainer.sft_step` (SFT step): the SFT warm start's step is asked for and not trained
  (`Trainer.sft_step`); the trainer dies, and a resume continues the warm start from its
  newest checkpoint (`trainer.warm_start.checkpoint_every`).
* `trainer.publish` (version): a version's first chunks are sent, the rest and the commit
  are not (`ParamServerClient`); the trainer dies.
* `param_server.receive` (version): a publish's first chunks are received, its commit is
  not (`Publish`); the parameter server dies.
* `param_server.persist` (version): a version is committed in memory, its manifest is not
  on storage yet (`VersionStore`); the parameter server dies.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "RLAX_TPU_FAILPOINTS"
DIR_ENV = "RLAX_TPU_FAILPOINTS_DIR"
NAMES = (
    "controller.snapshot",
    "trainer.checkpoint",
    "trainer.restore",
    "trainer.sft_step",
    "trainer.publish",
    "param_server.receive",
    "param_server.persist",
)


def parse(text: str) -> dict[str, set[str]]:
    """`name@key,...` -> {name: {key, ...}}; ValueError naming a bad entry."""
    points: dict[str, set[str]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, at, key = entry.partition("@")
        if name not in NAMES or not at or not key:
            raise ValueError(
                f"{ENV}: {entry!r} is not NAME@KEY with NAME one of {', '.join(NAMES)} and KEY "
                "a step, a version or *"
            )
        points.setdefault(name, set()).add(key)
    return points


_POINTS = parse(os.environ.get(ENV, ""))


def failpoint(name: str, key: int) -> None:
    """Die here (SIGKILL, no cleanup) if `name@key` (or `name@*`) is set and has not fired
    in this run yet."""
    if not _POINTS:
        return
    keys = _POINTS.get(name)
    if keys is None or (str(key) not in keys and "*" not in keys):
        return
    directory = os.environ.get(DIR_ENV)
    if not directory:
        raise RuntimeError(f"{ENV} is set without {DIR_ENV}: failpoints fire once per run")
    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, f"{name}@{key}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    print(f"FAILPOINT {name}@{key}: pid {os.getpid()} dies here", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
