"""The controller's schedule (DESIGN §2): which version generates each batch, which batches
may be generated while the trainer is at a given step, which version an evaluation uses, and
when to snapshot. Pure: a function of the config and the step, never of timing, so the whole
run is a function of (config, seed).
"""

from __future__ import annotations

from collections.abc import Container

from rlax_tpu.config import RunConfig
from rlax_tpu.staleness import StalenessPolicy


class Schedule:
    """`policy` is the acceptance rule (η, N) the trainer enforces; `generation_policy` says
    which version generates batch b: the same, or in replay mode one lagging by at most
    `controller.replay.generation_lag` versions, leaving the rest of N for reusing rollouts."""

    def __init__(self, config: RunConfig) -> None:
        ctl = config.controller
        self.policy = StalenessPolicy.from_config(config.staleness)
        self.generation_policy = self.policy
        if ctl.replay.enabled:
            eta = self.policy.reload_every
            lag = min(self.policy.max_staleness, max(ctl.replay.generation_lag, eta - 1))
            self.generation_policy = StalenessPolicy(eta, lag, self.policy.schedule)
        self.num_steps = ctl.num_steps
        self.eval_every = ctl.eval_every
        self.checkpoint_every = config.trainer.checkpoint_every

    @property
    def reload_every(self) -> int:
        return self.policy.reload_every

    def to_launch(self, step: int, launched: Container[int]) -> list[tuple[int, int]]:
        """(batch, version) of every batch in [step, num_steps) not yet launched whose version
        is published while the trainer is at version `step`, in batch order: as far ahead as
        the generation bound allows, stopping at the first batch that must wait."""
        out = []
        lead = self.generation_policy.max_staleness
        for b in range(step, min(self.num_steps, step + lead + 1)):
            if b in launched:
                continue
            version = self.generation_policy.generation_version(b, step)
            if version is None:
                break
            out.append((b, version))
        return out

    def eval_version(self, step: int) -> int:
        """The version evaluated at `step`: the run's final version at its last step (the
        trainer publishes it whatever η is, and workers load it for the evaluation only),
        else the newest one workers may load (a multiple of η) at or before it."""
        if step == self.num_steps:
            return step
        return step - step % self.policy.reload_every

    def eval_due(self, step: int) -> bool:
        """Whether to evaluate after training step `step` - 1 (the end is handled apart)."""
        return bool(self.eval_every) and step % self.eval_every == 0 and step < self.num_steps

    def snapshot_due(self, step: int) -> bool:
        """Snapshots at every weight-reload boundary and at the end."""
        return step % self.policy.reload_every == 0 or step == self.num_steps

    def checkpoint_at_or_before(self, step: int) -> int:
        """The newest trainer checkpoint a snapshot at `step` can rely on."""
        return step - step % self.checkpoint_every

    def oldest_needed(self, step: int) -> int:
        """The oldest version a run resumed at `step` may generate with."""
        return self.policy.oldest_needed(step)
