"""Batch assembly: from judged groups of rollouts to the arrays of one train step. Pure
functions of their arguments (no threads, no servers), so each rule is tested directly.

* `group_has_signal`: DAPO's predicate — a group whose rewards are not all equal.
* `select_groups`: which of a batch's groups train — only fully judged ones (a group with an
  unjudged sample is dropped whole: its advantages would be computed against a reward that
  does not exist), with dynamic sampling those with signal first, in draw order.
* `assemble_batch`: the `RolloutArrays` of step b, padded to few shapes, after checking
  every token of every rollout is acceptable for b (b − version ≤ N for its oldest token,
  and no token after b; the trainer checks it again); dense per-token rewards (from a
  reward function of the user's) and, for mixed-version rollouts, per-token versions placed
  like the log-probs.

A multi-turn episode's response holds tokens the policy did not sample (observations,
`RolloutRecord.loss_mask` 0): the batch's response_mask is the loss mask over the response
positions, 0 on a given token as on padding, so nothing trains on them; their placeholder
log-probs and versions are not sent (0 there, like padding), and a dense reward a reward
function put on one moves to the sampled token before it (`on_sampled_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlax_tpu.api.records import Group, RolloutKey
from rlax_tpu.api.trainer import RolloutArrays
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.filters import dynamic_sampling_keep
from rlax_tpu.shapes import padded_seq_len
from rlax_tpu.staleness import StalenessPolicy


def group_has_signal(rewards: Sequence[float]) -> bool:
    """Whether one group's rewards differ: DAPO's predicate (algorithms.filters), since a
    group whose rewards are all equal has zero advantage everywhere and trains nothing."""
    return bool(dynamic_sampling_keep(rewards, np.zeros(len(rewards), np.int32))[0])


@dataclasses.dataclass(frozen=True)
class Selection:
    """The groups (prompt keys, in draw order) that train, and what the choice left out."""

    keys: list[str]
    flat: int  # judged groups without reward variance
    dropped: int  # groups with an unjudged sample

    def __len__(self) -> int:
        return len(self.keys)


def select_groups(
    groups: Sequence[tuple[str, bool, bool]], wanted: int, *, dynamic: bool
) -> Selection:
    """`groups`: (prompt key, fully judged, has signal) in draw order. The first `wanted`
    judged groups; with dynamic sampling those with signal first, then flat ones to fill
    the batch (when the extra rounds ran out). Never a group with an unjudged sample."""
    judged = [(key, signal) for key, ok, signal in groups if ok]
    dropped = len(groups) - len(judged)
    flat = sum(1 for _, signal in judged if not signal)
    if dynamic:
        ordered = [k for k, s in judged if s] + [k for k, s in judged if not s]
    else:
        ordered = [k for k, _ in judged]
    chosen = set(ordered[:wanted])
    keys = [key for key, _, _ in groups if key in chosen]
    return Selection(keys=keys, flat=flat, dropped=dropped)


@dataclasses.dataclass(frozen=True)
class Assembled:
    """One train step's batch and what the controller logs about it."""

    batch: RolloutArrays
    keys: list[RolloutKey]  # per row
    rewards: np.ndarray  # float32[rows]
    staleness_mean: float  # of each row's oldest token
    response_tokens: int  # every response token, sampled or given
    version_span: int  # newest sampled token's version - oldest one's, over the batch
    partial_fraction: float  # rows whose tokens more than one version sampled
    given_tokens: int = 0  # response tokens the policy did not sample (episodes' observations)


def on_sampled_tokens(token_rewards: Sequence[float], mask: Sequence[int]) -> list[float]:
    """Dense rewards, one per response token, with each given token's (mask 0) moved to the
    sampled token before it: the action whose consequence the observation is (to the first
    sampled token after it when none comes before). The sum is kept, and every estimator
    sees it: the objective reads rewards on sampled tokens only. A response without sampled
    tokens keeps its rewards where they are (it trains nothing)."""
    out = [float(x) if m else 0.0 for x, m in zip(token_rewards, mask, strict=True)]
    sampled = [i for i, m in enumerate(mask) if m]
    if not sampled:
        return [float(x) for x in token_rewards]
    before = sampled[0]
    for i, (x, m) in enumerate(zip(token_rewards, mask, strict=True)):
        if m:
            before = i
        else:
            out[before] += float(x)
    return out


def rollout_rows(rollouts: Sequence[Any], seq: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32[rows, seq], response mask, behaviour log-probs float32[rows, seq]) of
    rollouts whose every response token was sampled (an engine's, with prompt_tokens,
    tokens and logprobs), laid out as `assemble_batch` lays out a batch: prompt + response
    right-padded, the log-prob of response token j at position P - 1 + j (targets[t] =
    tokens[t + 1]). For benchmarks and tests that feed engine rollouts to the trainer."""
    rows = len(rollouts)
    tokens = np.zeros((rows, seq), np.int32)
    mask = np.zeros((rows, seq), bool)
    behaviour = np.zeros((rows, seq), np.float32)
    for row, r in enumerate(rollouts):
        full = list(r.prompt_tokens) + list(r.tokens)
        if len(full) > seq:
            raise ValueError(f"rollout {row} has {len(full)} tokens; the rows hold {seq}")
        tokens[row, : len(full)] = full
        at = slice(len(r.prompt_tokens) - 1, len(r.prompt_tokens) - 1 + len(r.tokens))
        mask[row, at] = True
        behaviour[row, at] = r.logprobs
    return tokens, mask, behaviour


def assemble_batch(
    step: int,
    groups: Sequence[Group],
    *,
    policy: StalenessPolicy,
    max_seq_len: int,
) -> Assembled:
    """The batch of train step `step` from `groups`: each sample's token rewards are a
    sequence of floats, one per generated token (`rollout.tokens`), or None.

    Rows are the groups' samples in order; tokens are prompt + response, padded to
    `padded_seq_len` of the longest; position t scores tokens[t + 1], so response token j of
    a row with prompt length P sits at P − 1 + j in the mask, the behaviour log-probs and the
    token rewards. The mask is the rollout's loss mask there (0 on an episode's given
    tokens), and the log-probs and token versions are 0 off it (a given token's reward moves
    to the sampled token before it). `token_rewards` is None when no row has any (the batch
    of a run without dense rewards is what it always was); else rows without any hold
    zeros. A rollout that
    step may not train on, or token rewards that do not match its tokens, is a
    ControllerError (the schedule and the replay buffer's eviction prevent the first, the
    verifier the second; neither is ever trained on). Group baselines (ReMax: the reward of
    the prompt's greedy response) are sent as every row's `baseline_rewards` when the groups
    have them — all or none; with none, none is sent."""
    with_baseline = sum(g.baseline is not None for g in groups)
    if with_baseline not in (0, len(groups)):
        raise ControllerError(f"{with_baseline} baselines for {len(groups)} groups")
    samples, group_ids = [], []
    for g, group in enumerate(groups):
        for sample in group.samples:
            r = sample.rollout
            for version in {r.oldest_version, r.newest_version}:
                if not policy.is_acceptable(step, version):
                    raise ControllerError(
                        f"rollout {r.prompt_id}/s{r.sample_index} has tokens of version "
                        f"{version}, not acceptable for batch {step} "
                        f"(N={policy.max_staleness})"
                    )
            if sample.token_rewards is not None and len(sample.token_rewards) != len(r.tokens):
                raise ControllerError(
                    f"rollout {r.prompt_id}/s{r.sample_index} has "
                    f"{len(sample.token_rewards)} token rewards for {len(r.tokens)} response "
                    "tokens; a reward function gives one per generated token"
                )
            samples.append(sample)
            group_ids.append(g)
    if not samples:
        raise ControllerError(f"batch {step} has no rollouts to train on")
    records = [s.rollout for s in samples]
    lengths = [len(r.prompt_tokens) + len(r.tokens) for r in records]
    seq = padded_seq_len(max(lengths), max_seq_len)
    rows = len(records)
    tokens = np.zeros((rows, seq), np.int32)
    mask = np.zeros((rows, seq), bool)
    behaviour = np.zeros((rows, seq), np.float32)
    token_rewards = None
    if any(s.token_rewards is not None for s in samples):
        token_rewards = np.zeros((rows, seq), np.float32)
    mixed = [r.mixed for r in records]
    token_versions = None
    if any(mixed):  # only then: a batch without mixed rows is what it always was
        token_versions = np.zeros((rows, seq), np.int32)
    for row, sample in enumerate(samples):
        r = sample.rollout
        p, resp = r.prompt_tokens, r.tokens
        full = (list(p) + list(resp))[:seq]
        tokens[row, : len(full)] = full
        n = min(len(resp), seq - len(p))
        at = slice(len(p) - 1, len(p) - 1 + n)
        sampled = np.asarray(r.mask[:n], bool)
        mask[row, at] = sampled
        behaviour[row, at] = np.where(sampled, r.logprobs[:n], 0.0)
        if sample.token_rewards is not None:
            token_rewards[row, at] = on_sampled_tokens(sample.token_rewards, r.mask)[:n]
        if token_versions is not None:
            token_versions[row, at] = np.where(sampled, r.versions[:n], 0)
    rewards_array = np.asarray([s.reward for s in samples], np.float32)
    versions = np.asarray([r.oldest_version for r in records], np.int32)
    batch = RolloutArrays(
        tokens=tokens,
        response_mask=mask,
        group_ids=np.asarray(group_ids, np.int32),
        rewards=rewards_array,
        behaviour_logprobs=behaviour,
        versions=versions,
        token_rewards=token_rewards,
        baseline_rewards=None
        if not with_baseline
        else np.asarray([groups[g].baseline for g in group_ids], np.float32),
        token_versions=token_versions,
    )
    return Assembled(
        batch=batch,
        keys=[r.key for r in records],
        rewards=rewards_array,
        staleness_mean=float(np.mean(step - versions)),
        response_tokens=int(sum(len(r.tokens) for r in records)),
        version_span=max(r.newest_version for r in records) - int(versions.min()),
        partial_fraction=float(np.mean(mixed)),
        given_tokens=int(sum(len(r.mask) - sum(r.mask) for r in records)),
    )
