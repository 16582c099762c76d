"""Recovery (DESIGN §8): snapshots, resume and garbage collection of the parameter server.

A resume continues from a trainer checkpoint c and must draw the same prompts from there on,
so as the run passes each step the controller records what its choices depend on: the main
prompt stream before batch b's first draw (which happens up to N steps early), and at step b
the refill stream, the replay buffer and the accounting. A snapshot (every η steps) pairs
the newest checkpoint with those records; a resume restores them and retrains [c, step)
from the rollout log. Versions a resume may still generate with are confirmed to the
parameter server, which then deletes older ones.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlax_tpu.api.param_server import VersionsMissingError
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.schedule import Schedule
from rlax_tpu.controller.snapshots import Snapshot, SnapshotError, SnapshotStore
from rlax_tpu.failpoints import failpoint
from rlax_tpu.rpc.client import is_unreachable, retry_unreachable

_log = logging.getLogger(__name__)

CONTROLLER_CONSUMER = "controller"


class Recovery:
    """`capture_main()` is the main prompt stream's state; `capture_step()` the state a
    resume at the current step needs besides it ({"refill", "replay", "stats"});
    `restore(mixture, stats)` puts a snapshot's back; `worker_versions()` is the version
    each inference worker holds (recorded in snapshots, for people)."""

    def __init__(
        self,
        schedule: Schedule,
        snapshots: SnapshotStore,
        *,
        trainer: Any,
        param_server: Any,
        digest: str,
        capture_main: Callable[[], dict[str, Any]],
        capture_step: Callable[[], dict[str, Any]],
        restore: Callable[[Mapping[str, Any], Mapping[str, Any]], None],
        worker_versions: Callable[[], Sequence[int]],
        wait_s: float = 300.0,
        stop: threading.Event | None = None,
        flush_log: Callable[[], None] | None = None,
    ) -> None:
        self.schedule = schedule
        self.snapshots = snapshots
        self.trainer, self.param_server = trainer, param_server
        self.digest = digest
        self._capture_main, self._capture_step = capture_main, capture_step
        self._restore = restore
        self._worker_versions = worker_versions
        # For a trainer that does not answer during the restore; `stop`: the run stops.
        self.wait_s, self.stop = wait_s, stop
        # The rollout log's writes run in the background: on storage before a snapshot.
        self._flush_log = flush_log
        self._main_at: dict[int, dict[str, Any]] = {}
        self._step_at: dict[int, dict[str, Any]] = {}
        # The checkpoint whose versions were last found on the server's storage: snapshots
        # between checkpoints rely on the same versions, so they are checked once.
        self._persisted_for: int | None = None
        # Confirmations and garbage collection (they only free memory): in order, off the
        # loop, so no decision waits for them.
        self._housekeeping = concurrent.futures.ThreadPoolExecutor(1, "controller-housekeeping")

    # -- records as the run passes each step ------------------------------------------------------
    def before_draw(self, batch: int) -> None:
        """Record the main stream before batch `batch`'s first draw."""
        self._main_at.setdefault(batch, self._capture_main())

    def at_step(self, step: int, *, drawn: bool) -> None:
        """Record what a resume at `step` needs as the loop reaches it (`drawn`: whether
        batch `step` was drawn already, as off-policy; else the main stream is recorded
        now, as on-policy)."""
        if not drawn:
            self.before_draw(step)
        self._step_at.setdefault(step, self._capture_step())

    # -- resume --------------------------------------------------------------------------------
    def resume(self) -> int:
        """Restore the newest snapshot whose checkpoint loads and return its step; on a new
        run, checkpoint version 0, write the first snapshot and return 0."""
        snapshot = None
        for candidate in self.snapshots.candidates(self.digest):
            try:
                # A trainer that does not answer (restarting, or it died while restoring)
                # is waited for and asked again: that says nothing about the checkpoint.
                restored = retry_unreachable(
                    lambda c=candidate: self.trainer.restore(c.checkpoint_step),
                    wait_s=self.wait_s,
                    what="the trainer",
                    on_retry=_log.warning,
                    stop=self.stop,
                )
            except Exception as e:  # noqa: BLE001 - the checkpoint is gone or broken
                if is_unreachable(e):
                    raise ControllerError(
                        f"could not restore checkpoint {candidate.checkpoint_step}: {e}. The "
                        "run directory is intact: start the trainer again, then `rlax-tpu "
                        "resume`"
                    ) from None
                _log.warning(
                    "snapshot of step %d: checkpoint %d does not load (%s); trying an older one",
                    candidate.step,
                    candidate.checkpoint_step,
                    e,
                )
                continue
            if restored != candidate.checkpoint_step:
                raise ControllerError(
                    f"asked the trainer for checkpoint {candidate.checkpoint_step}, it "
                    f"restored {restored}"
                )
            snapshot = candidate
            break
        if snapshot is None:
            if self.snapshots.steps():
                raise SnapshotError(
                    f"no snapshot in {self.snapshots.directory} is usable (each is truncated "
                    "or its trainer checkpoint does not load; snapshot steps "
                    f"{self.snapshots.steps()}); the run cannot resume without diverging: "
                    "start a new run directory"
                )
            status = self.trainer.status()
            if status.version != 0:
                raise ControllerError(
                    f"the trainer is at step {status.version} but the run directory has no "
                    "snapshot: a half-started run; start a new run directory"
                )
            self.trainer.save(wait=True)  # checkpoint 0: the first snapshot's resume point
            self.at_step(0, drawn=False)
            self.snapshot(0, drawn=False)
            return 0
        step = snapshot.checkpoint_step
        self._restore(snapshot.mixture, snapshot.stats)
        self.at_step(step, drawn=False)
        _log.info(
            "resuming at step %d (snapshot of step %d, checkpoint %d)",
            step,
            snapshot.step,
            snapshot.checkpoint_step,
        )
        return step

    # -- snapshots ------------------------------------------------------------------------------
    def snapshot(self, step: int, *, drawn: bool, final: bool = False) -> None:
        """Snapshot at `step`, resumable from the newest finished trainer checkpoint. A final
        snapshot checkpoints `step` itself first, so a stop loses no training. `drawn`:
        whether batch `step` was drawn already."""
        # Recorded first: a final snapshot resumes from `step` itself, also at the end of
        # the run, where no batch `step` was ever drawn (re-running a finished run, or
        # extending it, resumes there).
        self.at_step(step, drawn=drawn)
        checkpoint = self.schedule.checkpoint_at_or_before(step)
        # A trainer ahead of the loop (reattached: it answers the steps up to its own from
        # their records) checkpoints its own step, not this one.
        if final and self.trainer.save(wait=True) == step:
            checkpoint = step
        checkpoint = max(c for c in self._main_at if c <= checkpoint)
        state = self._step_at[checkpoint]
        snapshot = Snapshot(
            step=step,
            checkpoint_step=checkpoint,
            config_digest=self.digest,
            mixture={
                "main": self._main_at[checkpoint],
                "refill": state["refill"],
                "replay": state["replay"],
            },
            stats=state["stats"],
            versions={
                "trainer": step,
                **{f"worker-{i}": v for i, v in enumerate(self._worker_versions())},
            },
        )
        # A resume from `checkpoint` generates with versions [oldest needed, checkpoint]
        # from the server: they must be on its storage (a publish returns once the memory
        # copy is complete, the persistent one follows) before a snapshot relies on them.
        oldest = self.schedule.oldest_needed(checkpoint)
        if checkpoint != self._persisted_for:  # a new checkpoint: new versions to check
            final = self.schedule.num_steps
            self._wait_persisted(self.schedule.policy.published(oldest, checkpoint, final))
            self._persisted_for = checkpoint
        if self._flush_log is not None:  # the rollouts, verdicts and consumed records
            self._flush_log()
        failpoint("controller.snapshot", step)  # all ready, not yet written (chaos test)
        self.snapshots.write(snapshot)
        # Then the server may delete what no consumer needs (memory and persisted copies).
        self._housekeeping.submit(self._collect, oldest)
        for old in [b for b in self._main_at if b < checkpoint]:
            del self._main_at[old]
            self._step_at.pop(old, None)

    def _wait_persisted(self, versions: Sequence[int]) -> None:
        """Until the parameter server has `versions` on storage. One it lost (it restarted
        before the version was on storage) the trainer publishes again if it holds it;
        any other refusal stops the run, and the resume uses an earlier snapshot."""
        try:
            self.param_server.wait_persisted(versions)
        except VersionsMissingError as e:
            for version in e.missing:
                _log.warning("the parameter server lost version %d: publishing it again", version)
                self.trainer.republish(version)
            self.param_server.wait_persisted(versions)

    def _collect(self, oldest: int) -> None:
        try:
            self.param_server.confirm(CONTROLLER_CONSUMER, oldest)
            self.param_server.garbage_collect(oldest)
        except Exception as e:  # noqa: BLE001 - only delays garbage collection
            _log.warning("could not confirm version %d to the parameter server: %s", oldest, e)

    def close(self) -> None:
        self._housekeeping.shutdown(wait=True)
