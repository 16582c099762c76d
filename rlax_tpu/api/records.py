"""The records of the RL loop, from a finished rollout to the groups a train step assembles:
typed all the way, so a rollout keeps its meaning between the generation pool, the verifier,
the replay buffer and the batch. JAX-free; no imports from the rest of rlax_tpu.

`RolloutRecord` and `Judgement` are also what the rollout log holds (a JSON object per line,
rollouts-*.jsonl and verdicts-*.jsonl): `to_json` / `from_json` are that on-disk form, exactly
as it always was, so logs written before these types existed still load. A field added later
(per-token versions, say) is one field with a None default: `to_json` leaves a None field out,
so the lines of runs without it stay what they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple


class RolloutKey(NamedTuple):
    """A rollout's identity in the log, the replay buffer and a batch's `consumed` rows."""

    prompt_id: str
    sample_index: int
    version: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutRecord:
    """A finished rollout as the controller keeps it (and logs it).

    batch: the batch it was generated for (-1: an evaluation's, never logged). prompt_id: the
    request's prompt key, unique per draw. version: the version the request was submitted
    with (its identity, `key`). prompt_tokens + tokens: the sequence (tokens: the response, a
    stop token that ended it included). logprobs: the behaviour log-prob of each response
    token, under the version that generated it. finish_reason: "stop" or "length" (only
    finished rollouts are kept). token_versions: the version that generated each response
    token, for a mixed-version rollout (weights changed under it in flight), else None: every
    token is `version`'s.

    loss_mask: a multi-turn episode's: 1 for each response token the policy sampled, 0 for
    one given (an observation, a tool's result, appended between turns); None when every
    token was sampled (held as None when all are 1). A given token's log-prob (0.0) and
    version (the version the next turn starts under) are placeholders: nothing reads them.
    So the staleness of a rollout is its oldest *sampled* token's (`oldest_version`), and
    `newest_version` / `mixed` look at sampled tokens only; the trainer never learns from a
    given token (assembly puts the mask in the batch's response_mask).
    """

    batch: int
    prompt_id: str
    sample_index: int
    version: int
    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    token_versions: tuple[int, ...] | None = None
    loss_mask: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Sequences arrive as lists from JSON: held as tuples (the record is immutable).
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, list):
                object.__setattr__(self, field.name, tuple(value))
        name = f"rollout {self.prompt_id}/s{self.sample_index}"
        mask = self.loss_mask
        if mask is not None:
            if len(mask) != len(self.tokens):
                raise ValueError(
                    f"{name}: a loss mask of {len(mask)} entries for {len(self.tokens)} "
                    "response tokens (one per token: 1 sampled, 0 given)"
                )
            if any(m not in (0, 1) for m in mask):
                raise ValueError(f"{name}: a loss mask holds 0 and 1 only, got {list(mask)}")
            mask = tuple(int(m) for m in mask)
            object.__setattr__(self, "loss_mask", None if all(mask) else mask)
        tv = self.token_versions
        if tv is not None:
            if len(tv) != len(self.tokens):
                raise ValueError(
                    f"{name}: {len(tv)} token versions for {len(self.tokens)} tokens (one per "
                    "generated token)"
                )
            sampled = self.sampled_versions
            if any(b < a for a, b in zip(sampled, sampled[1:], strict=False)) or (
                sampled and sampled[0] < 0
            ):
                raise ValueError(
                    f"{name}: token versions must be non-negative and never decrease along "
                    f"the response's sampled tokens, got {list(tv)}"
                )

    @property
    def key(self) -> RolloutKey:
        return RolloutKey(self.prompt_id, self.sample_index, self.version)

    @property
    def versions(self) -> tuple[int, ...]:
        """The version that generated each response token (a given token's: a placeholder)."""
        if self.token_versions is not None:
            return self.token_versions
        return (self.version,) * len(self.tokens)

    @property
    def mask(self) -> tuple[int, ...]:
        """`loss_mask`, one per response token (all 1 when None)."""
        return self.loss_mask if self.loss_mask is not None else (1,) * len(self.tokens)

    @property
    def sampled_versions(self) -> tuple[int, ...]:
        """The versions of the tokens the policy sampled, in order (never decreasing)."""
        if self.loss_mask is None:
            return self.versions
        return tuple(v for v, m in zip(self.versions, self.loss_mask, strict=True) if m)

    @property
    def oldest_version(self) -> int:
        """The version of its oldest sampled token (the request's own when it sampled none):
        what the staleness bound N is checked on."""
        sampled = self.sampled_versions
        return sampled[0] if sampled else self.version

    @property
    def newest_version(self) -> int:
        sampled = self.sampled_versions
        return sampled[-1] if sampled else self.version

    @property
    def mixed(self) -> bool:
        """Whether more than one version sampled its tokens."""
        return self.oldest_version != self.newest_version

    @property
    def final_turn(self) -> tuple[int, ...]:
        """The response's tokens after its last given token: an episode's final turn, the
        answer a verifier judges (the whole response when every token was sampled)."""
        mask = self.loss_mask
        if mask is None:
            return self.tokens
        last_given = max(i for i, m in enumerate(mask) if not m)
        return self.tokens[last_given + 1 :]

    def to_json(self) -> dict[str, Any]:
        """The rollout log's line (JSON types): tuples as lists; a None field is left out."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RolloutRecord:
        """The record of a log line; KeyError / TypeError when it lacks a field (keys it
        does not know are ignored)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass(frozen=True)
class Judgement:
    """A rollout's final verdict: `reward` is None when it stayed unjudged. `token_rewards`:
    dense per-token rewards, one per generated token, when the verifier (a reward function
    of the user's) gave them, else None. `response` is the decoded text that was judged,
    kept so that people can read the rollout log (`rlax-tpu samples`); it is not part of
    the verdict (judgements compare without it)."""

    reward: float | None
    verdict: str
    reason: str = ""
    response: str = dataclasses.field(default="", compare=False)
    token_rewards: tuple[float, ...] | None = None

    @property
    def judged(self) -> bool:
        return self.reward is not None

    def with_response(self, response: str) -> Judgement:
        return dataclasses.replace(self, response=response)

    def to_json(self, key: RolloutKey) -> dict[str, Any]:
        """The rollout log's verdict line of the rollout `key`."""
        return {
            "prompt_id": key.prompt_id,
            "sample_index": key.sample_index,
            "version": key.version,
            "reward": self.reward,
            "verdict": self.verdict,
            "reason": self.reason,
            "response": self.response,
            # Only when there are some: the records of every other run stay as they were.
            **({} if self.token_rewards is None else {"token_rewards": list(self.token_rewards)}),
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Judgement:
        """The judgement of a verdict line; lines written before verdicts carried the
        response text load with response "" (their reward and verdict are what counts)."""
        reward, token_rewards = record["reward"], record.get("token_rewards")
        return cls(
            None if reward is None else float(reward),
            record["verdict"],
            record.get("reason", ""),
            response=record.get("response", ""),
            token_rewards=None if token_rewards is None else tuple(map(float, token_rewards)),
        )


@dataclasses.dataclass(frozen=True)
class ScoredRollout:
    """A judged rollout as it trains: its reward (never None: an unjudged rollout does not
    train) and its dense per-token rewards, one per response token, or None. The verdict
    that gave them is the rollout's `Judgement` (in the batch and the rollout log); the
    replay buffer keeps only what trains."""

    rollout: RolloutRecord
    reward: float
    token_rewards: tuple[float, ...] | None = None

    @classmethod
    def of(cls, rollout: RolloutRecord, judgement: Judgement) -> ScoredRollout:
        if judgement.reward is None:
            raise ValueError(
                f"rollout {rollout.key} is unjudged ({judgement.reason}): it cannot train"
            )
        return cls(rollout, judgement.reward, judgement.token_rewards)


@dataclasses.dataclass(frozen=True)
class Group:
    """One prompt's scored samples, in sample order, which share an advantage baseline.

    key: the prompt the group is of (a batch's prompt key; in replay mode, the buffer's
    prompt uid "<dataset>:<id>"). baseline: the reward every row's advantage is taken
    against when the algorithm asks for one (ReMax: the prompt's greedy response), else None.
    """

    key: str
    samples: tuple[ScoredRollout, ...]
    baseline: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
