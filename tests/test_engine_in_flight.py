"""Mixed-version rollouts: responses generated over several calls (continuations and the
per-call token budget), parked KV pages under inference.in_flight_update "keep", and what a
load of a newer version does to the requests in flight in each mode."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from model_helpers import model_params
from test_engine import GREEDY, INFERENCE, LLAMA, init_params, make_engine, request
from test_inference_worker import OVERRIDES, TINY, FreezableEngine

from rlax_tpu.api.inference import (
    Partial,
    Rollout,
    request_from_proto,
    request_to_proto,
    rollout_from_proto,
    rollout_to_proto,
)
from rlax_tpu.config import load_config
from rlax_tpu.inference.engine import Engine, GenerationRequest
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.models import Transformer

# INFERENCE has one decode size (4 rows), so a decode row is bitwise the same in every call
# on every host: what "keep" promises rests on it. Prompts here reach 30 tokens, so a
# continuation's prompt + partial (up to 43 tokens) needs the continuation bucket (64).
KEEP = dataclasses.replace(INFERENCE, in_flight_update="keep")
RESUME = dataclasses.replace(INFERENCE, in_flight_update="resume")
LENGTHS = [5, 30, 9, 17, 2, 26]
K = 5  # tokens of the first call


def continuation(rollout: Rollout, *, max_tokens: int = 0, sampling=None) -> GenerationRequest:
    """The request that continues `rollout` (same prompt and sample, a new request id);
    `sampling` must be the first call's for the response to be drawn as in one call."""
    n = len(rollout.tokens)
    return GenerationRequest(
        f"{rollout.request_id}+{n}",
        rollout.prompt_id,
        rollout.sample_index,
        rollout.prompt_tokens,
        sampling,
        partial=Partial.of(rollout),
        max_tokens=max_tokens,
    )


def budgeted(requests: list[GenerationRequest], max_tokens: int) -> list[GenerationRequest]:
    return [dataclasses.replace(r, max_tokens=max_tokens) for r in requests]


def response(rollout: Rollout) -> tuple:
    """A rollout without its request id: what two ways of generating it must agree on."""
    return dataclasses.replace(rollout, request_id="")


def run_in_two_calls(engine: Engine, requests: list[GenerationRequest]) -> list[Rollout]:
    paused = engine.run(budgeted(requests, K))
    assert {r.finish_reason for r in paused} == {"paused"}
    assert all(len(r.tokens) == K for r in paused)
    return engine.run(
        [continuation(r, sampling=q.sampling) for r, q in zip(paused, requests, strict=True)]
    )


def teacher_forced_logprobs(params: dict, rollout: Rollout) -> np.ndarray:
    """log_softmax of the model's logits (no cache) before each response token:
    float32[len(tokens), vocab]."""
    model = Transformer(LLAMA, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    seq = np.asarray([rollout.prompt_tokens + rollout.tokens], np.int32)
    logits = model.forward_train(seq, seq, return_logits=True).logits[0]
    start = len(rollout.prompt_tokens) - 1
    return np.asarray(jax.nn.log_softmax(logits[start : start + len(rollout.tokens)], axis=-1))


# -- continuations under one version ----------------------------------------------------------
def test_keep_continues_on_parked_pages_bitwise_as_one_call():
    # Sampled (top-k and top-p); the paused sequences' pages (24) all stay parked in the
    # pool's size (27 pages).
    requests = [request(i, n) for i, n in enumerate(LENGTHS[:5])]
    one_call = make_engine(inference=KEEP).run(requests)
    engine = make_engine(inference=KEEP)
    two_calls = run_in_two_calls(engine, requests)
    assert [response(r) for r in two_calls] == [response(r) for r in one_call]
    assert all(r.token_versions is None for r in two_calls)  # one version throughout
    stats = engine.stats()
    assert (stats["kv_reused"], stats["kv_rebuilt"], stats["continuations"]) == (5, 0, 5)
    assert stats["parked"] == stats["parked_bytes"] == stats["parked_evictions"] == 0
    assert stats["free_pages"] == stats["total_pages"]
    assert "prefill:4x64" not in stats["compiled"]  # 30 + 5 tokens, never prefilled


def test_resume_prefills_prompt_and_partial_to_the_one_call_greedy_tokens():
    # Greedy on weights whose choices win by clear margins (test_engine): the fresh prefill
    # of prompt + partial rounds differently from the decode steps it replaces (log-probs
    # agree to ~1e-6, not bitwise), which can flip only a near-tie.
    params = init_params(LLAMA, seed=4)
    requests = [request(i, n, GREEDY) for i, n in enumerate(LENGTHS)]
    one_call = make_engine(inference=RESUME, params=params).run(requests)
    engine = make_engine(inference=RESUME, params=params)
    two_calls = run_in_two_calls(engine, requests)
    for a, b in zip(one_call, two_calls, strict=True):
        assert (b.tokens, b.finish_reason, b.version) == (a.tokens, a.finish_reason, 0)
        assert b.logprobs[:K] == a.logprobs[:K]  # the partial's, as given
        np.testing.assert_allclose(b.logprobs[K:], a.logprobs[K:], atol=1e-4)
    stats = engine.stats()
    assert "prefill:4x64" in stats["compiled"]  # 30 + 5 tokens: the continuation bucket
    assert stats["kv_rebuilt"] == stats["kv_reused"] == 0  # "resume" never parks


def test_a_new_version_between_calls_samples_the_rest_with_its_weights():
    params = {0: init_params(LLAMA, seed=4), 1: init_params(LLAMA, seed=7)}
    engine = make_engine(inference=RESUME, params=params[0])
    requests = [request(i, n, GREEDY) for i, n in enumerate([7, 30])]
    paused = engine.run(budgeted(requests, K))
    assert engine.load(1, params[1]) == []  # nothing in flight
    for r in engine.run([continuation(r, sampling=GREEDY) for r in paused]):
        n = len(r.tokens)
        assert (r.finish_reason, r.version) == ("length", 0)
        assert r.token_versions == (0,) * K + (1,) * (n - K)
        # The new tokens are version 1's: its greedy choices and log-probs, teacher-forced.
        logprobs = teacher_forced_logprobs(params[1], r)[K:]
        want = logprobs[np.arange(n - K), r.tokens[K:]]
        np.testing.assert_allclose(r.logprobs[K:], want, atol=1e-4)
        assert np.all(want >= logprobs.max(axis=-1) - 1e-4)  # greedy under version 1


# -- the per-call token budget ----------------------------------------------------------------
def test_a_call_pauses_at_its_budget_and_a_response_that_ends_first_ends_as_usual():
    engine = make_engine()  # "off": continuations and budgets work in every mode
    target = request(0, 10)
    whole = engine.run([target])[0]
    before = engine.stats()["tokens_generated"]
    paused = engine.run([dataclasses.replace(target, max_tokens=5)])[0]
    assert (paused.finish_reason, len(paused.tokens)) == ("paused", 5)
    assert engine.stats()["tokens_generated"] == before + 5  # nothing sampled past it
    again = engine.run([continuation(paused, max_tokens=5)])[0]
    assert (again.finish_reason, len(again.tokens)) == ("paused", 10)
    last = engine.run([continuation(again, max_tokens=5)])[0]
    assert (last.finish_reason, len(last.tokens)) == ("length", 12)  # max_new_tokens
    assert last.tokens == whole.tokens and last.token_versions is None
    # A stop token at response index 6: the second call of 5 ends there, "stop".
    stop_at = dataclasses.replace(engine.defaults, stop_token_ids=(whole.tokens[6],))
    first = whole.tokens.index(whole.tokens[6])
    stopped = engine.run([dataclasses.replace(target, sampling=stop_at, max_tokens=5)])[0]
    if first >= 5:  # the stop token's first occurrence is past the first call
        assert stopped.finish_reason == "paused"
        stopped = engine.run([continuation(stopped, max_tokens=5, sampling=stop_at)])[0]
    assert (stopped.finish_reason, stopped.tokens) == ("stop", whole.tokens[: first + 1])


def test_a_continuation_that_cannot_run_fails_alone():
    engine = make_engine(inference=KEEP)
    paused = engine.run([dataclasses.replace(request(0, 30), max_tokens=4)])[0]
    partial = Partial.of(paused)
    bad = [
        GenerationRequest("lengths", "p0", 0, paused.prompt_tokens, None,
                          dataclasses.replace(partial, logprobs=partial.logprobs[:3])),
        GenerationRequest("full", "p0", 0, paused.prompt_tokens, None,
                          Partial(0, (1,) * 12, (0.0,) * 12)),
        GenerationRequest("budget", "p0", 0, paused.prompt_tokens, None, partial, max_tokens=-1),
    ]  # fmt: skip
    got = engine.run([*bad, continuation(paused)])
    assert [r.finish_reason for r in got] == ["error", "error", "error", "length"]
    assert "4 tokens, 3 log-probs, 4 token versions" in got[0].error
    assert "nothing to generate" in got[1].error and "max_tokens" in got[2].error
    assert got[3].tokens[:4] == paused.tokens


# -- parked pages ---------------------------------------------------------------------------
def test_a_continuation_without_its_parked_pages_replays_them_as_the_one_call_rollout():
    target = request(0, 9)
    (whole,) = make_engine(inference=KEEP).run([target])
    paused = make_engine(inference=KEEP).run([dataclasses.replace(target, max_tokens=4)])
    elsewhere = make_engine(inference=KEEP)  # another worker, or this one restarted
    (rollout,) = elsewhere.run([continuation(paused[0])])
    assert response(rollout) == dataclasses.replace(response(whole), sample_index=0)
    stats = elsewhere.stats()
    assert (stats["kv_replayed"], stats["kv_reused"], stats["kv_rebuilt"]) == (1, 0, 0)
    assert stats["replay_mismatches"] == 0 and stats["replay_decode_calls"] >= 3


def test_lost_parked_pages_are_replayed_under_their_versions_bitwise_as_if_kept():
    # Three versions, a newer one between calls of K tokens: the pages of the second call's
    # continuations hold the prompt and tokens 0..K-2 from version 0, K-1..2K-2 from 1.
    params = {v: init_params(LLAMA, seed=seed) for v, seed in [(0, 0), (1, 5), (2, 7)]}
    requests = [request(i, n) for i, n in enumerate(LENGTHS[:4])]  # sampled: top-k, top-p
    keeper = make_engine(inference=KEEP, params=params[0])
    first = keeper.run(budgeted(requests, K))
    keeper.load(1, params[1])
    second = keeper.run([continuation(r, max_tokens=K) for r in first])
    keeper.load(2, params[2])
    kept = keeper.run([continuation(r) for r in second])
    assert keeper.stats()["kv_reused"] == 8
    assert all(set(r.token_versions) == {0, 1, 2} for r in kept)

    def restarted(weights_of) -> Engine:  # a worker that never saw the first two calls
        engine = Engine(LLAMA, KEEP, seed=0, weights_of=weights_of)
        engine.load(2, params[2])
        return engine

    fetched = []
    engine = restarted(lambda v: fetched.append(v) or params[v])
    replayed = engine.run([continuation(r) for r in second])
    assert [response(r) for r in replayed] == [response(r) for r in kept]
    stats = engine.stats()
    assert (stats["kv_replayed"], stats["replay_mismatches"], stats["kv_rebuilt"]) == (4, 0, 0)
    assert sorted(set(fetched)) == [0, 1]  # the served version's own weights need no fetch
    assert stats["free_pages"] == stats["total_pages"]
    # Without the old versions' weights the pages are prefilled under version 2: the
    # continuations are sampled from other numbers, and say so.
    engine = restarted(None)
    prefilled = engine.run([continuation(r) for r in second])
    assert engine.stats()["kv_rebuilt"] == 4
    assert [r.logprobs for r in prefilled] != [r.logprobs for r in kept]
    # A partial made elsewhere (here: log-probs not this machine's) is replayed, and the
    # mismatch counted.
    engine = restarted(params.__getitem__)
    other = dataclasses.replace(second[0], logprobs=tuple(x + 1.0 for x in second[0].logprobs))
    (rollout,) = engine.run([continuation(other)])
    assert rollout.finish_reason == "length"
    assert engine.stats()["replay_mismatches"] == 1


def test_parked_pages_stay_within_the_pools_bytes_evicting_the_oldest():
    # Six 30-token prompts paused at 5 tokens park 9 pages each: 54 pages, the pool is 27.
    engine = make_engine(inference=KEEP)
    requests = [request(i, 30) for i in range(6)]
    paused = engine.run(budgeted(requests, K))
    stats, state = engine.stats(), engine.paging_state()
    pool_bytes = 27 * 2 * LLAMA.num_layers * LLAMA.num_kv_heads * 4 * LLAMA.head_dim * 4
    assert 0 < stats["parked_bytes"] <= pool_bytes and stats["parked_evictions"] >= 3
    assert stats["parked"] + stats["parked_evictions"] == 6
    kept = {key.prompt_id for key in state.parked}
    assert "p5" in kept and "p0" not in kept  # the oldest went first
    assert stats["free_pages"] == stats["total_pages"]  # parked sequences hold no page
    finished = engine.run([continuation(r) for r in paused])
    # The evicted sequences' pages are replayed: every response is the one-call one.
    one_call = make_engine(inference=KEEP).run(requests)
    assert [response(r) for r in finished] == [response(r) for r in one_call]
    stats = engine.stats()
    assert stats["kv_reused"] == 6 - stats["parked_evictions"]
    assert stats["kv_replayed"] == stats["parked_evictions"] and stats["kv_rebuilt"] == 0


# -- Engine.load of a newer version with requests in flight -----------------------------------
@pytest.mark.parametrize("inference", [KEEP, RESUME], ids=["keep", "resume"])
def test_a_newer_version_takes_over_requests_in_flight_without_aborting(inference):
    requests = [request(i, n) for i, n in enumerate(LENGTHS)]  # 6 requests for 4 slots
    old_only = make_engine(inference=inference).run(requests)
    engine = make_engine(inference=inference)
    for r in requests:
        engine.submit(r)
    done = engine.step() + engine.step() + engine.step()
    sampled_before = engine.stats()["tokens_generated"]
    assert engine.load(1, init_params(LLAMA, seed=5)) == []
    while engine.has_work():
        done += engine.step()
    assert sorted(r.request_id for r in done) == [r.request_id for r in requests]
    old_tokens = 0
    for r in done:
        assert r.finish_reason == "length" and r.version == 0
        versions = r.token_versions or (0,) * len(r.tokens)
        k = versions.count(0)
        assert versions == (0,) * k + (1,) * (len(r.tokens) - k)  # switched once, for good
        want = next(o for o in old_only if o.request_id == r.request_id)
        assert r.tokens[:k] == want.tokens[:k] and r.logprobs[:k] == want.logprobs[:k]
        old_tokens += k
    assert old_tokens == sampled_before  # exactly the tokens sampled before the load
    assert 0 < sampled_before < sum(len(r.tokens) for r in done)
    if inference is RESUME:
        assert engine.stats()["requeued"] == 4  # the live ones
    # An older version (an evaluation of an earlier one) still aborts what is in flight.
    for r in requests[:2]:
        engine.submit(dataclasses.replace(r, request_id=r.request_id + "-again"))
    engine.step()
    aborted = engine.load(0, init_params(LLAMA))
    assert [r.finish_reason for r in aborted] == ["aborted", "aborted"]
    assert not engine.has_work()


# -- the wire and the worker ------------------------------------------------------------------
def test_partial_max_tokens_and_paused_round_trip_the_wire():
    partial = Partial(3, (5, 6, 7), (-0.5, -1.25, -2.0), (3, 3, 4))
    request = GenerationRequest("r", "p", 2, (1, 2), GREEDY, partial, max_tokens=9)
    assert request_from_proto(request_to_proto(request), GREEDY) == request
    one_version = dataclasses.replace(request, partial=Partial(3, (5,), (-0.5,)))
    message = request_to_proto(one_version)
    assert not message.partial.token_versions  # all the partial's version: left out
    assert request_from_proto(message, GREEDY) == one_version
    fresh = GenerationRequest("r", "p", 2, (1, 2))
    assert not request_to_proto(fresh).HasField("partial")
    assert request_from_proto(request_to_proto(fresh), GREEDY) == fresh
    rollout = Rollout("r", "p", 2, 3, (1, 2), (5, 6), (-0.5, -1.0), "paused", "", (3, 4))
    assert rollout_from_proto(rollout_to_proto(rollout)) == rollout


def test_the_worker_records_paused_rollouts_and_keeps_requests_over_a_newer_load():
    config = load_config(TINY, [*OVERRIDES, "inference.in_flight_update=keep"])
    params = {v: model_params(config, v) for v in (0, 1)}
    engine = FreezableEngine(Engine(config.model, config.inference, seed=config.seed))
    worker = InferenceWorker(config, param_server=None, consumer_id="w", engine=engine)
    try:
        worker.load(0, params[0])
        fresh = GenerationRequest("a", "pa", 0, (1, 2, 3), max_tokens=3)
        (paused,) = worker.generate([fresh])
        assert (paused.finish_reason, len(paused.tokens)) == ("paused", 3)
        assert list(worker.generate([fresh])) == [paused]  # recorded: a final result
        assert worker.stats()["recorded_hits"] == 1
        with pytest.raises(ValueError, match="max_tokens differ"):
            worker.generate([dataclasses.replace(fresh, max_tokens=4)])
        engine.freeze_after(1)
        stream = worker.generate([continuation(paused)])
        assert engine.frozen.wait(30)
        assert worker.load(1, params[1]).aborted == ()
        engine.unfreeze()
        (rollout,) = stream
        assert rollout.finish_reason == "length" and rollout.version == 0
        assert rollout.token_versions[:3] == (0, 0, 0) and rollout.token_versions[-1] == 1
        stats = worker.stats()
        assert (stats["kv_reused"], stats["kv_rebuilt"], stats["parked"]) == (1, 0, 0)
    finally:
        worker.close()


def test_continuation_buckets_are_compiled_ahead_only_when_responses_continue():
    assert Engine(LLAMA, KEEP, seed=0, allocate=False).continuation_buckets == (64,)
    keep = Engine(LLAMA, KEEP, seed=0, allocate=False).lowerings()
    off = Engine(LLAMA, INFERENCE, seed=0, allocate=False).lowerings()
    assert set(keep) - set(off) == {"prefill@64", "extend@64"}
