"""From a launched batch to its train step's arrays: judge its rollouts (logged verdicts
first, so a resumed run trains on the rewards the first run had), choose its groups — with
dynamic sampling those with reward variance; never one with an unjudged sample — drawing
more prompts from the refill stream (same version) while the batch is short, and assemble
the chosen groups (or, in replay mode, the groups sampled from the buffer).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, MutableMapping

from rlax_tpu.config import RunConfig
from rlax_tpu.controller.assembly import (
    Assembled,
    Selection,
    assemble_batch,
    group_has_signal,
    select_groups,
)
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.generation import BatchState, GenerationPool, Prompt
from rlax_tpu.controller.replay import ReplayStage
from rlax_tpu.controller.scoring import Scorer
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.data.datasets import PromptMixture, PromptRecord
from rlax_tpu.staleness import StalenessPolicy

# Rounds of replacements for groups dropped as unjudged, per batch, before the run stops.
MAX_UNJUDGED_REFILLS = 4


class BatchBuilder:
    """`refill` is the refill prompt stream; `encode` a prompt record's tokens; `counters`
    the run's snapshotted accounting (groups_dropped; with dynamic sampling
    groups_generated and groups_filtered)."""

    def __init__(
        self,
        config: RunConfig,
        *,
        pool: GenerationPool,
        scorer: Scorer,
        log: RolloutLog,
        refill: PromptMixture,
        replay: ReplayStage | None,
        policy: StalenessPolicy,
        encode: Callable[[PromptRecord], tuple[int, ...]],
        counters: MutableMapping[str, int],
    ) -> None:
        self.ctl = config.controller
        self.max_seq_len = config.trainer.max_seq_len
        self.dynamic = self.ctl.dynamic_sampling.enabled
        self.pool, self.scorer, self.log = pool, scorer, log
        self.refill, self.replay, self.policy = refill, replay, policy
        self.encode = encode
        self.counters = counters
        for key in ("groups_dropped", "groups_generated", "groups_filtered"):
            counters.setdefault(key, 0)

    def _refill(self, batch: BatchState, count: int) -> None:
        """`count` more prompts for `batch` from the refill stream (same version)."""
        r, b = batch.rounds, batch.index
        records = self.refill.draw(count)
        prompts = [Prompt(f"b{b}r{r}:{x.dataset}:{x.id}", self.encode(x), x) for x in records]
        batch.rounds += 1
        self.pool.submit(batch, prompts)

    def judge(self, batch: BatchState) -> None:
        """A judgement for every rollout of `batch` that has none: the logged verdict (a
        resumed run trains on the rewards the first run had), else the verifier's."""
        todo = batch.unjudged()
        if not todo:
            return
        logged = batch.logged_judgements
        if logged is None:
            logged = self.log.judgements(batch.index)
        fresh = []
        for p, i in todo:
            judgement = logged.get(batch.rollouts[(p.key, i)].key)
            if judgement is not None:
                batch.judgements[(p.key, i)] = judgement
            else:
                fresh.append((p, i))
        if not fresh:
            return
        items = [(p.record, batch.rollouts[(p.key, i)]) for p, i in fresh]
        judgements = self.scorer.judge(items, what=f"batch {batch.index}")
        for (p, i), judgement in zip(fresh, judgements, strict=True):
            batch.judgements[(p.key, i)] = judgement
        verdicts = [(r.key, j) for (_, r), j in zip(items, judgements, strict=True)]
        self.log.append_verdicts(batch.index, verdicts)

    def _groups(self, batch: BatchState) -> list[tuple[str, bool, bool]]:
        """(prompt key, fully judged, has reward variance) per group, in draw order. With a
        greedy baseline (ReMax), a group is fully judged only with its baseline judged."""
        out = []
        for p in batch.prompts:
            judged = batch.judged(p)
            signal = judged and group_has_signal([j.reward for j in batch.judgements_of(p)])
            out.append((p.key, judged, signal))
        return out

    def fill(self, batch: BatchState, stop: threading.Event) -> Selection | None:
        """Judge `batch` and choose its groups, drawing more prompts while dynamic sampling
        wants groups with signal (at most controller.dynamic_sampling.max_rounds extra
        rounds) or groups dropped as unjudged leave the batch short. None if stopped meanwhile."""
        ctl = self.ctl
        wanted = ctl.prompts_per_batch
        signal_rounds = refills = 0
        while True:
            if not self.pool.wait(batch, stop):
                return None
            self.judge(batch)
            groups = self._groups(batch)
            judged = sum(ok for _, ok, _ in groups)
            signal = sum(s for _, _, s in groups)
            more_signal = (
                self.dynamic and signal < wanted and signal_rounds < ctl.dynamic_sampling.max_rounds
            )
            short = judged < wanted and self.replay is None  # the buffer needs no refill
            if not (more_signal or short):
                break
            if not more_signal:
                refills += 1
                if refills > MAX_UNJUDGED_REFILLS:
                    raise ControllerError(
                        f"batch {batch.index}: only {judged} of {wanted} groups are judged "
                        f"after {MAX_UNJUDGED_REFILLS} rounds of replacements; the verifier "
                        "keeps failing on some requests (see verify/dropped in metrics.jsonl)"
                    )
            signal_rounds += more_signal
            self._refill(batch, wanted - (signal if more_signal else judged))
        selection = select_groups(groups, wanted, dynamic=self.dynamic)
        self.counters["groups_dropped"] += selection.dropped
        if self.dynamic and self.replay is None:
            self.counters["groups_generated"] += len(groups)
            self.counters["groups_filtered"] += selection.flat
        return selection

    def assemble(self, batch: BatchState, selection: Selection) -> Assembled:
        """The training batch of step `batch.index`: its chosen groups, or (replay mode)
        groups sampled from the replay buffer after this step's sync."""
        # With `batch.greedy` (ReMax) each group's greedy reward is its rows' baseline.
        judged = {p.key: batch.group(p) for p in batch.prompts if batch.judged(p)}
        if self.replay is not None:  # (RunConfig refuses a greedy baseline with replay)
            uids = {p.key: p.uid for p in batch.prompts}
            new = self.replay.entries(
                batch.index, [dataclasses.replace(g, key=uids[k]) for k, g in judged.items()]
            )
            groups = self.replay.groups(batch.index, new)
        else:
            groups = [judged[key] for key in selection.keys]
        return assemble_batch(batch.index, groups, policy=self.policy, max_seq_len=self.max_seq_len)
