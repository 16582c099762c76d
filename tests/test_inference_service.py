"""The inference worker as a real process on loopback, next to a real parameter server:
Load pulls a published version, Generate streams rollouts equal to an in-process engine's,
idempotency by request id over gRPC, status codes, Health, auth and SIGTERM."""

import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from model_helpers import model_params
from processes import ProcessGroup

from rlax_tpu.api.inference import InferenceCallError, InferenceWorkerClient
from rlax_tpu.config import load_config
from rlax_tpu.inference.engine import Engine, GenerationRequest
from rlax_tpu.inference.sampling import SamplingParams
from rlax_tpu.param_server.trees import TreeClient

TOKEN = "inference-test-token"
TINY = str(Path(__file__).resolve().parent / "tiny_components_config.py")
OVERRIDES = [
    "cpu_devices=0",
    "inference.max_decode_slots=4",
    "inference.max_prompt_len=16",
    "inference.prefill_buckets=(16,)",
    "inference.max_new_tokens=8",
    "inference.temperature=0.0",
    "inference.kv_cache_bytes=1048576",
]
ETA_2 = ["staleness.max_staleness=1", "staleness.reload_every=2"]
# One device per worker process: the same XLA programs as the in-process reference engine,
# so greedy tokens match exactly.
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}


def requests(tag: str, n: int = 5) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"{tag}-{i}", f"{tag}-prompt-{i}", i % 2, tuple(range(3, 6 + 2 * i)))
        for i in range(n)
    ]


def by_id(rollouts) -> dict:
    return {r.request_id: r for r in rollouts}


def details(client) -> dict:
    return dict(client.status().details)


@pytest.fixture(scope="module")
def config():
    return load_config(TINY, OVERRIDES)


@pytest.fixture(scope="module")
def params(config):
    return model_params(config, seed=0)


@pytest.fixture(scope="module")
def group():
    group = ProcessGroup()
    yield group
    group.stop_all()


@pytest.fixture(scope="module")
def param_server(group, params):
    """A memory-only parameter server holding version 0."""
    server = group.start_param_server(None, token=TOKEN)
    with TreeClient([server.address], auth_token=TOKEN) as client:
        client.publish(0, params)
    return server


@pytest.fixture(scope="module")
def worker(group, param_server):
    return group.start_inference_worker(
        TINY,
        token=TOKEN,
        param_servers=[param_server.address],
        overrides=OVERRIDES,
        args=["--worker-id", "inference_worker-test"],
        env=ONE_DEVICE,
    )


@pytest.fixture(scope="module")
def client(worker):
    with InferenceWorkerClient(worker.address, auth_token=TOKEN, timeout_s=120) as client:
        yield client


@pytest.fixture(scope="module")
def first_load(client):
    return client.load(0)


@pytest.fixture(scope="module")
def unloaded(group):
    """A worker with η = 2 and no parameter server: it never holds weights."""
    process = group.start_inference_worker(
        TINY, token=TOKEN, overrides=[*OVERRIDES, *ETA_2], env=ONE_DEVICE
    )
    with InferenceWorkerClient(process.address, auth_token=TOKEN, timeout_s=60) as client:
        yield process, client


def test_load_pulls_the_version_and_confirms_it_to_the_param_server(
    first_load, client, param_server
):
    assert (first_load.version, first_load.already_loaded, first_load.aborted) == (0, False, ())
    assert client.status().version == 0
    with TreeClient([param_server.address], auth_token=TOKEN) as ps:
        assert ps.list_versions().consumers["inference_worker-test"] == 0


def test_generate_streams_greedy_rollouts_equal_to_an_in_process_engine(
    first_load, client, config, params
):
    batch = requests("greedy")
    got = list(client.generate(batch))
    reference = Engine(config.model, config.inference, seed=config.seed)
    reference.load(0, params)
    expected = by_id(reference.run(batch))
    assert sorted(r.request_id for r in got) == sorted(expected)
    for rollout in got:
        want = expected[rollout.request_id]
        assert (rollout.version, rollout.finish_reason) == (0, "length")
        assert rollout.prompt_tokens == want.prompt_tokens
        assert rollout.tokens == want.tokens
        np.testing.assert_allclose(rollout.logprobs, want.logprobs, rtol=1e-5, atol=1e-6)


def test_repeated_generate_returns_recorded_rollouts_without_decoding_again(first_load, client):
    first = by_id(client.generate(requests("repeat")))
    before = details(client)
    again = by_id(client.generate(requests("repeat")))
    after = details(client)
    assert again == first and len(again) == 5
    for counter in ("started", "tokens_generated", "prefills", "decode_steps"):
        assert after[counter] == before[counter], counter
    assert int(after["recorded_hits"]) == int(before["recorded_hits"]) + 5


def test_a_cancelled_generate_leaves_its_requests_to_finish_for_a_retry(first_load, client):
    started = int(details(client)["started"])
    stream = client.generate(requests("cancel"))
    next(stream)
    stream.close()  # cancels the call after the first rollout
    retry = list(client.generate(requests("cancel")))
    assert len(retry) == 5 and all(r.finish_reason == "length" for r in retry)
    assert int(details(client)["started"]) == started + 5


def test_concurrent_generate_calls_share_the_engine(first_load, client):
    results = {}

    def call(tag):
        results[tag] = list(client.generate(requests(tag, 3)))

    threads = [threading.Thread(target=call, args=(tag,)) for tag in ("left", "right")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {tag: len(rollouts) for tag, rollouts in results.items()} == {"left": 3, "right": 3}
    assert all(r.finish_reason == "length" for rollouts in results.values() for r in rollouts)


def test_per_request_sampling_overrides_reach_the_engine(first_load, client):
    short = SamplingParams(temperature=0.0, max_new_tokens=3)
    request = GenerationRequest("short-0", "short", 0, (1, 2, 3), sampling=short)
    (rollout,) = client.generate([request])
    assert len(rollout.tokens) == 3 and rollout.finish_reason == "length"


def test_loading_the_version_held_again_is_a_no_op(first_load, client):
    loads = details(client)["loads"]
    result = client.load(0)
    assert (result.version, result.already_loaded, result.aborted) == (0, True, ())
    assert details(client)["loads"] == loads


def test_load_of_an_unpublished_version_is_not_found(first_load, client):
    with pytest.raises(InferenceCallError, match="version 7 is not on the parameter server") as e:
        client.load(7)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert client.status().version == 0


def test_a_batch_for_another_version_is_failed_precondition(first_load, client):
    with pytest.raises(InferenceCallError, match="holds version 0") as e:
        list(client.generate(requests("other"), version=4))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_health_reports_version_pages_and_queue_depth(first_load, client, config):
    status = client.status()
    assert (status.component, status.instance_id) == ("inference_worker", "inference_worker-test")
    assert status.config_digest == config.digest()
    for key in ("free_pages", "total_pages", "queue_depth", "in_flight", "compiled_shapes"):
        assert key in status.details, key


def test_generate_before_any_load_is_failed_precondition(unloaded):
    _, client = unloaded
    with pytest.raises(InferenceCallError, match="Load a version before Generate") as e:
        list(client.generate(requests("early")))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_load_of_a_version_that_is_not_a_multiple_of_eta_is_invalid_argument(unloaded):
    _, client = unloaded
    with pytest.raises(InferenceCallError, match="η = staleness.reload_every = 2") as e:
        client.load(3)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_load_without_a_param_server_is_failed_precondition(unloaded):
    _, client = unloaded
    with pytest.raises(InferenceCallError, match="--param-server") as e:
        client.load(2)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_wrong_token_is_unauthenticated(unloaded):
    process, _ = unloaded
    with InferenceWorkerClient(process.address, auth_token="wrong", timeout_s=10) as intruder:
        for call in (lambda: intruder.load(0), lambda: list(intruder.generate(requests("x")))):
            with pytest.raises(InferenceCallError) as e:
                call()
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_sigterm_stops_the_worker_gracefully(group):
    process = group.start_inference_worker(TINY, token=TOKEN, overrides=OVERRIDES, env=ONE_DEVICE)
    assert process.stop() == 0
