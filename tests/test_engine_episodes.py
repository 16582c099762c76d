"""Multi-turn episodes in the engine: a turn that ends at a stop token parks its pages
(`keep_pages`), the next turn is a continuation whose partial ends with the observation's
tokens (given, loss mask 0), and only those (with the turn's last token) are fed, by an
extend call over the parked pages; a restarted engine replays an episode's lost pages."""

import dataclasses

import numpy as np
from test_engine import GREEDY, LLAMA, init_params, make_engine, request
from test_engine_in_flight import KEEP, RESUME, response, teacher_forced_logprobs

from rlax_tpu.api.inference import (
    Partial,
    request_from_proto,
    request_to_proto,
    rollout_from_proto,
    rollout_to_proto,
)
from rlax_tpu.inference.engine import Engine, GenerationRequest

OBSERVATION = (5, 17, 42, 99)  # token ids a tool's result rendered to


def first_turn(engine: Engine, sampling, stop_index: int = 3):
    """Turn 1 of request 0's episode, ending at the stop token its one-call response has at
    `stop_index`: (the turn's rollout, the sampling with that stop token)."""
    target = dataclasses.replace(request(0, 9), sampling=sampling)
    (whole,) = make_engine(inference=engine.config, params=PARAMS[0]).run([target])
    sampling = dataclasses.replace(sampling, stop_token_ids=(whole.tokens[stop_index],))
    turn = dataclasses.replace(target, sampling=sampling, keep_pages=True)
    (rollout,) = engine.run([turn])
    assert rollout.finish_reason == "stop"
    return rollout, sampling


def next_turn(rollout, sampling, version: int, *, max_tokens: int = 0, n: int = 2):
    partial = Partial.of(rollout).extended(OBSERVATION, version)
    return GenerationRequest(
        f"r0/turn{n}", rollout.prompt_id, rollout.sample_index, rollout.prompt_tokens,
        sampling, partial, max_tokens=max_tokens, keep_pages=True,
    )  # fmt: skip


PARAMS = {v: init_params(LLAMA, seed=seed) for v, seed in [(0, 4), (1, 7)]}
LONG = dataclasses.replace(GREEDY, max_new_tokens=24)
SAMPLED = dataclasses.replace(GREEDY, temperature=1.0, top_p=0.9, top_k=20, max_new_tokens=24)


def test_the_next_turn_feeds_only_the_observation_over_the_parked_pages():
    engine = make_engine(params=PARAMS[0])  # "off": episodes park in every mode
    turn1, sampling = first_turn(engine, LONG)
    (turn2,) = engine.run([next_turn(turn1, sampling, 0)])
    n = len(turn1.tokens)
    assert turn2.tokens[: n + len(OBSERVATION)] == turn1.tokens + OBSERVATION
    assert turn2.logprobs[:n] == turn1.logprobs
    assert turn2.logprobs[n : n + len(OBSERVATION)] == (0.0,) * len(OBSERVATION)
    rest = len(turn2.tokens) - n - len(OBSERVATION)
    assert rest > 0 and turn2.loss_mask == (1,) * n + (0,) * len(OBSERVATION) + (1,) * rest
    stats = engine.stats()
    # One prefill (turn 1's prompt); turn 2 swapped its pages in and fed 1 + 4 tokens.
    assert (stats["prefills"], stats["kv_reused"], stats["kv_rebuilt"]) == (1, 1, 0)
    assert (stats["extends"], stats["extend_tokens"]) == (1, 1 + len(OBSERVATION))
    assert stats["parked"] == (turn2.finish_reason == "stop")  # a turn ending at a stop parks
    # The new tokens are the model's greedy choices over the whole context, teacher-forced
    # (the extend attends the parked pages at the right positions).
    logprobs = teacher_forced_logprobs(PARAMS[0], turn2)[n + len(OBSERVATION) :]
    new = np.asarray(turn2.tokens[n + len(OBSERVATION) :])
    want = logprobs[np.arange(rest), new]
    np.testing.assert_allclose(turn2.logprobs[n + len(OBSERVATION) :], want, atol=1e-4)
    assert np.all(want >= logprobs.max(axis=-1) - 1e-4)
    # An engine without the pages (another worker, a restart) replays them as they were
    # made, in any mode: the same turn, bitwise.
    elsewhere = make_engine(params=PARAMS[0])
    (again,) = elsewhere.run([next_turn(turn1, sampling, 0)])
    assert response(again) == response(turn2)
    stats = elsewhere.stats()
    assert (stats["kv_replayed"], stats["replay_mismatches"], stats["kv_rebuilt"]) == (1, 0, 0)


def test_pages_parked_under_another_version_are_not_reused_without_keep():
    engine = make_engine(inference=RESUME, params=PARAMS[0])
    turn1, sampling = first_turn(engine, LONG)
    engine.load(1, PARAMS[1])
    (turn2,) = engine.run([next_turn(turn1, sampling, 1)])
    stats = engine.stats()
    assert (stats["kv_reused"], stats["kv_rebuilt"], stats["parked"]) == (0, 1, 0)
    assert turn2.tokens[: len(turn1.tokens)] == turn1.tokens


def test_a_restarted_engine_replays_an_episodes_pages_bitwise():
    # "keep": turn 1 under version 0, turn 2 under version 1 paused after 3 tokens; its
    # continuation on the parked pages vs on pages replayed by an engine that never saw it:
    # prefill (v0), turn 1's tokens decoded (v0), the extend of stop + observation (v1),
    # turn 2's tokens decoded (v1).
    keeper = make_engine(inference=KEEP, params=PARAMS[0])
    turn1, sampling = first_turn(keeper, SAMPLED, stop_index=2)
    keeper.load(1, PARAMS[1])
    (paused,) = keeper.run([next_turn(turn1, sampling, 1, max_tokens=3)])
    assert paused.finish_reason == "paused"
    on = GenerationRequest(
        "r0/turn2+", "p0", 0, paused.prompt_tokens, sampling, Partial.of(paused), keep_pages=True
    )
    (kept,) = keeper.run([on])
    assert set(kept.token_versions) == {0, 1} and 0 in kept.loss_mask
    restarted = Engine(LLAMA, KEEP, seed=0, weights_of=PARAMS.__getitem__)
    restarted.load(1, PARAMS[1])
    (replayed,) = restarted.run([on])
    assert response(replayed) == response(kept)
    stats = restarted.stats()
    assert (stats["kv_replayed"], stats["replay_mismatches"], stats["kv_rebuilt"]) == (1, 0, 0)
    # The same episode continued after its observation, its pages lost: the replay stops
    # before the observation, which the continuation's own extend feeds.
    restarted = Engine(LLAMA, KEEP, seed=0, weights_of=PARAMS.__getitem__)
    restarted.load(1, PARAMS[1])
    (again,) = restarted.run([next_turn(turn1, sampling, 1, max_tokens=3)])
    assert response(again) == response(paused)
    assert restarted.stats()["extends"] == 1


def test_loss_masks_and_keep_pages_round_trip_the_wire():
    partial = Partial(3, (5, 6, 7), (-0.5, 0.0, -2.0), (3, 3, 4), (1, 0, 1))
    message = GenerationRequest("r", "p", 2, (1, 2), GREEDY, partial, keep_pages=True)
    assert request_from_proto(request_to_proto(message), GREEDY) == message
    assert Partial(3, (5,), (-0.5,), loss_mask=(1,)).loss_mask is None  # all sampled
    engine = make_engine(params=PARAMS[0])
    turn1, sampling = first_turn(engine, LONG)
    (turn2,) = engine.run([next_turn(turn1, sampling, 0)])
    assert rollout_from_proto(rollout_to_proto(turn2)) == turn2
    assert rollout_to_proto(turn1).loss_mask == []  # every token sampled: left out


def test_an_ended_episodes_parked_pages_are_released():
    """The last turn parks its pages too (no one knows it is the last); the controller's
    next Generate call names the ended episode (`ended`) and the engine drops them. Another
    request's pages, and a name with nothing parked, are left alone."""
    engine = make_engine(params=PARAMS[0])
    turn1, sampling = first_turn(engine, LONG)
    other = dataclasses.replace(
        request(1, 9), sampling=dataclasses.replace(sampling), keep_pages=True
    )
    engine.run([other])
    parked = engine.stats()["parked"]
    assert parked >= 1  # turn 1's pages, and request 1's if it ended at the stop token
    engine.release([("p0", 0, 0), ("nobody", 0, 0)])
    stats = engine.stats()
    assert (stats["parked"], stats["parked_released"]) == (parked - 1, 1)
    # The episode's next turn, if it came after all, replays its pages: the same tokens.
    (again,) = engine.run([next_turn(turn1, sampling, 0)])
    (kept,) = make_engine(params=PARAMS[0]).run([next_turn(turn1, sampling, 0)])
    assert response(again) == response(kept) and engine.stats()["kv_replayed"] == 1


def test_ended_episodes_travel_with_the_generate_call():
    from rlax_tpu.rpc.gen.rlax_tpu.v1 import inference_pb2 as pb

    message = pb.GenerateRequest(ended=[pb.EpisodeEnd(prompt_id="p0", sample_index=3, version=2)])
    decoded = pb.GenerateRequest.FromString(message.SerializeToString())
    assert [(e.prompt_id, e.sample_index, e.version) for e in decoded.ended] == [("p0", 3, 2)]


def test_a_resume_load_forgets_what_a_requeued_continuations_pages_held():
    """A turn continued on its parked pages (extend), then requeued by a "resume" load that
    freed them, is prefilled anew when admitted again: not extended after positions its new
    pages never held."""
    engine = make_engine(inference=RESUME, params=PARAMS[0])
    turn1, sampling = first_turn(engine, LONG)
    engine.submit(next_turn(turn1, sampling, 0))
    engine.step()  # admitted on its parked pages: one extend call, then decoding
    before = engine.stats()
    assert (before["extends"], before["kv_reused"], before["prefills"]) == (1, 1, 1)
    assert engine.load(1, PARAMS[1]) == []  # "resume": requeued, its pages freed
    finished = []
    while engine.has_work():
        finished.extend(engine.step())
    (turn2,) = finished
    stats = engine.stats()
    assert (stats["extends"], stats["prefills"]) == (1, 2)  # prefilled anew, no second extend
    n = len(turn1.tokens)
    assert turn2.tokens[: n + len(OBSERVATION)] == turn1.tokens + OBSERVATION


def test_an_ended_episode_named_over_the_service_releases_its_pages():
    """The whole path: a Generate message naming an ended episode (`ended`) reaches the
    worker's engine through the servicer, which drops the episode's parked pages."""
    import time

    from rlax_tpu.config import load_config
    from rlax_tpu.inference.service import InferenceWorkerServicer
    from rlax_tpu.inference.worker import InferenceWorker
    from rlax_tpu.rpc.gen.rlax_tpu.v1 import inference_pb2 as pb

    engine = make_engine(params=PARAMS[0])
    config = dataclasses.replace(
        load_config("configs/tiny_cpu.py"), model=LLAMA, inference=engine.config
    )
    worker = InferenceWorker(config, param_server=None, consumer_id="w", engine=engine)
    try:
        _, sampling = first_turn(make_engine(params=PARAMS[0]), LONG)
        turn = dataclasses.replace(request(0, 9), sampling=sampling, keep_pages=True)
        (rollout,) = list(worker.generate([turn]))
        assert rollout.finish_reason == "stop" and engine.stats()["parked"] == 1

        class Context:
            def add_callback(self, callback):
                pass

        ended = [pb.EpisodeEnd(prompt_id="p0", sample_index=0, version=0)]
        servicer = InferenceWorkerServicer(worker)
        assert list(servicer.Generate(pb.GenerateRequest(ended=ended), Context())) == []
        deadline = time.monotonic() + 30
        while engine.stats()["parked_released"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (engine.stats()["parked"], engine.stats()["parked_released"]) == (0, 1)
    finally:
        worker.close()
