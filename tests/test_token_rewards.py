"""Dense per-token rewards from a reward function of the user's (issue 23): the function may
take the response's token ids and return one reward per token; they travel in the
VerificationResult, over the verifier proto, through the service's idempotency cache, the
controller's scoring and its rollout log, the replay buffer's snapshot, and land in the
assembled batch aligned like the behaviour log-probs. Runs without them are unchanged."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from rlax_tpu.api.records import Group, RolloutRecord, ScoredRollout
from rlax_tpu.api.verifier import (
    RequestIdReusedError,
    Verdict,
    VerificationRequest,
    VerificationResult,
    request_from_proto,
    request_to_proto,
    result_from_proto,
    result_to_proto,
)
from rlax_tpu.config import VerifierConfig
from rlax_tpu.controller.assembly import assemble_batch
from rlax_tpu.controller.errors import ControllerError
from rlax_tpu.controller.replay import Entry
from rlax_tpu.controller.scoring import Judgement, Scorer
from rlax_tpu.controller.snapshots import RolloutLog
from rlax_tpu.rpc.protos import verifier_pb2 as pb
from rlax_tpu.staleness import StalenessPolicy
from rlax_tpu.verifiers import functions
from rlax_tpu.verifiers.functions import result_from_return
from rlax_tpu.verifiers.local import LocalVerifier, pool_for
from rlax_tpu.verifiers.service import VerificationService

DENSE = """
def dense(prompt, response, reference, metadata, response_tokens):
    # One reward per generated token, the token id / 100: alignment shows in the batch.
    return {"reward": 1.0, "token_rewards": [t / 100 for t in response_tokens]}

def counted(prompt, response, reference, metadata, **kwargs):
    return {"reward": 0.5, "token_rewards": [1.0] * len(kwargs["response_tokens"])}

def blind(prompt, response, reference, metadata):
    return {"reward": 0.0, "token_rewards": [0.25, 0.25, 0.25]}

def plain(prompt, response, reference, metadata):
    return 1.0
"""


class CharTokenizer:
    def decode(self, tokens, **_):
        return "".join(chr(t) for t in tokens)


@dataclasses.dataclass(frozen=True)
class Record:  # the PromptRecord fields the scorer reads
    reward_function: str
    verifier: str = "function"
    prompt: str = "q"
    messages: tuple = ()
    reference: str = ""
    problem: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)


def rollout(prompt_id: str, sample: int, tokens: list[int], prompt_len: int = 3) -> RolloutRecord:
    return RolloutRecord(
        batch=0,
        prompt_id=prompt_id,
        sample_index=sample,
        version=0,
        prompt_tokens=tuple(range(1, prompt_len + 1)),
        tokens=tuple(tokens),
        logprobs=(-0.5,) * len(tokens),
        finish_reason="stop",
    )


def group(*samples) -> Group:
    """A group of (rollout, reward[, token rewards])."""
    return Group(samples[0][0].prompt_id, tuple(ScoredRollout(*s) for s in samples))


@pytest.fixture(scope="module")
def module_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "dense.py"
    path.write_text(DENSE)
    return path


# -- the contract -------------------------------------------------------------------------------
def test_token_rewards_are_one_finite_number_per_response_token():
    ok = result_from_return("m:f", {"reward": 1, "token_rewards": [0, 0.5, -1]}, num_tokens=3)
    assert ok.token_rewards == (0.0, 0.5, -1.0) and ok.verdict == Verdict.ACCEPTED
    as_array = result_from_return(
        "m:f", {"reward": 1, "token_rewards": np.arange(3, dtype=np.float32)}, num_tokens=3
    )
    assert as_array.token_rewards == (0.0, 1.0, 2.0)
    assert result_from_return("m:f", 1.0, num_tokens=3).token_rewards is None
    for value, problem in [
        ([0.0, 1.0], "token_rewards has 2 entries for a response of 3 tokens"),
        ([0.0, float("nan"), 1.0], "token_rewards[1] = nan is not a finite number"),
        ([0.0, "1", 1.0], "token_rewards[1] = '1' is not a finite number"),
        ("abc", "token_rewards must be a list of numbers, got str"),
    ]:
        result = result_from_return("m:f", {"reward": 1, "token_rewards": value}, num_tokens=3)
        assert result.verdict == Verdict.VERIFIER_ERROR and problem in result.reason, value
        assert result.token_rewards is None
    # Without the response's tokens, token rewards cannot be placed.
    result = result_from_return("m:f", {"reward": 1, "token_rewards": [1.0]})
    assert result.verdict == Verdict.VERIFIER_ERROR
    assert "this request carries none" in result.reason


def test_a_function_gets_the_response_tokens_when_it_takes_them(module_file):
    tokens = [50, 60, 2]

    def judged(name: str, response_tokens=tokens) -> VerificationResult:
        spec = f"{module_file}:{name}"
        return functions.judge(spec, "q", "26", "", {}, response_tokens)

    assert judged("dense").token_rewards == (0.5, 0.6, 0.02)
    assert judged("counted").token_rewards == (1.0, 1.0, 1.0)  # **kwargs: it gets them too
    assert judged("blind").token_rewards == (0.25, 0.25, 0.25)  # counted without taking them
    wrong = judged("blind", [50, 2])
    assert wrong.verdict == Verdict.VERIFIER_ERROR and "3 entries for a response of 2" in (
        wrong.reason
    )
    plain = judged("plain")
    assert plain.token_rewards is None and plain.reward == 1.0
    # No tokens sent: a function that needs them is not called with them (it fails as
    # the user's TypeError), one that does not is judged as before.
    assert judged("plain", None).reward == 1.0
    assert judged("dense", None).verdict == Verdict.VERIFIER_ERROR


# -- the wire and the service's cache --------------------------------------------------------------
def test_response_tokens_and_token_rewards_cross_the_wire():
    request = VerificationRequest(
        kind="function", function="m:f", response="ab", response_tokens=(97, 98, 2)
    )
    assert request_from_proto(request_to_proto(request), 0) == request
    plain = dataclasses.replace(request, response_tokens=())
    assert request_from_proto(request_to_proto(plain), 0) == plain
    for token_rewards in ((0.1, -2.5, 3.0), (), None):
        result = VerificationResult(
            reward=1.0, verdict=Verdict.ACCEPTED, reason="ok", token_rewards=token_rewards
        )
        wire = pb.VerificationResultMessage.FromString(result_to_proto(result).SerializeToString())
        assert result_from_proto(wire) == result, token_rewards


def test_a_cached_result_carries_its_token_rewards_and_a_reused_id_needs_the_same_tokens():
    calls = []

    def verify(request):
        calls.append(request.request_id)
        rewards = tuple(t / 10 for t in request.response_tokens)
        return VerificationResult(
            reward=1.0, verdict=Verdict.ACCEPTED, reason="ok", token_rewards=rewards
        )

    service = VerificationService(verify, concurrency=1)
    try:
        first = VerificationRequest(
            kind="function", function="m:f", response="x", response_tokens=(5, 7), request_id="a"
        )
        fresh = service.verify_batch([first])[0]
        again = service.verify_batch([first])[0]
        assert (fresh.cached, again.cached, calls) == (False, True, ["a"])
        assert again.result.token_rewards == fresh.result.token_rewards == (0.5, 0.7)
        wire = result_from_proto(result_to_proto(again.result, "a", cached=True))
        assert wire.token_rewards == (0.5, 0.7)
        with pytest.raises(RequestIdReusedError):
            service.verify_batch([dataclasses.replace(first, response_tokens=(5, 8))])
    finally:
        service.close()


# -- the controller --------------------------------------------------------------------------------
def test_judgements_keep_token_rewards_through_the_rollout_log(tmp_path):
    log = RolloutLog(str(tmp_path))
    r0, r1 = rollout("p", 0, [70, 71]), rollout("p", 1, [72])
    dense = Judgement(1.0, "accepted", "ok", response="FG", token_rewards=(0.1, 1 / 3))
    plain = Judgement(0.0, "wrong_answer", "no")
    log.append_verdicts(4, [(r0.key, dense), (r1.key, plain)])
    logged = log.read_verdicts(4)
    assert Judgement.from_json(logged[("p", 0, 0)]) == dense
    assert Judgement.from_json(logged[("p", 0, 0)]).token_rewards == (0.1, 1 / 3)  # exact
    assert "token_rewards" not in logged[("p", 1, 0)]  # records without them are unchanged
    assert Judgement.from_json(logged[("p", 1, 0)]).token_rewards is None


def test_replay_entries_snapshot_their_token_rewards_only_when_present():
    entry = Entry(
        batch=1, prompt_key="k", sample_index=0, version=0, reward=1.0, added_at=1,
        token_rewards=(0.5, 0.25),
    )  # fmt: skip
    data = json.loads(json.dumps(entry.to_json()))
    assert Entry.from_json(data) == entry
    plain = dataclasses.replace(entry, token_rewards=None)
    assert "token_rewards" not in plain.to_json() and Entry.from_json(plain.to_json()) == plain


def test_assembled_token_rewards_sit_where_the_behaviour_logprobs_do():
    policy = StalenessPolicy(reload_every=1, max_staleness=0)
    a, b, c = rollout("p", 0, [5, 6, 7]), rollout("p", 1, [8, 9], 5), rollout("q", 0, [4])
    groups = [group((a, 1.0, (0.1, 0.2, 0.3)), (b, 0.0, None)), group((c, 0.5))]
    batch = assemble_batch(0, groups, policy=policy, max_seq_len=32).batch
    dense = batch.token_rewards
    assert dense.dtype == np.float32 and dense.shape == batch.behaviour_logprobs.shape
    np.testing.assert_array_equal(dense[0, 2:5], np.float32([0.1, 0.2, 0.3]))  # P − 1 + j
    np.testing.assert_array_equal(dense[0] != 0, batch.response_mask[0])
    assert not dense[1:].any()  # rows without token rewards hold zeros
    # A batch without any sends none: it is the batch it always was.
    plain = assemble_batch(0, [group((a, 1.0), (b, 0.0, None))], policy=policy, max_seq_len=32)
    assert plain.batch.token_rewards is None
    with pytest.raises(ControllerError, match="2 token rewards for 3 response tokens"):
        assemble_batch(0, [group((a, 1.0, (0.1, 0.2)))], policy=policy, max_seq_len=32)


def test_a_reward_functions_token_rewards_reach_the_assembled_batch(module_file, tmp_path):
    """A real worker pool runs the function; the scorer sends the rollout's tokens and keeps
    the token rewards in its judgement, which the rollout log keeps for a resume."""
    spec = f"{module_file}:dense"
    pool = pool_for(VerifierConfig(num_workers=1), reward_functions=[spec])
    try:
        verifier = LocalVerifier(VerifierConfig(num_workers=1), pool)
        scorer = Scorer(
            verifier,
            CharTokenizer(),
            (2,),
            retries=0,
            backoff_s=0,
            max_unjudged_fraction=0,
            counters={},
        )
        items = [
            (Record(spec), rollout("p", 0, [50, 51, 2])),
            (Record(spec), rollout("p", 1, [52, 2], prompt_len=4)),
            (Record(spec, verifier="none"), rollout("q", 0, [53])),
        ]
        sent = scorer.request(*items[0])
        assert sent.response_tokens == (50, 51, 2) and sent.response == "23"
        judgements = scorer.judge(items, what="batch 0")
    finally:
        pool.close()
    assert [j.token_rewards for j in judgements] == [(0.5, 0.51, 0.02), (0.52, 0.02), None]
    log = RolloutLog(str(tmp_path))
    log.append_verdicts(0, [(r.key, j) for (_, r), j in zip(items, judgements, strict=True)])
    logged = log.read_verdicts(0)
    resumed = [Judgement.from_json(logged[("p", i, 0)]) for i in (0, 1)]
    groups = [
        group(*[(r, j.reward, j.token_rewards) for (_, r), j in zip(items, resumed, strict=False)])
    ]
    policy = StalenessPolicy(reload_every=1, max_staleness=0)
    batch = assemble_batch(0, groups, policy=policy, max_seq_len=32).batch
    np.testing.assert_array_equal(batch.token_rewards[0, 2:5], np.float32([0.5, 0.51, 0.02]))
    np.testing.assert_array_equal(batch.token_rewards[1, 3:5], np.float32([0.52, 0.02]))
    assert batch.token_rewards[:, :2].sum() == 0 and batch.token_rewards[:, 5:].sum() == 0
