"""The inference worker in-process: loading versions (idempotent, η, pulls and confirmations),
generation idempotent by request id, and in-flight requests aborted by a reload."""

import threading
import time
from pathlib import Path

import grpc
import pytest
from model_helpers import model_params
from processes import ProcessGroup

from rlax_tpu.api.inference import (
    InvalidRequestError,
    NoParamServerError,
    NotLoadableError,
    NotLoadedError,
    UnknownVersionError,
    VersionMismatchError,
    WorkerClosedError,
)
from rlax_tpu.api.param_server import ParamServerCallError
from rlax_tpu.config import load_config
from rlax_tpu.inference.engine import Engine, GenerationRequest
from rlax_tpu.inference.worker import InferenceWorker
from rlax_tpu.param_server.trees import TreeClient

TINY = str(Path(__file__).resolve().parent / "tiny_components_config.py")
# A tiny engine: 4 slots, one prefill bucket, 8 greedy tokens; compiles in about 2 s.
OVERRIDES = [
    "cpu_devices=0",
    "inference.max_decode_slots=4",
    "inference.max_prompt_len=16",
    "inference.prefill_buckets=(16,)",
    "inference.max_new_tokens=8",
    "inference.temperature=0.0",
    "inference.kv_cache_bytes=1048576",
]


def requests(tag: str, n: int = 3) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"{tag}-{i}", f"{tag}-prompt-{i}", 0, tuple(range(1, 4 + 2 * i)))
        for i in range(n)
    ]


def by_id(rollouts) -> dict:
    return {r.request_id: r for r in rollouts}


class FreezableEngine:
    """A real Engine whose step() can stop advancing after a given number of steps (it then
    returns nothing), so a test holds requests in flight while the worker keeps serving
    loads and new calls."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.frozen = threading.Event()
        self._steps_left: int | None = None

    def freeze_after(self, steps: int) -> None:
        self.frozen.clear()
        self._steps_left = steps

    def unfreeze(self) -> None:
        self._steps_left = None
        self.frozen.clear()

    def step(self):
        if self._steps_left == 0:
            self.frozen.set()
            time.sleep(0.001)  # the worker loops while work is pending: do not spin hot
            return []
        if self._steps_left is not None:
            self._steps_left -= 1
        return self.engine.step()

    def __getattr__(self, name):
        return getattr(self.engine, name)


class FakeParamServer:
    """Stands in for ParamServerClient: serves `versions` and records confirmations."""

    def __init__(self, versions: dict) -> None:
        self.versions_held, self.confirmed = versions, []

    def pull(self, version, like):
        if version not in self.versions_held:
            raise ParamServerCallError("no such version", grpc.StatusCode.NOT_FOUND)
        assert set(like) == set(self.versions_held[version])  # the model's param tree
        return self.versions_held[version]

    def fetch(self, version, like, wait_s=0.0):  # the worker's prefetch: `place` finishes it
        return self.pull(version, like)

    def place(self, fetched, like):
        return fetched

    def versions(self):
        return sorted(self.versions_held)

    def confirm(self, consumer, oldest_needed):
        self.confirmed.append((consumer, oldest_needed))


@pytest.fixture(scope="module")
def config():
    return load_config(TINY, OVERRIDES)


@pytest.fixture(scope="module")
def params(config):
    return {0: model_params(config, 0), 1: model_params(config, 1)}


@pytest.fixture(scope="module")
def engine(config):
    return FreezableEngine(Engine(config.model, config.inference, seed=config.seed))


@pytest.fixture(scope="module")
def worker(config, engine, params):
    """One worker (one compile) for the module; tests leave it holding version 0, unfrozen."""
    worker = InferenceWorker(config, param_server=None, consumer_id="worker-test", engine=engine)
    worker.load(0, params[0])
    yield worker
    worker.close()


@pytest.fixture
def restore(worker, engine, params):
    yield
    engine.unfreeze()
    worker.load(0, params[0])


def test_generate_before_any_load_says_to_load_first(config):
    worker = InferenceWorker(config, param_server=None, consumer_id="w")
    try:
        with pytest.raises(NotLoadedError, match="Load a version"):
            worker.generate(requests("early"))
    finally:
        worker.close()


def test_only_multiples_of_eta_are_loadable_but_for_an_evaluation(config, params):
    eta2 = config.apply_overrides(["staleness.max_staleness=1", "staleness.reload_every=2"])
    worker = InferenceWorker(eta2, param_server=None, consumer_id="w")
    try:
        with pytest.raises(NotLoadableError, match="η = staleness.reload_every = 2"):
            worker.load(1, params[0])
        with pytest.raises(NoParamServerError, match="--param-server"):
            worker.load(2)  # loadable, but there is nowhere to pull it from
        # The run's final version, evaluated whatever η is: loaded for that alone.
        assert worker.load(1, params[0], evaluation=True).version == 1
    finally:
        worker.close()


def test_generate_yields_every_rollout_with_the_version_held(worker):
    batch = requests("gen")
    got = by_id(worker.generate(batch))
    assert sorted(got) == sorted(r.request_id for r in batch)
    assert all(got[r.request_id].prompt_tokens == r.prompt_tokens for r in batch)
    assert {r.version for r in got.values()} == {0}
    assert {r.finish_reason for r in got.values()} == {"length"}
    assert all(len(r.tokens) == len(r.logprobs) == 8 for r in got.values())


def test_repeated_request_ids_return_recorded_rollouts_without_new_work(worker):
    first = by_id(worker.generate(requests("repeat")))
    before = worker.stats()
    again = by_id(worker.generate(requests("repeat")))
    after = worker.stats()
    assert again == first
    assert after["started"] == before["started"]
    assert after["tokens_generated"] == before["tokens_generated"]
    assert after["recorded_hits"] == before["recorded_hits"] + 3


def test_a_request_in_flight_is_joined_not_started_twice(worker, engine, restore):
    before = worker.stats()
    engine.freeze_after(1)
    first = worker.generate(requests("join"))
    assert engine.frozen.wait(30)
    second = worker.generate(requests("join"))
    engine.unfreeze()
    assert by_id(first) == by_id(second)
    stats = worker.stats()
    assert stats["started"] == before["started"] + 3
    assert stats["joined_in_flight"] == before["joined_in_flight"] + 3


def test_load_during_generation_returns_in_flight_requests_as_aborted(
    worker, engine, params, restore
):
    engine.freeze_after(1)  # prefilled and one decode step done, then held in flight
    stream = worker.generate(requests("abort"))
    assert engine.frozen.wait(30)
    result = worker.load(1, params[1])
    assert not result.already_loaded and result.version == worker.version == 1
    assert sorted(r.request_id for r in result.aborted) == ["abort-0", "abort-1", "abort-2"]
    got = by_id(stream)  # the callers hear of it too: nothing is lost
    assert got == by_id(result.aborted)
    assert {(r.finish_reason, r.version) for r in got.values()} == {("aborted", 0)}


def test_a_reload_forgets_rollouts_of_the_old_version(worker, params, restore):
    old = by_id(worker.generate(requests("reload")))
    worker.load(1, params[1])
    new = by_id(worker.generate(requests("reload")))
    assert {r.version for r in old.values()} == {0}
    assert {r.version for r in new.values()} == {1}
    assert new != old


def test_loading_the_version_held_is_a_no_op(worker, params):
    loads = worker.stats()["loads"]
    result = worker.load(0, params[1])  # even other weights: the version is what counts
    assert result.already_loaded and result.aborted == () and result.version == 0
    assert worker.stats()["loads"] == loads


def test_reusing_a_request_id_for_another_request_is_rejected(worker):
    list(worker.generate(requests("reuse", 1)))
    other = GenerationRequest("reuse-0", "another-prompt", 0, (5, 6, 7))
    with pytest.raises(InvalidRequestError, match="already used for a different request"):
        worker.generate([other])
    with pytest.raises(InvalidRequestError, match="twice in one batch"):
        worker.generate(requests("dup", 1) * 2)


def test_a_batch_for_another_version_is_refused(worker):
    with pytest.raises(VersionMismatchError, match="holds version 0"):
        worker.generate(requests("mismatch"), version=1)


def test_a_request_that_cannot_run_fails_alone(worker):
    too_long = GenerationRequest("long-0", "long", 0, tuple(range(1, 30)))
    got = by_id(worker.generate([too_long, *requests("fine", 1)]))
    assert got["long-0"].finish_reason == "error" and "max_prompt_len" in got["long-0"].error
    assert got["fine-0"].finish_reason == "length"


def test_load_pulls_from_the_param_server_and_confirms_the_version(config, params):
    server = FakeParamServer({0: params[0], 1: params[1]})
    worker = InferenceWorker(config, param_server=server, consumer_id="w-7")
    try:
        assert worker.load(1).version == 1
        worker.wait_confirmed()  # confirmations run off the load's path
        assert server.confirmed == [("w-7", 1)]
        assert worker.load(1).already_loaded
        worker.wait_confirmed()
        assert server.confirmed == [("w-7", 1)]
        with pytest.raises(UnknownVersionError, match="version 5 is not on the parameter server"):
            worker.load(5)
        assert worker.version == 1
    finally:
        worker.close()


def test_the_next_version_is_fetched_while_generating_and_loads_from_it(config, params):
    """A real parameter server: after loading 0 the worker waits for version 1 in the
    background; once 1 is published its bytes arrive without any load asking, and the load
    of 1 only places them (counted as a prefetched load). Without prefetch_weights it pulls."""
    group = ProcessGroup()
    token = "prefetch-test-token"
    try:
        address = group.start_param_server(None, token=token).address
        with TreeClient([address], auth_token=token) as client:
            client.publish(0, params[0])
            for prefetch in (True, False):
                run = config.apply_overrides([f"inference.prefetch_weights={prefetch}"])
                worker = InferenceWorker(run, param_server=client, consumer_id=f"w-{prefetch}")
                try:
                    worker.load(0)
                    if prefetch:
                        client.publish(1, params[1])
                        version, pending = worker.weights.pending
                        assert version == 1
                        pending.result(timeout=60)  # arrived before the load asks for it
                    worker.load(1)
                    assert worker.stats()["prefetched_loads"] == (1 if prefetch else 0)
                    rollouts = list(worker.generate(requests(f"p{prefetch}", 1), version=1))
                    assert [r.version for r in rollouts] == [1]
                finally:
                    worker.close()
    finally:
        group.stop_all()


class BrokenEngine(FreezableEngine):
    def step(self):
        raise RuntimeError("device lost")


def test_an_engine_failure_ends_every_caller_and_closes_the_worker(config, params):
    engine = BrokenEngine(Engine(config.model, config.inference, seed=config.seed))
    worker = InferenceWorker(config, param_server=None, consumer_id="w", engine=engine)
    try:
        worker.load(0, params[0])
        got = list(worker.generate(requests("broken")))
        assert {r.finish_reason for r in got} == {"error"} and len(got) == 3
        assert "device lost" in got[0].error
        with pytest.raises(WorkerClosedError, match="device lost"):
            worker.generate(requests("after"))
    finally:
        worker.close()
