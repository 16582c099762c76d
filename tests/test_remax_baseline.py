"""ReMax's greedy baseline (issue 23): with advantage="remax" the controller also generates
one greedy response per prompt (temperature 0, its own deterministic request id), judges
it, and sends its reward as `baseline_rewards` for every row of the prompt's group; it is
never a training row, a group whose baseline stays unjudged is dropped, and a resumed batch
reuses the logged greedy rollouts and verdicts. The generation pool runs with stand-in
workers and verifiers answering as their clients do."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from rlax_tpu.api.inference import LoadResult, Rollout, SamplingParams
from rlax_tpu.api.records import Group, RolloutRecord, ScoredRollout
from rlax_tpu.api.verifier import Verdict, VerificationResult
from rlax_tpu.config import (
    AlgorithmConfig,
    ConfigError,
    ControllerConfig,
    KLConfig,
    RunConfig,
    TrainerConfig,
)
from rlax_tpu.config.run import greedy_baseline
from rlax_tpu.controller.assembly import assemble_batch
from rlax_tpu.controller.batches import BatchBuilder
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.generation import GREEDY_SAMPLE, BatchState, GenerationPool, Prompt
from rlax_tpu.controller.scoring import Scorer
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.controller.workers import WorkerThreads
from rlax_tpu.staleness import StalenessPolicy

SAMPLES = 2
CONFIG = RunConfig(
    controller=ControllerConfig(prompts_per_batch=2, samples_per_prompt=SAMPLES),
    trainer=TrainerConfig(
        mini_batch_size=4,
        micro_batch_size=4,
        algorithm=AlgorithmConfig(name="grpo", advantage="remax", kl=KLConfig(beta=0.0)),
    ),
)


class Worker:
    """An inference worker's answers: a response of one token, 60 + sample index (59 for
    the greedy one), generated at the request's temperature."""

    address = "worker"

    def __init__(self):
        self.requests = []

    def load(self, version, *, evaluation=False):
        return LoadResult(version=version, already_loaded=False, aborted=())

    def generate(self, requests, version):
        for r in requests:
            self.requests.append(r)
            token = 60 + r.sample_index
            yield Rollout(
                r.request_id, r.prompt_id, r.sample_index, version, r.prompt_tokens,
                (token,), (-0.5,), "stop",
            )  # fmt: skip


class Verifier:
    """Rewards by sample: 1 for sample 0, 0 for sample 1, 0.25 (prompt a) or 0.75 (prompt
    b) for the greedy response; `errors`: request ids answered verifier_error."""

    def __init__(self, errors=()):
        self.calls, self.errors = [], set(errors)

    def verify_many(self, requests):
        self.calls.append([q.request_id for q in requests])
        out = []
        for q in requests:
            if q.request_id in self.errors:
                out.append(VerificationResult(reward=0, verdict=Verdict.VERIFIER_ERROR, reason="x"))
                continue
            if "/s-1/" in q.request_id:
                reward = 0.25 if ":a/" in q.request_id else 0.75
            else:
                reward = 1.0 if "/s0/" in q.request_id else 0.0
            out.append(VerificationResult(reward=reward, verdict=Verdict.ACCEPTED, reason=""))
        return out


class CharTokenizer:
    def decode(self, tokens, **_):
        return "".join(chr(t) for t in tokens)


@dataclasses.dataclass(frozen=True)
class Record:  # the PromptRecord fields the controller reads
    id: str
    dataset: str = "d"
    verifier: str = "arithmetic"
    prompt: str = ""
    messages: tuple = ()
    reference: str = ""
    problem: str = ""
    reward_function: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)

    def to_json(self):
        return {"id": self.id}


def prompts() -> list[Prompt]:
    return [Prompt(f"b0:d:{k}", (1, 2, 3), Record(k)) for k in ("a", "b")]


def run_batch(tmp_path, verifier, worker=None):
    """Generate, judge, choose and assemble batch 0 (version 0) with a greedy baseline;
    (assembled, batch, selection, worker)."""
    worker = worker or Worker()
    log = RolloutLog(str(tmp_path))
    sampling = SamplingParams(temperature=0.7, max_new_tokens=4)
    pool = GenerationPool(
        WorkerThreads([worker], sampling=sampling, counters={}), log, samples=SAMPLES
    )
    scorer = Scorer(
        verifier,
        CharTokenizer(),
        (),
        retries=0,
        backoff_s=0,
        max_unjudged_fraction=1,
        counters={},
    )
    policy = StalenessPolicy(reload_every=1, max_staleness=0)
    builder = BatchBuilder(
        CONFIG,
        pool=pool,
        scorer=scorer,
        log=log,
        refill=None,
        replay=None,
        policy=policy,
        encode=lambda r: (1, 2, 3),
        counters={},
    )
    batch = BatchState(0, 0, SAMPLES, greedy=True)
    pool.start()
    try:
        pool.submit(batch, prompts())
        assert pool.wait(batch, threading.Event())
        builder.judge(batch)
        groups = builder._groups(batch)
        if not all(ok for _, ok, _ in groups):
            return None, batch, groups, worker
        selection = builder.fill(batch, threading.Event())
        return builder.assemble(batch, selection), batch, groups, worker
    finally:
        pool.stop()
        log.close()  # its writes on storage, as a controller's stop leaves them


def test_remax_is_the_config_that_asks_for_a_greedy_baseline_and_refuses_replay():
    assert greedy_baseline(CONFIG.trainer.algorithm)
    assert not greedy_baseline(AlgorithmConfig(name="grpo"))
    with pytest.raises(ConfigError, match="controller.replay.enabled: cannot go with .*'remax'"):
        CONFIG.override("controller.replay.enabled", True)


def test_each_group_gets_its_greedy_reward_as_the_baseline_of_every_row(tmp_path):
    verifier = Verifier()
    assembled, batch, _, worker = run_batch(tmp_path, verifier)
    greedy = [r for r in worker.requests if r.sample_index == GREEDY_SAMPLE]
    samples = [r for r in worker.requests if r.sample_index != GREEDY_SAMPLE]
    assert [r.request_id for r in greedy] == ["b0:d:a/greedy/v0", "b0:d:b/greedy/v0"]
    assert all(r.sampling.temperature == 0.0 for r in greedy)
    assert all(r.sampling.temperature == 0.7 and r.sampling.max_new_tokens == 4 for r in samples)
    assert len(samples) == 2 * SAMPLES
    # The greedy responses are judged under their own request ids, never trained on.
    assert sum("/s-1/" in i for i in verifier.calls[0]) == 2
    arrays = assembled.batch
    assert [k[1] for k in assembled.keys] == [0, 1, 0, 1]  # no greedy row
    np.testing.assert_array_equal(arrays.rewards, np.float32([1, 0, 1, 0]))
    np.testing.assert_array_equal(arrays.baseline_rewards, np.float32([0.25, 0.25, 0.75, 0.75]))
    assert arrays.tokens.shape[0] == 4 and not (arrays.tokens == 59).any()


def test_a_resumed_batch_reuses_the_logged_greedy_rollouts_and_verdicts(tmp_path):
    first, _, _, _ = run_batch(tmp_path, Verifier())
    worker, verifier = Worker(), Verifier()
    again, _, _, _ = run_batch(tmp_path, verifier, worker)
    assert worker.requests == [] and verifier.calls == []  # all from the rollout log
    for name in ("tokens", "rewards", "baseline_rewards", "behaviour_logprobs"):
        np.testing.assert_array_equal(getattr(again.batch, name), getattr(first.batch, name))


def test_a_group_whose_greedy_response_stays_unjudged_is_not_fully_judged(tmp_path):
    verifier = Verifier(errors={"b0:d:b/s-1/v0"})
    assembled, batch, groups, _ = run_batch(tmp_path, verifier)
    assert assembled is None
    assert groups == [("b0:d:a", True, True), ("b0:d:b", False, False)]
    assert not batch.baseline(batch.prompts[1]).judged


def test_assembly_repeats_each_groups_baseline_over_its_rows_and_checks_the_count():
    policy = StalenessPolicy(reload_every=1, max_staleness=0)

    def scored(prompt, sample, reward):
        rollout = RolloutRecord(
            batch=0, prompt_id=prompt, sample_index=sample, version=0, prompt_tokens=(1, 2),
            tokens=(3,), logprobs=(-1.0,), finish_reason="stop",
        )  # fmt: skip
        return ScoredRollout(rollout, reward)

    def groups(*baselines):
        a = Group("a", (scored("a", 0, 1.0), scored("a", 1, 0.0)), baselines[0])
        return [a, Group("b", (scored("b", 0, 0.5),), baselines[1])]

    batch = assemble_batch(0, groups(0.5, -1), policy=policy, max_seq_len=16).batch
    np.testing.assert_array_equal(batch.baseline_rewards, np.float32([0.5, 0.5, -1.0]))
    plain = assemble_batch(0, groups(None, None), policy=policy, max_seq_len=16)
    assert plain.batch.baseline_rewards is None
    with pytest.raises(ControllerError, match="1 baselines for 2 groups"):
        assemble_batch(0, groups(0.5, None), policy=policy, max_seq_len=16)
