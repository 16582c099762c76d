"""The TBA replay buffer: verified rollouts kept per prompt, sampled by recency or reward.

In replay mode the controller adds each generated batch's judged rollouts here (every
`sync_every` steps, through `ReplayStage`; a group with an unjudged sample never enters)
and trains on batches sampled from the buffer: each prompt of a batch is, with probability
m, one of the prompts that got new data at the latest sync, else drawn by a softmax of its
mean reward (temperature T; T = 0: uniform); K responses per prompt, with replacement only
when the prompt has fewer than K. Only rollouts acceptable for the step (b − version ≤ N)
are ever sampled; those too old to be acceptable again are evicted, as are the oldest
beyond the per-prompt and global caps. Deterministic given its RNG stream, whose state is
part of the controller snapshot with the buffer's contents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlax_tpu.api.records import Group, RolloutKey, RolloutRecord, ScoredRollout
from rlax_tpu.config import RunConfig
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.snapshots import RolloutLog, SnapshotError


@dataclasses.dataclass(frozen=True)
class Entry:
    """One verified rollout in the buffer (its tokens stay in the rollout log)."""

    batch: int  # the generated batch it came from (its directory in the rollout log)
    prompt_key: str  # the request's prompt id (unique per draw)
    sample_index: int
    version: int
    reward: float
    added_at: int  # the step at which it entered the buffer
    # Dense per-token rewards of its verdict (one per generated token), or None.
    token_rewards: tuple[float, ...] | None = None

    @property
    def key(self) -> RolloutKey:
        return RolloutKey(self.prompt_key, self.sample_index, self.version)

    def to_json(self) -> dict[str, Any]:
        """The snapshot's form; token_rewards only when there are some (a snapshot of a run
        without dense rewards is what it always was)."""
        out = dataclasses.asdict(self)
        if self.token_rewards is None:
            del out["token_rewards"]
        else:
            out["token_rewards"] = list(self.token_rewards)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        token_rewards = data.get("token_rewards")
        if token_rewards is not None:
            data = {**data, "token_rewards": tuple(float(x) for x in token_rewards)}
        return cls(**data)


class ReplayBuffer:
    def __init__(
        self,
        *,
        per_prompt_cap: int,
        global_cap: int,
        recency_prob: float,
        reward_temperature: float,
        seed: int,
    ) -> None:
        if not 0.0 <= recency_prob <= 1.0:
            raise ValueError(f"recency_prob must be in [0, 1], got {recency_prob}")
        if reward_temperature < 0:
            raise ValueError(f"reward_temperature must be >= 0, got {reward_temperature}")
        if per_prompt_cap < 1 or global_cap < per_prompt_cap:
            raise ValueError("caps must satisfy 1 <= per_prompt_cap <= global_cap")
        self.per_prompt_cap, self.global_cap = per_prompt_cap, global_cap
        self.recency_prob, self.temperature = recency_prob, reward_temperature
        # Named stream: (seed, "replay") through a SeedSequence, like the prompt mixture.
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x7E9A])))
        self._by_prompt: dict[str, list[Entry]] = {}  # prompt uid -> entries, oldest first
        self._recent: list[str] = []  # prompt uids that got new data at the latest sync
        self._seen: set[tuple[str, int, int]] = set()

    # -- contents -------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(v) for v in self._by_prompt.values())

    @property
    def prompts(self) -> list[str]:
        return list(self._by_prompt)

    @property
    def recent(self) -> list[str]:
        return list(self._recent)

    def entries(self, uid: str) -> list[Entry]:
        return list(self._by_prompt.get(uid, ()))

    def add(self, step: int, items: Sequence[tuple[str, Entry]]) -> int:
        """One sync: add (prompt uid, entry) pairs (duplicates ignored); the prompts that
        got new data become the recent set. Returns how many were added."""
        recent: list[str] = []
        added = 0
        for uid, entry in items:
            if entry.key in self._seen:
                continue
            entry = dataclasses.replace(entry, added_at=step)
            self._seen.add(entry.key)
            entries = self._by_prompt.setdefault(uid, [])
            entries.append(entry)
            if uid not in recent:
                recent.append(uid)
            added += 1
            if len(entries) > self.per_prompt_cap:
                self._drop(uid, 0)
        while len(self) > self.global_cap:  # oldest entry overall (ties: first prompt)
            uid = min(self._by_prompt, key=lambda u: (self._by_prompt[u][0].added_at,))
            self._drop(uid, 0)
        self._recent = [u for u in recent if u in self._by_prompt]
        return added

    def evict_older_than(self, min_version: int) -> int:
        """Drop entries generated by versions below `min_version` (never acceptable again)."""
        dropped = 0
        for uid in list(self._by_prompt):
            keep = [e for e in self._by_prompt[uid] if e.version >= min_version]
            dropped += len(self._by_prompt[uid]) - len(keep)
            if keep:
                self._by_prompt[uid] = keep
            else:
                del self._by_prompt[uid]
        self._recent = [u for u in self._recent if u in self._by_prompt]
        return dropped

    def _drop(self, uid: str, index: int) -> None:
        entries = self._by_prompt[uid]
        entries.pop(index)
        if not entries:
            del self._by_prompt[uid]

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, num_prompts: int, responses: int) -> list[tuple[str, list[Entry]]]:
        """`num_prompts` distinct prompts, each with `responses` entries (see module doc).
        Raises ValueError when the buffer holds fewer prompts than asked for."""
        if len(self._by_prompt) < num_prompts:
            raise ValueError(
                f"the replay buffer holds {len(self._by_prompt)} prompts, fewer than the "
                f"{num_prompts} a batch needs"
            )
        chosen: list[str] = []
        for _ in range(num_prompts):
            recent = [u for u in self._recent if u not in chosen]
            use_recent = self._rng.random() < self.recency_prob
            if use_recent and recent:
                uid = recent[int(self._rng.integers(len(recent)))]
            else:
                pool = [u for u in self._by_prompt if u not in chosen]
                uid = pool[int(self._rng.choice(len(pool), p=self._reward_weights(pool)))]
            chosen.append(uid)
        out = []
        for uid in chosen:
            entries = self._by_prompt[uid]
            replace = len(entries) < responses
            picks = self._rng.choice(len(entries), size=responses, replace=replace)
            out.append((uid, [entries[int(i)] for i in sorted(picks)]))
        return out

    def _reward_weights(self, pool: list[str]) -> np.ndarray:
        if self.temperature == 0:
            return np.full(len(pool), 1.0 / len(pool))
        means = np.asarray([np.mean([e.reward for e in self._by_prompt[u]]) for u in pool])
        logits = means / self.temperature
        weights = np.exp(logits - logits.max())
        return weights / weights.sum()

    # -- snapshot -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "rng": self._rng.bit_generator.state,
            "recent": list(self._recent),
            "prompts": {
                uid: [e.to_json() for e in entries] for uid, entries in self._by_prompt.items()
            },
        }

    def restore(self, state: dict[str, Any]) -> None:
        try:
            by_prompt = {
                uid: [Entry.from_json(e) for e in entries]
                for uid, entries in state["prompts"].items()
            }
            self._rng.bit_generator.state = state["rng"]
            recent = list(state["recent"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed replay buffer state: {e}") from None
        self._by_prompt = by_prompt
        self._recent = recent
        self._seen = {e.key for entries in by_prompt.values() for e in entries}


class ReplayStage:
    """Replay mode's part of the controller: each generated batch's judged groups are queued
    for the buffer and added every `sync_every` steps; step b trains on groups sampled from
    the buffer after evicting what b can no longer accept. The buffer keeps entries; the
    rollouts' tokens are looked up here (or in the rollout log after a resume)."""

    def __init__(self, config: RunConfig, *, log: RolloutLog, max_staleness: int) -> None:
        ctl = config.controller
        self.buffer = ReplayBuffer(
            per_prompt_cap=ctl.replay.per_prompt_cap,
            global_cap=ctl.replay.global_cap,
            recency_prob=ctl.replay.recency_prob,
            reward_temperature=ctl.replay.reward_temperature,
            seed=config.seed,
        )
        self.sync_every = ctl.replay.sync_every
        self.prompts_per_batch, self.samples = ctl.prompts_per_batch, ctl.samples_per_prompt
        self.max_staleness = max_staleness
        self.log = log
        self._pending: list[tuple[str, Entry]] = []
        self._records: dict[RolloutKey, RolloutRecord] = {}

    def entries(self, batch: int, groups: Sequence[Group]) -> list[tuple[str, Entry]]:
        """(prompt uid, entry) of `groups` of `batch` (each keyed by its prompt uid), their
        rollouts kept for sampling."""
        out = []
        for group in groups:
            for sample in group.samples:
                record, token_rewards = sample.rollout, sample.token_rewards
                entry = Entry(
                    batch=batch,
                    prompt_key=record.prompt_id,
                    sample_index=record.sample_index,
                    version=record.version,
                    reward=sample.reward,
                    added_at=batch,
                    token_rewards=None if token_rewards is None else tuple(token_rewards),
                )
                self._records[entry.key] = record
                out.append((group.key, entry))
        return out

    def prefill(self, items: list[tuple[str, Entry]]) -> None:
        """TBA's pre-fill before step 0."""
        self.buffer.add(0, items)

    def groups(self, step: int, new: list[tuple[str, Entry]]) -> list[Group]:
        """Queue `new` (this step's batch); every `sync_every` steps add what is queued;
        evict what `step` can no longer accept; sample the step's groups."""
        self._pending.extend(new)
        if step % self.sync_every == 0:
            self.buffer.add(step, self._pending)
            self._pending = []
        self.buffer.evict_older_than(step - self.max_staleness)
        groups = []
        for uid, entries in self.buffer.sample(self.prompts_per_batch, self.samples):
            samples = [ScoredRollout(self._record(e), e.reward, e.token_rewards) for e in entries]
            groups.append(Group(uid, tuple(samples)))
        live = {e.key for u in self.buffer.prompts for e in self.buffer.entries(u)}
        live |= {e.key for _, e in self._pending}
        self._records = {k: v for k, v in self._records.items() if k in live}
        return groups

    def _record(self, entry: Entry) -> RolloutRecord:
        record = self._records.get(entry.key)
        if record is None:  # after a resume: the rollout log has it
            for key, logged in self.log.rollouts(entry.batch).items():
                self._records.setdefault(key, logged)
            record = self._records.get(entry.key)
            if record is None:
                raise ControllerError(
                    f"replay buffer entry {entry.key} of batch {entry.batch} is not in the "
                    "rollout log: the run directory is incomplete"
                )
        return record

    def state(self) -> dict[str, Any]:
        return {
            "buffer": self.buffer.state(),
            "pending": [[uid, e.to_json()] for uid, e in self._pending],
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise SnapshotError("the snapshot has no replay buffer state (replay mode is on)")
        self.buffer.restore(state["buffer"])
        self._pending = [(uid, Entry.from_json(e)) for uid, e in state["pending"]]
